"""Training batch sources with a resumable position (epoch, batch index within the epoch).

webdataset reads shards, torch's DataLoader COCO. zsprob writes one loader per source for the whole run, exact
mid-epoch resume (an epoch's order is a function of (seed, epoch)), the per-process slice of the GLOBAL batch,
and noisy correspondence (``noise_ratio``: COCO permutes captions once, streams rotate them in every batch).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.utils.host_sync import pins_memory, to_device
from zsprob.utils.signals import leave_stop_signals_to_the_main_process


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integers (deterministic, order sensitive)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    out = np.uint64(1469598103934665603)
    with np.errstate(over="ignore"):
        for p in parts:
            out = (out ^ np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF)) * np.uint64(1099511628211) + h
    return int(out) & 0x7FFFFFFFFFFFFFFF


class BatchSource:
    """Base: ``epoch_batches(epoch, skip)`` yields local (images, tokens) batches of one epoch."""

    steps_per_epoch: int | None = None   # known for map-style data; None for streams
    local_batch_size: int

    def configure(self, *, device=None) -> None:
        """Where the batches go (the training device), told before the first epoch: loaders pin for CUDA."""

    def epoch_batches(self, epoch: int, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def stats(self) -> dict:
        return {}


class WdsSource(BatchSource):
    """WebDataset shards (SynthWorld, RedCaps, any img2dataset output) through one loader for every epoch,
    told each epoch's position (``set_epoch``: the batches to skip); the pipeline owns the data order."""

    def __init__(self, shards, options, *, preprocess, tokenizer):
        from zsprob.data.webdataset import build_wds_pipeline
        self.shards = shards
        self.options = options  # a ShardPipelineOptions (shard_options builds it from the config)
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.local_batch_size = options.batch_size
        self.loader = build_wds_pipeline(shards, options, preprocess=preprocess, tokenizer=tokenizer)
        self.steps_per_epoch = self.loader.num_batches  # None for a plain one-pass epoch

    def configure(self, *, device=None) -> None:
        if device is not None:
            self.loader.pin_memory = pins_memory(device)

    def epoch_batches(self, epoch, skip=0):
        self.loader.set_epoch(epoch, skip)
        for batch in self.loader:
            images, tokens = batch[0], batch[1]
            if images.shape[0] != self.local_batch_size:
                continue  # all processes need the same local size
            yield images, tokens

    def stats(self) -> dict:
        return {k: v for k, v in self.loader.stats().items() if isinstance(v, (int, float)) and k != "epoch" and v}


class _EpochIndices(list):
    """One batch of dataset indices tagged ``(generation, seed)``: the epoch's count in this source, and the
    seed a DataLoader made for that epoch would draw its workers' base seed with."""

    epoch_seed: tuple[int, int] = (0, 0)


