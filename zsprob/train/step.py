"""One training step of the pairwise losses: the step module, the batch, forward / backward / clip / update.

The step is queued on the device and the host reads one value: whether the loss and the gradient norms
were finite on every process, which decides the update. Under fp16 the gradients are unscaled once and
the scaler is updated on skipped steps too. accelerate does the backward and DDP; torch clips.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
import warnings

import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.train import accumulate
from zsprob.train import distributed as dist
from zsprob.train import optim, resilience
from zsprob.train.accumulate import at_least_fp32
from zsprob.train.data import add_caption_noise, mixed_seed
from zsprob.train.run import Run


class ContrastiveStep(nn.Module):
    """Model + loss in one module, so DDP sees every trainable parameter (incl. the loss's a, b). A loss with
    ``wants_masked`` (the occlusion term) also gets masked copies of the first ``loss.n_masked(n, step)`` rows,
    encoded by the same model, with masks seeded by (seed, step, rank) so that a resumed run draws the same."""

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
        masked_tokens = mask_text(tokens[:n_masked], self.loss.drop_prob, self._text_mask_spec, generator)
        return self.masked_images(images[:n_masked], generator), masked_tokens

    def masked_images(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The occlusion term's image copies: cells blanked, or one lossy operation per image (``degrade``)."""
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
        with torch.autocast(device_type=device_type, enabled=False), full_precision_matmuls():
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


@contextlib.contextmanager
def full_precision_matmuls():
    """float32 matmuls in full precision inside the block (TF32 off, whatever ``train.tf32`` set for the
    towers): CSD's squared distances subtract large numbers, which TF32's 10-bit mantissa would blur."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def gradient_clip_sets(raw: nn.Module, split: bool) -> list[list]:
    """The parameter sets clipped apart: all trainable parameters, or (``optim.grad_clip_split``) all but the
    log-variance heads, then the heads, so large sigma-only gradients never scale down the means' update."""
    named = [(name, p) for name, p in raw.named_parameters() if p.requires_grad]
    if not split:
        return [[p for _, p in named]]
    heads = tuple(f"model.{m}." for m in getattr(raw.model, "SIGMA_MODULES", ()))
    sigma = [p for name, p in named if name.startswith(heads)]
    if not sigma:
        raise UserError("optim.grad_clip_split needs a model with log-variance heads (this one has none)")
    return [[p for name, p in named if not name.startswith(heads)], sigma]


def unscale_once(run: Run) -> None:
    """Under fp16, divide the gradients by the loss scale once per update, before clipping; the scaler
    records whether it found inf / NaN. A no-op without a scaler."""
    if run.acc.scaler is not None:
        run.acc.scaler.unscale_(_inner(run))


def clip_gradient_sets(sets: list[list], max_norm: float) -> list[torch.Tensor]:
    """Clip each parameter set's gradient to ``max_norm`` on its own (on the device: no host sync); the norms
    before clipping, one per set."""
    return [torch.nn.utils.clip_grad_norm_(params, max_norm) for params in sets]


def clip_check(run: Run, loss: torch.Tensor, sets: list[list]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Unscale and clip each parameter set apart; (the update's check: the loss, made non-finite by a non-finite
    norm unless an fp16 scaler judges the gradients, the norms before clipping)."""
    unscale_once(run)
    check = loss.detach().float()
    norms = []
    if run.cfg.optim.grad_clip:
        norms = [norm.detach().float() for norm in clip_gradient_sets(sets, float(run.cfg.optim.grad_clip))]
        if run.acc.scaler is None:
            for norm in norms:
                check = check + 0.0 * norm  # NaN / inf norms poison the check
    return check, norms


def fetch(run: Run, ahead: bool = False):
    """The next batch of the run's data cursor (``ahead``: whether the one after it is missing,
    :meth:`~zsprob.train.run.DataCursor.look_ahead`), the wait added to the interval's data time."""
    started = time.perf_counter()
    batch = run.cursor.look_ahead() if ahead else run.cursor.next()
    run.counters.data_time += time.perf_counter() - started
    return batch


def next_batch(run: Run, step: int):
    """(images, tokens, match targets or None) of the next local batch on the device, with noisy captions,
    text SizeAugment, MSDA or label smoothing where configured, every draw from one generator seeded by
    (seed, step, rank); without MSDA, captions of one image (COCO) are positives, as the official engine has it."""
    batch = fetch(run)
    device = run.acc.device
    images, tokens = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
    groups = None
    if len(batch) > 2 and run.cfg.data.same_image_positives:
        groups = batch[2].to(device, non_blocking=True)
    msda = run.cfg.msda
    generator = None
    text_aug = run.text_aug if run.text_aug is not None and run.text_aug.share > 0 else None
    if run.noise > 0 or msda.enabled or text_aug is not None:
        generator = torch.Generator().manual_seed(mixed_seed(int(run.cfg.seed), step, run.rank))
    if run.noise > 0:
        tokens, replaced = add_caption_noise(tokens, run.noise, generator)
        run.counters.noisy_rows += replaced
    if text_aug is not None:
        tokens = text_aug(tokens, generator)
    images, matched = batch_targets(run, images, groups, generator)
    return images, tokens, matched


def batch_targets(run: Run, images: torch.Tensor, groups, generator):
    """(images, soft match targets or None): MSDA mixing, or same-image positives / label smoothing."""
    msda = run.cfg.msda
    if msda.enabled and msda.mode == "official":
        from zsprob.prob.msda import mix_batch_official
        return mix_batch_official(images, ratio=float(msda.ratio), alpha=float(msda.alpha),
                                  switch_prob=float(msda.switch_prob), smoothing=float(msda.smoothing),
                                  generator=generator)
    if msda.enabled:
        from zsprob.prob.msda import mix_batch
        return mix_batch(images, ratio=float(msda.ratio), alpha=float(msda.alpha), mode=msda.mode,
                         generator=generator)
    if run.label_smoothing > 0 or groups is not None:  # captions of one image: positives (official engine)
        from zsprob.prob.msda import smooth_targets
        from zsprob.train.data import same_image_targets

        matched = (torch.eye(images.shape[0], device=images.device) if groups is None
                   else same_image_targets(groups))
        return images, smooth_targets(matched, run.label_smoothing) if run.label_smoothing > 0 else matched
    return images, None


def one_step(run: Run, step: int) -> dict:
    """Forward, backward, clip; the update unless the loss or a gradient is non-finite; returns the loss's stats."""
    images, tokens, matched = next_batch(run, step)
    loss, stats = forward_backward(run, images, tokens, matched, step)
    frozen = run.schedule.frozen_groups()
    if frozen:
        optim.zero_frozen_grads(frozen)
    check, norms = clip_check(run, loss, run.clip_sets)
    finite = apply_if_finite(run, check)
    stats.update(zip(("grad_norm", "grad_norm_sigma"), norms))
    count_outcome(run, finite, loss, step, "loss or gradient")
    return stats


def forward_backward(run: Run, images, tokens, matched, step: int) -> tuple[torch.Tensor, dict]:
    """The loss of the batch (times the embedding warm-up's factor) and its gradients; (loss, stats)."""
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
        stats["loss_warmup"] = loss.new_full((), scale)
    return loss, stats


def apply_if_finite(run: Run, check: torch.Tensor) -> bool:
    """Step the optimiser if ``check`` is finite on every process (:func:`step_verdict`) and, under fp16, the
    scaler found no inf / NaN gradient at its scale (read in the same host read: the scaler's own step would
    read it again); the scaler is updated either way. Clear the gradients; True if ``check`` was finite."""
    scaler = run.acc.scaler
    found_inf = None
    if scaler is not None:  # recorded by unscale_ (:func:`unscale_once`) until the scaler's update
        found_inf = sum(scaler._per_optimizer_states[id(_inner(run))]["found_inf_per_device"].values())
    finite, overflow = step_verdict(run, check, found_inf)
    if finite and not overflow:
        _inner(run).step()  # the gradients are unscaled already
    if scaler is not None:
        run.counters.scaler_skipped += int(finite and overflow)
        scaler.update()  # ends the scaler's iteration; inf seen: the scale backs off
    run.optimizer.zero_grad(set_to_none=True)
    return finite


def optimizer_step(run: Run) -> None:
    """An unconditional update (jWAE's discriminator), through accelerate's wrapper and its scaler."""
    run.optimizer.step()


def _inner(run: Run):
    return getattr(run.optimizer, "optimizer", run.optimizer)  # accelerate's wrapper holds the torch optimiser


def step_verdict(run: Run, check: torch.Tensor, found_inf: torch.Tensor | None = None) -> tuple[bool, bool]:
    """(whether ``check`` is finite on every process, whether any found an fp16 overflow): the step's one host
    read. With several processes the same reduction says whether any has no next batch (the cursor fetches
    it now) or has received a stop signal, so that all move to the next epoch, or stop after this step, together."""
    flags = [check, check.new_zeros(()) if found_inf is None else found_inf.to(check.dtype)]
    if run.world == 1:
        check_value, overflow = torch.stack(flags).tolist()
        return math.isfinite(check_value), overflow > 0
    missing = fetch(run, ahead=True)
    signalled = getattr(resilience.StopSignals.active, "received", None) is not None
    flags += [torch.full_like(check, float(missing)), torch.full_like(check, float(signalled))]
    check_mean, overflow_share, missing_share, signalled_share = dist.mean_across(torch.stack(flags)).tolist()
    run.cursor.agree(missing_share > 0)
    run.counters.stop_anywhere = signalled_share > 0
    return math.isfinite(check_mean), overflow_share > 0


def count_outcome(run: Run, finite: bool, loss: torch.Tensor, step: int, what: str) -> None:
    """Add a finished step to the interval's loss, or count it as skipped (``train.max_nonfinite`` in a row
    stop the run)."""
    counters = run.counters
    if finite:
        counters.consecutive_bad = 0
        counters.loss_sum += loss.detach().float()
        counters.n_in_interval += 1
        return
    counters.nonfinite_total += 1
    counters.consecutive_bad += 1
    warnings.warn(f"step {step + 1}: non-finite {what}, update skipped "
                  f"({counters.consecutive_bad} in a row, {counters.nonfinite_total} in total)")
    if counters.consecutive_bad >= int(run.cfg.train.max_nonfinite):
        raise UserError(f"training stopped: the {what} was non-finite in {counters.consecutive_bad} consecutive "
                        f"steps (step {step + 1}); lower optim.lr, keep optim.grad_clip on, use fp32 or bf16, "
                        "or check the data")
