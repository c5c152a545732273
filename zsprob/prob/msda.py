"""Mixed sample data augmentation (MSDA) with soft image-text match targets (PCME++ Sec. 2.4).

Modes (``MODES``): "official" is what naver-ai/pcmepp trains with (its ``Mixup`` in "elem" mode,
``augmentation.py``, called from ``engine.forward_step``); "random", "mixup" and "cutmix" are the
paper-text variant below.

"official" (:func:`mix_batch_official`): every image i is mixed with probability ``ratio``
(mix_batch_ratio 0.25) with its partner ``B - 1 - i`` (the batch reversed); per image, CutMix with
probability ``switch_prob`` (0.5) else Mixup; lambda ~ Beta(alpha, alpha) (2, 2) per image, for
CutMix replaced by the area fraction kept after the box is clipped. The targets are the official
smoothed soft labels: with s = ``smoothing`` (mixup_smoothing 1e-4) every entry of row i is s,
``matched[i, i] = lam (1 - s) + (1 - lam) s`` and ``matched[i, B-1-i] = lam s + (1 - lam)(1 - s)``
(an unmixed row: 1 - s on the diagonal, s elsewhere). The official code drops the last sample of
an odd batch; zsprob keeps it and leaves the middle image (its own partner) unmixed.
When no mixing happens in a step the official code smooths the identity targets instead
(label_smoothing 1e-4): :func:`smooth_targets`.

PCME++ paper text ("random" / "mixup" / "cutmix", :func:`mix_batch`): for every mini-batch it picks Mixup or CutMix at random, mixes a
fraction (25%) of the images with a partner image of the same batch, with lambda ~ Beta(2, 2),
and turns the match labels soft: the mixed image i matches its own caption with weight lambda
and its partner j's caption with weight 1 - lambda (``matched[i, i] = lambda``,
``matched[i, j] = 1 - lambda``). For CutMix lambda is the area fraction actually kept from image
i after the box is clipped at the borders. Feed ``matched`` to any loss of
:mod:`zsprob.prob.losses`. With ``m = lambda`` the BCE gradient per pair is exactly
dL/dl = sigmoid(l) - lambda (tests/test_prob_losses.py checks it numerically): a confidently
matched pair (sigmoid(l) ~ 1) gets 1 - lambda instead of the full 1 of a hard negative. The
expression printed in PCME++ Sec. 2.4, (1 - lambda) - (1 - 2 lambda) sigmoid(l), is not the
derivative of Eq. 2 (it is 0.5 for every l at lambda = 0.5, where the true gradient sigmoid(l) - 0.5
vanishes at l = 0).

Library reuse: the CutMix box is timm's ``timm.data.mixup.cutmix_bbox_and_lam`` (square box of
side sqrt(1 - lambda), lambda corrected to the clipped area). timm draws from numpy's global RNG,
so zsprob seeds that RNG from ``generator`` for the call and restores its state afterwards. What
zsprob writes: choosing the images and partners, per-image lambdas from Beta(alpha, alpha) (numpy,
seeded from the torch generator), and the soft target matrix.

Distributed training: each process mixes its own batch; the global targets are the block
diagonal of the per-process matrices (``zsprob.train.distributed.block_diag_targets``).
"""
from __future__ import annotations

import numpy as np
import torch

from zsprob.errors import UserError

__all__ = ["mix_batch", "mix_batch_official", "smooth_targets", "check_config", "MODES"]

PAPER_MODES = ("random", "mixup", "cutmix")
MODES = ("official",) + PAPER_MODES


