"""Image features of a classification split and their on-disk cache.

:class:`ImageFeatures` holds one split's image Gaussians and labels; :func:`encode_split` reads
the split through :mod:`zsprob.data.classification` (folders, ImageNet, SynthWorld) with the
model's open_clip ``preprocess_val`` transform, embeds it with
:func:`zsprob.models.encode.encode_images` (on ``device``, with ``num_workers`` decoding
processes and the encoding ``precision``), and caches the result (safetensors + a JSON of the
key, written atomically by :mod:`zsprob.utils.io`) under a key made of the model fingerprint and
the dataset's identity (paths, labels, transform; the precision when it is not fp32, so fp32
caches keep their keys).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zsprob.errors import UserError

DATASET_KINDS = ("imagenet", "synthetic", "folder")


@dataclass
class ImageFeatures:
    """Cached image embeddings of one split: ``mu`` [N, D], ``logvar`` [N, D] or None, ``labels`` [N]."""

    mu: torch.Tensor
    logvar: torch.Tensor | None
    labels: torch.Tensor
    classnames: list[str]
    source: str = ""
    from_cache: bool = False
    seconds: float = 0.0
    skipped: int = 0  # unreadable images the dataset left out (a folder's damaged files)

    @property
    def feats(self):
        return (self.mu, self.logvar)

    @property
    def uncertainty(self):
        return None if self.logvar is None else self.logvar.exp().sum(-1)

    def __len__(self) -> int:
        return int(self.mu.shape[0])


def load_split(kind: str, root, split: str | None, transform=None):
    """A classification dataset through ``zsprob.data.classification`` (items ``(image, label)``)."""
    if kind not in DATASET_KINDS:
        raise UserError(f"unknown dataset kind {kind!r}; choose from {', '.join(DATASET_KINDS)}")
    from zsprob.data.classification import build_classification_dataset

    return build_classification_dataset(kind, root, split=split, transform=transform)


def _dataset_identity(kind, root, split, ds) -> dict:
    targets = list(getattr(ds, "targets", []))
    h = hashlib.sha256(json.dumps(targets).encode())
    for attr in ("samples", "paths", "image_paths", "files"):
        v = getattr(ds, attr, None)
        if v is not None:
            try:
                h.update(json.dumps([str(p if not isinstance(p, (tuple, list)) else p[0]) for p in v]).encode())
            except TypeError:
                pass
            break
    return {"kind": kind, "root": str(Path(root).resolve()), "split": split, "n": len(ds),
            "classnames": list(ds.classnames), "content": h.hexdigest()[:24]}


def encode_split(model, kind: str, root, split: str | None, *, model_id: str, cache_dir=None,
                 batch_size: int = 256, device=None, num_workers: int = 0, progress: bool = True,
                 precision: str = "fp32") -> ImageFeatures:
    """Embed a classification split (cached on disk by model fingerprint + dataset identity)."""
    from zsprob.utils.devices import check_precision
    from zsprob.utils.io import atomic_write, atomic_write_json

    check_precision(precision)

    ds = load_split(kind, root, split, transform=getattr(model, "preprocess_val", None))
    if len(ds) == 0:
        raise UserError(f"{kind} split {split or ''} under {root} has no images")
    ident = _dataset_identity(kind, root, split, ds)
    ident["transform"] = repr(getattr(model, "preprocess_val", None))
    if precision != "fp32":
        ident["precision"] = precision
    key = hashlib.sha256(json.dumps({"model": model_id, **ident}, sort_keys=True).encode()).hexdigest()
    labels = torch.as_tensor(list(ds.targets), dtype=torch.long)
    source = f"{kind}:{root}" + (f":{split}" if split else "")
    stem = Path(cache_dir) / f"images-{key[:24]}" if cache_dir is not None else None
    if stem is not None and stem.with_suffix(".safetensors").is_file():
        try:
            from safetensors.torch import load_file

            meta = json.loads(stem.with_suffix(".json").read_text())
            if meta.get("key") == key:
                t = load_file(str(stem.with_suffix(".safetensors")))
                return ImageFeatures(t["mu"], t.get("logvar"), t["labels"], list(ds.classnames), source,
                                     from_cache=True, skipped=len(getattr(ds, "skipped", ())))
        except Exception:
            pass
    from zsprob.models.encode import encode_images

    t0 = time.perf_counter()
    mu, logvar = encode_images(model, ds, batch_size=batch_size, device=device, num_workers=num_workers,
                               progress=progress, precision=precision)
    secs = time.perf_counter() - t0
    feats = ImageFeatures(mu, logvar, labels, list(ds.classnames), source, seconds=secs,
                          skipped=len(getattr(ds, "skipped", ())))
    if stem is not None:
        from safetensors.torch import save_file

        tensors = {"mu": mu.contiguous(), "labels": labels}
        if logvar is not None:
            tensors["logvar"] = logvar.contiguous()
        atomic_write(stem.with_suffix(".safetensors"), lambda tmp: save_file(tensors, tmp))
        atomic_write_json(stem.with_suffix(".json"), {"key": key, "model_id": model_id, **ident,
                                                      "encode_seconds": secs})
    return feats