class _EpochSampler:
    """The batch sampler of the one COCO DataLoader: the tagged index batches of the epoch set last."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.epoch_seed = (0, 0)

    def set(self, batches: list[list[int]], epoch_seed: tuple[int, int]) -> None:
        self.batches, self.epoch_seed = batches, epoch_seed

    def __iter__(self):
        for batch in self.batches:
            tagged = _EpochIndices(batch)
            tagged.epoch_seed = self.epoch_seed
            yield tagged

    def __len__(self) -> int:
        return len(self.batches)


class _CocoTrain(torch.utils.data.Dataset):
    def __init__(self, coco, preprocess, caption_order: np.ndarray):
        self.coco = coco
        self.preprocess = preprocess
        self.caption_order = caption_order  # caption index used for sample i (noise permutes it)
        self.seeded_for: tuple[int, int] | None = None  # the epoch this worker's generators were seeded for

    def __len__(self):
        return len(self.coco.captions)

    def __getitems__(self, indices):
        """One batch; a persistent worker's first batch of an epoch first re-seeds its generators as a worker
        started for that epoch would have them."""
        from torch.utils.data import get_worker_info

        from zsprob.data.webdataset import loader_base_seed, seed_worker_as_fresh
        tag = getattr(indices, "epoch_seed", None)
        info = get_worker_info()
        if info is not None and tag is not None and tag != self.seeded_for:
            seed_worker_as_fresh(loader_base_seed(torch.Generator().manual_seed(tag[1])), info.id)
            self.seeded_for = tag
        return [self[i] for i in indices]

    def __getitem__(self, i):
        from zsprob.data.images import open_rgb
        img_idx = int(self.coco.caption_image[i])
        path = self.coco.image_paths[img_idx]
        try:
            image = self.preprocess(open_rgb(path))
            ok = True
        except (OSError, ValueError):
            image, ok = None, False
        return image, self.coco.captions[int(self.caption_order[i])], ok, img_idx


class _CocoCollate:
    """Collation in the workers: ``(images, tokens, image_index, unreadable)`` of the readable samples, filled
    up to the local size with copies of the first (images None when none was readable); ``unreadable`` is
    ``(count, image index of the first)``."""

    def __init__(self, tokenizer, batch_size: int):
        self.tokenizer, self.batch_size = tokenizer, batch_size

    def __call__(self, items):
        good = [x for x in items if x[2]]
        bad = [x[3] for x in items if not x[2]]
        unreadable = (len(bad), bad[0] if bad else -1)
        if not good:
            return None, None, None, unreadable
        good += [good[0]] * (self.batch_size - len(good))
        images = torch.utils.data.default_collate([x[0] for x in good])
        tokens = self.tokenizer([x[1] for x in good])
        return images, tokens, torch.tensor([x[3] for x in good], dtype=torch.long), unreadable


def same_image_targets(image_index: torch.Tensor) -> torch.Tensor:
    """[B, B] hard targets: 1 where row and column show the same image (naver-ai/pcmepp's positives), else 0."""
    return (image_index[:, None] == image_index[None, :]).float()


class CocoSource(BatchSource):
    """COCO / Flickr30k Karpathy train captions, one sample per caption, as (images, tokens, image_index)
    batches (captions of one image are positives: :func:`same_image_targets`). One DataLoader with
    persistent workers serves every epoch, its workers seeded by (seed, epoch, skip, rank) as a loader
    built for that epoch would be."""

    def __init__(self, root, *, preprocess, tokenizer, global_batch_size: int, rank: int, world: int,
                 seed: int, num_workers: int, noise_ratio: float = 0.0, split: str = "train",
                 karpathy_json=None, dataset: str = "coco"):
        from zsprob.data.flickr import karpathy_captions
        # training needs neither the official caption ids nor the instance labels
        self.coco = karpathy_captions(dataset, root, split, karpathy_json, official_ids=False, instances=False)
        n = len(self.coco.captions)
        if n < global_batch_size:
            raise UserError(f"{dataset} {split} has {n} captions, fewer than the batch size {global_batch_size}")
        order = np.arange(n)
        if noise_ratio > 0:
            rng = np.random.default_rng(mixed_seed(seed, 0x401CE))
            k = int(round(noise_ratio * n))
            picked = rng.choice(n, size=k, replace=False)
            order[picked] = order[rng.permutation(picked)]
        self.dataset = _CocoTrain(self.coco, preprocess, order)
        self.tokenizer = tokenizer
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // world
        self.rank, self.world, self.seed = rank, world, seed
        self.num_workers = num_workers
        self.steps_per_epoch = n // global_batch_size
        self.bad = 0
        self.pin_memory = False
        self._sampler = _EpochSampler()
        self._generator = torch.Generator()
        self._generation = 0
        self._loader: torch.utils.data.DataLoader | None = None

    def configure(self, *, device=None) -> None:
        if device is not None:
            self.pin_memory = pins_memory(device)

    def _dataloader(self) -> torch.utils.data.DataLoader:
        """The one DataLoader of this source, remade only when ``pin_memory`` changed."""
        if self._loader is None or self._loader.pin_memory != self.pin_memory:
            workers = self.num_workers
            self._loader = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=self._sampler, num_workers=workers, pin_memory=self.pin_memory,
                collate_fn=_CocoCollate(self.tokenizer, self.local_batch_size), persistent_workers=workers > 0,
                generator=self._generator,  # a fresh iterator draws its workers' base seed from it
                worker_init_fn=leave_stop_signals_to_the_main_process if workers > 0 else None)
        return self._loader

    def epoch_batches(self, epoch, skip=0):
        n = len(self.dataset)
        perm = np.random.default_rng(mixed_seed(self.seed, epoch, 0xC0C0)).permutation(n)
        B, b = self.global_batch_size, self.local_batch_size
        idx_batches = [perm[s * B + self.rank * b: s * B + (self.rank + 1) * b].tolist()
                       for s in range(skip, self.steps_per_epoch)]
        worker_seed = mixed_seed(self.seed, epoch, skip, self.rank)
        self._generation += 1
        self._sampler.set(idx_batches, (self._generation, worker_seed))
        loader = self._dataloader()
        self._generator.manual_seed(worker_seed)
        for images, tokens, ids, (unreadable, first) in loader:
            if unreadable and not self.bad:  # once per run and process; metrics.jsonl counts them all
                warnings.warn(f"unreadable training image {self.coco.image_paths[int(first)]}: each unreadable image "
                              "is replaced by a copy of a readable sample of its batch (counted as data.bad_images "
                              "in metrics.jsonl and summary.json)")
            self.bad += unreadable
            if images is not None:
                yield images, tokens, ids

    def stats(self):
        return {"bad_images": self.bad}


