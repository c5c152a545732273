"""Every key of a training config, declared once (:data:`KEYS`; the ``loss.<method>`` options are each method's
registry entry), and the one place a config is resolved (no torch import).

A recipe (YAML) is merged over the defaults and patched with ``--set a.b=v`` (:func:`load_train_config`);
:func:`resolve_config` checks it once, before anything is built, and the loop trusts what it returns. Durations
are optimiser steps unless the key says epochs; an ``*_epochs`` key wins when the epoch length is known.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable

from zsprob.config import Config, apply_override, deep_merge, read_yaml, refuse_pipes, to_config
from zsprob.data.captions import SHARD_KINDS
from zsprob.data.flickr import KARPATHY_KINDS
from zsprob.errors import PREEMPT_EXIT_CODE, UserError
from zsprob.prob.method_registry import METHOD_ENTRIES, PCMEPP_DISTANCES, default_loss_options, method_names
from zsprob.train.optim import OPTIMIZERS, SCHEDULES
from zsprob.train.remote_sync import check_target
from zsprob.train.schema import INHERITED, Count, Key, OneOf, Range, check, nest
from zsprob.utils.devices import PRECISIONS

AT_LEAST_1, AT_LEAST_0, ABOVE_0 = Count(">=1"), Count(">=0"), Count(">0", real=True)
SET_1, SET_0 = Count(">=1", null=False), Count(">=0", null=False)  # counts that have no "off"
EPOCHS = Count(">=0", real=True)
POSITIVE = Range(0.0, math.inf, low_open=True)
NON_NEGATIVE = Range(0.0)
SHARE = Range(0.0, 1.0)

KEYS: tuple[Key, ...] = (
    Key("seed", 0, "Seed of every random choice (data order, noise, masks, initialisation).", SET_0,
        flag="--seed"),
    Key("method", "pcmepp", "Training objective (default: the recipe's, else pcmepp).",
        OneOf(method_names, message="unknown method {value!r}; choose one of {listed}"), flag="--method"),
    # ------------------------------------------------------------------ model (zsprob.models.create_model)
    Key("model.name", "zsprob-tiny", "Model name (open_clip or configs/models).", flag="--model"),
    Key("model.pretrained", None, "open_clip pretrained tag or checkpoint file.", flag="--pretrained"),
    Key("model.weights", None, "A PCME++ COCO trainer file's copy: swa-text, swa or raw (null: by the file).",
        flag="--weights"),
    Key("model.embed_dim", None, "embedding dimension (null: the model's)", AT_LEAST_1),
    Key("model.sigma_depth", 1, "tower blocks the log-variance head duplicates", AT_LEAST_1),
    Key("model.sigma_init", "random", "random | copy: how the duplicated blocks start"),
    Key("model.pooling", "gpo", "gpo | native: how a tower pools its tokens"),
    Key("model.var_bounds", None, "[low, high] of the log-variance (null: unbounded)"),
    Key("model.sigma_head", None, "null (the model's): block | unc | pcme (zsprob.models.sigma_heads)"),
    Key("model.sigma_param", None, "null: logvar, or logsigma for --method pcme with loss.pcme.form official"),
    Key("model.sigma_shape", None, "null: diagonal | spherical_mean | spherical_one (Pishdad et al.)"),
    Key("model.overrides", {}, "any other create_model keyword argument by name"),
    Key("model.jwae", None, "--method jwae: {latent_dim, image_hidden, text_hidden, decoder: {...}}"),
    Key("model.grad_checkpointing", False, "recompute the tower blocks in backward (zsprob.train.accumulate)"),
    # ------------------------------------------------------------------ loss (each method's registry entry)
    Key("loss", default_loss_options(), "keyword arguments of each method's loss (zsprob.prob.create_loss)",
        free=1),
    Key("loss.pcmepp.distance", INHERITED, "PCME++ distance: csd (paper) or wd (2-Wasserstein ablation).",
        OneOf(PCMEPP_DISTANCES), flag="--distance"),
    # ------------------------------------------------------------------ data
    Key("data.kind", "synthetic", "where the training pairs come from: shards, or a COCO / Flickr30k folder",
        OneOf(SHARD_KINDS + KARPATHY_KINDS, message="unknown data kind {value!r} ({listed})")),
    Key("data.shards", None, "shard directory, brace pattern or URL ('::' joins sources)"),
    Key("data.root", None, "COCO / Flickr30k directory"),
    Key("data.karpathy_json", None, "the Karpathy split file, when not under data.root"),
    Key("data.batch_size", 128, "GLOBAL batch size (all processes).", SET_1, flag="--batch-size"),
    Key("data.num_workers", 1, "Data loader worker processes per process.", AT_LEAST_0, flag="--workers",
        routine=True),
    Key("data.shuffle_buffer", 1000, "samples in the shard stream's shuffle buffer", AT_LEAST_0),
    Key("data.resampled", False, "draw shards with replacement (open_clip's convention)"),
    Key("data.samples_per_epoch", None, "epoch length of a stream (null: one pass over the shards)", AT_LEAST_1),
    Key("data.noise_ratio", 0.0, "Share of training captions replaced by wrong ones (PCME++ Table 2).", SHARE,
        flag="--noise-ratio"),
    Key("data.text_size_augment", 0.0, "text SizeAugment: share of caption tokens selected (official COCO 0.2)",
        SHARE),
    Key("data.text_size_augment_masking", 0.5, "... of which masked ...", SHARE),
    Key("data.text_size_augment_erasing", 0.1, "... or randomised; the rest deleted (zsprob.data.text_augment)",
        SHARE),
    Key("data.same_image_positives", True, "COCO: captions of the same image in a batch are positives"),
    Key("data.preprocess", "clip", "the model's open_clip transforms, or PCME++'s official COCO ones",
        OneOf(("clip", "official"), null=True)),
    Key("data.augment", True, "open_clip's training transform (RandomResizedCrop); false: the eval transform"),
    Key("data.pipeline", {}, "any other ShardPipelineOptions field by name (zsprob.data.webdataset)"),
    Key("data.paired_fraction", 1.0, "--method jwae: share of pretraining pairs kept paired",
        Range(0.0, 1.0, low_open=True, message="{name} must be in (0, 1], got {value!r}")),
    Key("data.unpaired", True, "--method jwae: the rest feeds image-only and caption-only streams"),
    Key("data.unpaired_batch_size", None, "--method jwae: unpaired rows per step (null: data.batch_size)",
        AT_LEAST_1),
    Key("data.cache_features", True, "--method jwae: the frozen tower's features computed once ..."),
    Key("data.feature_cache", None, "... and kept in this file between runs (same tower, same shards)"),
    # ------------------------------------------------------------------ MSDA (zsprob.prob.msda)
    Key("msda.enabled", False, "Mixup / CutMix with soft targets (PCME++ Sec. 2.4).", flag="--msda"),
    Key("msda.ratio", 0.25, "share of the batch mixed", SHARE),
    Key("msda.alpha", 2.0, "Beta(alpha, alpha) of the mixing weights"),
    Key("msda.mode", "random", "official (per image, partner B-1-i, smoothed targets) | random | mixup | cutmix"),
    Key("msda.switch_prob", 0.5, "official: per-image probability of CutMix instead of Mixup", SHARE),
    Key("msda.smoothing", 1.0e-4, "official: target smoothing of the mixed batch", SHARE),
    Key("msda.label_smoothing", 0.0, "smoothing of the identity targets of steps without MSDA (official 1e-4)",
        SHARE),
    # ------------------------------------------------------------------ optimiser (zsprob.train.optim)
    Key("optim.name", "adamp", "optimiser (zsprob.train.optim)",
        OneOf(OPTIMIZERS, message="unknown optimizer {value!r} (choose {listed})")),
    Key("optim.lr", 5e-4, "Base learning rate.", POSITIVE, flag="--lr"),
    Key("optim.weight_decay", 1e-4, "decoupled weight decay", NON_NEGATIVE),
    Key("optim.betas", [0.9, 0.999], "Adam betas", Range(0.0, 1.0, high_open=True)),
    Key("optim.eps", 1e-8, "Adam epsilon", NON_NEGATIVE),
    Key("optim.grouping", "zsprob", "zsprob, or official: naver-ai/pcmepp's parameter groups",
        OneOf(("zsprob", "official"), null=True)),
    Key("optim.layer_decay", None, "lr x decay^(num_layers - depth) for backbone blocks (e.g. 0.7)",
        Range(0.0, 1.0, low_open=True, null=True)),
    Key("optim.image_lr_mult", 1.0, "lr multiplier of the image backbone (PCME++ COCO: 0.01)", NON_NEGATIVE),
    Key("optim.text_lr_mult", 1.0, "lr multiplier of the text backbone (PCME++ COCO: 0.1)", NON_NEGATIVE),
    Key("optim.grad_clip", 2.0, "max global gradient norm (null: no clipping)", Range(0.0, math.inf, True, null=True)),
    Key("optim.grad_clip_split", False, "clip the log-variance heads' gradients apart from the rest"),
    Key("optim.fused", False, "torch's fused kernels (adamw / adam / sgd); default: multi-tensor"),
    Key("optim.disc_lr", None, "--method jwae: the discriminator's lr (null: optim.lr / 2)",
        Range(0.0, math.inf, True, null=True)),
    # ------------------------------------------------------------------ schedule
    Key("schedule.name", "cosine", "lr schedule after the warm-up",
        OneOf(SCHEDULES, message="unknown lr schedule {value!r} (choose {choices})")),
    Key("schedule.steps", None, "Total optimiser steps.", AT_LEAST_1, flag="--steps", routine=True),
    Key("schedule.epochs", None, "Total epochs (needs a known epoch length).", ABOVE_0, flag="--epochs",
        routine=True),
    Key("schedule.warmup_steps", 0, "linear lr warm-up", AT_LEAST_0),
    Key("schedule.warmup_epochs", None, "... in epochs", EPOCHS),
    Key("schedule.min_lr_ratio", 0.0, "cosine: the final lr / optim.lr", SHARE),
    Key("schedule.milestones_steps", [], "step schedule: lr x gamma at each milestone"),
    Key("schedule.milestones_epochs", [], "... in epochs"),
    Key("schedule.gamma", 0.1, "step schedule: the lr factor at each milestone", POSITIVE),
    # ------------------------------------------------------------------ backbone freezing, then warm-up
    Key("freeze.image_steps", 0, "image backbone frozen at the start", AT_LEAST_0),
    Key("freeze.image_epochs", None, "... in epochs", EPOCHS),
    Key("freeze.text_steps", 0, "text backbone frozen at the start", AT_LEAST_0),
    Key("freeze.text_epochs", None, "... in epochs", EPOCHS),
    Key("freeze.warmup_steps", 0, "linear warm-up after the freeze", AT_LEAST_0),
    Key("freeze.warmup_epochs", None, "... in epochs", EPOCHS),
    Key("freeze.warmup_mode", "lr", "lr: the backbone lr ramps up | loss: the loss ramps 0 -> 1 (PCME++)",
        OneOf(("lr", "loss"), null=True)),
    # ------------------------------------------------------------------ SWA
    Key("swa.enabled", False, "stochastic weight averaging over the last steps"),
    Key("swa.last_epochs", None, "average the last epochs ...", EPOCHS),
    Key("swa.last_steps", None, "... or steps", AT_LEAST_0),
    Key("swa.every_steps", None, "steps between snapshots (null: an epoch, else a tenth of the span)", AT_LEAST_1),
    Key("swa.average_loss", True, "the loss's a, b averaged with the weights (official swa_criterion)"),
    # ------------------------------------------------------------------ how the run is carried out
    Key("train.precision", "fp32", "fp32 | bf16 | fp16 (fp16: GPU only)", OneOf(PRECISIONS), flag="--precision"),
    Key("train.cpu", None, "null: the CPU when no GPU is visible", routine=True),
    Key("train.log_every", 10, "Steps between metrics.jsonl records.", SET_1, flag="--log-every",
        routine=True),
    Key("train.checkpoint_every", 1000, "Steps between resumable checkpoints.", AT_LEAST_0,
        flag="--checkpoint-every", routine=True),
    Key("train.keep_checkpoints", 2, "step directories kept (0: all)", SET_0, routine=True),
    Key("train.max_nonfinite", 10, "consecutive non-finite losses before the run stops", SET_1, routine=True),
    Key("train.requeue_exit_code", PREEMPT_EXIT_CODE, "Exit code after SIGTERM / SIGUSR1 (checkpoint written first).",
        Count(">=0", most=255, null=False), flag="--requeue-exit-code", routine=True),
    Key("train.tensorboard", True, "TensorBoard scalars beside metrics.jsonl", routine=True),
    Key("train.eval_every", None, "Steps between evaluation hooks.", AT_LEAST_0, flag="--eval-every", routine=True),
    Key("train.eval_every_epochs", None, "... or epochs (wins when the epoch length is known)", ABOVE_0,
        routine=True),
    Key("train.threads", None, "torch CPU threads.", Count(">=1", most=1024), flag="--threads", routine=True),
    Key("train.find_unused_parameters", False, "DDP's find_unused_parameters", routine=True),
    Key("train.remote_sync", None, "Mirror OUT to an fsspec URL (s3://, gs://, file://) after each checkpoint; "
        "--resume pulls a newer checkpoint from it.", flag="--remote-sync", routine=True),
    Key("train.accum_steps", 1, "micro-batches per step, same loss as one batch (zsprob.train.accumulate)",
        SET_1),
    Key("train.tf32", True, "CUDA: TF32 matmuls / convolutions in the towers (losses and CSD stay fp32)"),
    Key("train.compile", False, "torch.compile the model (a C++ compiler on the CPU, triton on CUDA)",
        routine=True),
    Key("train.dist_timeout_s", 1800, "timeout of every process group (a long rank-0 evaluation must fit)",
        Count(">0", real=True, null=False), routine=True),
)

#: keys that exclude each other: (key, other, why)
EXCLUSIVE = (("schedule.steps", "schedule.epochs",
              "--steps / schedule.steps counts optimiser steps, --epochs passes over the data"),)

#: every key with its default, nested as a config is (derived from :data:`KEYS`)
DEFAULTS: dict = nest(KEYS)

#: the keys whose change on ``--resume`` is routine: how a run is carried out, not what it learns
ROUTINE_KEYS = frozenset(key.name for key in KEYS if key.routine)


def __getattr__(name):  # METHODS: the registry's method names (re-exported: zsprob.train.METHODS), read live
    if name == "METHODS":
        return method_names()
    raise AttributeError(name)


class TrainConfig(Config):
    """A training config with :data:`DEFAULTS` merged in (made only by :func:`with_defaults`)."""


def with_defaults(cfg: Any = None) -> TrainConfig:
    """:data:`DEFAULTS` <- ``cfg`` (a mapping); a :class:`TrainConfig` is returned as it is."""
    if isinstance(cfg, TrainConfig):
        return cfg
    return TrainConfig(to_config(deep_merge(DEFAULTS, dict(cfg or {}))))


#: the keys that hold local paths: recorded absolutely when a run starts (zsprob.utils.checks.absolute_paths)
PATH_KEYS = ("data.shards", "data.root", "data.karpathy_json", "data.feature_cache")


def resolve_config(cfg: Any, out: str | os.PathLike | None = None) -> TrainConfig:
    """The one place a run's config is checked: :data:`DEFAULTS` <- ``cfg``, then every rule of :data:`KEYS`
    and :data:`EXCLUSIVE`, the method's step kind, and with the run directory ``out`` the mirror
    ``train.remote_sync`` against it. The loop builds from the result without checking it again."""
    from zsprob.utils.checks import absolute_paths

    cfg = absolute_paths(with_defaults(cfg), PATH_KEYS)
    check(cfg, KEYS, DEFAULTS, EXCLUSIVE)
    if METHOD_ENTRIES[cfg.method].step_kind != "pairwise" and cfg.train.accum_steps != 1:
        raise UserError(f"train.accum_steps applies to the pairwise losses, not to --method {cfg.method}")
    if METHOD_ENTRIES[cfg.method].needs_negatives and cfg.data.batch_size < 2:
        raise UserError(f"--method {cfg.method} learns from the other pairs of a batch: at --batch-size 1 its loss "
                        "is 0 at every step; use a batch of 2 or more")
    if out is not None and cfg.train.remote_sync:
        check_target(cfg.train.remote_sync, out)
    return cfg


def load_train_config(path=None, overrides: Iterable[str] = (), allow_pipe: bool = False) -> TrainConfig:
    """A recipe (YAML, with its ``base:`` chain; a run's saved config.yaml reads the same way) over
    :data:`DEFAULTS`, patched with ``a.b=v`` overrides; :func:`resolve_config` checks it. A ``pipe:`` command
    in the recipe is refused unless ``allow_pipe``."""
    recipe = read_yaml(path) if path is not None else {}
    if not allow_pipe:
        refuse_pipes(recipe, path)
    cfg = with_defaults(recipe)
    for item in overrides:
        apply_override(cfg, item)
    return cfg
