"""Mixed sample data augmentation (MSDA) with soft image-text match targets (PCME++ Sec. 2.4).

PCME++ mixes only images: for every mini-batch it picks Mixup or CutMix at random, mixes a
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

__all__ = ["mix_batch"]

MODES = ("random", "mixup", "cutmix")


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
