"""Image features of a classification split and their on-disk cache.

:class:`Split` names one split and lists its dataset once (:mod:`zsprob.data.classification`, with the
model's ``preprocess_val``); :func:`encode_split` embeds it (:func:`zsprob.models.encode.encode_images`)
into :class:`ImageFeatures`, cached under the model fingerprint and the dataset's identity (paths with their
sizes and modification times, labels, transform; the precision when it is not fp32).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch


@dataclass
class Split:
    """One classification split: a dataset ``kind``, its ``root`` and the split ``name`` there (None: the
    root itself), listed once when first asked for."""

    kind: str
    root: Any
    name: str | None
    transform: Any = None

    @cached_property
    def dataset(self):
        from zsprob.data.classification import build_classification_dataset

        return build_classification_dataset(self.kind, self.root, split=self.name, transform=self.transform)

    @property
    def classnames(self) -> list[str]:
        return list(self.dataset.classnames)

    @property
    def source(self) -> str:
        return f"{self.kind}:{self.root}" + (f":{self.name}" if self.name else "")


@dataclass
class ImageFeatures:
    """Cached image embeddings of one split: ``mu`` [N, D], ``logvar`` [N, D] or None, ``labels`` [N], and
    ``paths`` [N] the image files in the same order (None when made from tensors alone)."""

    mu: torch.Tensor
    logvar: torch.Tensor | None
    labels: torch.Tensor
    classnames: list[str]
    source: str = ""
    from_cache: bool = False
    seconds: float = 0.0
    skipped: int = 0  # unreadable images the dataset left out (a folder's damaged files)
    paths: list[str] | None = None

    @property
    def feats(self):
        return (self.mu, self.logvar)

    @property
    def uncertainty(self):
        return None if self.logvar is None else self.logvar.exp().sum(-1)

    def __len__(self) -> int:
        return int(self.mu.shape[0])


def _stat(path: str) -> list[int]:
    try:
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return [-1, -1]


def _dataset_identity(kind, root, split, ds) -> dict:
    """What the cached features depend on: the labels, each file's path, size and modification time (a world
    regenerated in place changes them), the class names."""
    targets = list(getattr(ds, "targets", []))
    h = hashlib.sha256(json.dumps(targets).encode())
    for attr in ("samples", "paths", "image_paths", "files"):
        v = getattr(ds, attr, None)
        if v is not None:
            try:
                paths = [str(p if not isinstance(p, (tuple, list)) else p[0]) for p in v]
            except TypeError:
                break
            h.update(json.dumps([[p, *_stat(p)] for p in paths]).encode())
            break
    return {"kind": kind, "root": str(Path(root).resolve()), "split": split, "n": len(ds),
            "classnames": list(ds.classnames), "content": h.hexdigest()[:24]}


def encode_split(model, split: Split, model_id: str, request) -> ImageFeatures:
    """Embed a classification split with ``request``'s encoding options, cached under ``request.cache_dir``
    by model fingerprint and dataset identity."""
    from zsprob.zeroshot.prompts import cache_stem, content_key, read_cache, write_cache

    ds, precision = split.dataset, request.precision
    ident = _dataset_identity(split.kind, split.root, split.name, ds)
    ident["transform"] = repr(getattr(model, "preprocess_val", None))
    if precision != "fp32":
        ident["precision"] = precision
    key = content_key({"model": model_id, **ident})
    labels = torch.as_tensor(list(ds.targets), dtype=torch.long)
    skipped = len(getattr(ds, "skipped", ()))
    paths = [str(path) for path, _ in ds.samples]
    stem = cache_stem(request.cache_dir, "images", key)
    cached = read_cache(stem, key)
    if cached is not None:
        tensors = cached[0]
        return ImageFeatures(tensors["mu"], tensors.get("logvar"), tensors["labels"], list(ds.classnames), split.source,
                             from_cache=True, skipped=skipped, paths=paths)
    from zsprob.models.encode import encode_images

    t0 = time.perf_counter()
    mu, logvar = encode_images(model, ds, batch_size=request.batch_size, device=request.device,
                               num_workers=request.num_workers, progress=request.progress, precision=precision)
    secs = time.perf_counter() - t0
    feats = ImageFeatures(mu, logvar, labels, list(ds.classnames), split.source, seconds=secs, skipped=skipped,
                          paths=paths)
    write_cache(stem, {"mu": mu, "labels": labels, "logvar": logvar},
                {"key": key, "model_id": model_id, **ident, "encode_seconds": secs})
    return feats
