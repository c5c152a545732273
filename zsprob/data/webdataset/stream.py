"""The iterable each DataLoader worker runs: the epoch's seeded shard schedule -> samples -> shuffle
buffer -> preprocessed, tokenised batches, with the worker's counts sent along with every batch, the
batches to skip on resume sent as placeholders, and a stream that stalls ended with one line.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import random
from typing import Iterable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

import webdataset as wds

from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.samples import Counts, SampleDecoder, read_shard
from zsprob.data.webdataset.seeding import call_seeded, loader_base_seed, loader_generator, mix_seed, \
    seed_worker_as_fresh

log = logging.getLogger("zsprob.data")


class BatchBuffer:
    """Collects one batch of images into a preallocated [B, ...] tensor as they arrive; inside a DataLoader
    worker it lives in shared memory (as torch's default_collate does), so sending the batch copies nothing."""

    def __init__(self, batch_size: int, shared: bool):
        self.batch_size = batch_size
        self.shared = shared
        self.buf: Optional[torch.Tensor] = None
        self.items: list = []
        self.n = 0

    def add(self, img) -> Optional[str]:
        if not isinstance(img, torch.Tensor):
            self.items.append(img)
            self.n += 1
            return None
        if self.buf is None:
            shape = (self.batch_size, *img.shape)
            if self.shared:
                numel = math.prod(shape)
                storage = img._typed_storage()._new_shared(numel, device=img.device)
                self.buf = img.new(storage).resize_(*shape)
            else:
                self.buf = torch.empty(shape, dtype=img.dtype, device=img.device)
        elif img.shape != self.buf.shape[1:] or img.dtype != self.buf.dtype:
            return (f"preprocess output {tuple(img.shape)} {img.dtype} differs from the batch's "
                    f"{tuple(self.buf.shape[1:])} {self.buf.dtype}")
        self.buf[self.n].copy_(img)
        self.n += 1
        return None

    def take(self):
        if self.buf is not None:
            out = self.buf if self.n == self.batch_size else self.buf[: self.n]
        else:
            out = self.items
        self.buf, self.items, self.n = None, [], 0
        return out


class SharedPosition:
    """The epoch a stream reads and the batches it skips, in shared memory, where persistent workers read each
    epoch's position. Pickled while a worker process starts it stays shared; otherwise it is copied."""

    def __init__(self, epoch: int = 0, skip: int = 0):
        self._values = multiprocessing.RawArray("q", [int(epoch), int(skip)])

    def get(self) -> tuple[int, int]:
        return int(self._values[0]), int(self._values[1])

    def set(self, epoch: int, skip: int) -> None:
        self._values[0], self._values[1] = int(epoch), int(skip)

    def __getstate__(self):
        from multiprocessing.context import get_spawning_popen
        return {"values": self._values} if get_spawning_popen() is not None else {"copy": self.get()}

    def __setstate__(self, state):
        if "values" in state:
            self._values = state["values"]
        else:
            self._values = multiprocessing.RawArray("q", list(state["copy"]))


class ShardStream(IterableDataset):
    """The iterable each DataLoader worker runs: shards -> samples -> shuffled -> batches, each sent as
    ``(images, tokens, keys, counts)`` (a placeholder with ``images=None`` carries only counts)."""

    def __init__(self, sources: list[list[str]], opts: ShardPipelineOptions, *, weights, preprocess, tokenizer,
                 rank: int, world_size: int):
        super().__init__()
        self.sources = sources
        self.urls = [u for s in sources for u in s]
        self.opts = opts
        self.weights = weights
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.rank = rank
        self.world_size = world_size
        self.decoder = SampleDecoder(opts)
        # set by WdsLoader before each iteration; persistent workers read them from shared memory
        self.position = SharedPosition()
        self.num_workers = 0  # fixed while a DataLoader's workers live (WdsLoader remakes it on a change)

    # ---- schedule
    def batches_per_worker(self) -> Optional[int]:
        if self.opts.num_samples is None:
            return None
        nw = max(1, self.num_workers)
        return max(1, math.ceil(self.opts.num_samples / (self.opts.batch_size * self.world_size * nw)))

    def assigned_shards(self, worker: int, nw: int, epoch: int) -> list[str]:
        """Shards this (rank, worker) reads in a non-resampled epoch (before repeats)."""
        urls = list(self.urls)
        if self.opts.shuffle:
            random.Random(mix_seed(self.opts.seed, epoch, 0xA11)).shuffle(urls)
        return urls[self.rank::self.world_size][worker::nw]

    def _shard_iter(self, worker: int, nw: int, epoch: int, repeat: bool) -> Iterator[str]:
        seed = self.opts.seed
        if self.opts.resampled:
            rng = random.Random(mix_seed(seed, epoch, self.rank, worker, 0x5E5))
            if self.weights is None:
                while True:
                    yield rng.choice(self.urls)
            cum = np.cumsum(self.weights)
            while True:
                s = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
                s = min(s, len(self.sources) - 1)
                yield rng.choice(self.sources[s])
        mine = self.assigned_shards(worker, nw, epoch)
        if not mine:
            log.warning("zsprob.data: rank %d worker %d has no shard this epoch (%d shards for %d "
                        "ranks x %d workers); use fewer workers or resampled=True",
                        self.rank, worker, len(self.urls), self.world_size, nw)
            return
        yield from mine
        p = 1
        while repeat:
            again = list(mine)
            if self.opts.shuffle:
                random.Random(mix_seed(seed, epoch, self.rank, worker, p, 0xAE7)).shuffle(again)
            yield from again
            p += 1

    # ---- reading
    def _samples(self, shard_urls: Iterable[str], counts: Counts) -> Iterator[dict]:
        # endless streams stop when shard after shard gives nothing instead of spinning forever
        limit = 10 * len(self.urls) + 10
        empty = 0
        for url in shard_urls:
            n = 0
            for sample in read_shard(url, counts, self.decoder.complete):
                n += 1
                yield sample
            empty = 0 if n else empty + 1
            if empty >= limit:
                log.warning("zsprob.data: %s: %d shards in a row had no readable sample; "
                            "this worker stops", counts.where, empty)
                return

    # ---- the worker loop
    def __iter__(self):
        opts = self.opts
        info = get_worker_info()
        worker, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        counts = Counts(worker, self.rank)
        epoch, k = self.position.get()
        if info is not None:  # a persistent worker starts each epoch as a fresh one would
            seed_worker_as_fresh(loader_base_seed(loader_generator(opts.seed, epoch)), worker)
        per_worker = self.batches_per_worker()
        my_skip = max(0, -(-(k - worker) // nw)) if k > 0 else 0
        shards = self._shard_iter(worker, nw, epoch, repeat=per_worker is not None)
        samples = self._samples(shards, counts)
        if opts.shuffle and opts.shuffle_buffer > 1:
            rng = random.Random(mix_seed(opts.seed, epoch, self.rank, worker, 0x5B0))
            samples = wds.filters._shuffle(samples, opts.shuffle_buffer,
                                           min(opts.shuffle_initial, opts.shuffle_buffer), rng=rng)
        sample_base = mix_seed(opts.seed, epoch, self.rank, worker, 0x5A3)
        imgs = BatchBuffer(opts.batch_size, shared=info is not None)
        caps: list[str] = []
        keys: list[str] = []
        produced = 0
        last_good = -1  # the index of the last sample put into a batch
        for idx, s in enumerate(samples):
            if per_worker is not None and produced >= per_worker:
                break
            if idx - last_good > opts.max_consecutive_skips:  # nothing usable comes: stop instead of spinning
                yield None, None, None, {**counts.take(), "__fatal__": counts.stall_message(
                    idx - last_good - 1, opts.max_consecutive_skips)}
                return
            if s.get("__bad__"):
                continue
            skipping = produced < my_skip
            sseed = (sample_base + idx) & 0x7FFFFFFFFFFFFFFF
            cap = self.decoder.caption(s, sseed, counts)
            if cap is None:
                continue
            img = self.decoder.image(s, counts)
            if img is None:
                continue
            if not skipping:
                try:
                    img = call_seeded(sseed, self.preprocess, img) if self.preprocess is not None else img
                except Exception as e:
                    counts.bad("transform_error", f"{s['__key__']}: {type(e).__name__}: {e}")
                    continue
                err = imgs.add(img)
                if err is not None:
                    counts.bad("transform_error", f"{s['__key__']}: {err}")
                    continue
            caps.append(cap)
            keys.append(s["__key__"])
            last_good = idx
            if len(caps) == opts.batch_size:
                counts.add("samples", len(caps))
                if skipping:
                    counts.add("skipped_batches")
                    yield None, None, None, counts.take()
                else:
                    yield self._emit(imgs, caps, keys, counts)
                produced += 1
                caps, keys = [], []
        if caps and per_worker is None:
            if opts.drop_last or produced < my_skip:
                counts.add("dropped_partial" if opts.drop_last else "samples", len(caps))
                if not opts.drop_last:
                    counts.add("skipped_batches")
            else:
                counts.add("samples", len(caps))
                yield self._emit(imgs, caps, keys, counts)
        yield None, None, None, counts.take()  # flush the last counts

    def _emit(self, imgs: BatchBuffer, caps, keys, counts: Counts):
        counts.add("batches")
        images = imgs.take()  # a tensor, or a list of PIL images with preprocess=None
        tokens = self.tokenizer(caps) if self.tokenizer is not None else list(caps)
        return images, tokens, list(keys), counts.take()
