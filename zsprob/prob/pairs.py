"""The rows / columns bookkeeping every pairwise loss shares (zsprob.prob.losses, zsprob.prob.prolip).

:class:`PairBatch` holds this process's rows, the globally gathered columns and the target rows of
both directions in the compute dtype (the conventions are in :mod:`zsprob.prob.losses`'s
docstring); :func:`stat` turns a value into a detached tensor for a loss's ``stats``. Plain torch;
imports nothing from the package but :mod:`zsprob.prob.distances`.
"""
from __future__ import annotations

import torch

from zsprob.prob import distances as D

__all__ = ["PairBatch", "as_dtype", "stat"]


def as_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class PairBatch:
    """Local rows, global columns and the target rows of both directions, in the compute dtype."""

    def __init__(self, img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset,
                 need_sigma: bool):
        if need_sigma and (img_logvar is None or txt_logvar is None):
            raise ValueError("this loss needs sigma (img_logvar / txt_logvar), got None")
        dt = D.compute_dtype(img_mu, txt_mu)
        self.dtype = dt
        self.img_mu, self.img_lv = as_dtype(img_mu, dt), as_dtype(img_logvar, dt)
        self.txt_mu, self.txt_lv = as_dtype(txt_mu, dt), as_dtype(txt_logvar, dt)
        self.single = all_img is None and all_txt is None
        if (all_img is None) != (all_txt is None):
            raise ValueError("give both all_img and all_txt, or neither")
        if self.single:
            if offset:
                raise ValueError("offset needs all_img / all_txt")
            self.all_img_mu, self.all_img_lv = self.img_mu, self.img_lv
            self.all_txt_mu, self.all_txt_lv = self.txt_mu, self.txt_lv
        else:
            self.all_img_mu, self.all_img_lv = as_dtype(all_img[0], dt), as_dtype(all_img[1], dt)
            self.all_txt_mu, self.all_txt_lv = as_dtype(all_txt[0], dt), as_dtype(all_txt[1], dt)
            if need_sigma and (self.all_img_lv is None or self.all_txt_lv is None):
                raise ValueError("this loss needs sigma: all_img / all_txt carry logvar None")
        n_i, n_t = self.img_mu.shape[0], self.txt_mu.shape[0]
        N_i, N_t = self.all_img_mu.shape[0], self.all_txt_mu.shape[0]
        self.offset = int(offset)
        if self.offset + n_i > N_i or self.offset + n_t > N_t:
            raise ValueError(f"local rows at offset {offset} do not fit in the global batch ({N_i}, {N_t})")
        dev = self.img_mu.device
        if matched is None:
            if N_i != N_t:
                raise ValueError("matched is required when the numbers of images and texts differ")
            eye_rows = torch.zeros(n_i, N_t, device=dev, dtype=dt)
            eye_rows[torch.arange(n_i, device=dev), self.offset + torch.arange(n_i, device=dev)] = 1.0
            self.t_i2t = eye_rows
            t2i = torch.zeros(n_t, N_i, device=dev, dtype=dt)
            t2i[torch.arange(n_t, device=dev), self.offset + torch.arange(n_t, device=dev)] = 1.0
            self.t_t2i = t2i
        else:
            if tuple(matched.shape) != (N_i, N_t):
                raise ValueError(f"matched must be [{N_i}, {N_t}] (global images x texts), got {tuple(matched.shape)}")
            m = matched.to(device=dev, dtype=dt)
            self.t_i2t = m[self.offset:self.offset + n_i]
            self.t_t2i = m[:, self.offset:self.offset + n_t].t()
        # single process with a square batch: the t2i matrix is the transpose of the i2t matrix
        self.transpose_ok = self.single


def stat(x) -> torch.Tensor:
    return x.detach() if torch.is_tensor(x) else torch.tensor(float(x))
