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

from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.samples import ERROR_KEYS, STAT_KEYS
from zsprob.data.webdataset.seeding import loader_generator
from zsprob.data.webdataset.shards import check_some_exist, expand_shards, parse_weights
from zsprob.data.webdataset.stream import ShardStream
from zsprob.errors import UserError
from zsprob.utils.signals import leave_stop_signals_to_the_main_process

log = logging.getLogger("zsprob.data")


def _identity_collate(x):
    return x


class WdsLoader:
    """Iterable over the ``(images [B,3,H,W], tokens [B,L])`` batches of one rank (with ``with_keys``, their keys
    too); ``epoch`` is the epoch the next iteration reads, ``num_batches`` the batches per epoch when
    ``num_samples`` fixes them (else None)."""

    def __init__(self, stream: ShardStream, opts: ShardPipelineOptions, *, epoch: int):
        self._stream = stream
        self.epoch = int(epoch)
        self.num_workers = opts.num_workers
        self.pin_memory = opts.pin_memory  # the trainer sets it for its device
        self.batch_size, self.rank, self.world_size = opts.batch_size, stream.rank, stream.world_size
        self.shards = list(stream.urls)
        self.num_shards = len(self.shards)
        self._skip = 0
        self._batch_in_epoch = 0
        self._stats: Counter = Counter({k: 0 for k in STAT_KEYS})
        self._loader = None  # the DataLoader (webdataset's WebLoader), made at the first iteration
        self._loader_config: tuple = ()
        self.loaders_made = 0  # DataLoaders made so far (1 for any number of epochs, unless options changed)
        stream.num_workers = self.num_workers
        pw = stream.batches_per_worker()
        self.num_batches = pw * max(1, self.num_workers) if pw is not None else None
        self.num_samples = self.num_batches * self.batch_size if self.num_batches is not None else None

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("this WdsLoader has no fixed length (give num_samples=...)")
        return self.num_batches

    def stats(self) -> dict[str, int]:
        """Counts since construction (this rank, all its workers): good samples, batches, and
        every kind of skipped item (see ``STAT_KEYS``); plus ``skipped_total`` and ``epoch``."""
        d = {k: int(self._stats[k]) for k in STAT_KEYS}
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
        return {"epoch": self.epoch, "batch": self._batch_in_epoch, "seed": self._stream.opts.seed,
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
        only when ``num_workers`` or ``pin_memory`` changed)."""
        opts = self._stream.opts
        config = (self.num_workers, bool(self.pin_memory))
        if self._loader is not None and self._loader_config == config:
            return self._loader
        self._stream.num_workers = self.num_workers
        kw: dict[str, Any] = dict(batch_size=None, shuffle=False, num_workers=self.num_workers,
                                  collate_fn=_identity_collate, pin_memory=bool(self.pin_memory),
                                  generator=loader_generator(opts.seed, self.epoch))
        if self.num_workers > 0:
            kw["timeout"] = opts.timeout
            kw["persistent_workers"] = True
            kw["worker_init_fn"] = leave_stop_signals_to_the_main_process  # the stop is the trainer's to handle
            if opts.prefetch_factor is not None:
                kw["prefetch_factor"] = opts.prefetch_factor
        self._loader, self._loader_config = wds.WebLoader(self._stream, **kw), config
        self.loaders_made += 1
        return self._loader

    def __iter__(self):
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        loader = self._dataloader()
        self._stream.position.set(epoch, skip)  # before iter(): the workers read it when the epoch starts
        self._batch_in_epoch = skip
        width = 3 if self._stream.opts.with_keys else 2
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
            yield item[:width]
        self.epoch = epoch + 1
        self._batch_in_epoch = 0


def _dist_info(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world size): the options', else torch.distributed's, else the RANK / WORLD_SIZE environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
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
    loader = WdsLoader(stream, opts, epoch=epoch)
    loader.set_epoch(epoch, skip_batches)
    return loader
