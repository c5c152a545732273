"""Mixed sample data augmentation (MSDA) with soft image-text match targets (PCME++ Sec. 2.4).

Two families: "official" (naver-ai/pcmepp's per-image Mixup / CutMix with partner B - 1 - i and smoothed
targets) and the paper text's per-batch "random" / "mixup" / "cutmix". timm gives the CutMix box; random
numbers come from the host, the mixing runs on the batch's device with nothing read back. Targets and
modes in full: docs/prob.md."""
from __future__ import annotations

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.utils.host_sync import to_device

#: "official" (naver-ai/pcmepp's per-image mixing) and the paper text's per-batch modes
MODES = ("official", "random", "mixup", "cutmix")


def check_config(*, enabled: bool, mode: str, alpha: float) -> None:
    """Check the ``msda`` options the config schema leaves open (its shares are checked there)."""
    if mode not in MODES:
        raise UserError(f"unknown msda.mode {mode!r} (choose from {', '.join(MODES)})")
    if enabled and not float(alpha) > 0:
        raise UserError(f"msda.alpha must be > 0, got {alpha}")


def smooth_targets(matched: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label smoothing of hard targets as the official code does it on the unmixed path:
    ``(1 - s) matched + s (1 - matched)``."""
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
    """naver-ai/pcmepp's per-image MSDA (docs/prob.md) of ``images`` [B, C, H, W] (not modified):
    ``ratio`` (mix_batch_ratio), ``alpha`` (its Mixup and CutMix alphas), ``switch_prob``, ``smoothing``
    (mixup_smoothing). Returns ``(mixed_images, matched [B, B] float32)`` on the images' device, plus
    ``dict(index, partner, lam, cutmix)`` of the mixed images with ``return_info``."""
    bsz = images.shape[0]
    rng = _numpy_rng(generator)
    use_cutmix = rng.random(bsz) < switch_prob
    lam_draw = rng.beta(alpha, alpha, size=bsz)
    use_mix = rng.random(bsz) < ratio
    lams = np.where(use_mix, lam_draw, 1.0)
    plan = _MixPlan()
    for i in range(bsz):
        j = bsz - 1 - i
        if not use_mix[i] or i == j:
            lams[i] = 1.0
            continue
        if use_cutmix[i]:
            lams[i] = plan.add(i, j, *_timm_box(images.shape, float(lams[i]), int(rng.integers(0, 2 ** 31 - 1))))
        else:
            plan.add(i, j, float(lams[i]))
    out = plan.apply(images)
    lam = to_device(torch.as_tensor(lams, dtype=torch.float64), images.device)
    matched = official_targets(lam, smoothing)
    return (out, matched, plan.info(cutmix=True)) if return_info else (out, matched)


class _MixPlan:
    """Which rows are mixed with which partner, how (Mixup lambda or CutMix box): collected on the
    host from the numpy draws, then applied to the batch in a few device operations (index tensors
    moved with one non-blocking copy each; nothing is read back from the device)."""

    def __init__(self):
        self.rows: list[int] = []
        self.partners: list[int] = []
        self.lams: list[float] = []
        self.boxes: list[tuple[int, int, int, int] | None] = []  # None: Mixup

    def add(self, row: int, partner: int, lam: float, box: tuple[int, int, int, int] | None = None) -> float:
        """Mix ``row`` with ``partner``: Mixup with ``lam``, or CutMix inside ``box`` (yl, yh, xl, xh); returns lam."""
        self.rows.append(row)
        self.partners.append(partner)
        self.lams.append(float(lam))
        self.boxes.append(box)
        return float(lam)

    def info(self, cutmix: bool) -> dict:
        out = {"index": list(self.rows), "partner": list(self.partners), "lam": list(self.lams)}
        if cutmix:
            out["cutmix"] = [b is not None for b in self.boxes]
        return out

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        out = images.clone()
        mix = [n for n, b in enumerate(self.boxes) if b is None]
        cut = [n for n, b in enumerate(self.boxes) if b is not None]
        if mix:
            rows, partners = self.index_tensors(mix, images.device)
            lam = to_device(torch.tensor([self.lams[n] for n in mix], dtype=torch.float64), images.device)
            out[rows] = _blend(images[rows], images[partners], lam)
        if cut:
            rows, partners = self.index_tensors(cut, images.device)
            boxes = to_device(torch.tensor([self.boxes[n] for n in cut], dtype=torch.long), images.device)
            inside = _box_mask(boxes, images.shape[-2], images.shape[-1]).unsqueeze(1)
            out[rows] = torch.where(inside, images[partners], images[rows])
        return out

    def index_tensors(self, which, device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor([[self.rows[n] for n in which], [self.partners[n] for n in which]], dtype=torch.long)
        both = to_device(both, device)
        return both[0], both[1]


def _blend(first: torch.Tensor, second: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``lam * first + (1 - lam) * second`` per row (``lam`` float64 [K]), rounded exactly as torch
    rounds an image times a Python float: the factors in the image's compute precision (float64 for
    float64 images, else float32), each product rounded to the image dtype, then the sum."""
    compute = torch.float64 if first.dtype == torch.float64 else torch.float32
    shape = (-1,) + (1,) * (first.dim() - 1)
    keep = lam.to(compute).view(shape)
    take = (1.0 - lam).to(compute).view(shape)
    return (keep * first.to(compute)).to(first.dtype) + (take * second.to(compute)).to(first.dtype)


def _box_mask(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[K, H, W] bool: True inside box k = (yl, yh, xl, xh) (half-open, as the slice ``[yl:yh, xl:xh]``)."""
    ys = torch.arange(height, device=boxes.device).view(1, height, 1)
    xs = torch.arange(width, device=boxes.device).view(1, 1, width)
    yl, yh, xl, xh = (boxes[:, c].view(-1, 1, 1) for c in range(4))
    return (ys >= yl) & (ys < yh) & (xs >= xl) & (xs < xh)


def _numpy_rng(generator: torch.Generator | None) -> np.random.Generator:
    """A numpy generator seeded by one draw of ``generator``. The draw is made on the generator's own
    device (the CPU for the training loop's generator) and read on the host: it is the one ``.item()``
    of this module, and it never touches a batch tensor."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu").item())
    return np.random.default_rng(seed)


def _timm_box(shape, lam: float, seed: int) -> tuple[float, tuple[int, int, int, int]]:
    """(kept lambda, box) of timm's CutMix for lambda, drawn with numpy's global RNG seeded for this call."""
    from timm.data.mixup import cutmix_bbox_and_lam  # imported here: timm is slow to import

    state = np.random.get_state()
    try:
        np.random.seed(seed)
        (yl, yh, xl, xh), lam_kept = cutmix_bbox_and_lam(shape, lam, correct_lam=True)
    finally:
        np.random.set_state(state)
    return float(lam_kept), (int(yl), int(yh), int(xl), int(xh))


def mix_batch(images: torch.Tensor, *, ratio: float = 0.25, alpha: float = 2.0, mode: str = "random",
              generator: torch.Generator | None = None, return_info: bool = False):
    """Mix ``round(ratio * B)`` of ``images`` [B, C, H, W] (not modified) with a partner, one lambda ~
    Beta(alpha, alpha) each; ``mode`` "random" picks Mixup or CutMix per call ("official":
    :func:`mix_batch_official`). Returns ``(mixed_images, matched [B, B] float32)`` (images x captions, on
    the images' device), plus ``dict(mode, index, partner, lam)`` with ``return_info``."""
    if images.dim() != 4:
        raise UserError(f"mix_batch expects images [B, C, H, W], got shape {tuple(images.shape)}")
    if mode == "official":
        return mix_batch_official(images, ratio=ratio, alpha=alpha, generator=generator, return_info=return_info)
    bsz = images.shape[0]
    matched = torch.eye(bsz, device=images.device, dtype=torch.float32)
    k = int(round(ratio * bsz)) if bsz >= 2 else 0
    rng = _numpy_rng(generator)
    use = mode if mode != "random" else ("cutmix" if rng.random() < 0.5 else "mixup")
    if k == 0:
        out = images.clone()
        return (out, matched, {"mode": use, "index": [], "partner": [], "lam": []}) if return_info else (out, matched)

    idx = rng.permutation(bsz)[:k]
    partner = (idx + rng.integers(1, bsz, size=k)) % bsz  # any other image of the batch
    lams = rng.beta(alpha, alpha, size=k)
    plan = _MixPlan()
    for i, j, lam in zip(idx.tolist(), partner.tolist(), lams.tolist()):
        if use == "mixup":
            plan.add(i, j, lam)
        else:
            plan.add(i, j, *_timm_box(images.shape, lam, int(rng.integers(0, 2 ** 31 - 1))))
    out = plan.apply(images)
    rows, partners = plan.index_tensors(range(len(plan.rows)), matched.device)  # the soft targets
    lam = to_device(torch.tensor(plan.lams, dtype=torch.float64), matched.device)
    matched[rows, rows] = lam.to(matched.dtype)
    matched[rows, partners] = (1.0 - lam).to(matched.dtype)
    info = {"mode": use, **plan.info(cutmix=False)}
    return (out, matched, info) if return_info else (out, matched)
