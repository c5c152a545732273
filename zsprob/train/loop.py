"""The training loop behind ``zsprob pretrain`` and ``zsprob finetune``.

Libraries: accelerate (devices, DDP across GPUs / nodes / CPU processes, mixed precision,
gradient scaling, TensorBoard tracker), torch.distributed (through
``zsprob.train.distributed``), timm / torch optimisers and SWA (``zsprob.train.optim``),
zsprob.models (Gaussian towers, checkpoints), zsprob.prob (losses, MSDA), zsprob.data
(shards, COCO), tqdm. What zsprob writes itself is this file: one loop, readable top to bottom.

One step::

    images, tokens  <- next local batch (global batch / world processes)
    noisy captions   (data.noise_ratio), MSDA mixing (msda.*): generator seeded by (seed, step, rank)
    mu, logvar       <- model(images, tokens)               (autocast in bf16 / fp16)
    masked copies    <- model(masked first rows)            (losses with wants_masked: ProLIP; seed, step, rank)
    columns          <- all_gather_with_grad(mu, logvar)    (every process: local rows x global columns)
    loss, stats      <- loss(local rows, matched, all_img, all_txt, offset)   (float32)
    backward; frozen backbone grads dropped; clip; skip the update if the loss is non-finite
    optimizer step; lr schedule step; SWA average; log / checkpoint / evaluate at intervals

The run, one named function per line (:func:`train`)::

    cfg <- resolve_config(cfg); accelerator <- make_accelerator(cfg, out)
    model, loss, source <- build_model, build_loss, build_source
    plan <- resolve_schedule(cfg, source.steps_per_epoch)        (steps, warm-up, milestones, freezing)
    optimizer, schedule <- build_optimisation; swa <- build_swa
    restore_state(run, find_resume_dir(...))                     (when resuming: zsprob.train.resilience)
    run_steps: for step in start..plan.total_steps:              (SIGTERM / SIGUSR1 caught: StopSignals)
        one_step(run, step)                                      (next_batch, forward, backward, update)
        after_step: schedule.step(); SWA update;
                    log_record / save_checkpoint / run_hooks     (at their intervals)
        stop_if_signalled                                        (pre-empted: checkpoint, raise Preempted)
    finish(run)                                                  (checkpoint, final model(s), hooks, summary)

``--method jwae`` swaps in its own parts and step (:mod:`zsprob.train.jwae_step`: autoencoders over
a frozen tower, the prior discriminator, paired + unpaired batches); the rest of the run is the same.

Outputs under ``out``: ``config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/step-*/`` (+ ``latest.json``) for ``resume``, and at the end ``model/`` (the
final weights, a ``zsprob.models.save`` directory) and ``model-swa/`` when SWA ran;
``summary.json`` holds the run's totals. With ``train.remote_sync`` (an fsspec URL) ``out`` is
mirrored there after each checkpoint and at the end, and resuming pulls a newer remote checkpoint
first (:mod:`zsprob.train.remote_sync`).
"""
from __future__ import annotations

import itertools
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from zsprob.config import Config, dump_yaml
from zsprob.data.captions import SHARD_KINDS
from zsprob.errors import Preempted, UserError
from zsprob.train import accumulate
from zsprob.train.accumulate import at_least_fp32
from zsprob.train import distributed as dist
from zsprob.train import optim
from zsprob.train import remote_sync
from zsprob.train import resilience
from zsprob.train import state
from zsprob.train.data import (BatchSource, CocoSource, WdsSource, add_caption_noise, count_samples_synthetic,
                               mixed_seed, resolve_shards, shard_options, steps_from)
from zsprob.train.defaults import COUNT_KEYS, DEFAULTS, METHODS, with_defaults
from zsprob.utils.checks import check_counts, check_flags, check_shards
from zsprob.utils.io import append_jsonl, atomic_write_json, atomic_write_text

EvalHook = Callable[[nn.Module, int], dict]


# ----------------------------------------------------------------------------- the step module

