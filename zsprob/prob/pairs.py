"""The rows / columns bookkeeping every pairwise loss shares, and the helpers of their terms.

:class:`PairBatch` holds this process's rows, the globally gathered columns and the target rows of both
directions in the compute dtype (the conventions are in :mod:`zsprob.prob.losses`); :func:`hinge_rows`
is the row-wise triplet hinge of TripletLoss, ProbTripletLoss and jWAE's max-margin alignment;
:func:`guard_term` skips an exploding term without a host sync; :func:`stat` makes a stats entry.
"""
from __future__ import annotations

import torch

from zsprob.errors import UserError
from zsprob.prob import distances


def as_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class PairBatch:
    """Local rows, global columns and the target rows of both directions, in the compute dtype."""

    def __init__(self, img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset,
                 need_sigma: bool):
        if need_sigma and (img_logvar is None or txt_logvar is None):
            raise ValueError("this loss needs sigma (img_logvar / txt_logvar), got None")
        dt = distances.compute_dtype(img_mu, txt_mu)
        self.dtype = dt
        self.img_mu, self.img_lv = as_dtype(img_mu, dt), as_dtype(img_logvar, dt)
        self.txt_mu, self.txt_lv = as_dtype(txt_mu, dt), as_dtype(txt_logvar, dt)
        self.single = all_img is None and all_txt is None
        if (all_img is None) != (all_txt is None):
            raise ValueError("give both all_img and all_txt, or neither")
        if self.single:
            self.all_img_mu, self.all_img_lv = self.img_mu, self.img_lv
            self.all_txt_mu, self.all_txt_lv = self.txt_mu, self.txt_lv
        else:
            self.all_img_mu, self.all_img_lv = as_dtype(all_img[0], dt), as_dtype(all_img[1], dt)
            self.all_txt_mu, self.all_txt_lv = as_dtype(all_txt[0], dt), as_dtype(all_txt[1], dt)
        n_i, n_t = self.img_mu.shape[0], self.txt_mu.shape[0]
        N_i, N_t = self.all_img_mu.shape[0], self.all_txt_mu.shape[0]
        self.offset = int(offset)
        if self.offset + n_i > N_i or self.offset + n_t > N_t:
            raise ValueError(f"local rows at offset {offset} do not fit in the global batch ({N_i}, {N_t})")
        dev = self.img_mu.device
        if matched is None:
            if N_i != N_t:
                raise ValueError("matched is required when the numbers of images and texts differ")
            # a comparison, not an indexed write of 1.0: that copies the scalar to the device and waits for it
            self.t_i2t = _shifted_eye(n_i, N_t, self.offset, dev, dt)
            self.t_t2i = _shifted_eye(n_t, N_i, self.offset, dev, dt)
        else:
            if tuple(matched.shape) != (N_i, N_t):
                raise ValueError(f"matched must be [{N_i}, {N_t}] (global images x texts), got {tuple(matched.shape)}")
            m = matched.to(device=dev, dtype=dt)
            self.t_i2t = m[self.offset:self.offset + n_i]
            self.t_t2i = m[:, self.offset:self.offset + n_t].t()
        # single process with a square batch: the t2i matrix is the transpose of the i2t matrix
        self.transpose_ok = self.single


def _shifted_eye(rows: int, cols: int, offset: int, device, dtype) -> torch.Tensor:
    """[rows, cols] with 1 at (r, offset + r) and 0 elsewhere, built on ``device`` by comparing positions."""
    r = torch.arange(rows, device=device).unsqueeze(1) + offset
    return (r == torch.arange(cols, device=device).unsqueeze(0)).to(dtype)


def stat(x) -> torch.Tensor:
    return x.detach() if torch.is_tensor(x) else torch.tensor(float(x))


def hinge_rows(sim: torch.Tensor, targets: torch.Tensor, margin: float, negatives: str = "hardest") -> torch.Tensor:
    """Row-wise triplet hinge [n]: positive = the column with the largest target, negatives =
    columns with target 0. ``negatives``: "hardest" (max violation, VSE++), "all" (sum over
    negatives), "semihard" (the most similar negative that is still less similar than the
    positive; rows without one use their least similar negative, as in FaceNet-style mining)."""
    pos_idx = targets.argmax(dim=1, keepdim=True)
    s_pos = sim.gather(1, pos_idx)
    neg = targets <= 0
    cost = (margin + sim - s_pos).clamp(min=0.0)
    if negatives == "all":
        return cost.masked_fill(~neg, 0.0).sum(dim=1)
    if negatives == "hardest":
        return cost.masked_fill(~neg, 0.0).max(dim=1).values
    if negatives == "semihard":
        with torch.no_grad():
            semi = neg & (sim < s_pos)
            s_semi = sim.masked_fill(~semi, float("-inf"))
            has = semi.any(dim=1)
            easiest = sim.masked_fill(~neg, float("inf")).argmin(dim=1)
            choice = torch.where(has, s_semi.argmax(dim=1), easiest)
            any_neg = neg.any(dim=1)
        c = cost.gather(1, choice.unsqueeze(1)).squeeze(1)
        return torch.where(any_neg, c, torch.zeros_like(c))
    raise UserError(f"unknown negatives {negatives!r} (choose from hardest, semihard, all)")


def guard_term(value: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``value``, or ``value * 0`` when ``|value| > limit``; 1 if so else 0): the official code's skip of an
    exploding term, decided by ``torch.where`` so the step never waits for the device; the flag goes to the stats."""
    tripped = value.detach().abs() > limit
    return torch.where(tripped, value * 0.0, value), tripped.to(torch.float32)
