"""Test-set embeddings: a split embedded by a model (:func:`encode_split`), and the ``E.npz`` exchange
format of ``zsprob eval --embeddings`` (its arrays: docs/retrieval.md).

``caption_image`` [n_cap] is each caption's image as an index into ``image_ids``; without it the ground truth
comes from elsewhere, e.g. eccv_caption. :func:`load_embeddings` checks every array where the file is read.
"""
from __future__ import annotations

from dataclasses import dataclass
import difflib
from pathlib import Path

import numpy as np
import torch

from zsprob.errors import UserError, require_file
from zsprob.prob.distances import uncertainty

REQUIRED = ("image_ids", "caption_ids", "image_mu", "caption_mu")
OPTIONAL = ("image_logvar", "caption_logvar", "caption_image")
#: the largest log-variance whose sigma^2 = exp(logvar) is finite in float32 (exp(88.7) overflows)
LOGVAR_MAX = 88.0


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

    def uncertainty(self) -> tuple[np.ndarray, np.ndarray]:
        """||sigma^2||_1 of every image and every caption (float32; embeddings with sigma)."""
        return uncertainty(self.image_logvar).numpy(), uncertainty(self.caption_logvar).numpy()

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

        arrays = {}
        for key in REQUIRED + OPTIONAL:  # the attributes are named as the arrays of the format
            value = getattr(self, key)
            if value is not None:
                arrays[key] = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value, dtype=np.int64)

        def w(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        return atomic_write(path, w)


class ImageList:
    """A map-style dataset of image files -> ``transform(PIL image)``."""

    def __init__(self, paths, transform):
        self.paths = [Path(p) for p in paths]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        from zsprob.data.images import open_rgb

        try:
            image = open_rgb(self.paths[i])
        except (OSError, ValueError) as e:  # truncated, not an image, unreadable: the benchmark is not complete
            raise UserError(f"image {self.paths[i]} cannot be read ({' '.join(str(e).split())}); restore it: "
                            "a retrieval benchmark is not scored with images missing") from None
        return self.transform(image)


def encode_split(model, split, *, batch_size: int = 128, device=None, progress: bool = False, num_workers: int = 0,
                 precision: str = "fp32") -> Embeddings:
    """A split's images (``image_paths``) and ``captions`` embedded, with its ids (``image_ids``, ``caption_ids``,
    ``caption_image``); ``precision`` "bf16" autocasts the towers, the embeddings are float32 CPU tensors."""
    from zsprob.models.encode import encode_images, encode_texts

    img_mu, img_lv = encode_images(model, ImageList(split.image_paths, model.preprocess_val), batch_size=batch_size,
                                   device=device, progress=progress, num_workers=num_workers, precision=precision)
    cap_mu, cap_lv = encode_texts(model, list(split.captions), batch_size=max(256, batch_size), device=device,
                                  progress=progress, precision=precision)
    return Embeddings(image_ids=np.asarray(split.image_ids, dtype=np.int64),
                      caption_ids=np.asarray(split.caption_ids, dtype=np.int64), image_mu=img_mu, caption_mu=cap_mu,
                      image_logvar=img_lv, caption_logvar=cap_lv,
                      caption_image=np.asarray(split.caption_image, dtype=np.int64))


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def check_ids(ids: np.ndarray, where: str, key: str, *, unique: bool = True, what: str = "ids") -> np.ndarray:
    """``ids`` as int64 if it is a 1-D array of integers (without repeats when ``unique``), else one
    :class:`UserError` line naming ``where`` and ``key``; float ids are refused, not truncated into other items."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise UserError(f"{where}: {key} must be a 1-D array of integer {what}, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise UserError(f"{where}: {key} must hold integer {what}, got dtype {ids.dtype} "
                        "(save them with .astype(numpy.int64))")
    if ids.dtype.kind == "u" and len(ids) and int(ids.max()) > np.iinfo(np.int64).max:
        raise UserError(f"{where}: {key} holds ids above the int64 range (e.g. {int(ids.max())})")
    ids = ids.astype(np.int64)
    if unique and len(ids) > 1:
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(repeated):
            n_rep = len(np.unique(repeated))
            raise UserError(f"{where}: {key} holds id {int(repeated[0])} more than once ({n_rep} repeated "
                            f"id{'s' if n_rep > 1 else ''}); every item needs its own id")
    return ids


def _check_values(a: np.ndarray, where: str, key: str) -> None:
    """A real-valued array (float or integer dtype) without NaN or inf in float32, the dtype it is used in."""
    if a.dtype.kind not in "fiu":
        raise UserError(f"{where}: {key} must hold real numbers, got dtype {a.dtype}")
    with np.errstate(over="ignore"):
        if not np.isfinite(a.astype(np.float32, copy=False)).all():
            raise UserError(f"{where}: {key} contains NaN, inf or values beyond float32's range (+-3.4e38)")


#: an archive whose members inflate past this, and past 100 times their compressed size, is refused unread
NPZ_INFLATE_LIMIT = 256 * 2 ** 20


def _read_npz(p: Path) -> dict:
    import zipfile

    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as zf:
            inflated, packed = (sum(getattr(i, k) for i in zf.infolist()) for k in ("file_size", "compress_size"))
        if inflated > NPZ_INFLATE_LIMIT and inflated > 100 * packed:
            raise UserError(f"embeddings {p} are refused: {packed:,} bytes that inflate to {inflated:,} (a zip bomb?); "
                            "save embeddings with numpy.savez, uncompressed")
    try:
        z = np.load(p, allow_pickle=False)
        if not hasattr(z, "files"):
            raise ValueError("a single .npy array, not an .npz archive")
        return {k: z[k] for k in z.files}
    except Exception as e:  # zipfile / format errors, object arrays (allow_pickle=False)
        raise UserError(f"cannot read embeddings {p}: {e}") from None


def _check_shapes(arrays: dict, where: str) -> None:
    img_mu, cap_mu = arrays["image_mu"], arrays["caption_mu"]
    if img_mu.ndim != 2 or cap_mu.ndim != 2 or img_mu.shape[1] != cap_mu.shape[1]:
        raise UserError(f"{where}: image_mu {img_mu.shape} and caption_mu {cap_mu.shape} must be [N, D] "
                        "with the same D")
    for key, a in (("image_mu", img_mu), ("caption_mu", cap_mu)):
        if a.shape[0] == 0 or a.shape[1] == 0:
            raise UserError(f"{where}: {key} is empty (shape {a.shape}); nothing to evaluate or index")
    for key, ref in (("image_ids", "image_mu"), ("caption_ids", "caption_mu")):
        if np.ndim(arrays[key]) == 1 and len(arrays[key]) != len(arrays[ref]):
            raise UserError(f"{where}: {key} has {len(arrays[key])} ids for {len(arrays[ref])} rows of {ref}")
    if ("image_logvar" in arrays) != ("caption_logvar" in arrays):
        raise UserError(f"{where}: give both image_logvar and caption_logvar, or neither")
    for k, ref in (("image_logvar", img_mu), ("caption_logvar", cap_mu)):
        if k in arrays and arrays[k].shape != ref.shape:
            raise UserError(f"{where}: {k} has shape {arrays[k].shape}, expected {ref.shape}")


def _check_caption_image(cap_img: np.ndarray, where: str, n_cap: int, n_img: int) -> np.ndarray:
    cap_img = check_ids(cap_img, where, "caption_image", unique=False, what="image indices")
    if len(cap_img) != n_cap or (cap_img.min() < 0 or cap_img.max() >= n_img):
        raise UserError(f"{where}: caption_image must hold one image index in [0, {n_img}) per caption")
    return cap_img


def _refuse_unknown(arrays: dict, where: str) -> None:
    """An array the format does not name is refused: a misspelled ``img_logvar`` would make the file deterministic."""
    unknown = sorted(set(arrays) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        close = difflib.get_close_matches(unknown[0], REQUIRED + OPTIONAL, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{where}: unknown array {unknown[0]!r}{hint} (an embeddings file holds "
                        f"{', '.join(REQUIRED)} and optionally {', '.join(OPTIONAL)})")


def load_embeddings(path) -> Embeddings:
    """Load an ``E.npz``, every array checked: a problem is one :class:`UserError` line naming the file and the
    array (missing or unknown arrays, ids, shapes, non-finite values, logvar above :data:`LOGVAR_MAX`)."""
    p = require_file(path, "embeddings file", "an .npz with image_ids, caption_ids, image_mu, caption_mu")
    arrays = _read_npz(p)
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise UserError(f"embeddings {p} lack arrays: {', '.join(missing)} "
                        f"(have: {', '.join(sorted(arrays)) or 'none'})")
    where = f"embeddings {p}"
    _refuse_unknown(arrays, where)
    image_ids = check_ids(arrays["image_ids"], where, "image_ids")
    caption_ids = check_ids(arrays["caption_ids"], where, "caption_ids")
    _check_shapes(arrays, where)
    for k in ("image_mu", "caption_mu", "image_logvar", "caption_logvar"):
        if k in arrays:
            _check_values(arrays[k], where, k)
    for k in ("image_logvar", "caption_logvar"):
        if k in arrays and arrays[k].max() > LOGVAR_MAX:
            raise UserError(f"{where}: {k} holds {float(arrays[k].max()):g}, above {LOGVAR_MAX:g}: sigma^2 = "
                            "exp(logvar) overflows float32 (these arrays are log sigma^2, not sigma^2 or sigma)")
    img_mu, cap_mu = arrays["image_mu"], arrays["caption_mu"]
    cap_img = arrays.get("caption_image")
    if cap_img is not None:
        cap_img = _check_caption_image(cap_img, where, len(cap_mu), len(img_mu))
    return Embeddings(
        image_ids=image_ids, caption_ids=caption_ids, image_mu=_f32(img_mu), caption_mu=_f32(cap_mu),
        image_logvar=_f32(arrays["image_logvar"]) if "image_logvar" in arrays else None,
        caption_logvar=_f32(arrays["caption_logvar"]) if "caption_logvar" in arrays else None,
        caption_image=cap_img)