class ContrastiveStep(nn.Module):
    """Model + loss in one module, so DDP sees every trainable parameter (incl. the loss's a, b).

    A loss with ``wants_masked`` (the occlusion inclusion term is on) also gets masked copies of
    this process's first ``loss.n_masked(n, step)`` images and captions (``zsprob.data.masking``;
    none while the term's scheduled weight is 0), encoded by the same model, and the 0-based
    step; the masks come from a generator seeded by (seed, step, rank), so a run and its
    resumption draw the same masks.
    """

    MASK_SALT = 0x3A5C  # keeps the mask stream apart from the noise / MSDA stream of the same step

    def __init__(self, model: nn.Module, loss: nn.Module, seed: int = 0):
        super().__init__()
        self.model = model
        self.loss = loss
        self.seed = int(seed)
        self._text_mask_spec = None

    def _mu_logvar(self, out: dict, side: str):
        return at_least_fp32(out[f"{side}_mu"]), at_least_fp32(out[f"{side}_logvar"])

    def masked_inputs(self, images: torch.Tensor, tokens: torch.Tensor, step: int):
        """Masked copies (images, tokens) of the first ``loss.n_masked(n)`` rows, or None when the loss wants none."""
        if not getattr(self.loss, "wants_masked", False):
            return None
        n_masked = self.loss.n_masked(images.shape[0], step)
        if n_masked == 0:
            return None
        from zsprob.data.masking import TEXT_MASK_MODES, text_mask_spec
        if self._text_mask_spec is None:
            self._text_mask_spec = text_mask_spec(self.model.tokenizer)
        rank = dist.world_info()[0]
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, int(step), rank, self.MASK_SALT))
        mask_text = TEXT_MASK_MODES[getattr(self.loss, "text_mask_mode", "replace")]
        masked_tokens = mask_text(tokens[:n_masked].cpu(), self.loss.drop_prob, self._text_mask_spec, generator)
        masked_images = self.masked_images(images[:n_masked].cpu(), generator)
        return masked_images.to(images.device), masked_tokens.to(tokens.device)

    def masked_images(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The occlusion term's image copies: cells blanked, or one lossy operation per image
        (``image_mask_mode: degrade``, with the model's normalisation)."""
        loss = self.loss
        if getattr(loss, "image_mask_mode", "cells") == "degrade":
            from zsprob.data.degrade import degrade_images
            pre = self.model.config["preprocess_cfg"]
            return degrade_images(images, generator, mean=pre["mean"], std=pre["std"], ops=loss.image_degrade_ops,
                                  drop_prob=loss.image_drop_prob, cell=loss.mask_patch_size)[0]
        from zsprob.data.masking import mask_image_cells
        return mask_image_cells(images, loss.image_drop_prob, loss.mask_patch_size, generator)

    def masked_features(self, images: torch.Tensor, tokens: torch.Tensor, step: int) -> dict:
        """``masked_img`` / ``masked_txt`` keyword arguments for the loss ({} when it wants none)."""
        masked = self.masked_inputs(images, tokens, step)
        if masked is None:
            return {}
        with accumulate.frozen_norm_statistics(self.model):  # masked images must not move BatchNorm's statistics
            out = self.model(*masked)
        return {"masked_img": self._mu_logvar(out, "img"), "masked_txt": self._mu_logvar(out, "txt")}

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, matched: torch.Tensor | None = None,
                step: int = 0, surrogate=None):
        if surrogate is not None:  # a re-encoding pass of gradient accumulation (zsprob.train.accumulate)
            return surrogate(self.model, images, tokens), {}
        out = self.model(images, tokens)
        masked = self.masked_features(images, tokens, step)
        return self.pairwise_loss(out["img_mu"], out["img_logvar"], out["txt_mu"], out["txt_logvar"], matched,
                                  step, masked)

    def pairwise_loss(self, img_mu, img_lv, txt_mu, txt_lv, matched, step: int, masked: dict):
        """The loss of this process's rows against the gathered columns, and its stats; in float32
        (float64 for a float64 model) with autocast off."""
        device_type = img_mu.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            img_mu, txt_mu, img_lv, txt_lv = (at_least_fp32(t) for t in (img_mu, txt_mu, img_lv, txt_lv))
            if dist.is_distributed():
                all_img, offset = dist.gather_gaussians(img_mu, img_lv)
                all_txt, _ = dist.gather_gaussians(txt_mu, txt_lv)
                if matched is not None:
                    matched = dist.block_diag_targets(matched)
            else:
                all_img = all_txt = None
                offset = 0
            scheduled = {"step": int(step)} if hasattr(self.loss, "occlusion_weight") else {}
            loss, stats = self.loss(img_mu, img_lv, txt_mu, txt_lv, matched, all_img=all_img, all_txt=all_txt,
                                    offset=offset, **masked, **scheduled)
        stats = dict(stats or {})
        with torch.no_grad():
            if img_lv is not None:
                stats.setdefault("img_sigma2", img_lv.exp().mean())
            if txt_lv is not None:
                stats.setdefault("txt_sigma2", txt_lv.exp().mean())
        return loss, stats


# ----------------------------------------------------------------------------- helpers

def resolve_config(cfg: Any) -> Config:
    """Defaults <- ``cfg`` (unless ``cfg`` already has them: :func:`zsprob.train.defaults.with_defaults`);
    validates the method, the precision, every count (``COUNT_KEYS``) and every true / false key."""
    cfg = with_defaults(cfg)
    check_counts(cfg, COUNT_KEYS)
    if cfg.method not in METHODS:
        raise UserError(f"unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    check_flags(cfg, DEFAULTS)  # every true / false key (data.augment, optim.fused, msda.enabled, ...)
    if cfg.train.precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"train.precision must be fp32, bf16 or fp16, got {cfg.train.precision!r}")
    return cfg


def _is_zsprob_checkpoint(path) -> bool:
    from zsprob.models import is_checkpoint
    return bool(path) and is_checkpoint(path)


def build_model(cfg: Config):
    from zsprob.models import create_model
    from zsprob.prob import needs_sigma
    m = cfg.model
    kw: dict[str, Any] = {}
    for key in ("embed_dim", "sigma_depth", "sigma_init", "pooling", "var_bounds", "sigma_head", "sigma_param",
                "sigma_shape", "weights"):
        if m.get(key) is not None:
            kw[key] = m[key]
    if cfg.method == "pcme" and kw.get("sigma_param") is None and not _is_zsprob_checkpoint(m.get("pretrained")):
        # PCME's official head predicts log sigma (the official loss form reads it so)
        form = ((cfg.loss or {}).get("pcme") or {}).get("form", "official")
        kw["sigma_param"] = "logsigma" if form == "official" else "logvar"
    if kw.get("var_bounds") is not None:
        kw["var_bounds"] = tuple(kw["var_bounds"])
    kw.update(dict(m.get("overrides") or {}))
    deterministic = bool(kw.pop("deterministic", not needs_sigma(cfg.method)))
    if deterministic and needs_sigma(cfg.method):
        raise UserError(f"--method {cfg.method} needs sigma, but the model is deterministic "
                        "(model.overrides.deterministic); drop that override or pick a method without sigma")
    model = create_model(m.name, pretrained=m.get("pretrained"), deterministic=deterministic, seed=int(cfg.seed), **kw)
    preprocess = cfg.data.get("preprocess") or "clip"
    if preprocess not in ("clip", "official"):
        raise UserError(f"data.preprocess must be clip or official, got {preprocess!r}")
    if preprocess == "official":  # PCME++'s COCO transforms (ImageNet normalisation, crop 0.6-1.0, flip)
        from zsprob.data.transforms import apply_official_coco_preprocess
        apply_official_coco_preprocess(model)
    return model


def build_loss(cfg: Config) -> nn.Module:
    from zsprob.prob import create_loss
    kwargs = dict((cfg.loss or {}).get(cfg.method) or {})
    try:
        return create_loss(cfg.method, **kwargs)
    except TypeError as e:
        raise UserError(f"bad loss options for --method {cfg.method}: {e} (config section loss.{cfg.method})") from None


def build_source(cfg: Config, model, rank: int, world: int) -> BatchSource:
    d = cfg.data
    B = int(d.batch_size)
    # data.augment=False trains on the evaluation transform (resize + centre crop): open_clip's
    # RandomResizedCrop also jitters the aspect ratio (3/4..4/3), which blurs classes that differ
    # by aspect ratio only (SynthWorld's circle / ellipse, square / rectangle)
    preprocess = model.preprocess_train if d.get("augment", True) else model.preprocess_val
    if B % world:
        raise UserError(f"data.batch_size {B} (the global batch) is not divisible by {world} processes")
    kind = d.kind
    if kind in SHARD_KINDS:
        check_shards(kind, d.shards)
        samples = d.get("samples_per_epoch")
        if samples is None and kind == "synthetic":
            samples = count_samples_synthetic(d.shards)
        options = shard_options(d, B // world, int(cfg.seed), samples)
        return WdsSource(resolve_shards(d.shards), options, preprocess=preprocess, tokenizer=model.tokenizer)
    if kind == "coco":
        if not d.root:
            raise UserError("--data coco needs --root (the COCO directory)")
        return CocoSource(d.root, preprocess=preprocess, tokenizer=model.tokenizer,
                          global_batch_size=B, rank=rank, world=world, seed=int(cfg.seed),
                          num_workers=int(d.num_workers), noise_ratio=float(d.noise_ratio or 0.0),
                          karpathy_json=d.get("karpathy_json"))
    raise UserError(f"unknown data kind {kind!r} (synthetic, webdataset, redcaps, coco)")


def build_parts(cfg: Config, acc, source: BatchSource | None, resolve_schedule_fn):
    """(model, loss, source, plan, step module, optimiser, schedule) of a contrastive run."""
    model = build_model(cfg)
    if cfg.model.get("grad_checkpointing"):
        accumulate.enable_grad_checkpointing(model)
    loss_fn = build_loss(cfg)
    if source is None:
        source = build_source(cfg, model, acc.process_index, acc.num_processes)
    plan = resolve_schedule_fn(cfg, source.steps_per_epoch)
    step_module = ContrastiveStep(model, loss_fn, seed=int(cfg.seed))
    optimizer, schedule = build_optimisation(cfg, model, step_module, plan)
    return model, loss_fn, source, plan, step_module, optimizer, schedule


class DataCursor:
    """Walks epochs of a source; (epoch, pos) is the resumable position, pos = batches consumed."""

    def __init__(self, source: BatchSource, device: torch.device, epoch: int = 0, pos: int = 0):
        self.source, self.device = source, device
        self.epoch, self.pos = epoch, pos
        self._it = None
        self._empty_epochs = 0

    def next(self):
        while True:
            spe = self.source.steps_per_epoch
            batch = None
            if spe is None or self.pos < spe:
                if self._it is None:
                    self._it = iter(self.source.epoch_batches(self.epoch, skip=self.pos))
                    self._fresh = True
                batch = next(self._it, None)
            exhausted = dist.all_reduce_any(batch is None, self.device)
            if not exhausted:
                self.pos += 1
                self._fresh = False
                self._empty_epochs = 0
                return batch
            if self.pos == 0:
                self._empty_epochs += 1
                if self._empty_epochs >= 2:
                    raise UserError("the training data yielded no full batch; check --shards and the batch size "
                                    f"(local batch {self.source.local_batch_size})")
            self.epoch += 1
            self.pos = 0
            self._it = None


def _scalar(v) -> float | int | None:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None
        return v.detach().float().item()
    if isinstance(v, (int, float, np.floating, np.integer)):
        return float(v)
    return None


def _loss_scalars(loss: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in loss.named_parameters():
        if p.numel() == 1:
            out[name] = float(p.detach().float().item())
    return out


# ----------------------------------------------------------------------------- the run's parts

@dataclass
class SchedulePlan:
    """The run's durations in optimiser steps (epochs converted with the source's epoch length)."""

    total_steps: int
    warmup: int
    milestones: list
    freeze: dict  # tower -> freeze_fn
    steps_per_epoch: int | None
    loss_scale: Callable[[int], float] | None = None  # freeze.warmup_mode loss: the embedding warm-up

    def steps_of(self, steps: Any, epochs: Any, what: str) -> int:
        return steps_from(epochs, self.steps_per_epoch, what) if epochs is not None else int(steps or 0)


def resolve_schedule(cfg: Config, steps_per_epoch: int | None) -> SchedulePlan:
    """Total, warm-up, milestone and backbone-freeze steps from ``cfg.schedule`` / ``cfg.freeze``."""
    sch = cfg.schedule
    total_steps = sch.get("steps")
    if sch.get("epochs") is not None:
        total_steps = steps_from(sch.epochs, steps_per_epoch, "schedule.epochs")
    if not total_steps:
        raise UserError("set the run length: --steps N (schedule.steps) or schedule.epochs")
    plan = SchedulePlan(int(total_steps), 0, [], {}, steps_per_epoch)
    plan.warmup = plan.steps_of(sch.get("warmup_steps"), sch.get("warmup_epochs"), "schedule.warmup_epochs")
    plan.milestones = list(sch.get("milestones_steps") or [])
    if sch.get("milestones_epochs"):
        plan.milestones += [steps_from(e, steps_per_epoch, "schedule.milestones_epochs") for e in sch.milestones_epochs]
    fz = cfg.freeze
    freeze_warmup = plan.steps_of(fz.get("warmup_steps"), fz.get("warmup_epochs"), "freeze.warmup_epochs")
    mode = fz.get("warmup_mode") or "lr"
    if mode not in ("lr", "loss"):
        raise UserError(f"freeze.warmup_mode must be lr or loss, got {mode!r}")
    frozen = {t: plan.steps_of(fz.get(f"{t}_steps"), fz.get(f"{t}_epochs"), f"freeze.{t}_epochs") for t in ("image", "text")}
    for tower, n in frozen.items():
        if n > 0:
            plan.freeze[tower] = optim.freeze_fn(n, freeze_warmup if mode == "lr" else 0)
    if mode == "loss" and freeze_warmup > 0:  # PCME++'s embedding warm-up: the whole loss x (k + 1) / R
        plan.loss_scale = optim.loss_warmup_fn(max(frozen.values()), freeze_warmup)
    return plan


def make_accelerator(cfg: Config, out: Path):
    """The accelerate ``Accelerator`` of ``cfg.train`` (device, precision, DDP, TensorBoard) and its tracker name."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    tc = cfg.train
    if tc.get("threads"):
        torch.set_num_threads(int(tc.threads))
    cpu = (not torch.cuda.is_available()) if tc.get("cpu") is None else bool(tc.cpu)
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[tc.precision]
    if mixed == "fp16" and cpu:
        raise UserError("fp16 needs a GPU; use --set train.precision=bf16 or fp32 on the CPU")
    log_with = None
    if tc.tensorboard:
        try:
            import tensorboard  # noqa: F401
            log_with = "tensorboard"
        except ImportError:
            warnings.warn("tensorboard is not installed; metrics go to metrics.jsonl only")
    resilience.init_restart_safe_process_group(cpu)  # before accelerate opens one: see its docstring
    acc = Accelerator(cpu=cpu, mixed_precision=mixed, log_with=log_with, project_dir=str(out),
                      kwargs_handlers=[DistributedDataParallelKwargs(
                          find_unused_parameters=bool(tc.find_unused_parameters))])
    return acc, log_with


def gradient_clip_sets(raw: nn.Module, split: bool) -> list[list]:
    """The parameter sets whose gradient norms are clipped apart: all trainable parameters in one set,
    or (``optim.grad_clip_split``) everything but the log-variance heads, then the heads
    (``ProbCLIP.SIGMA_MODULES``), so large sigma-only gradients (the occlusion term's) never scale
    down the means' update."""
    named = [(name, p) for name, p in raw.named_parameters() if p.requires_grad]
    if not split:
        return [[p for _, p in named]]
    heads = tuple(f"model.{m}." for m in getattr(raw.model, "SIGMA_MODULES", ()))
    sigma = [p for name, p in named if name.startswith(heads)]
    if not sigma:
        raise UserError("optim.grad_clip_split needs a model with log-variance heads (this one has none)")
    return [[p for name, p in named if not name.startswith(heads)], sigma]


def clip_gradient_sets(acc, sets: list[list], max_norm: float) -> list:
    """Clip each parameter set's gradient to ``max_norm`` on its own (accelerate's clip_grad_norm_,
    which unscales fp16 gradients first); the norms before clipping, one per set."""
    return [acc.clip_grad_norm_(params, max_norm) for params in sets]


def find_resume_dir(resume: bool | str | os.PathLike | None, out: Path) -> Path | None:
    """The step directory ``resume`` names (see :func:`zsprob.train.resilience.find_resume_dir`:
    "auto", "latest" / True, a path; None under an elastic agent means "auto"); None for a fresh start."""
    return resilience.find_resume_dir(resume, out)


def build_optimisation(cfg: Config, model, step_module: nn.Module, plan: SchedulePlan):
    """Parameter groups, the optimiser and the per-group lr schedule (with backbone freezing)."""
    oc = cfg.optim
    sch = cfg.schedule
    info = model.param_info() if hasattr(model, "param_info") else {}
    groups = optim.param_groups(step_module, lr=float(oc.lr), weight_decay=float(oc.weight_decay), param_info=info,
                            prefix="model.",
                            layer_decay=float(oc.layer_decay) if oc.get("layer_decay") is not None else None,
                            image_lr_mult=float(oc.image_lr_mult), text_lr_mult=float(oc.text_lr_mult),
                            grouping=str(oc.get("grouping") or "zsprob"))
    optimizer = optim.create_optimizer(groups, name=oc.name, lr=float(oc.lr), weight_decay=float(oc.weight_decay),
                                   betas=oc.betas, eps=float(oc.eps), fused=oc.get("fused", False))
    schedule = optim.GroupSchedule(optimizer, optim.schedule_fn(sch.name, total_steps=plan.total_steps,
                                                        warmup_steps=plan.warmup,
                                                        min_lr_ratio=float(sch.min_lr_ratio),
                                                        milestones=plan.milestones, gamma=float(sch.gamma)),
                               freeze=plan.freeze)
    return optimizer, schedule


def batch_augmentations(cfg: Config, model) -> tuple[Any, float]:
    """Text SizeAugment (``data.text_size_augment*``) and the label smoothing of steps without MSDA
    (``msda.label_smoothing``), after checking the MSDA options; both off unless a recipe asks."""
    from zsprob.data.text_augment import TextSizeAugment
    from zsprob.prob.msda import check_config

    msda = cfg.msda
    label_smoothing = float(msda.get("label_smoothing") or 0.0)
    check_config(enabled=bool(msda.enabled), mode=str(msda.mode), ratio=float(msda.ratio), alpha=float(msda.alpha),
                 switch_prob=float(msda.get("switch_prob", 0.5)), smoothing=float(msda.get("smoothing", 1e-4)),
                 label_smoothing=label_smoothing)
    text_aug = TextSizeAugment(float(cfg.data.get("text_size_augment") or 0.0),
                               float(cfg.data.get("text_size_augment_masking", 0.5)),
                               float(cfg.data.get("text_size_augment_erasing", 0.1)), model.tokenizer)
    return text_aug, label_smoothing


def build_swa(cfg: Config, model: nn.Module, plan: SchedulePlan, loss: nn.Module | None = None) -> optim.SWA | None:
    """SWA of the model (and of the loss's a, b: ``swa.average_loss``, the official swa_criterion)."""
    if not cfg.swa.enabled:
        return None
    last = plan.steps_of(cfg.swa.get("last_steps"), cfg.swa.get("last_epochs"), "swa.last_epochs")
    every = cfg.swa.get("every_steps") or plan.steps_per_epoch or max(1, last // 10)
    loss = loss if cfg.swa.get("average_loss", True) else None
    return optim.SWA(model, start=max(0, plan.total_steps - last), every=int(every), loss=loss)


@dataclass
class Run:
    """Everything one training run holds between steps: the parts, the data position, the counters."""

    cfg: Config
    out: Path
    acc: Any
    log_with: str | None
    step_module: nn.Module
    raw: ContrastiveStep  # the unwrapped step module: raw.model, raw.loss
    optimizer: Any
    schedule: optim.GroupSchedule
    swa: optim.SWA | None
    source: BatchSource
    total_steps: int
    hooks: list
    clip_sets: list = field(default_factory=list)  # the trainable parameters, in the sets clipped apart (gradient_clip_sets)
    cursor: DataCursor | None = None
    nonfinite_total: int = 0
    consecutive_bad: int = 0
    # the current logging interval
    loss_sum: torch.Tensor | None = None
    n_in_interval: int = 0
    data_time: float = 0.0
    t_interval: float = 0.0
    noisy_rows: int = 0
    last_loss: float = float("nan")
    last_stats: dict = field(default_factory=dict)
    # batch augmentations of the official PCME++ recipe (zsprob.data.text_augment, zsprob.prob.msda)
    text_aug: Any = None
    label_smoothing: float = 0.0
    loss_scale: Callable[[int], float] | None = None  # the embedding warm-up (freeze.warmup_mode loss)
    sync: Any = None  # zsprob.train.remote_sync.RemoteSync on the main process with train.remote_sync
    step_fn: Callable[["Run", int], dict] | None = None  # one_step, or jWAE's own step
    accum_steps: int = 1  # micro-batches per step (zsprob.train.accumulate)

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def world(self) -> int:
        return self.acc.num_processes

    @property
    def main(self) -> bool:
        return self.acc.is_main_process

    @property
    def global_batch_size(self) -> int:
        return self.source.local_batch_size * self.world

    @property
    def noise(self) -> float:
        return float(self.cfg.data.get("noise_ratio") or 0.0) if self.cfg.data.kind != "coco" else 0.0


def restore_state(run: Run, ckpt_dir: Path) -> tuple[int, int, int, Any]:
    """Load model, loss, optimiser, schedule, scaler and SWA state from ``ckpt_dir``; returns
    (step, epoch, batch in epoch, this rank's random state or None when the world size changed)."""
    from zsprob.models import load as load_model

    saved = state.load_state(ckpt_dir)
    loaded = load_model(Path(ckpt_dir) / "model", map_location="cpu")
    run.raw.model.load_state_dict(loaded.state_dict())
    run.raw.loss.load_state_dict(saved["loss"])
    run.optimizer.load_state_dict(saved["optimizer"])
    run.schedule.load_state_dict(saved["schedule"])
    if saved.get("scaler") is not None and run.acc.scaler is not None:
        run.acc.scaler.load_state_dict(saved["scaler"])
    if run.swa is not None and saved.get("swa") is not None:
        run.swa.load_state_tensors(saved["swa"])
    run.nonfinite_total = int(saved.get("nonfinite_total", 0))
    rng_state = None
    if int(saved.get("world", 1)) == run.world:
        rank_file = Path(ckpt_dir) / f"rng-rank{run.rank}"
        rng_state = state.load_state(rank_file)["rng"] if rank_file.is_dir() else saved["rng"]
    else:
        warnings.warn(f"resuming with {run.world} processes from a {saved.get('world')}-process run: "
                      "random streams restart from the seed (the run is not bit-identical)")
    if run.main:
        _truncate_metrics(run.out / "metrics.jsonl", int(saved["step"]))
    return int(saved["step"]), int(saved["epoch"]), int(saved["batch_in_epoch"]), rng_state


def next_batch(run: Run, step: int):
    """The next local batch on the device, with noisy captions, text SizeAugment, MSDA mixing
    (paper-text or official) and label smoothing where configured (one generator seeded by
    (seed, step, rank)); without MSDA, captions of the same image (sources that yield image
    indices: COCO) are positives, as the official engine marks them (its Mixup path does not);
    returns (images, tokens, matched or None)."""
    started = time.perf_counter()
    batch = run.cursor.next()
    images, tokens = batch[0], batch[1]
    groups = batch[2] if len(batch) > 2 and run.cfg.data.get("same_image_positives", True) else None
    run.data_time += time.perf_counter() - started
    msda = run.cfg.msda
    generator = None
    matched = None
    text_aug = run.text_aug if run.text_aug is not None and run.text_aug.share > 0 else None
    if run.noise > 0 or msda.enabled or text_aug is not None:
        generator = torch.Generator().manual_seed(mixed_seed(int(run.cfg.seed), step, run.rank))
    if run.noise > 0:
        tokens, replaced = add_caption_noise(tokens, run.noise, generator)
        run.noisy_rows += replaced
    if text_aug is not None:
        tokens = text_aug(tokens, generator)
    if msda.enabled and msda.mode == "official":
        from zsprob.prob.msda import mix_batch_official

        images, matched = mix_batch_official(images, ratio=float(msda.ratio), alpha=float(msda.alpha),
                                             switch_prob=float(msda.get("switch_prob", 0.5)),
                                             smoothing=float(msda.get("smoothing", 1e-4)), generator=generator)
    elif msda.enabled:
        from zsprob.prob.msda import mix_batch

        images, matched = mix_batch(images, ratio=float(msda.ratio), alpha=float(msda.alpha),
                                    mode=msda.mode, generator=generator)
    elif run.label_smoothing > 0 or groups is not None:  # captions of one image: positives (official engine)
        from zsprob.prob.msda import smooth_targets
        from zsprob.train.data import same_image_targets

        matched = torch.eye(images.shape[0]) if groups is None else same_image_targets(groups)
        matched = smooth_targets(matched, run.label_smoothing) if run.label_smoothing > 0 else matched
    if matched is not None:
        matched = matched.to(run.acc.device, non_blocking=True)
    return images.to(run.acc.device, non_blocking=True), tokens.to(run.acc.device, non_blocking=True), matched


def one_step(run: Run, step: int) -> dict:
    """Forward, backward, clip; the update unless the loss or the gradient is non-finite; returns the loss's stats."""
    images, tokens, matched = next_batch(run, step)
    frozen = run.schedule.frozen_groups()
    scale = run.loss_scale(step) if run.loss_scale is not None else 1.0
    if run.accum_steps > 1:  # exact: the loss of the whole batch, backpropagated micro-batch by micro-batch
        loss, stats = accumulate.accumulated_step(run.step_module, run.raw, images, tokens, matched, step,
                                                  run.accum_steps, run.acc)
        if scale != 1.0:  # gradients are linear in the loss: scale them after the micro-batches
            for p in itertools.chain.from_iterable(run.clip_sets):
                if p.grad is not None:
                    p.grad.mul_(scale)
            loss = loss * scale
    else:
        loss, stats = run.step_module(images, tokens, matched, step=step)
        if scale != 1.0:
            loss = loss * scale
        run.acc.backward(loss)
    if scale != 1.0:
        stats["loss_warmup"] = torch.tensor(scale)
    if frozen:
        optim.zero_frozen_grads(frozen)
    check = loss.detach().float()
    grad_clip = run.cfg.optim.get("grad_clip")
    if grad_clip:
        norms = clip_gradient_sets(run.acc, run.clip_sets, float(grad_clip))
        for key, gnorm in zip(("grad_norm", "grad_norm_sigma"), norms):
            if gnorm is not None:
                stats[key] = gnorm.detach().float()  # before clipping (metrics.jsonl)
            if gnorm is not None and run.cfg.train.precision != "fp16":
                check = check + 0.0 * gnorm.detach().float()  # NaN / inf norms poison the check
    if run.world > 1:
        check = dist.mean_across(check)
    if bool(torch.isfinite(check).item()):
        run.optimizer.step()
        run.consecutive_bad = 0
        run.loss_sum += loss.detach().float()
        run.n_in_interval += 1
    else:
        run.nonfinite_total += 1
        run.consecutive_bad += 1
        warnings.warn(f"step {step + 1}: non-finite loss or gradient, update skipped "
                      f"({run.consecutive_bad} in a row, {run.nonfinite_total} in total)")
        if run.consecutive_bad >= int(run.cfg.train.max_nonfinite):
            raise UserError(f"training stopped: the loss was non-finite in {run.consecutive_bad} consecutive steps "
                            f"(step {step + 1}); lower optim.lr, keep optim.grad_clip on, use fp32 or bf16, "
                            "or check the data")
    run.optimizer.zero_grad(set_to_none=True)
    return stats


def current_lrs(optimizer) -> dict[str, float]:
    """The learning rate of each parameter group, by group name."""
    return {g.get("group_name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}


def log_record(run: Run, step_done: int, stats: dict, lr_groups: dict, log_every: int) -> dict:
    """The metrics.jsonl record of the interval ending at ``step_done``; resets the interval."""
    now = time.perf_counter()
    mean_loss = (run.loss_sum / max(1, run.n_in_interval))
    if run.world > 1:
        mean_loss = dist.mean_across(mean_loss)
    # None when every step of the interval was skipped (non-finite)
    interval_loss = float(mean_loss.item()) if run.n_in_interval else None
    if interval_loss is not None:
        run.last_loss = interval_loss
    steps_in = step_done - (step_done - 1) // log_every * log_every if step_done == run.total_steps else log_every
    rec: dict[str, Any] = {"step": step_done, "epoch": run.cursor.epoch, "loss": interval_loss}
    for k, v in stats.items():  # the last step's terms on this process (rank 0)
        s = _scalar(v)
        if s is not None and k not in rec:
            rec[k] = s
    for k, v in _loss_scalars(run.raw.loss).items():
        rec.setdefault(k, v)
    rec["lr"] = max(lr_groups.values()) if lr_groups else 0.0
    rec["lr_groups"] = lr_groups
    elapsed = now - run.t_interval
    rec["samples_per_s"] = run.global_batch_size * steps_in / max(elapsed, 1e-9)
    rec["data_time_frac"] = run.data_time / max(elapsed, 1e-9)
    rec["nonfinite_total"] = run.nonfinite_total
    if run.noise > 0:
        rec["noisy_pairs"] = run.noisy_rows
    data_stats = run.source.stats()
    if data_stats:
        rec["data"] = data_stats
    if run.swa is not None:
        rec["swa_n"] = run.swa.n_averaged
    run.last_stats = rec
    if run.main:
        append_jsonl(run.out / "metrics.jsonl", rec)
        if run.log_with:
            run.acc.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step_done)
    run.loss_sum.zero_()
    run.n_in_interval = 0
    run.data_time = 0.0
    run.t_interval = time.perf_counter()
    return rec


def save_checkpoint(run: Run, step_done: int) -> None:
    """A resumable step directory: every rank's random state, then (main) models, optimiser and schedule
    state, written under a temporary name and committed by a rename (a write that fails or dies half-way
    leaves the previous checkpoint the one ``--resume`` picks)."""
    acc, out = run.acc, run.out
    tmp = state.checkpoint_root(out) / f".tmp-step-{step_done:07d}"
    try:
        if run.main:
            if tmp.exists():
                import shutil
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        state.save_state(tmp / f"rng-rank{run.rank}", {"rng": state.rng_state()})
        acc.wait_for_everyone()
        if run.main:
            _write_main_state(run, tmp, step_done)
            state.commit_checkpoint(out, tmp, step_done, keep=int(run.cfg.train.keep_checkpoints))
            if run.sync is not None:
                run.sync.try_push()
    except OSError as e:
        previous = resilience.latest_valid_checkpoint(out)
        raise UserError(f"writing the checkpoint of step {step_done} failed ({e}); "
                        f"{'the last complete one is ' + str(previous) if previous else 'no complete checkpoint'}"
                        " is what --resume takes") from None
    acc.wait_for_everyone()
    resilience.fault_point("checkpoint-done", step_done, run.rank)


def _write_main_state(run: Run, tmp: Path, step_done: int) -> None:
    """The main process's part of a checkpoint: model(s), then optimiser / schedule / data / RNG state."""
    _save_model(run.raw, tmp / "model", run.cfg, step_done)
    if run.swa is not None and run.swa.n_averaged > 0:
        _save_model(run.raw, tmp / "model-swa", run.cfg, step_done, swa=run.swa)
    resilience.fault_point("checkpoint-mid", step_done, run.rank)
    state.save_state(tmp, {
        "step": step_done, "epoch": run.cursor.epoch, "batch_in_epoch": run.cursor.pos, "world": run.world,
        "optimizer": run.optimizer.state_dict(), "schedule": run.schedule.state_dict(),
        "scaler": run.acc.scaler.state_dict() if run.acc.scaler is not None else None,
        "loss": run.raw.loss.state_dict(), "swa": run.swa.state_tensors() if run.swa is not None else None,
        "rng": state.rng_state(), "nonfinite_total": run.nonfinite_total,
    })


def run_hooks(run: Run, step_done: int) -> None:
    """The evaluation hooks on the main process (model in eval mode, no grad); results to metrics.jsonl."""
    if not run.hooks or not run.main:
        return
    results = {}
    model = run.raw.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for hook in run.hooks:
            results.update(hook(model, step_done) or {})
    model.train(was_training)
    append_jsonl(run.out / "metrics.jsonl", {"step": step_done, "eval": results})
    if run.log_with:
        run.acc.log({f"eval/{k}": v for k, v in results.items() if isinstance(v, (int, float))}, step=step_done)


def finish(run: Run, start_step: int, wall: float) -> dict:
    """The end: a resumable checkpoint, the final model(s), the hooks, summary.json."""
    out, total_steps = run.out, run.total_steps
    save_checkpoint(run, total_steps)
    summary: dict[str, Any] = {"steps": total_steps, "start_step": start_step, "method": run.cfg.method,
                               "global_batch_size": run.global_batch_size, "world_size": run.world,
                               "final_loss": run.last_loss, "nonfinite_total": run.nonfinite_total,
                               "wall_s": wall,
                               "samples_per_s": run.global_batch_size * (total_steps - start_step) / max(wall, 1e-9),
                               "model": str(out / "model")}
    if run.main:
        _save_model(run.raw, out / "model", run.cfg, total_steps)
        if run.swa is not None and run.swa.n_averaged > 0:
            _save_model(run.raw, out / "model-swa", run.cfg, total_steps, swa=run.swa)
            summary["model_swa"] = str(out / "model-swa")
            summary["swa_n"] = run.swa.n_averaged
    run_hooks(run, total_steps)
    if run.main:
        summary["last_log"] = run.last_stats
        atomic_write_json(out / "summary.json", summary)
        if run.sync is not None:
            run.sync.try_push()
    run.acc.wait_for_everyone()
    if run.log_with:
        run.acc.end_training()
    return summary


# ----------------------------------------------------------------------------- the loop

def train(cfg: Any, out: str | os.PathLike, *, resume: bool | str | None = None,
          source: BatchSource | None = None, eval_hooks: Iterable[EvalHook] = (), progress: bool = True) -> dict:
    """Train as ``cfg`` says; write everything under ``out``; return the summary dict.

    ``resume``: "auto" continues from the latest valid checkpoint if there is one, else starts afresh;
    "latest" (or True) continues from ``out/checkpoints/latest.json`` and fails without one; a path
    names a step directory; False never resumes; None (the default) is "auto" under a torchrun elastic
    agent and False elsewhere.
    ``source``: a custom :class:`zsprob.train.data.BatchSource` instead of ``cfg.data``.
    ``eval_hooks``: callables ``hook(model, step) -> dict`` run on the main process every
    ``train.eval_every`` steps and at the end; their dicts go to metrics.jsonl under "eval".
    SIGTERM / SIGUSR1 during the steps: the current step finishes, a checkpoint is written and
    :class:`zsprob.errors.Preempted` is raised (``train.requeue_exit_code`` is its exit code).
    """
    cfg = resolve_config(cfg)
    out = Path(out)
    acc, log_with = make_accelerator(cfg, out)
    state.seed_everything(int(cfg.seed) + acc.process_index)
    sync = remote_sync.for_run(cfg, out, acc, resume)  # may pull the remote's latest checkpoint first
    ckpt_dir = find_resume_dir(resume, out)

    builder, step_fn = build_parts, one_step
    if cfg.method == "jwae":  # autoencoders + prior discriminator: its own parts and step (zsprob.train.jwae_step)
        from zsprob.train import jwae_step
        builder, step_fn = jwae_step.build, jwae_step.one_step
    model, loss_fn, source, plan, step_module, optimizer, schedule = builder(cfg, acc, source, resolve_schedule)
    accum_steps = 1
    if step_fn is one_step:
        accum_steps = accumulate.check_accum_steps(cfg.train.get("accum_steps", 1), source.local_batch_size)
    elif cfg.train.get("accum_steps", 1) != 1:
        raise UserError(f"train.accum_steps applies to the pairwise losses, not to --method {cfg.method}")
    step_module, optimizer = acc.prepare(step_module, optimizer)
    raw = acc.unwrap_model(step_module)
    text_aug, label_smoothing = batch_augmentations(cfg, model)
    run = Run(cfg, out, acc, log_with, step_module, raw, optimizer, schedule, build_swa(cfg, raw.model, plan, raw.loss),
              source, plan.total_steps, list(eval_hooks),
              gradient_clip_sets(raw, cfg.optim.get("grad_clip_split", False)))
    run.text_aug, run.label_smoothing, run.loss_scale = text_aug, label_smoothing, plan.loss_scale
    run.sync, run.accum_steps, run.step_fn = sync, accum_steps, step_fn

    start_step, epoch, pos, rng_state = restore_state(run, ckpt_dir) if ckpt_dir is not None else (0, 0, 0, None)
    run.cursor = DataCursor(source, acc.device, epoch, pos)
    if rng_state is not None:
        # Sources skip already-consumed batches under isolated_rng(), so the restored
        # generators see exactly what they saw in the uninterrupted run.
        state.set_rng_state(rng_state)
    if run.main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", dump_yaml(cfg))
    if log_with:
        acc.init_trackers("tensorboard")
    return run_steps(run, start_step, progress)


def run_steps(run: Run, start_step: int, progress: bool) -> dict:
    """The steps from ``start_step`` to the end, then :func:`finish`; pre-emption signals are caught
    for the whole of it (a signal during the final writes lets them complete)."""
    from tqdm.auto import tqdm
    bar = tqdm(total=run.total_steps, initial=start_step, disable=not (progress and run.main), dynamic_ncols=True,
               desc=f"{run.cfg.method}")
    run.step_module.train()
    run.loss_sum = torch.zeros((), device=run.acc.device)
    run.t_interval = t_start = time.perf_counter()
    with resilience.StopSignals() as stop:
        try:
            for step in range(start_step, run.total_steps):
                stats = run.step_fn(run, step)
                saved = after_step(run, step + 1, stats, bar)
                stop_if_signalled(run, stop, step + 1, saved)
        finally:
            bar.close()
        return finish(run, start_step, time.perf_counter() - t_start)


def after_step(run: Run, step_done: int, stats: dict, bar) -> bool:
    """The schedule, SWA, logging, checkpoint and hooks due after ``step_done``; True if it checkpointed."""
    tc = run.cfg.train
    log_every = max(1, int(tc.log_every))
    ckpt_every = int(tc.checkpoint_every or 0)
    eval_every = int(tc.eval_every or 0)
    if tc.get("eval_every_epochs") and run.source.steps_per_epoch:  # e.g. model selection once per epoch
        eval_every = max(1, int(round(float(tc.eval_every_epochs) * run.source.steps_per_epoch)))
    log_now = step_done % log_every == 0 or step_done == run.total_steps
    lr_groups = current_lrs(run.optimizer) if log_now else {}  # the learning rates this step used
    run.schedule.step()
    bar.update(1)
    if run.swa is not None and run.swa.should_update(step_done):
        run.swa.update(run.raw.model, run.raw.loss)
    if log_now:
        rec = log_record(run, step_done, stats, lr_groups, log_every)
        if run.main:
            bar.set_postfix(loss=f"{run.last_loss:.4f}", sps=f"{rec['samples_per_s']:.0f}", refresh=False)
    saved = False
    if ckpt_every and step_done % ckpt_every == 0 and step_done != run.total_steps:
        save_checkpoint(run, step_done)
        run.t_interval = time.perf_counter()
        saved = True
    if eval_every and step_done % eval_every == 0 and step_done != run.total_steps:
        run_hooks(run, step_done)
        run.acc.wait_for_everyone()
        run.t_interval = time.perf_counter()
    return saved


def stop_if_signalled(run: Run, stop: resilience.StopSignals, step_done: int, saved: bool) -> None:
    """After a pre-emption signal (on any process): checkpoint ``step_done`` unless just done, then raise
    :class:`Preempted`. The last step finishes the run normally instead."""
    received = stop.received is not None
    if run.world > 1:
        received = dist.all_reduce_any(received, run.acc.device)
    if not received or step_done == run.total_steps:
        return
    if not saved:
        save_checkpoint(run, step_done)
    if run.log_with:
        run.acc.end_training()
    code = int(run.cfg.train.get("requeue_exit_code", resilience.DEFAULT_REQUEUE_EXIT_CODE))
    raise Preempted(f"stopped by {stop.received or 'a signal to another process'} after step {step_done} of "
                    f"{run.total_steps}; checkpoint {state.checkpoint_root(run.out) / f'step-{step_done:07d}'} "
                    f"written; run the same command with --resume auto to continue (exit code {code})",
                    exit_code=code, step=step_done)


def _save_model(raw: ContrastiveStep, path: Path, cfg: Config, step: int, swa: optim.SWA | None = None) -> None:
    from zsprob.models import save
    model = swa.averaged.module if swa is not None else raw.model
    extra = {"method": cfg.method, "step": step, "loss_params": _loss_scalars(raw.loss),
             "train_config": cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)}
    if swa is not None:
        extra["swa_n"] = swa.n_averaged
    loss = swa.averaged_loss.module if swa is not None and swa.averaged_loss is not None else raw.loss
    loss_tensors = {f"loss.{k}": v for k, v in loss.state_dict().items()}
    extra["loss_params"] = _loss_scalars(loss)
    save(model, path, extra=extra, extra_tensors=loss_tensors)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (a killed run may have logged past its last checkpoint)."""
    if not path.is_file():
        return
    import json
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(rec.get("step", 0)) <= step:
            keep.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in keep))
