"""The shard loader of one rank: :func:`build_wds_pipeline` checks the options and the shards and makes a
:class:`WdsLoader`, which keeps one DataLoader (webdataset's ``WebLoader``, persistent workers) for every
epoch, tells its workers each epoch's position, adds up the counts they send, raises a stalled stream's
line, and saves / restores its position.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Callable, Optional

import webdataset as wds

from zsprob.data.webdataset.counts import ERROR_KEYS, STAT_KEYS
from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.seeding import loader_generator
from zsprob.data.webdataset.shards import check_some_exist, expand_shards, parse_weights
from zsprob.data.webdataset.stream import ShardStream
from zsprob.errors import UserError
from zsprob.utils.workers import leave_stop_signals_to_the_main_process

log = logging.getLogger("zsprob.data")


def _identity_collate(x):
    return x


class WdsLoader:
    """Iterable over the ``(images [B,3,H,W], tokens [B,L])`` batches of one rank; ``epoch`` is the epoch the
    next iteration reads, ``num_batches`` the batches per epoch when ``num_samples`` fixes them (else None)."""

    def __init__(self, stream: ShardStream, *, epoch: int, num_workers: int, pin_memory: bool,
                 prefetch_factor: Optional[int], timeout: float):
        self._stream = stream
        self.epoch = int(epoch)
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.timeout = timeout
        self._skip = 0
        self._batch_in_epoch = 0
        self._stats: Counter = Counter({k: 0 for k in STAT_KEYS})
        self._loader = None  # the DataLoader (webdataset's WebLoader), made at the first iteration
        self._loader_config: tuple = ()
        self.loaders_made = 0  # DataLoaders made so far (1 for any number of epochs, unless options changed)
        stream.num_workers = self.num_workers
        pw = stream.batches_per_worker()
        self.num_batches = pw * max(1, self.num_workers) if pw is not None else None
        self.num_samples = self.num_batches * stream.batch_size if self.num_batches is not None else None

    # -- info
    @property
    def batch_size(self) -> int:
        return self._stream.batch_size

    @property
    def rank(self) -> int:
        return self._stream.rank

    @property
    def world_size(self) -> int:
        return self._stream.world_size

    @property
    def num_shards(self) -> int:
        return len(self._stream.urls)

    @property
    def shards(self) -> list[str]:
        return list(self._stream.urls)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("this WdsLoader has no fixed length (give num_samples=...)")
        return self.num_batches

    def stats(self) -> dict[str, int]:
        """Counts since construction (this rank, all its workers): good samples, batches, and
        every kind of skipped item (see ``STAT_KEYS``); plus ``skipped_total`` and ``epoch``."""
        d = {k: int(self._stats.get(k, 0)) for k in STAT_KEYS}
        for k, v in self._stats.items():
            d.setdefault(k, int(v))
        d["skipped_total"] = sum(d[k] for k in ERROR_KEYS)
        d["epoch"] = self.epoch
        return d

    # -- epochs and resuming
    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Make the next iteration read epoch ``epoch``, starting after ``skip_batches`` batches."""
        self.epoch = int(epoch)
        self._skip = max(0, int(skip_batches))
        self._batch_in_epoch = self._skip

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self._batch_in_epoch, "seed": self._stream.seed,
                "num_workers": self.num_workers, "world_size": self.world_size,
                "batch_size": self.batch_size}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("num_workers", "world_size", "batch_size"):
            if k in sd and sd[k] != getattr(self, k):
                log.warning("zsprob.data: resuming with %s=%s (saved with %s): the data order "
                            "will not be identical", k, getattr(self, k), sd[k])
        self.set_epoch(sd["epoch"], sd.get("batch", 0))

    # -- iteration
    def _dataloader(self):
        """The one DataLoader of this loader, made at the first iteration and kept across epochs (remade
        only when its settings changed)."""
        config = (self.num_workers, bool(self.pin_memory), self.prefetch_factor, self.timeout)
        if self._loader is not None and self._loader_config == config:
            return self._loader
        self._stream.num_workers = self.num_workers
        kw: dict[str, Any] = dict(batch_size=None, shuffle=False, num_workers=self.num_workers,
                                  collate_fn=_identity_collate, pin_memory=bool(self.pin_memory),
                                  generator=loader_generator(self._stream.seed, self.epoch))
        if self.num_workers > 0:
            kw["timeout"] = self.timeout
            kw["persistent_workers"] = True
            kw["worker_init_fn"] = leave_stop_signals_to_the_main_process  # the stop is the trainer's to handle
            if self.prefetch_factor is not None:
                kw["prefetch_factor"] = self.prefetch_factor
        self._loader, self._loader_config = wds.WebLoader(self._stream, **kw), config
        self.loaders_made += 1
        return self._loader

    def __iter__(self):
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        loader = self._dataloader()
        self._stream.position.set(epoch, skip)  # before iter(): the workers read it when the epoch starts
        self._batch_in_epoch = skip
        with_keys = self._stream.with_keys
        for item in loader:
            delta = item[-1]
            if delta:
                fatal = delta.pop("__fatal__", None)
                self._stats.update(delta)
                if fatal:
                    raise UserError(fatal)
            if item[0] is None:
                continue
            self._batch_in_epoch += 1
            yield item[:-1] if with_keys else (item[0], item[1])
        self.epoch = epoch + 1
        self._batch_in_epoch = 0


def _dist_info(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    r, w = 0, 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r = int(os.environ.get("RANK", 0))
            w = int(os.environ.get("WORLD_SIZE", 1))
    except Exception:  # pragma: no cover
        pass
    return (int(rank) if rank is not None else r, int(world_size) if world_size is not None else w)


def build_wds_pipeline(shards, options: Optional[ShardPipelineOptions] = None, *,
                       preprocess: Optional[Callable], tokenizer: Optional[Callable], epoch: int = 0,
                       skip_batches: int = 0, **changes) -> WdsLoader:
    """The shard loader (docs/data.md). Keyword ``changes`` replace fields of ``options`` (or of the defaults).
    ``preprocess``: PIL image -> tensor (None: PIL images); ``tokenizer``: list[str] -> LongTensor [B, L],
    once per batch in the worker (None: caption strings). ``epoch`` / ``skip_batches``: where the first
    iteration starts."""
    opts = ShardPipelineOptions.build(options, **changes)
    sources = expand_shards(shards)
    w = parse_weights(opts.weights, len(sources))
    if w is not None and not opts.resampled and len(set(w)) > 1:
        raise UserError("source sampling weights need resampled=True (sampling shards with "
                        "replacement); a plain epoch reads every shard exactly once")
    r, ws = _dist_info(opts.rank, opts.world_size)
    if not 0 <= r < ws:
        raise UserError(f"rank {r} outside world size {ws}")
    urls = [u for s in sources for u in s]
    check_some_exist(urls)
    if not opts.resampled and opts.num_samples is not None and len(urls) < ws * max(1, opts.num_workers):
        raise UserError(f"{len(urls)} shards cannot feed {ws} ranks x {max(1, opts.num_workers)} workers "
                        f"with a fixed epoch length; use fewer workers or resampled=True")
    stream = ShardStream(sources, opts, weights=w, preprocess=preprocess, tokenizer=tokenizer, rank=r,
                         world_size=ws)
    loader = WdsLoader(stream, epoch=epoch, num_workers=opts.num_workers, pin_memory=opts.pin_memory,
                       prefetch_factor=opts.prefetch_factor, timeout=opts.timeout)
    if skip_batches:
        loader.set_epoch(epoch, skip_batches)
    return loader
