"""zsprob.data: everything zsprob reads, real and embedded.

Owns every reader of data and SynthWorld, the offline dataset: :mod:`~zsprob.data.webdataset`
(image-text tar shards), :mod:`~zsprob.data.coco` / :mod:`~zsprob.data.flickr` (Karpathy splits),
:mod:`~zsprob.data.classification` (ImageNet, class folders, SynthWorld's classify splits),
:mod:`~zsprob.data.masking` / :mod:`~zsprob.data.degrade` / :mod:`~zsprob.data.text_augment` (masked,
degraded and augmented copies of batches), :mod:`~zsprob.data.transforms` (PCME++'s COCO transforms)
and :mod:`~zsprob.data.synthetic` (SynthWorld). May import ``zsprob.errors``, ``zsprob.utils``,
``zsprob.methods`` and the root package only. Sub-modules load on first attribute access.
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
}
_SUBMODULES = ("webdataset", "coco", "classification", "transforms", "synthetic")

__all__ = sorted(_LAZY) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"zsprob.data.{name}")
    raise AttributeError(f"module 'zsprob.data' has no attribute {name!r}")
