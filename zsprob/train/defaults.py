"""Default training configuration: every key a recipe in configs/*.yaml may set.

A recipe (YAML) is merged over these defaults and then patched with ``--set a.b=v``
overrides (:func:`load_train_config`). :func:`with_defaults` is the one place the defaults are
merged; its result is a :class:`TrainConfig`, which later steps (``train()``) take as it is.
:func:`resolve_config` is the one place a run's config is resolved and checked, in one descent (the
tables are here, :data:`RULES`; the checking is :mod:`zsprob.utils.checks`'). Durations are in
optimiser steps unless the key says epochs; ``*_epochs`` keys win over ``*_steps`` keys when both are
set and the epoch length is known (map-style COCO, ``data.samples_per_epoch``, or a SynthWorld manifest).
"""
from __future__ import annotations

import os
from typing import Any, Iterable

from zsprob.config import Config, apply_override, deep_merge, read_yaml, to_config
from zsprob.errors import UserError
from zsprob.prob.method_registry import METHOD_ENTRIES, default_loss_options, method_names
from zsprob.train.remote_sync import check_target
from zsprob.utils.checks import ConfigRules, check_config, check_flags

DEFAULTS: dict = {
    "seed": 0,
    "method": "pcmepp",
    "model": {
        "name": "zsprob-tiny",
        "pretrained": None,
        "weights": None,           # a PCME++ COCO trainer file as pretrained: swa-text | swa | raw (null: by the file)
        "embed_dim": None,
        "sigma_depth": 1,
        "sigma_init": "random",
        "pooling": "gpo",
        "var_bounds": None,
        "sigma_head": None,        # null: block | unc | pcme (zsprob.models.sigma_heads)
        "sigma_param": None,       # null: logvar, or logsigma for --method pcme with loss.pcme.form official
        "sigma_shape": None,       # null: diagonal | spherical_mean | spherical_one (Pishdad et al.)
        "overrides": {},           # passed to create_model as **overrides
        "jwae": None,              # --method jwae: {latent_dim, image_hidden, text_hidden, decoder: {...}}
        "grad_checkpointing": False,  # recompute tower blocks in backward (zsprob.train.accumulate)
    },
    # keyword arguments of each method's loss (zsprob.prob.create_loss), from each method's registry entry
    # (zsprob.prob.method_registry, where their sources are noted)
    "loss": default_loss_options(),
    "data": {
        "kind": "synthetic",       # synthetic | webdataset | redcaps | coco | flickr30k
        "shards": None,
        "root": None,              # COCO root
        "karpathy_json": None,
        "batch_size": 128,         # GLOBAL batch (all processes together)
        "num_workers": 1,
        "shuffle_buffer": 1000,
        "resampled": False,
        "samples_per_epoch": None, # epoch length for streams (None: one pass over the shards)
        "noise_ratio": 0.0,        # share of training captions replaced by wrong ones
        "text_size_augment": 0.0,  # text SizeAugment: share of caption tokens selected (official COCO 0.2) ...
        "text_size_augment_masking": 0.5,  # ... of which masked ...
        "text_size_augment_erasing": 0.1,  # ... or randomised; the rest deleted (zsprob.data.text_augment)
        "same_image_positives": True,  # COCO: captions of the same image in a batch are positives (no MSDA)
        "preprocess": "clip",      # clip: the model's open_clip transforms | official: PCME++'s COCO ones
        "augment": True,           # open_clip's training transform (RandomResizedCrop); False: the eval transform
        "pipeline": {},            # any other ShardPipelineOptions field by name (zsprob.data.webdataset)
        # --method jwae (SynthWorld): share of pretraining pairs kept paired, in (0, 1]; the rest feeds
        # unpaired image-only and caption-only streams (data.unpaired: false drops them)
        "paired_fraction": 1.0,
        "unpaired": True,
        "unpaired_batch_size": None,   # None: data.batch_size
        "cache_features": True,        # jwae: the frozen tower's features computed once ...
        "feature_cache": None,         # ... and kept in this file between runs (same tower, same shards)
    },
    # mode: official (naver-ai/pcmepp: per image, partner B-1-i, smoothed targets) | random | mixup | cutmix
    "msda": {"enabled": False, "ratio": 0.25, "alpha": 2.0, "mode": "random",
             "switch_prob": 0.5,        # official: per-image probability of CutMix instead of Mixup
             "smoothing": 1.0e-4,       # official: target smoothing of the mixed batch (mixup_smoothing)
             "label_smoothing": 0.0},   # smoothing of the identity targets of steps without MSDA (official 1e-4)
    "optim": {
        "name": "adamp",
        "lr": 5e-4,
        "weight_decay": 1e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "grouping": "zsprob",      # zsprob | official (naver-ai/pcmepp's parameter groups, see train/optim.py)
        "layer_decay": None,       # e.g. 0.7: lr x decay^(num_layers - depth) for backbone blocks
        "image_lr_mult": 1.0,      # lr multiplier of the image backbone (PCME++ COCO: 0.01)
        "text_lr_mult": 1.0,       # lr multiplier of the text backbone (PCME++ COCO: 0.1)
        "grad_clip": 2.0,          # max global grad norm; null disables
        "grad_clip_split": False,  # clip the log-variance heads' gradients apart from the rest (decoupled sigma)
        "fused": False,            # torch's fused optimiser kernels (adamw / adam / sgd); default: foreach
        "disc_lr": None,           # --method jwae: the discriminator's lr (None: optim.lr / 2; paper 5e-5 vs 1e-4)
    },
    "schedule": {
        "name": "cosine",          # cosine | step | constant
        "steps": None,             # total optimiser steps ...
        "epochs": None,            # ... or epochs
        "warmup_steps": 0,
        "warmup_epochs": None,
        "min_lr_ratio": 0.0,
        "milestones_steps": [],    # step schedule: lr x gamma at each milestone
        "milestones_epochs": [],
        "gamma": 0.1,
    },
    "freeze": {                    # backbone frozen at the start, then linear warm-up
        "image_steps": 0, "image_epochs": None,
        "text_steps": 0, "text_epochs": None,
        "warmup_steps": 0, "warmup_epochs": None,
        "warmup_mode": "lr",       # lr: the backbone lr ramps up | loss: the loss ramps 0 -> 1 (PCME++ official)
    },
    "swa": {"enabled": False, "last_epochs": None, "last_steps": None, "every_steps": None,
            "average_loss": True},     # the loss's a, b averaged with the weights (official swa_criterion)
    "train": {
        "precision": "fp32",       # fp32 | bf16 | fp16
        "cpu": None,               # null: CPU when no GPU
        "log_every": 10,
        "checkpoint_every": 1000,
        "keep_checkpoints": 2,
        "max_nonfinite": 10,       # consecutive non-finite losses before the run stops
        "requeue_exit_code": 143,  # exit code after SIGTERM / SIGUSR1: checkpoint written, relaunch to resume
        "tensorboard": True,
        "eval_every": None,        # steps between evaluation hooks
        "eval_every_epochs": None, # ... or epochs (wins when the epoch length is known)
        "threads": None,           # torch.set_num_threads on the CPU
        "find_unused_parameters": False,
        "remote_sync": None,       # fsspec URL mirroring OUT after each checkpoint (zsprob.train.remote_sync)
        "accum_steps": 1,          # micro-batches per step, same loss as one batch (zsprob.train.accumulate)
        "tf32": True,              # CUDA: TF32 matmuls / convolutions in the towers (losses and CSD stay full fp32)
        "compile": False,          # torch.compile the model (needs a C++ compiler on the CPU, triton on CUDA)
        "dist_timeout_s": 1800,    # timeout of every process group (a long rank-0 evaluation must fit in it)
    },
}


