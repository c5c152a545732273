"""The feature file of post-hoc training: every tensor the heads read, computed once by the frozen towers.

Each *view* is one pass over the data (one caption per image, a degraded copy of each image and caption) storing
the frozen mean and the head's features; training reads this file, never the data. A safetensors file with a
JSON key in its metadata: a later run with the same key reads it instead of the data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from zsprob.errors import UserError

#: the recipe's copies (configs/synthetic_tiny_sigma.yaml): half the words deleted, one lossy image operation
#: of zsprob.data.degrade's default seven (its default share and size of blanked cells)
WORD_DROP = 0.5
#: the four rows of one view: original and copy, per modality
PARTS = ("image", "image_copy", "text", "text_copy")


@dataclass
class DataSpec:
    """Where post-hoc training reads image-caption pairs: ``kind`` (:data:`zsprob.posthoc.DATA_KINDS`), ``path``
    (shards or a SynthWorld root; a COCO root), at most ``max_samples`` images per view (None: all)."""

    kind: str
    path: str
    max_samples: int | None = None
    workers: int = 0

    def key(self) -> dict:
        return {"kind": self.kind, "path": str(Path(self.path).resolve()) if Path(self.path).exists()
                else str(self.path), "max_samples": self.max_samples}


def _shard_batches(spec: DataSpec, model, batch_size: int, view: int, seed: int, pin: bool):
    from zsprob.data.webdataset import build_wds_pipeline

    synthetic = spec.kind == "synthetic"
    loader = build_wds_pipeline(spec.path, preprocess=model.preprocess_val, tokenizer=model.tokenizer, epoch=view,
                                batch_size=batch_size, seed=seed, shuffle=False, num_workers=spec.workers,
                                caption_key="json:captions" if synthetic else "txt", pin_memory=pin,
                                dataset_type="synthetic" if synthetic else "webdataset")
    for batch in loader:
        yield batch[0], batch[1]


def _coco_batches(spec: DataSpec, model, batch_size: int, view: int, seed: int, pin: bool):
    from zsprob.data.coco import CocoCaptions, CocoPairs

    pairs = CocoPairs(CocoCaptions(spec.path, split="train", official_ids=False, instances=False),
                      model.preprocess_val, model.tokenizer, mode="random", seed=seed)
    pairs.set_epoch(view)
    loader = torch.utils.data.DataLoader(pairs, batch_size=batch_size, shuffle=False, num_workers=spec.workers,
                                         pin_memory=pin)
    for images, tokens, _image_index, _caption_index in loader:
        yield images, tokens


def pair_batches(spec: DataSpec, model, batch_size: int, view: int, seed: int, device=None):
    """(images, tokens) batches of one view, in the data's order, capped at ``spec.max_samples`` images; in
    page-locked memory when bound for a CUDA ``device``."""
    source = _coco_batches if spec.kind == "coco" else _shard_batches
    seen = 0
    pin = device is not None and torch.device(device).type == "cuda"  # CUDA: non-blocking copies to the device
    for images, tokens in source(spec, model, batch_size, view, seed, pin):
        if spec.max_samples is not None:
            images, tokens = images[:spec.max_samples - seen], tokens[:spec.max_samples - seen]
        if images.shape[0] == 0:
            return
        seen += images.shape[0]
        yield images, tokens


def _copies(model, images, tokens, generator, mask_spec):
    from zsprob.data.degrade import degrade_images
    from zsprob.data.masking import delete_tokens

    pre = model.config["preprocess_cfg"]
    degraded = degrade_images(images, generator, mean=pre["mean"], std=pre["std"])[0]
    return degraded, delete_tokens(tokens, WORD_DROP, mask_spec, generator)


def _view_seed(seed: int, view: int, batch: int) -> int:
    return (int(seed) * 1_000_003 + int(view) * 7_919 + int(batch)) % (2 ** 63)


@torch.no_grad()
def extract(model, adapters: dict, spec: DataSpec, *, views: int, batch_size: int, seed: int, device,
            progress: bool = True) -> dict[str, torch.Tensor]:
    """Means and head features of every view: ``{PART_mu, PART_features}`` for each of :data:`PARTS`, rows
    ordered view by view (CPU float32)."""
    from tqdm.auto import tqdm

    from zsprob.data.masking import text_mask_spec

    mask_spec = text_mask_spec(model.tokenizer)
    rows: dict[str, list[torch.Tensor]] = {}
    bar = tqdm(desc="post-hoc features", unit="img", disable=not progress)
    for view in range(views):
        for index, (images, tokens) in enumerate(pair_batches(spec, model, batch_size, view, seed, device)):
            generator = torch.Generator().manual_seed(_view_seed(seed, view, index))
            degraded, deleted = _copies(model, images, tokens, generator, mask_spec)
            inputs = {"image": images, "image_copy": degraded, "text": tokens, "text_copy": deleted}
            for part, value in inputs.items():
                mu, features = adapters[part.split("_")[0]].encode(value.to(device, non_blocking=True))
                rows.setdefault(f"{part}_mu", []).append(mu.float().cpu())
                rows.setdefault(f"{part}_features", []).append(features.float().cpu())
            bar.update(images.shape[0])
    bar.close()
    if not rows:
        raise UserError(f"no image-caption pairs read from {spec.path} ({spec.kind}): post-hoc training needs "
                        "images with captions")
    return {k: torch.cat(v) for k, v in rows.items()}


def feature_key(model, spec: DataSpec, adapters: dict, *, views: int, seed: int) -> str:
    """The JSON that says which source, data and draws a feature file holds."""
    from zsprob.data.degrade import DEFAULT_DEGRADE_OPS

    weights = (model.checkpoint_meta or {}).get("weights", {}).get("sha256")
    return json.dumps({"model": model.name, "weights": weights, "source": model.posthoc_source,
                       "data": spec.key(), "views": views, "seed": seed,
                       "heads": {side: a.kind for side, a in adapters.items()},
                       "copies": {"word_drop": WORD_DROP, "image_ops": list(DEFAULT_DEGRADE_OPS)}}, sort_keys=True)


def load_features(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of the feature file at ``path`` when its key is ``key``, else None (a feature file of
    other draws is recomputed and replaced). A path holding anything else is one line: it is not
    overwritten."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if path.is_dir():
        raise UserError(f"feature file {path} is a directory")
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get("key")
    except Exception as e:  # noqa: BLE001 - any reader error means: not a feature file
        stored, why = None, f"{type(e).__name__}"
    else:
        why = "no feature key in its metadata"
    if stored is None:
        raise UserError(f"{path} exists and is not a zsprob posthoc feature file ({why}); it would be overwritten: "
                        "give another --features path or remove it")
    return load_file(str(path)) if stored == key else None


def save_features(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    from safetensors.torch import save_file

    from zsprob.utils.io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                             metadata={"key": key}))


__all__ = ["DataSpec", "PARTS", "pair_batches", "extract", "feature_key", "load_features",
           "save_features"]
