"""Building a training run from its resolved config: the accelerator, the model, the loss, the data source,
the optimiser and schedule, SWA, and the :class:`~zsprob.train.run.Run` that holds them with its method's step.

accelerate does devices, DDP and mixed precision; zsprob.models, zsprob.prob and zsprob.train.data build
the parts.
"""
from __future__ import annotations

import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from zsprob.config import Config
from zsprob.data.captions import SHARD_KINDS
from zsprob.errors import UserError
from zsprob.prob.method_registry import METHOD_ENTRIES
from zsprob.train import accumulate, optim, resilience
from zsprob.train.data import (BatchSource, CocoSource, WdsSource, count_samples_synthetic, resolve_shards,
                               shard_options)
from zsprob.train.defaults import DEFAULTS
from zsprob.train.run import DataCursor, Run
from zsprob.train.schedule import SchedulePlan, create_optimisation, resolve_schedule
from zsprob.train.step import ContrastiveStep, gradient_clip_sets, one_step
from zsprob.utils.checks import check_count, check_shards


def build_model(cfg: Config):
    """The model of ``cfg.model``, with the method's head defaults unless it loads a zsprob checkpoint."""
    from zsprob.models import create_model, is_checkpoint
    m = cfg.model
    kw: dict[str, Any] = {}
    for key in ("embed_dim", "sigma_depth", "sigma_init", "pooling", "var_bounds", "sigma_head", "sigma_param",
                "sigma_shape", "weights"):
        if m.get(key) is not None:
            kw[key] = m[key]
    method = METHOD_ENTRIES[cfg.method]
    unset = {k: v for k, v in method.model_defaults(cfg).items() if kw.get(k) is None}
    if unset and not (m.pretrained and is_checkpoint(m.pretrained)):  # e.g. PCME's official head: log sigma
        kw.update(unset)
    if kw.get("var_bounds") is not None:
        kw["var_bounds"] = tuple(kw["var_bounds"])
    both = [k for k, v in m.overrides.items() if m.get(k) is not None and m[k] != v]
    if both:  # the override would win silently
        k = both[0]
        raise UserError(f"model.{k} ({m[k]!r}) and model.overrides.{k} ({m.overrides[k]!r}) are both set: drop one")
    kw.update(m.overrides)
    if "image_size" in kw and not isinstance(kw["image_size"], (list, tuple)):  # 0 would skip every sample
        check_count(kw["image_size"], "model.overrides.image_size", ">=1")
    deterministic = bool(kw.pop("deterministic", not method.needs_sigma))
    if deterministic and method.needs_sigma:
        raise UserError(f"--method {cfg.method} needs sigma, but the model is deterministic "
                        "(model.overrides.deterministic); drop that override or pick a method without sigma")
    model = create_model(m.name, pretrained=m.pretrained, deterministic=deterministic, seed=int(cfg.seed), **kw)
    if (cfg.data.preprocess or DEFAULTS["data"]["preprocess"]) == "official":  # PCME++'s COCO transforms
        from zsprob.data.transforms import apply_official_coco_preprocess
        apply_official_coco_preprocess(model)
    return model


def build_loss(cfg: Config) -> nn.Module:
    from zsprob.prob import create_loss
    kwargs = dict(cfg.loss[cfg.method])
    try:
        return create_loss(cfg.method, **kwargs)
    except TypeError as e:
        raise UserError(f"bad loss options for --method {cfg.method}: {e} (config section loss.{cfg.method})") from None