#: every count of a training config: (dotted key, its command-line flag, rule, integer), checked by
#: ``zsprob.utils.checks.check_counts`` when a config is loaded and again when a run starts
COUNT_KEYS: tuple = (
    ("schedule.steps", "--steps", ">=1", True),
    ("schedule.epochs", "--epochs", ">0", False),
    ("schedule.warmup_steps", None, ">=0", True),
    ("schedule.warmup_epochs", None, ">=0", False),
    ("data.batch_size", "--batch-size", ">=1", True),
    ("data.num_workers", "--workers", ">=0", True),
    ("data.shuffle_buffer", None, ">=0", True),
    ("data.samples_per_epoch", None, ">=1", True),
    ("train.log_every", "--log-every", ">=1", True),
    ("train.checkpoint_every", "--checkpoint-every", ">=0", True),
    ("train.eval_every", "--eval-every", ">=0", True),
    ("train.keep_checkpoints", None, ">=0", True),
    ("train.max_nonfinite", None, ">=1", True),
    ("train.threads", "--threads", ">=1", True, 1024),  # torch would try to start them all (and crash)
    ("train.accum_steps", None, ">=1", True),
    ("train.dist_timeout_s", None, ">0", False),
    ("train.requeue_exit_code", "--requeue-exit-code", ">=0", True),
    ("freeze.image_steps", None, ">=0", True),
    ("freeze.image_epochs", None, ">=0", False),
    ("freeze.text_steps", None, ">=0", True),
    ("freeze.text_epochs", None, ">=0", False),
    ("freeze.warmup_steps", None, ">=0", True),
    ("freeze.warmup_epochs", None, ">=0", False),
    ("swa.last_steps", None, ">=0", True),
    ("swa.last_epochs", None, ">=0", False),
    ("swa.every_steps", None, ">=1", True),
    ("model.embed_dim", None, ">=1", True),
    ("data.unpaired_batch_size", None, ">=1", True),
    ("train.eval_every_epochs", None, ">0", False),
    ("seed", "--seed", ">=0", True),
    ("model.sigma_depth", None, ">=1", True),
)

