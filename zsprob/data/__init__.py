"""zsprob.data: everything zsprob reads, real and embedded.

Owns every reader of data (shards, caption cleaning, COCO, classification sets, transforms) and
SynthWorld. May import ``zsprob.errors``, ``zsprob.utils``, ``zsprob.methods`` and the root package
only: never models, prob, train, zeroshot or retrieval.

Sub-modules (imported on first attribute access, so ``import zsprob.data`` stays cheap):

- :mod:`zsprob.data.webdataset`: image-text tar shards (RedCaps, img2dataset output, SynthWorld
  pretraining shards; local, ``pipe:`` or fsspec URLs): :func:`build_wds_pipeline` with one
  :class:`ShardPipelineOptions` -> :class:`WdsLoader`.
- :mod:`zsprob.data.coco`: COCO Captions with the Karpathy splits and official ids: :class:`CocoCaptions`.
- :mod:`zsprob.data.classification`: ImageNet, folder-per-class datasets, SynthWorld classify splits:
  :func:`build_classification_dataset`.
- :mod:`zsprob.data.transforms`: open_clip train / val transforms and SizeAugment.
- :mod:`zsprob.data.masking` / :mod:`zsprob.data.degrade`: masked captions and images, and lossy
  image views, for the occlusion inclusion term (:mod:`zsprob.data.jpeg_torch`: the JPEG view's
  round trip on the images' device).
- :mod:`zsprob.data.synthetic`: SynthWorld, the embedded offline dataset.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "build_wds_pipeline": "zsprob.data.webdataset",
    "WdsLoader": "zsprob.data.webdataset",
    "ShardPipelineOptions": "zsprob.data.webdataset",
    "CocoCaptions": "zsprob.data.coco",
    "CocoImages": "zsprob.data.coco",
    "CocoPairs": "zsprob.data.coco",
    "FolderDataset": "zsprob.data.classification",
    "ImageNetDataset": "zsprob.data.classification",
    "build_classification_dataset": "zsprob.data.classification",
    "SizeAugment": "zsprob.data.transforms",
}
_SUBMODULES = ("webdataset", "coco", "classification", "transforms", "synthetic")

__all__ = sorted(_LAZY) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"zsprob.data.{name}")
    raise AttributeError(f"module 'zsprob.data' has no attribute {name!r}")