def build_source(cfg: Config, model, rank: int, world: int) -> BatchSource:
    """This process's share of the global batch, from shards or from a COCO / Flickr30k folder."""
    d = cfg.data
    B = int(d.batch_size)
    # data.augment=False: the evaluation transform (RandomResizedCrop's aspect jitter blurs shape classes)
    preprocess = model.preprocess_train if d.augment else model.preprocess_val
    if B % world:
        raise UserError(f"data.batch_size {B} (the global batch) is not divisible by {world} processes")
    kind = d.kind
    if kind in SHARD_KINDS:
        check_shards(kind, d.shards)
        samples = d.samples_per_epoch
        if samples is None and kind == "synthetic":
            samples = count_samples_synthetic(d.shards)
        options = shard_options(d, B // world, int(cfg.seed), samples)
        return WdsSource(resolve_shards(d.shards), options, preprocess=preprocess, tokenizer=model.tokenizer)
    if not d.root:  # COCO or Flickr30k captions (Karpathy splits)
        raise UserError(f"--data {kind} needs --root (the {kind} directory)")
    return CocoSource(d.root, preprocess=preprocess, tokenizer=model.tokenizer,
                      global_batch_size=B, rank=rank, world=world, seed=int(cfg.seed),
                      num_workers=int(d.num_workers), noise_ratio=float(d.noise_ratio),
                      karpathy_json=d.karpathy_json, dataset=kind)


def make_accelerator(cfg: Config, out: Path):
    """The accelerate ``Accelerator`` of ``cfg.train`` (device, precision, DDP, TensorBoard) and its tracker
    name; TF32 for the towers on CUDA (``train.tf32``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(int(tc.threads))
    cpu = training_on_cpu(tc)
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
    timeout = timedelta(seconds=float(tc.dist_timeout_s))
    resilience.init_restart_safe_process_group(cpu, timeout)  # before accelerate opens one
    _forget_other_precision(mixed, cpu)
    acc = Accelerator(cpu=cpu, mixed_precision=mixed, log_with=log_with, project_dir=str(out),
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=tc.find_unused_parameters),
                                       InitProcessGroupKwargs(timeout=timeout)])
    if acc.device.type == "cuda":
        set_tf32(tc.tf32)
    return acc, log_with


def _forget_other_precision(mixed: str, cpu: bool) -> None:
    """accelerate keeps one precision and device per process and refuses another, which a second run in the
    same process may ask for: its process-wide settings are then dropped (the process group is kept)."""
    from accelerate.state import AcceleratorState
    shared = AcceleratorState._shared_state
    if shared and (str(shared.get("_mixed_precision", mixed)) != mixed or bool(shared.get("_cpu", cpu)) != cpu):
        AcceleratorState._reset_state(reset_partial_state=False)


def training_on_cpu(tc) -> bool:
    """``train.cpu``: null means the CPU when no GPU is visible."""
    if tc.cpu is None:
        return not torch.cuda.is_available()
    if not tc.cpu and not torch.cuda.is_available():
        raise UserError("train.cpu=false asks for a GPU, but torch sees none (torch.cuda.is_available() is False); "
                        "drop the setting to train on the CPU")
    return bool(tc.cpu)


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matmuls and convolutions on CUDA (the towers; the losses opt out)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def build_optimisation(cfg: Config, model, step_module: nn.Module, plan: SchedulePlan):
    """The pairwise step's parameter groups (``optim.grouping``), then :func:`create_optimisation`."""
    oc = cfg.optim
    info = model.param_info() if hasattr(model, "param_info") else {}
    groups = optim.param_groups(step_module, lr=float(oc.lr), weight_decay=float(oc.weight_decay), param_info=info,
                                prefix="model.",
                                layer_decay=float(oc.layer_decay) if oc.layer_decay is not None else None,
                                image_lr_mult=float(oc.image_lr_mult), text_lr_mult=float(oc.text_lr_mult),
                                grouping=str(oc.grouping or DEFAULTS["optim"]["grouping"]))
    return create_optimisation(cfg, groups, plan, float(oc.lr))


def batch_augmentations(cfg: Config, model) -> tuple[Any, float]:
    """Text SizeAugment and the label smoothing of steps without MSDA, after checking the MSDA options."""
    from zsprob.data.text_augment import TextSizeAugment
    from zsprob.prob.msda import check_config

    msda = cfg.msda
    label_smoothing = float(msda.label_smoothing)
    check_config(enabled=bool(msda.enabled), mode=str(msda.mode), alpha=float(msda.alpha))
    text_aug = TextSizeAugment(float(cfg.data.text_size_augment),
                               float(cfg.data.text_size_augment_masking),
                               float(cfg.data.text_size_augment_erasing), model.tokenizer)
    return text_aug, label_smoothing


def build_swa(cfg: Config, model: nn.Module, plan: SchedulePlan, loss: nn.Module | None = None) -> optim.SWA | None:
    """SWA of the model (and of the loss's a, b with ``swa.average_loss``)."""
    if not cfg.swa.enabled:
        return None
    last = plan.steps_of(cfg.swa.last_steps, cfg.swa.last_epochs, "swa.last_epochs")
    every = cfg.swa.every_steps or plan.steps_per_epoch or max(1, last // 10)
    loss = loss if cfg.swa.average_loss else None
    return optim.SWA(model, start=max(0, plan.total_steps - last), every=int(every), loss=loss)


def build_parts(cfg: Config, acc, source: BatchSource | None):
    """(model, loss, source, plan, step module, optimiser, schedule) of a pairwise run."""
    model = build_model(cfg)
    if cfg.model.grad_checkpointing:
        accumulate.enable_grad_checkpointing(model)
    loss_fn = build_loss(cfg)
    if source is None:
        source = build_source(cfg, model, acc.process_index, acc.num_processes)
    plan = resolve_schedule(cfg, source.steps_per_epoch)
    step_module = ContrastiveStep(model, loss_fn, seed=int(cfg.seed))
    optimizer, schedule = build_optimisation(cfg, model, step_module, plan)
    return model, loss_fn, source, plan, step_module, optimizer, schedule


def compile_model(model: nn.Module, device: torch.device) -> None:
    """``train.compile``: torch.compile the model in place (state_dict keys unchanged), once a compiler is
    known to be there (a C++ compiler on the CPU, triton on CUDA)."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise UserError("train.compile needs triton on CUDA (pip install triton), or set train.compile=false")
    elif not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        raise UserError("train.compile on the CPU needs a C++ compiler (g++ or clang++ on PATH, or $CXX); "
                        "install one or set train.compile=false")
    model.compile()


def build_run(cfg: Config, out: Path, acc, log_with: str | None, *, source: BatchSource | None = None,
              hooks: Iterable = ()) -> Run:
    """Every part of the run ``cfg`` describes, built once, with the step of its method (the loop adds the
    remote mirror)."""
    from zsprob.train import jwae_step

    jwae = METHOD_ENTRIES[cfg.method].step_kind == "jwae"
    builder, step_fn = (jwae_step.build, jwae_step.one_step) if jwae else (build_parts, one_step)
    model, loss_fn, source, plan, step_module, optimizer, schedule = builder(cfg, acc, source)
    accum_steps = 1 if jwae else accumulate.check_accum_steps(cfg.train.accum_steps, source.local_batch_size)
    if cfg.train.compile:
        compile_model(model, acc.device)
    source.configure(device=acc.device)  # loaders pin their batches for CUDA
    step_module, optimizer = acc.prepare(step_module, optimizer)
    raw = acc.unwrap_model(step_module)
    swa = build_swa(cfg, raw.model, plan, raw.loss)
    cursor = DataCursor(source, acc.device)
    clip_sets = gradient_clip_sets(raw, cfg.optim.grad_clip_split)
    text_aug, label_smoothing = batch_augmentations(cfg, model)
    return Run(cfg=cfg, out=out, acc=acc, log_with=log_with, step_module=step_module, raw=raw, optimizer=optimizer,
               schedule=schedule, swa=swa, source=source, cursor=cursor, total_steps=plan.total_steps,
               hooks=list(hooks), step_fn=step_fn, clip_sets=clip_sets, accum_steps=accum_steps, text_aug=text_aug,
               label_smoothing=label_smoothing, loss_scale=plan.loss_scale, warmup_steps=plan.warmup)
