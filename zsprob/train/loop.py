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

Outputs under ``out``: ``config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/step-*/`` (+ ``latest.json``) for ``resume``, and at the end ``model/`` (the
final weights, a ``zsprob.models.save`` directory) and ``model-swa/`` when SWA ran;
``summary.json`` holds the run's totals.
"""
from __future__ import annotations

import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from zsprob.config import Config, deep_merge, dump_yaml, to_config
from zsprob.errors import UserError
from zsprob.train import distributed as D
from zsprob.train import optim as O
from zsprob.train import state as S
from zsprob.train.data import (BatchSource, CocoSource, WdsSource, add_caption_noise, count_samples_synthetic,
                               mixed_seed, resolve_shards, steps_from)
from zsprob.train.defaults import DEFAULTS, METHODS
from zsprob.utils.io import append_jsonl, atomic_write_json, atomic_write_text

EvalHook = Callable[[nn.Module, int], dict]


# ----------------------------------------------------------------------------- the step module

class ContrastiveStep(nn.Module):
    """Model + loss in one module, so DDP sees every trainable parameter (incl. the loss's a, b).

    A loss with ``wants_masked`` (ProLIP with ``inclusion_alpha_occ`` > 0) also gets masked copies
    of this process's first ``loss.n_masked(n)`` images and captions (``zsprob.data.masking``),
    encoded by the same model; the masks come from a generator seeded by (seed, step, rank), so a
    run and its resumption draw the same masks.
    """

    MASK_SALT = 0x3A5C  # keeps the mask stream apart from the noise / MSDA stream of the same step

    def __init__(self, model: nn.Module, loss: nn.Module, seed: int = 0):
        super().__init__()
        self.model = model
        self.loss = loss
        self.seed = int(seed)
        self._text_mask_spec = None

    def _mu_logvar(self, out: dict, side: str):
        mu, logvar = out[f"{side}_mu"].float(), out[f"{side}_logvar"]
        return mu, (logvar.float() if logvar is not None else None)

    def masked_features(self, images: torch.Tensor, tokens: torch.Tensor, step: int) -> dict:
        """``masked_img`` / ``masked_txt`` keyword arguments for the loss ({} when it wants none)."""
        if not getattr(self.loss, "wants_masked", False):
            return {}
        n_masked = self.loss.n_masked(images.shape[0])
        if n_masked == 0:
            return {}
        from zsprob.data.masking import TEXT_MASK_MODES, mask_image_cells, text_mask_spec
        if self._text_mask_spec is None:
            self._text_mask_spec = text_mask_spec(self.model.tokenizer)
        rank = D.world_info()[0]
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, int(step), rank, self.MASK_SALT))
        mask_text = TEXT_MASK_MODES[getattr(self.loss, "text_mask_mode", "replace")]
        masked_tokens = mask_text(tokens[:n_masked].cpu(), self.loss.drop_prob, self._text_mask_spec, generator)
        masked_images = mask_image_cells(images[:n_masked].cpu(), self.loss.image_drop_prob,
                                         self.loss.mask_patch_size, generator)
        out = self.model(masked_images.to(images.device), masked_tokens.to(tokens.device))
        return {"masked_img": self._mu_logvar(out, "img"), "masked_txt": self._mu_logvar(out, "txt")}

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, matched: torch.Tensor | None = None,
                step: int = 0):
        out = self.model(images, tokens)
        img_mu, img_lv, txt_mu, txt_lv = (out["img_mu"], out["img_logvar"], out["txt_mu"], out["txt_logvar"])
        masked = self.masked_features(images, tokens, step)
        device_type = img_mu.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            img_mu, txt_mu = img_mu.float(), txt_mu.float()
            img_lv = img_lv.float() if img_lv is not None else None
            txt_lv = txt_lv.float() if txt_lv is not None else None
            if D.is_distributed():
                all_img, offset = D.gather_gaussians(img_mu, img_lv)
                all_txt, _ = D.gather_gaussians(txt_mu, txt_lv)
                if matched is not None:
                    matched = D.block_diag_targets(matched)
            else:
                all_img = all_txt = None
                offset = 0
            loss, stats = self.loss(img_mu, img_lv, txt_mu, txt_lv, matched,
                                    all_img=all_img, all_txt=all_txt, offset=offset, **masked)
        stats = dict(stats or {})
        with torch.no_grad():
            if img_lv is not None:
                stats.setdefault("img_sigma2", img_lv.exp().mean())
            if txt_lv is not None:
                stats.setdefault("txt_sigma2", txt_lv.exp().mean())
        return loss, stats


# ----------------------------------------------------------------------------- helpers

def resolve_config(cfg: Any) -> Config:
    """Defaults <- ``cfg``; validates the method."""
    cfg = to_config(deep_merge(DEFAULTS, dict(cfg or {})))
    if cfg.method not in METHODS:
        raise UserError(f"unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    if not isinstance(cfg.data.get("augment", True), bool):
        raise UserError(f"data.augment must be true or false, got {cfg.data.augment!r}")
    if cfg.train.precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"train.precision must be fp32, bf16 or fp16, got {cfg.train.precision!r}")
    return cfg


def build_model(cfg: Config):
    from zsprob.models import create_model
    from zsprob.prob import needs_sigma
    m = cfg.model
    kw: dict[str, Any] = {}
    for key in ("embed_dim", "sigma_depth", "sigma_init", "pooling", "var_bounds"):
        if m.get(key) is not None:
            kw[key] = m[key]
    if kw.get("var_bounds") is not None:
        kw["var_bounds"] = tuple(kw["var_bounds"])
    kw.update(dict(m.get("overrides") or {}))
    deterministic = bool(kw.pop("deterministic", not needs_sigma(cfg.method)))
    if deterministic and needs_sigma(cfg.method):
        raise UserError(f"--method {cfg.method} needs sigma, but the model is deterministic "
                        "(model.overrides.deterministic); drop that override or pick a method without sigma")
    return create_model(m.name, pretrained=m.get("pretrained"), deterministic=deterministic,
                        seed=int(cfg.seed), **kw)


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
    if kind in ("synthetic", "webdataset", "redcaps"):
        if not d.shards:
            raise UserError(f"--data {kind} needs --shards (a directory of .tar files or a brace pattern)")
        if kind == "synthetic" and not any(c in str(d.shards) for c in "{}:") and not Path(str(d.shards)).exists():
            raise UserError(f"SynthWorld shards not found: {d.shards} (make them with `zsprob data synthetic --out DIR`,"
                            " then pass --shards DIR/pretrain)")
        samples = d.get("samples_per_epoch")
        if samples is None and kind == "synthetic":
            samples = count_samples_synthetic(d.shards)
        return WdsSource(resolve_shards(d.shards), kind=kind, preprocess=preprocess,
                         tokenizer=model.tokenizer, local_batch_size=B // world, seed=int(cfg.seed),
                         num_workers=int(d.num_workers), shuffle_buffer=d.get("shuffle_buffer"),
                         resampled=bool(d.resampled), samples_per_epoch=samples, world=world,
                         extra=dict(d.get("pipeline") or {}))
    if kind == "coco":
        if not d.root:
            raise UserError("--data coco needs --root (the COCO directory)")
        return CocoSource(d.root, preprocess=preprocess, tokenizer=model.tokenizer,
                          global_batch_size=B, rank=rank, world=world, seed=int(cfg.seed),
                          num_workers=int(d.num_workers), noise_ratio=float(d.noise_ratio or 0.0),
                          karpathy_json=d.get("karpathy_json"))
    raise UserError(f"unknown data kind {kind!r} (synthetic, webdataset, redcaps, coco)")


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
            exhausted = D.all_reduce_any(batch is None, self.device)
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


# ----------------------------------------------------------------------------- the loop

def train(cfg: Any, out: str | os.PathLike, *, resume: bool | str = False, source: BatchSource | None = None,
          eval_hooks: Iterable[EvalHook] = (), progress: bool = True) -> dict:
    """Train as ``cfg`` says; write everything under ``out``; return the summary dict.

    ``resume``: True continues from ``out/checkpoints/latest.json``; a path names a step directory.
    ``source``: a custom :class:`zsprob.train.data.BatchSource` instead of ``cfg.data``.
    ``eval_hooks``: callables ``hook(model, step) -> dict`` run on the main process every
    ``train.eval_every`` steps and at the end; their dicts go to metrics.jsonl under "eval".
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cfg = resolve_config(cfg)
    out = Path(out)
    tc = cfg.train
    if tc.get("threads"):
        torch.set_num_threads(int(tc.threads))
    cpu = (not torch.cuda.is_available()) if tc.get("cpu") is None else bool(tc.cpu)
    mp = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[tc.precision]
    if mp == "fp16" and cpu:
        raise UserError("fp16 needs a GPU; use --set train.precision=bf16 or fp32 on the CPU")
    log_with = None
    if tc.tensorboard:
        try:
            import tensorboard  # noqa: F401
            log_with = "tensorboard"
        except ImportError:
            warnings.warn("tensorboard is not installed; metrics go to metrics.jsonl only")
    acc = Accelerator(cpu=cpu, mixed_precision=mp, log_with=log_with, project_dir=str(out),
                      kwargs_handlers=[DistributedDataParallelKwargs(
                          find_unused_parameters=bool(tc.find_unused_parameters))])
    rank, world = acc.process_index, acc.num_processes
    main = acc.is_main_process
    device = acc.device
    seed = int(cfg.seed)
    S.seed_everything(seed + rank)

    # ---- resume: the saved config is the base unless the caller passed a different one
    ckpt_dir: Path | None = None
    if resume:
        ckpt_dir = Path(resume) if isinstance(resume, (str, os.PathLike)) else S.latest_checkpoint(out)
        if ckpt_dir is None:
            raise UserError(f"--resume: no checkpoint in {out / 'checkpoints'} (nothing to resume)")
        if not (Path(ckpt_dir) / "state.json").is_file():
            raise UserError(f"--resume: {ckpt_dir} is not a checkpoint directory (no state.json)")

    # ---- model, loss, data
    model = build_model(cfg)
    loss_fn = build_loss(cfg)
    if source is None:
        source = build_source(cfg, model, rank, world)
    global_bs = source.local_batch_size * world
    spe = source.steps_per_epoch
    sch = cfg.schedule
    total_steps = sch.get("steps")
    if sch.get("epochs") is not None:
        total_steps = steps_from(sch.epochs, spe, "schedule.epochs")
    if not total_steps:
        raise UserError("set the run length: --steps N (schedule.steps) or schedule.epochs")
    total_steps = int(total_steps)

    def steps_of(steps_key_val, epochs_val, what):
        return steps_from(epochs_val, spe, what) if epochs_val is not None else int(steps_key_val or 0)

    warmup = steps_of(sch.get("warmup_steps"), sch.get("warmup_epochs"), "schedule.warmup_epochs")
    milestones = list(sch.get("milestones_steps") or [])
    if sch.get("milestones_epochs"):
        milestones += [steps_from(e, spe, "schedule.milestones_epochs") for e in sch.milestones_epochs]
    fz = cfg.freeze
    freeze = {}
    f_warm = steps_of(fz.get("warmup_steps"), fz.get("warmup_epochs"), "freeze.warmup_epochs")
    for tower in ("image", "text"):
        n = steps_of(fz.get(f"{tower}_steps"), fz.get(f"{tower}_epochs"), f"freeze.{tower}_epochs")
        if n > 0:
            freeze[tower] = O.freeze_fn(n, f_warm)

    # ---- optimisation
    step_module = ContrastiveStep(model, loss_fn, seed=seed)
    oc = cfg.optim
    info = model.param_info() if hasattr(model, "param_info") else {}
    groups = O.param_groups(step_module, lr=float(oc.lr), weight_decay=float(oc.weight_decay), param_info=info,
                            prefix="model.",
                            layer_decay=float(oc.layer_decay) if oc.get("layer_decay") is not None else None,
                            image_lr_mult=float(oc.image_lr_mult), text_lr_mult=float(oc.text_lr_mult),
                            grouping=str(oc.get("grouping") or "zsprob"))
    optimizer = O.create_optimizer(groups, name=oc.name, lr=float(oc.lr), weight_decay=float(oc.weight_decay),
                                   betas=oc.betas, eps=float(oc.eps))
    schedule = O.GroupSchedule(optimizer, O.schedule_fn(sch.name, total_steps=total_steps, warmup_steps=warmup,
                                                        min_lr_ratio=float(sch.min_lr_ratio),
                                                        milestones=milestones, gamma=float(sch.gamma)),
                               freeze=freeze)
    step_module, optimizer = acc.prepare(step_module, optimizer)
    raw = acc.unwrap_model(step_module)
    params = [p for p in raw.parameters() if p.requires_grad]

    swa = None
    if cfg.swa.enabled:
        last = steps_of(cfg.swa.get("last_steps"), cfg.swa.get("last_epochs"), "swa.last_epochs")
        every = cfg.swa.get("every_steps") or spe or max(1, last // 10)
        swa = O.SWA(raw.model, start=max(0, total_steps - last), every=int(every))

    # ---- state
    start_step = 0
    epoch, pos = 0, 0
    nonfinite_total = 0
    rng_to_restore = None
    if ckpt_dir is not None:
        from zsprob.models import load as load_model
        st = S.load_state(ckpt_dir)
        loaded = load_model(Path(ckpt_dir) / "model", map_location="cpu")
        raw.model.load_state_dict(loaded.state_dict())
        raw.loss.load_state_dict(st["loss"])
        optimizer.load_state_dict(st["optimizer"])
        schedule.load_state_dict(st["schedule"])
        if st.get("scaler") is not None and acc.scaler is not None:
            acc.scaler.load_state_dict(st["scaler"])
        if swa is not None and st.get("swa") is not None:
            swa.load_state_tensors(st["swa"])
        start_step, epoch, pos = int(st["step"]), int(st["epoch"]), int(st["batch_in_epoch"])
        nonfinite_total = int(st.get("nonfinite_total", 0))
        if int(st.get("world", 1)) == world:
            rank_file = Path(ckpt_dir) / f"rng-rank{rank}"
            rng_to_restore = S.load_state(rank_file)["rng"] if rank_file.is_dir() else st["rng"]
        else:
            warnings.warn(f"resuming with {world} processes from a {st.get('world')}-process run: "
                          "random streams restart from the seed (the run is not bit-identical)")
        if main:
            _truncate_metrics(out / "metrics.jsonl", start_step)
    cursor = DataCursor(source, device, epoch, pos)
    if rng_to_restore is not None:
        # Sources skip already-consumed batches under isolated_rng(), so the restored
        # generators see exactly what they saw in the uninterrupted run.
        S.set_rng_state(rng_to_restore)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", dump_yaml(cfg))
    if log_with:
        acc.init_trackers("tensorboard")

    hooks = list(eval_hooks)
    noise = float(cfg.data.get("noise_ratio") or 0.0) if cfg.data.kind != "coco" else 0.0
    msda = cfg.msda
    if msda.enabled:
        from zsprob.prob.msda import mix_batch, mix_batch_official
    from zsprob.prob.msda import check_config, smooth_targets
    check_config(enabled=bool(msda.enabled), mode=str(msda.mode), ratio=float(msda.ratio), alpha=float(msda.alpha),
                 switch_prob=float(msda.get("switch_prob", 0.5)), smoothing=float(msda.get("smoothing", 1e-4)),
                 label_smoothing=float(msda.get("label_smoothing") or 0.0))
    from zsprob.data.text_augment import TextSizeAugment
    label_smoothing = float(msda.get("label_smoothing") or 0.0)  # targets of the steps without MSDA
    text_aug = TextSizeAugment(float(cfg.data.get("text_size_augment") or 0.0),
                               float(cfg.data.get("text_size_augment_masking", 0.5)),
                               float(cfg.data.get("text_size_augment_erasing", 0.1)), model.tokenizer)
    precision_fp16 = mp == "fp16"
    max_nonfinite = int(tc.max_nonfinite)
    log_every = max(1, int(tc.log_every))
    ckpt_every = int(tc.checkpoint_every or 0)
    eval_every = int(tc.eval_every or 0)

    def save_checkpoint(step_done: int) -> None:
        tmp = S.checkpoint_root(out) / f".tmp-step-{step_done:07d}"
        if main:
            if tmp.exists():
                import shutil
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        S.save_state(tmp / f"rng-rank{rank}", {"rng": S.rng_state()})
        acc.wait_for_everyone()
        if main:
            _save_model(raw, tmp / "model", cfg, step_done)
            if swa is not None and swa.n_averaged > 0:
                _save_model(raw, tmp / "model-swa", cfg, step_done, swa=swa)
            S.save_state(tmp, {
                "step": step_done, "epoch": cursor.epoch, "batch_in_epoch": cursor.pos, "world": world,
                "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                "loss": raw.loss.state_dict(), "swa": swa.state_tensors() if swa is not None else None,
                "rng": S.rng_state(), "nonfinite_total": nonfinite_total,
            })
            S.commit_checkpoint(out, tmp, step_done, keep=int(tc.keep_checkpoints))
        acc.wait_for_everyone()

    def run_hooks(step_done: int) -> None:
        if not hooks or not main:
            return
        results = {}
        was_training = raw.model.training
        raw.model.eval()
        with torch.no_grad():
            for h in hooks:
                r = h(raw.model, step_done) or {}
                results.update(r)
        raw.model.train(was_training)
        append_jsonl(out / "metrics.jsonl", {"step": step_done, "eval": results})
        if log_with:
            acc.log({f"eval/{k}": v for k, v in results.items() if isinstance(v, (int, float))}, step=step_done)

    # ---- loop
    from tqdm.auto import tqdm
    bar = tqdm(total=total_steps, initial=start_step, disable=not (progress and main), dynamic_ncols=True,
               desc=f"{cfg.method}")
    step_module.train()
    loss_sum = torch.zeros((), device=device)
    n_in_interval = 0
    consecutive_bad = 0
    t_interval = time.perf_counter()
    t_start = time.perf_counter()
    data_time = 0.0
    last_stats: dict = {}
    noisy_rows = 0
    last_loss = float("nan")
    for step in range(start_step, total_steps):
        t_d = time.perf_counter()
        images, tokens = cursor.next()
        data_time += time.perf_counter() - t_d
        gen = None
        matched = None
        if noise > 0 or msda.enabled or text_aug.share > 0:
            gen = torch.Generator().manual_seed(mixed_seed(seed, step, rank))
        if noise > 0:
            tokens, k = add_caption_noise(tokens, noise, gen)
            noisy_rows += k
        if text_aug.share > 0:
            tokens = text_aug(tokens, gen)
        if msda.enabled and msda.mode == "official":
            images, matched = mix_batch_official(images, ratio=float(msda.ratio), alpha=float(msda.alpha),
                                                 switch_prob=float(msda.get("switch_prob", 0.5)),
                                                 smoothing=float(msda.get("smoothing", 1e-4)), generator=gen)
        elif msda.enabled:
            images, matched = mix_batch(images, ratio=float(msda.ratio), alpha=float(msda.alpha),
                                        mode=msda.mode, generator=gen)
        elif label_smoothing > 0:
            matched = smooth_targets(torch.eye(images.shape[0]), label_smoothing)
        if matched is not None:
            matched = matched.to(device, non_blocking=True)
        images = images.to(device, non_blocking=True)
        tokens = tokens.to(device, non_blocking=True)

        frozen = schedule.frozen_groups()
        loss, stats = step_module(images, tokens, matched, step=step)
        acc.backward(loss)
        if frozen:
            O.zero_frozen_grads(frozen)
        check = loss.detach().float()
        if oc.get("grad_clip"):
            gnorm = acc.clip_grad_norm_(params, float(oc.grad_clip))
            if gnorm is not None and not precision_fp16:
                check = check + 0.0 * gnorm.detach().float()  # NaN / inf norms poison the check
        if world > 1:
            check = D.mean_across(check)
        finite = bool(torch.isfinite(check).item())
        if finite:
            optimizer.step()
            consecutive_bad = 0
            loss_sum += loss.detach().float()
            n_in_interval += 1
        else:
            nonfinite_total += 1
            consecutive_bad += 1
            warnings.warn(f"step {step + 1}: non-finite loss or gradient, update skipped "
                          f"({consecutive_bad} in a row, {nonfinite_total} in total)")
            if consecutive_bad >= max_nonfinite:
                raise UserError(f"training stopped: the loss was non-finite in {consecutive_bad} consecutive steps "
                                f"(step {step + 1}); lower optim.lr, keep optim.grad_clip on, use fp32 or bf16, "
                                "or check the data")
        optimizer.zero_grad(set_to_none=True)
        step_done = step + 1
        log_now = step_done % log_every == 0 or step_done == total_steps
        if log_now:  # the learning rates this step used
            lr_groups = {g.get("group_name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}
        schedule.step()
        bar.update(1)

        if swa is not None and swa.should_update(step_done):
            swa.update(raw.model)

        if log_now:
            now = time.perf_counter()
            mean_loss = (loss_sum / max(1, n_in_interval))
            if world > 1:
                mean_loss = D.mean_across(mean_loss)
            # None when every step of the interval was skipped (non-finite)
            interval_loss = float(mean_loss.item()) if n_in_interval else None
            if interval_loss is not None:
                last_loss = interval_loss
            steps_in = step_done - (step_done - 1) // log_every * log_every if step_done == total_steps \
                else log_every
            rec: dict[str, Any] = {"step": step_done, "epoch": cursor.epoch, "loss": interval_loss}
            for k, v in stats.items():  # the last step's terms on this process (rank 0)
                s = _scalar(v)
                if s is not None and k not in rec:
                    rec[k] = s
            for k, v in _loss_scalars(raw.loss).items():
                rec.setdefault(k, v)
            rec["lr"] = max(lr_groups.values()) if lr_groups else 0.0
            rec["lr_groups"] = lr_groups
            elapsed = now - t_interval
            rec["samples_per_s"] = global_bs * steps_in / max(elapsed, 1e-9)
            rec["data_time_frac"] = data_time / max(elapsed, 1e-9)
            rec["nonfinite_total"] = nonfinite_total
            if noise > 0:
                rec["noisy_pairs"] = noisy_rows
            dstats = source.stats()
            if dstats:
                rec["data"] = dstats
            if swa is not None:
                rec["swa_n"] = swa.n_averaged
            last_stats = rec
            if main:
                append_jsonl(out / "metrics.jsonl", rec)
                if log_with:
                    acc.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step_done)
                bar.set_postfix(loss=f"{last_loss:.4f}", sps=f"{rec['samples_per_s']:.0f}", refresh=False)
            loss_sum.zero_()
            n_in_interval = 0
            data_time = 0.0
            t_interval = time.perf_counter()

        if ckpt_every and step_done % ckpt_every == 0 and step_done != total_steps:
            save_checkpoint(step_done)
            t_interval = time.perf_counter()
        if eval_every and step_done % eval_every == 0 and step_done != total_steps:
            run_hooks(step_done)
            acc.wait_for_everyone()
            t_interval = time.perf_counter()
    bar.close()

    # ---- the end: a resumable checkpoint, the final model(s), the summary
    wall = time.perf_counter() - t_start
    save_checkpoint(total_steps)
    summary: dict[str, Any] = {"steps": total_steps, "start_step": start_step, "method": cfg.method,
                               "global_batch_size": global_bs, "world_size": world,
                               "final_loss": last_loss, "nonfinite_total": nonfinite_total,
                               "wall_s": wall, "samples_per_s": global_bs * (total_steps - start_step) / max(wall, 1e-9),
                               "model": str(out / "model")}
    if main:
        _save_model(raw, out / "model", cfg, total_steps)
        if swa is not None and swa.n_averaged > 0:
            _save_model(raw, out / "model-swa", cfg, total_steps, swa=swa)
            summary["model_swa"] = str(out / "model-swa")
            summary["swa_n"] = swa.n_averaged
    run_hooks(total_steps)
    if main:
        summary["last_log"] = last_stats
        atomic_write_json(out / "summary.json", summary)
    acc.wait_for_everyone()
    if log_with:
        acc.end_training()
    return summary


def _save_model(raw: ContrastiveStep, path: Path, cfg: Config, step: int, swa: O.SWA | None = None) -> None:
    from zsprob.models import save
    model = swa.averaged.module if swa is not None else raw.model
    extra = {"method": cfg.method, "step": step, "loss_params": _loss_scalars(raw.loss),
             "train_config": cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)}
    if swa is not None:
        extra["swa_n"] = swa.n_averaged
    loss_tensors = {f"loss.{k}": v for k, v in raw.loss.state_dict().items()}
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