def _check_share(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{name} must be in [0, 1], got {value}")
    return value


def check_config(*, enabled: bool, mode: str, ratio: float, alpha: float, switch_prob: float,
                 smoothing: float, label_smoothing: float) -> None:
    """Validate the ``msda`` config section up front (one-line UserErrors)."""
    if mode not in MODES:
        raise UserError(f"unknown msda.mode {mode!r} (choose from {', '.join(MODES)})")
    for key, value in (("msda.ratio", ratio), ("msda.switch_prob", switch_prob),
                       ("msda.smoothing", smoothing), ("msda.label_smoothing", label_smoothing)):
        _check_share(key, value)
    if enabled and not float(alpha) > 0:
        raise UserError(f"msda.alpha must be > 0, got {alpha}")


def smooth_targets(matched: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label smoothing of hard targets as the official code does it on the unmixed path:
    ``(1 - s) matched + s (1 - matched)``."""
    smoothing = _check_share("label smoothing", smoothing)
    return (1.0 - smoothing) * matched + smoothing * (1.0 - matched)


def official_targets(lam: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """The official soft targets [B, B] for per-image lambdas ``lam`` [B] (1 = unmixed), partner B-1-i."""
    bsz = lam.shape[0]
    eye = torch.eye(bsz, dtype=torch.float32, device=lam.device)
    own = smooth_targets(eye, smoothing)
    partner = own.flip(0)
    lam = lam.to(torch.float32).unsqueeze(1)
    return own * lam + partner * (1.0 - lam)


def mix_batch_official(images: torch.Tensor, *, ratio: float = 0.25, alpha: float = 2.0,
                       switch_prob: float = 0.5, smoothing: float = 1e-4,
                       generator: torch.Generator | None = None, return_info: bool = False):
    """naver-ai/pcmepp's per-image MSDA (see the module docstring).

    Args:
        images: [B, C, H, W] (not modified).
        ratio: probability that an image is mixed (mix_batch_ratio).
        alpha: lambda ~ Beta(alpha, alpha) (the official Mixup and CutMix alphas are both 2).
        switch_prob: probability of CutMix instead of Mixup, per image.
        smoothing: target smoothing s (mixup_smoothing).
        generator: torch generator; every draw comes from a numpy generator seeded from it.
        return_info: also return ``dict(index, partner, lam, cutmix)`` of the mixed images.

    Returns:
        ``(mixed_images, matched [B, B] float32)``, plus ``info`` if asked.
    """
    if images.dim() != 4:
        raise UserError(f"mix_batch expects images [B, C, H, W], got shape {tuple(images.shape)}")
    ratio = _check_share("msda.ratio", ratio)
    switch_prob = _check_share("msda.switch_prob", switch_prob)
    smoothing = _check_share("msda.smoothing", smoothing)
    if alpha <= 0:
        raise UserError(f"MSDA alpha must be > 0, got {alpha}")
    bsz = images.shape[0]
    rng = _numpy_rng(generator)
    use_cutmix = rng.random(bsz) < switch_prob
    lam_draw = rng.beta(alpha, alpha, size=bsz)
    use_mix = rng.random(bsz) < ratio
    lams = np.where(use_mix, lam_draw, 1.0)
    out = images.clone()
    info = {"index": [], "partner": [], "lam": [], "cutmix": []}
    for i in range(bsz):
        j = bsz - 1 - i
        if not use_mix[i] or i == j:
            lams[i] = 1.0
            continue
        if use_cutmix[i]:
            yl, yh, xl, xh, lam = _timm_box(images.shape, float(lams[i]), int(rng.integers(0, 2 ** 31 - 1)))
            out[i, :, yl:yh, xl:xh] = images[j, :, yl:yh, xl:xh]
            lams[i] = lam
        else:
            lam = float(lams[i])
            out[i] = lam * images[i] + (1.0 - lam) * images[j]
        info["index"].append(i)
        info["partner"].append(j)
        info["lam"].append(float(lams[i]))
        info["cutmix"].append(bool(use_cutmix[i]))
    matched = official_targets(torch.as_tensor(lams, dtype=torch.float64), smoothing).to(images.device)
    return (out, matched, info) if return_info else (out, matched)


def _numpy_rng(generator: torch.Generator | None) -> np.random.Generator:
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu").item())
    return np.random.default_rng(seed)


def _timm_box(shape, lam: float, seed: int):
    """timm's CutMix box for lambda, drawn with numpy's global RNG seeded for this call only."""
    from timm.data.mixup import cutmix_bbox_and_lam  # imported here: timm is slow to import

    state = np.random.get_state()
    try:
        np.random.seed(seed)
        (yl, yh, xl, xh), lam_kept = cutmix_bbox_and_lam(shape, lam, correct_lam=True)
    finally:
        np.random.set_state(state)
    return int(yl), int(yh), int(xl), int(xh), float(lam_kept)


def mix_batch(images: torch.Tensor, *, ratio: float = 0.25, alpha: float = 2.0, mode: str = "random",
              generator: torch.Generator | None = None, return_info: bool = False):
    """Mix ``round(ratio * B)`` images of the batch with a partner; return soft targets.

    Args:
        images: [B, C, H, W] (not modified).
        ratio: fraction of the batch that is mixed (PCME++: 0.25).
        alpha: lambda ~ Beta(alpha, alpha), one lambda per mixed image (PCME++: 2).
        mode: "random" (Mixup or CutMix, chosen per call, i.e. per mini-batch), "mixup", "cutmix".
        generator: torch generator for reproducibility (None: torch's global RNG).
        return_info: also return a dict with ``mode``, ``index`` (mixed rows), ``partner``, ``lam``.

    Returns:
        ``(mixed_images [B, C, H, W], matched [B, B])`` with images as rows and captions as
        columns (``matched`` is float32 on the images' device), plus ``info`` if asked.
    """
    if images.dim() != 4:
        raise UserError(f"mix_batch expects images [B, C, H, W], got shape {tuple(images.shape)}")
    if mode not in MODES:
        raise UserError(f"unknown MSDA mode {mode!r} (choose from {', '.join(MODES)})")
    if mode == "official":
        return mix_batch_official(images, ratio=ratio, alpha=alpha, generator=generator, return_info=return_info)
    if not 0.0 <= ratio <= 1.0:
        raise UserError(f"MSDA ratio must be in [0, 1], got {ratio}")
    if alpha <= 0:
        raise UserError(f"MSDA alpha must be > 0, got {alpha}")
    bsz = images.shape[0]
    matched = torch.eye(bsz, device=images.device, dtype=torch.float32)
    k = int(round(ratio * bsz)) if bsz >= 2 else 0
    rng = _numpy_rng(generator)
    use = mode if mode != "random" else ("cutmix" if rng.random() < 0.5 else "mixup")
    info = {"mode": use, "index": [], "partner": [], "lam": []}
    if k == 0:
        out = images.clone()
        return (out, matched, info) if return_info else (out, matched)

    idx = rng.permutation(bsz)[:k]
    partner = (idx + rng.integers(1, bsz, size=k)) % bsz  # any other image of the batch
    lams = rng.beta(alpha, alpha, size=k)
    out = images.clone()
    for i, j, lam in zip(idx.tolist(), partner.tolist(), lams.tolist()):
        if use == "mixup":
            out[i] = lam * images[i] + (1.0 - lam) * images[j]
        else:
            yl, yh, xl, xh, lam = _timm_box(images.shape, lam, int(rng.integers(0, 2 ** 31 - 1)))
            out[i, :, yl:yh, xl:xh] = images[j, :, yl:yh, xl:xh]
        matched[i, i] = lam
        matched[i, j] = 1.0 - lam
        info["index"].append(i)
        info["partner"].append(j)
        info["lam"].append(float(lam))
    return (out, matched, info) if return_info else (out, matched)