#: real-valued keys whose default is null ("off" or "derived"), so :func:`check_numbers` cannot tell their type
#: from the default: (dotted key, low, high, low excluded); null stays allowed, anything else must be a finite
#: number in range (``optim.layer_decay=nan`` / ``inf`` / ``abc`` is one line:
#: ``zsprob.utils.checks.check_nullable_numbers``)
NULLABLE_NUMBER_KEYS: tuple = (
    ("optim.layer_decay", 0.0, 1.0, True),
    ("optim.disc_lr", 0.0, float("inf"), True),
    ("optim.grad_clip", 0.0, float("inf"), True),   # null: no clipping (a negative norm would flip the gradient)
)

#: real-valued keys that must be set and in range: (dotted key, low, high, low excluded)
#: (``zsprob.utils.checks.check_ranges``; a fifth True: the high end excluded; a list: each of its numbers)
RANGE_KEYS: tuple = (
    ("optim.lr", 0.0, float("inf"), True),
    ("optim.weight_decay", 0.0, float("inf"), False),
    ("optim.eps", 0.0, float("inf"), False),
    ("optim.image_lr_mult", 0.0, float("inf"), False),
    ("optim.text_lr_mult", 0.0, float("inf"), False),
    ("schedule.min_lr_ratio", 0.0, 1.0, False),
    ("schedule.gamma", 0.0, float("inf"), True),
    ("data.noise_ratio", 0.0, 1.0, False),
    ("optim.betas", 0.0, 1.0, False, True),     # torch's Adam family: 0 <= beta < 1
)


#: sections that take any keys: create_model's keyword arguments, ShardPipelineOptions fields, and each
#: method's loss options (checked by its loss constructor); sections whose default is {} or null are free too
FREE_SECTIONS: tuple = ("model.overrides", "data.pipeline", "loss.*")


#: keys that exclude each other: (key, other, why)
EXCLUSIVE_KEYS: tuple = (
    ("schedule.steps", "schedule.epochs",
     "--steps / schedule.steps counts optimiser steps, --epochs passes over the data"),
)

#: what a training config is checked against (:func:`zsprob.utils.checks.check_config`)
RULES = ConfigRules(DEFAULTS, free=FREE_SECTIONS, counts=COUNT_KEYS, nullable_numbers=NULLABLE_NUMBER_KEYS,
                    ranges=RANGE_KEYS, exclusive=EXCLUSIVE_KEYS)

#: the mixed precisions a run may ask for (``train.precision``)
PRECISIONS: tuple = ("fp32", "bf16", "fp16")


def check_train_config(cfg: Any) -> None:
    """Every count (:data:`COUNT_KEYS`), no unknown key, finite float hyper-parameters in their ranges, and one
    run length (:data:`RULES`): checked when a config is loaded and again when a run starts (:func:`resolve_config`)."""
    check_config(cfg, RULES)


def __getattr__(name):  # METHODS: the registry's method names (re-exported: zsprob.train.METHODS), read live
    if name == "METHODS":
        return method_names()
    raise AttributeError(name)


class TrainConfig(Config):
    """A training config with :data:`DEFAULTS` already merged in (made only by :func:`with_defaults`)."""


def with_defaults(cfg: Any = None) -> TrainConfig:
    """:data:`DEFAULTS` <- ``cfg`` (a mapping); a :class:`TrainConfig` is returned as it is."""
    if isinstance(cfg, TrainConfig):
        return cfg
    return TrainConfig(to_config(deep_merge(DEFAULTS, dict(cfg or {}))))


def resolve_config(cfg: Any, out: str | os.PathLike | None = None) -> TrainConfig:
    """The one place a run's config is resolved, in one descent: :data:`DEFAULTS` <- ``cfg`` (unless ``cfg``
    already has them: :func:`with_defaults`), then every check: :data:`RULES` (counts, known keys, finite
    floats, one run length), the method, every true / false key and the precision; with the run
    directory ``out``, also ``train.remote_sync`` against it (:func:`zsprob.train.remote_sync.check_target`).
    A resolved config is trusted from here on: the loop builds from it without checking it again."""
    cfg = with_defaults(cfg)
    check_config(cfg, RULES)
    if cfg.method not in method_names():
        raise UserError(f"unknown method {cfg.method!r}; choose one of {', '.join(method_names())}")
    if METHOD_ENTRIES[cfg.method].step_kind != "pairwise" and cfg.train.accum_steps != 1:
        raise UserError(f"train.accum_steps applies to the pairwise losses, not to --method {cfg.method}")
    check_flags(cfg, DEFAULTS)  # every true / false key (data.augment, optim.fused, msda.enabled, ...)
    if cfg.train.precision not in PRECISIONS:
        raise UserError(f"train.precision must be fp32, bf16 or fp16, got {cfg.train.precision!r}")
    if out is not None and cfg.train.remote_sync:
        check_target(cfg.train.remote_sync, out)
    return cfg


def load_train_config(path=None, overrides: Iterable[str] = ()) -> TrainConfig:
    """A recipe (YAML, with its ``base:`` chain) over :data:`DEFAULTS`, patched with ``a.b=v`` overrides."""
    cfg = with_defaults(read_yaml(path) if path is not None else {})
    for item in overrides:
        apply_override(cfg, item)
    check_train_config(cfg)
    return cfg