def add_caption_noise(tokens: torch.Tensor, ratio: float, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Rotate the captions of ``round(ratio * n)`` random rows among themselves (each gets a wrong one);
    (tokens, rows replaced). The rows are drawn on the generator's device and copied without waiting."""
    n = tokens.shape[0]
    k = int(round(ratio * n))
    if ratio <= 0 or k < 2:
        return tokens, 0
    rows = torch.randperm(n, generator=generator, device=generator.device if generator is not None else "cpu")[:k]
    rows = to_device(rows, tokens.device)
    out = tokens.clone()
    out[rows] = tokens[rows.roll(1)]
    return out, k


def shard_options(data: Any, local_batch_size: int, seed: int, samples_per_epoch: int | None, *,
                  pin_memory: bool = False):
    """The :class:`~zsprob.data.webdataset.ShardPipelineOptions` of a config's ``data`` section (full batches
    only), ``data.pipeline`` last (any other option by name)."""
    from zsprob.data.webdataset import ShardPipelineOptions
    base = dict(batch_size=int(local_batch_size), seed=int(seed), resampled=bool(data.get("resampled")),
                num_workers=int(data.get("num_workers") or 0), dataset_type=str(data.kind), drop_last=True,
                num_samples=int(samples_per_epoch) if samples_per_epoch else None, pin_memory=bool(pin_memory))
    if data.get("shuffle_buffer") is not None:
        base["shuffle_buffer"] = int(data.shuffle_buffer)
    return ShardPipelineOptions.build(**{**base, **dict(data.get("pipeline") or {})})


def _manifest_candidates(shards: str) -> list[str]:
    """``manifest.json`` in the shards' directory and the two above it (paths or URLs)."""
    from zsprob.utils import remote
    s = str(shards).split("::")[0].rstrip("/")
    if remote.scheme_of(s) == "pipe":
        return []
    if remote.is_local(s):
        p = Path(remote.local_path(s))
        return [str(c / "manifest.json") for c in (p, p.parent, p.parent.parent)]
    head, _, path = s.partition("://")
    parts = path.split("/")
    return [f"{head}://{'/'.join(parts[:len(parts) - k])}/manifest.json" for k in range(3) if len(parts) - k > 0]


def _read_manifest(where: str) -> dict | None:
    import json

    from zsprob.utils import remote
    try:
        with remote.open_url(where, "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, ImportError):  # missing, unreadable, not JSON, no backend
        return None
    return m if isinstance(m, dict) else None


def count_samples_synthetic(shards: str | Path) -> int | None:
    """Number of pretraining samples from a SynthWorld manifest by the shards (a path or a URL), if any."""
    for cand in _manifest_candidates(str(shards)):
        counts = (_read_manifest(cand) or {}).get("counts")
        if isinstance(counts, dict) and isinstance(counts.get("pretrain"), int):
            return counts["pretrain"]
    return None


def resolve_shards(shards: str | Path) -> str | list[str]:
    """A local directory means every ``*.tar`` in it (sorted); patterns, ``pipe:`` and URLs pass
    through (the pipeline lists URL directories itself)."""
    from zsprob.utils import remote
    if not remote.is_local(str(shards)):
        return str(shards)
    p = Path(remote.local_path(str(shards)))
    if p.is_dir():
        tars = sorted(str(x) for x in p.glob("*.tar"))
        if not tars:
            raise UserError(f"no .tar shards in {p}")
        return tars
    return str(shards)
