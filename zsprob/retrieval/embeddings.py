"""Precomputed test-set embeddings: the ``E.npz`` exchange format of ``zsprob eval --embeddings``.

Arrays: ``image_ids`` [n_img] and ``caption_ids`` [n_cap] (int64; official COCO ids for COCO),
``image_mu`` [n_img, D], ``caption_mu`` [n_cap, D] and optionally ``image_logvar`` /
``caption_logvar`` (log sigma^2; absent for deterministic models). Optional ``caption_image``
[n_cap] gives each caption's source image as an index into ``image_ids`` (when absent, the
ground truth must come from elsewhere, e.g. eccv_caption for COCO). numpy does the I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zsprob.errors import UserError, require_file

REQUIRED = ("image_ids", "caption_ids", "image_mu", "caption_mu")


@dataclass
class Embeddings:
    image_ids: np.ndarray
    caption_ids: np.ndarray
    image_mu: torch.Tensor
    caption_mu: torch.Tensor
    image_logvar: torch.Tensor | None = None
    caption_logvar: torch.Tensor | None = None
    caption_image: np.ndarray | None = None

    @property
    def has_sigma(self) -> bool:
        return self.image_logvar is not None and self.caption_logvar is not None

    def select(self, image_index: np.ndarray | None = None, caption_index: np.ndarray | None = None) -> "Embeddings":
        """Subset (and reorder) images / captions; ``caption_image`` is remapped."""
        ii = np.arange(len(self.image_ids)) if image_index is None else np.asarray(image_index, dtype=np.int64)
        ci = np.arange(len(self.caption_ids)) if caption_index is None else np.asarray(caption_index, dtype=np.int64)
        it, ct = torch.from_numpy(ii), torch.from_numpy(ci)
        cap_img = None
        if self.caption_image is not None:
            remap = np.full(len(self.image_ids), -1, dtype=np.int64)
            remap[ii] = np.arange(len(ii))
            cap_img = remap[np.asarray(self.caption_image)[ci]]
        return Embeddings(
            image_ids=self.image_ids[ii], caption_ids=self.caption_ids[ci],
            image_mu=self.image_mu[it], caption_mu=self.caption_mu[ct],
            image_logvar=None if self.image_logvar is None else self.image_logvar[it],
            caption_logvar=None if self.caption_logvar is None else self.caption_logvar[ct],
            caption_image=cap_img)

    def save(self, path) -> Path:
        from zsprob.utils.io import atomic_write

        arrays = {"image_ids": np.asarray(self.image_ids, dtype=np.int64),
                  "caption_ids": np.asarray(self.caption_ids, dtype=np.int64),
                  "image_mu": self.image_mu.numpy(), "caption_mu": self.caption_mu.numpy()}
        if self.image_logvar is not None:
            arrays["image_logvar"] = self.image_logvar.numpy()
        if self.caption_logvar is not None:
            arrays["caption_logvar"] = self.caption_logvar.numpy()
        if self.caption_image is not None:
            arrays["caption_image"] = np.asarray(self.caption_image, dtype=np.int64)

        def w(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        return atomic_write(path, w)


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def load_embeddings(path) -> Embeddings:
    """Load and validate an ``E.npz``; problems raise :class:`UserError` naming the array."""
    p = require_file(path, "embeddings file", "an .npz with image_ids, caption_ids, image_mu, caption_mu")
    try:
        z = np.load(p, allow_pickle=False)
        arrays = {k: z[k] for k in z.files}
    except Exception as e:  # zipfile / format errors
        raise UserError(f"cannot read embeddings {p}: {e}") from None
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise UserError(f"embeddings {p} lack arrays: {', '.join(missing)} (have: {', '.join(sorted(arrays)) or 'none'})")
    img_mu, cap_mu = arrays["image_mu"], arrays["caption_mu"]
    if img_mu.ndim != 2 or cap_mu.ndim != 2 or img_mu.shape[1] != cap_mu.shape[1]:
        raise UserError(f"embeddings {p}: image_mu {img_mu.shape} and caption_mu {cap_mu.shape} must be [N, D] with the same D")
    if len(arrays["image_ids"]) != len(img_mu) or len(arrays["caption_ids"]) != len(cap_mu):
        raise UserError(f"embeddings {p}: image_ids/caption_ids lengths do not match image_mu/caption_mu rows")
    if ("image_logvar" in arrays) != ("caption_logvar" in arrays):
        raise UserError(f"embeddings {p}: give both image_logvar and caption_logvar, or neither")
    for k, ref in (("image_logvar", img_mu), ("caption_logvar", cap_mu)):
        if k in arrays and arrays[k].shape != ref.shape:
            raise UserError(f"embeddings {p}: {k} has shape {arrays[k].shape}, expected {ref.shape}")
    for k in ("image_mu", "caption_mu", "image_logvar", "caption_logvar"):
        if k in arrays and not np.isfinite(arrays[k]).all():
            raise UserError(f"embeddings {p}: {k} contains NaN or inf")
    cap_img = arrays.get("caption_image")
    if cap_img is not None:
        cap_img = cap_img.astype(np.int64)
        if len(cap_img) != len(cap_mu) or (len(cap_img) and (cap_img.min() < 0 or cap_img.max() >= len(img_mu))):
            raise UserError(f"embeddings {p}: caption_image must hold one image index in [0, {len(img_mu)}) per caption")
    return Embeddings(
        image_ids=arrays["image_ids"].astype(np.int64), caption_ids=arrays["caption_ids"].astype(np.int64),
        image_mu=_f32(img_mu), caption_mu=_f32(cap_mu),
        image_logvar=_f32(arrays["image_logvar"]) if "image_logvar" in arrays else None,
        caption_logvar=_f32(arrays["caption_logvar"]) if "caption_logvar" in arrays else None,
        caption_image=cap_img)
