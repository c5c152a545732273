"""WebDataset image-text shards: RedCaps, any img2dataset output, SynthWorld pretraining shards.

Layout read: tar shards whose members are grouped by key, ``KEY.jpg`` (or ``.jpeg``, ``.png``,
``.webp``), ``KEY.txt`` (the caption) and optionally ``KEY.json`` (metadata; img2dataset
writes it, RedCaps' subreddit lives there, SynthWorld writes all captions and ground truth).

What the ``webdataset`` library (1.0.x) does here: shard-pattern expansion (brace patterns,
``::`` separated sources, ``WDS_`` environment variables: :func:`webdataset.shardlists.expand_urls`),
opening ``pipe:`` commands, and URLs whose fsspec backend is not installed but that webdataset
reads with a command-line tool (``https://`` with curl, ``gs://`` with gsutil: :func:`webdataset.gopen.gopen`), streaming
tar members (:func:`webdataset.tariterators.tar_file_iterator`), key/extension splitting
(:func:`webdataset.tariterators.base_plus_ext`), the sample shuffle buffer
(:func:`webdataset.filters.shuffle`), pipeline composition (:class:`webdataset.DataPipeline`) and
the worker loader (:class:`webdataset.WebLoader`, a ``torch.utils.data.DataLoader``). fsspec opens,
lists and probes every other URL (``s3://``, ``gs://``, ``https://``, ``hf://``, ``memory://``,
``file://``; :mod:`zsprob.utils.remote`).

What zsprob writes itself (this file): the epoch-aware, seeded shard schedule (split
by node and worker, or resampled with per-source weights), grouping members into samples per
shard (so a truncated shard cannot leak a half sample into the next one; open_clip's own
``group_by_keys_nothrow`` breaks on webdataset 1.0's end-of-shard markers), error accounting
(every skipped thing is counted by kind and the counts travel with the batches from the
worker processes to :meth:`WdsLoader.stats`), caption cleaning (:mod:`zsprob.data.captions`), per-sample
seeding of augmentations, batched tokenisation in the workers, exact resumption, and one DataLoader
for every epoch of a :class:`WdsLoader`: its workers are persistent (torch's ``persistent_workers``),
learn each epoch's position (epoch, batches to skip) from shared memory when the epoch starts (as
open_clip's SharedEpoch passes the epoch), and re-seed their global generators as torch seeds the
workers of a DataLoader made for that epoch, so the batches are those of a loader built per epoch.

Semantics in one place
----------------------
* ``shards``: a pattern string (``"/data/redcaps/{00000..00999}.tar"``), several sources
  joined by ``::`` or given as a list, or a local directory (all ``*.tar`` in it, sorted; a
  SynthWorld output directory means its ``pretrain/`` folder). Each source may be a local path, a
  ``file://`` URL, a ``pipe:COMMAND`` (its stdout is the shard; braces expand inside the command) or
  an fsspec URL (``s3://bucket/{000..099}.tar``); a directory URL without braces is listed
  (``*.tar`` in it) through fsspec. An unknown scheme, or one whose fsspec backend (s3fs, gcsfs)
  is not installed and that webdataset cannot read either, is a UserError when the pipeline is
  built. The check that the shards exist covers local paths (all) and fsspec URLs (a few, spread
  over the list); ``pipe:`` commands fail at read time and are counted as ``missing_shard``.
  All options but the shards, callables and position live in one :class:`ShardPipelineOptions`.
* ``resampled=False`` (default): each epoch every shard is read exactly once. The shard list
  is permuted with ``(seed, epoch)`` (identical on every rank), split ``shards[rank::world]``
  and then ``[worker::num_workers]``. Rank / world size come from the arguments, else
  ``torch.distributed`` if initialised, else the ``RANK`` / ``WORLD_SIZE`` environment.
  Without ``num_samples`` one epoch = one pass; every good sample is yielded exactly once
  (the last batch of each worker may be partial unless ``drop_last``). With ``num_samples``
  (global samples per epoch) every worker yields exactly
  ``ceil(num_samples / (batch_size * world_size * workers))`` full batches, re-reading its
  shards in a new order if it runs out (open_clip's "roll over" rule), so all ranks see the
  same number of steps (needed for DDP).
* ``resampled=True`` (open_clip's convention for many GPUs): every worker draws shards with
  replacement from an RNG seeded by ``(seed, epoch, rank, worker)``; with ``weights`` (one
  per source, ``"1::3"`` or a list) it first draws a source with those probabilities, then a
  shard of that source uniformly. (open_clip's upsampling factors weight each *shard*; here
  a weight is the probability of the *source*.) ``num_samples`` bounds the epoch as above;
  without it the stream is infinite. Weights need ``resampled=True``.
* Shuffle: a sample buffer (``shuffle_buffer``) seeded by ``(seed, epoch, rank, worker)``.
  ``shuffle=False`` reads shards in order with no buffer (evaluation).
* Per-sample randomness (augmentation, choice of a caption from a list) is seeded by
  ``(seed, epoch, rank, worker, position in the worker's stream)``: the torch default
  generator and Python's ``random`` are re-seeded around each ``preprocess`` call and restored
  afterwards, so the loader never disturbs the caller's RNG and results are reproducible.
* ``dataset_type``: ``"webdataset"`` (whitespace cleaning only), ``"redcaps"`` (RedCaps
  cleaning, :func:`clean_redcaps_caption`, and ``prepend_subreddit`` -> ``"<subreddit>: caption"``
  from ``KEY.json``), ``"synthetic"`` (SynthWorld shards; whitespace cleaning). ``caption_key``
  is a member extension (``"txt"``) or ``"json:FIELD"``; if the field holds a list (of
  strings, or of dicts with a ``"text"`` or ``"caption"`` field), one element is drawn per
  sample (e.g. ``"json:captions"`` for all five SynthWorld captions).
* Bad data never stops training: an undecodable image, a missing image, a missing / empty /
  undecodable caption, a transform that raises, an unreadable or missing shard, a truncated
  tar: the item is skipped, a warning is logged (logger ``zsprob.data``; the first few of each
  kind per worker, then every 1000th) and it is counted. :meth:`WdsLoader.stats` returns the
  counts of this process, aggregated over its DataLoader workers (the workers send their
  counts along with each batch; no shared memory). Only a stream that makes no progress stops:
  ``max_consecutive_skips`` samples in a row skipped (a caption key no sample has, a transform
  that always fails) is one :class:`zsprob.UserError` line with the counts by reason, raised in
  the main process (a worker sends it with its counts).

Resuming (what is exact)
------------------------
``loader.state_dict()`` is ``{"epoch": e, "batch": k}`` (batches handed out so far in epoch
e). ``loader.load_state_dict(sd)`` (or ``set_epoch(e, skip_batches=k)``) makes the next
iteration start at batch k of epoch e. The workers skip their share of the first k batches
before preprocessing (they still decode the skipped images, which is how they know which
samples are bad) and send cheap placeholders, so the DataLoader's round-robin order is kept.
The resumed stream is batch-for-batch identical to an uninterrupted run, augmentations
included, given the same shards, seed, batch size, num_workers, world size and
``dataset_type`` options, and provided that k lies before the point where the first worker
runs out of data: always so with ``num_samples`` or ``resampled`` (all workers yield equally
many batches); in a plain one-pass epoch the last few batches after a worker ran dry may be
ordered differently. A transform that raises on a decodable image counts as bad in a normal
pass but not while skipping (it is not run); this is the one other way to lose exactness.
Starting a new epoch at batch 0 is always exact. ``set_epoch`` / ``load_state_dict`` on a loader that
already ran reuse its workers: an epoch left midway is dropped (torch drains what its workers had
prefetched) and the next one starts as in a fresh loader.
"""
from __future__ import annotations

import io
import json
import logging
import math
import multiprocessing
import os
import random
from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

import webdataset as wds
from webdataset.gopen import gopen, gopen_schemes
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext, tar_file_iterator

from zsprob.data.captions import (FLAVOUR_CAPTION_KEYS, SHARD_KINDS, clean_caption,  # noqa: F401 (re-exported)
                                  clean_redcaps_caption)
from zsprob.errors import UserError
from zsprob.utils import remote

__all__ = [
    "build_wds_pipeline",
    "ShardPipelineOptions",
    "WdsLoader",
    "expand_shards",
    "clean_caption",
    "clean_redcaps_caption",
    "STAT_KEYS",
    "DATASET_TYPES",
]

log = logging.getLogger("zsprob.data")

DATASET_TYPES = SHARD_KINDS
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")

# every counter the loader reports (all start at 0)
STAT_KEYS = (
    "samples",            # good samples put into batches
    "batches",            # batches handed out (not counting skipped ones)
    "skipped_batches",    # batches skipped on resume
    "shards_opened",      # shard files/streams opened (a shard read twice counts twice)
    "missing_shard",      # shard missing, unopenable, or without one readable member (bad URL)
    "truncated_shard",    # tar stream broke off after some members (truncated / corrupt tar)
    "bad_image",          # image bytes PIL cannot decode
    "missing_image",      # no jpg/jpeg/png/webp member
    "missing_caption",    # no caption member / json field
    "empty_caption",      # caption empty after cleaning
    "bad_caption",        # caption bytes not UTF-8, json not parseable
    "bad_sample",         # malformed group (e.g. duplicate member names)
    "transform_error",    # preprocess raised
    "dropped_partial",    # good samples in a final partial batch dropped by drop_last
)
_ERROR_KEYS = tuple(k for k in STAT_KEYS if k not in ("samples", "batches", "skipped_batches",
                                                      "shards_opened", "dropped_partial"))


# --------------------------------------------------------------------------- shard lists

def _split_sources(shards: Union[str, os.PathLike, Sequence]) -> list[str]:
    if isinstance(shards, (str, os.PathLike)):
        s = str(shards)
        return [p for p in s.split("::") if p.strip()]
    out: list[str] = []
    for item in shards:
        if isinstance(item, (tuple, list)):
            raise UserError("give weights with the weights= argument, not as (pattern, weight) pairs")
        out.extend(p for p in str(item).split("::") if p.strip())
    return out


#: schemes webdataset's gopen opens itself (curl, gsutil, ...) when fsspec's backend is not installed
GOPEN_SCHEMES = tuple(k for k in gopen_schemes if not k.startswith("_"))


def _expand_dir(source: str) -> Optional[list[str]]:
    """The shards of a directory (local or fsspec URL; a SynthWorld output means its ``pretrain/``),
    or None when ``source`` is not a directory."""
    if remote.is_local(source):
        p = Path(remote.local_path(source))
        if not p.is_dir():
            return None
        if (p / "pretrain").is_dir() and not list(p.glob("*.tar")):
            p = p / "pretrain"  # a SynthWorld output directory
        tars = sorted(str(x) for x in p.glob("*.tar"))
        if not tars:
            raise UserError(f"no *.tar shards in directory {p}")
        return tars
    if any(c in source for c in "{}") or source.endswith(".tar") or remote.fsspec_problem(remote.scheme_of(source)):
        return None  # a pattern, one shard, or a URL only webdataset's gopen reads: nothing to list
    fs, path = remote.url_fs(source)
    try:
        is_dir = fs.isdir(path)
    except Exception as e:  # network, credentials: say so in one line
        raise UserError(f"cannot list shards at {source}: {type(e).__name__}: {e}") from None
    if not is_dir:
        return None
    tars = remote.list_tars(source) or remote.list_tars(remote.join(source, "pretrain"))
    if not tars:
        raise UserError(f"no *.tar shards in {source}")
    return tars


def _expand_one(source: str) -> list[str]:
    remote.check_url(source, "shards", fallback=GOPEN_SCHEMES)
    if remote.scheme_of(source) == "pipe":
        return list(expand_urls(source))
    return _expand_dir(source) or list(expand_urls(source))


def expand_shards(shards) -> list[list[str]]:
    """Expand a shard spec into one list of URLs per source (brace patterns, ``::``, directories,
    local or fsspec URLs); an unknown URL scheme is a UserError."""
    sources = _split_sources(shards)
    if not sources:
        raise UserError("no shards given (expected a pattern like 'dir/{000000..000099}.tar')")
    return [_expand_one(s) for s in sources]


def open_shard(url: str):
    """A binary stream of one shard: local files and fsspec URLs through open / fsspec, ``pipe:``
    commands and the schemes only webdataset handles here through webdataset's ``gopen``."""
    if remote.is_local(url):
        return open(remote.local_path(url), "rb")
    scheme = remote.scheme_of(url)
    if scheme != "pipe" and remote.fsspec_problem(scheme) is None:
        return remote.open_url(url, "rb")
    return gopen(url, "rb")


def _check_some_exist(urls: list[str]) -> None:
    """UserError when none of the shards exists (local: all checked; fsspec URLs: up to 8 spread over
    the list, when the file system answers; ``pipe:`` commands cannot be checked)."""
    local = [u for u in urls if remote.is_local(u)]
    if local and len(local) == len(urls):
        if not any(os.path.isfile(remote.local_path(u)) for u in local):
            raise UserError(f"none of the {len(urls)} shards exists (first: {urls[0]}); check the --shards pattern")
        return
    far = [u for u in urls if remote.scheme_of(u) not in ("", "file", "pipe")
           and remote.fsspec_problem(remote.scheme_of(u)) is None]
    if not far or len(far) != len(urls):
        return
    probe = far[:: max(1, len(far) // 8)][:8]
    try:
        found = any(fs.exists(path) for fs, path in (remote.url_fs(u) for u in probe))
    except Exception:  # no answer (credentials, network): the readers count missing shards instead
        return
    if not found:
        raise UserError(f"none of {len(probe)} shards probed exists (first: {urls[0]}); check the --shards pattern")


def _parse_weights(weights, n_sources: int) -> Optional[list[float]]:
    if weights is None:
        return None
    if isinstance(weights, str):
        parts = [w for w in weights.split("::") if w.strip()]
    else:
        parts = list(weights)
    try:
        w = [float(x) for x in parts]
    except ValueError:
        raise UserError(f"shard weights must be numbers, got {weights!r}") from None
    if len(w) != n_sources:
        raise UserError(f"{len(w)} weights given for {n_sources} shard sources")
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise UserError(f"shard weights must be >= 0 with a positive sum, got {w}")
    return w


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


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0]
               & 0x7FFFFFFFFFFFFFFF)


# --------------------------------------------------------------------------- options

@dataclass(frozen=True)
class ShardPipelineOptions:
    """Every option of the shard pipeline except the shards, the two callables and the position in the
    stream: built once (from a training config by :func:`zsprob.train.data.shard_options`, or by hand)
    and handed down unchanged to the stream of each epoch. The module docstring gives the semantics.

    ``clean`` overrides the caption cleaning of ``dataset_type``; ``rank`` / ``world_size`` default to
    ``torch.distributed``, else the ``RANK`` / ``WORLD_SIZE`` environment.
    """

    batch_size: int
    seed: int = 0
    resampled: bool = False
    weights: Any = None
    shuffle: bool = True
    shuffle_buffer: int = 2000
    shuffle_initial: int = 500
    num_workers: int = 0
    caption_key: str = "txt"
    image_keys: Sequence[str] = IMAGE_KEYS
    dataset_type: str = "webdataset"
    prepend_subreddit: bool = False
    keep_emoji: bool = False
    clean: Optional[Callable[[str], str]] = None
    num_samples: Optional[int] = None
    drop_last: bool = False
    rank: Optional[int] = None
    world_size: Optional[int] = None
    with_keys: bool = False
    pin_memory: bool = False
    prefetch_factor: Optional[int] = None
    timeout: float = 0
    max_consecutive_skips: int = 10_000  # skipped samples in a row before the stream stops (one UserError line)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def build(cls, base: Optional["ShardPipelineOptions"] = None, **changes) -> "ShardPipelineOptions":
        """``base`` (or the defaults) with ``changes``; an unknown option is a UserError."""
        unknown = sorted(set(changes) - set(cls.names()))
        if unknown:
            raise UserError(f"unknown shard pipeline option(s) {', '.join(unknown)} "
                            f"(data.pipeline); known: {', '.join(cls.names())}")
        if base is None:
            if "batch_size" not in changes:
                raise UserError("the shard pipeline needs a batch_size")
            return cls(**changes).checked()
        return replace(base, **changes).checked()

    def checked(self) -> "ShardPipelineOptions":
        if self.dataset_type not in DATASET_TYPES:
            raise UserError(f"unknown dataset type {self.dataset_type!r}; choose one of {', '.join(DATASET_TYPES)}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_workers < 0:
            raise UserError(f"num_workers must be >= 0, got {self.num_workers}")
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 1:
            raise UserError(f"max_consecutive_skips must be an integer >= 1, got {self.max_consecutive_skips!r}")
        if self.num_samples is not None and self.num_samples < 1:
            raise UserError(f"num_samples must be >= 1, got {self.num_samples}")
        return self

    def caption_cleaner(self) -> Callable[[str], str]:
        if self.clean is not None:
            return self.clean
        if self.dataset_type == "redcaps":
            def clean(t, _k=self.keep_emoji):
                return clean_redcaps_caption(t, keep_emoji=_k)
            return clean
        return clean_caption


# --------------------------------------------------------------------------- worker side

class _Counts:
    """Per-worker counters, plus rate-limited warnings."""

    def __init__(self, worker: int, rank: int):
        self.delta: Counter = Counter()
        self.seen: Counter = Counter()
        self.where = f"rank {rank} worker {worker}"

    def add(self, key: str, n: int = 1) -> None:
        self.delta[key] += n

    def bad(self, key: str, detail: str) -> None:
        self.delta[key] += 1
        self.seen[key] += 1
        c = self.seen[key]
        if c <= 5 or c % 1000 == 0:
            log.warning("zsprob.data: skipped (%s, #%d on %s): %s", key, c, self.where, detail)

    def take(self) -> dict:
        d = dict(self.delta)
        self.delta.clear()
        return d


class _PrivateRNG:
    """Seed torch's default generator and Python's random for one call, then restore them."""

    def __init__(self):
        self.gen = torch.default_generator

    def __call__(self, seed: int, fn: Callable, *args):
        ts = self.gen.get_state()
        ps = random.getstate()
        try:
            self.gen.manual_seed(seed)
            random.seed(seed)
            return fn(*args)
        finally:
            self.gen.set_state(ts)
            random.setstate(ps)


class _BatchBuffer:
    """Collects one batch of images. Tensors are copied into a preallocated [B, ...] tensor as
    they arrive (while still in cache); inside a DataLoader worker that tensor lives in shared
    memory, as torch's default_collate does, so sending the batch to the main process copies
    nothing. Saves the separate torch.stack pass and the copy into shared memory."""

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


class _SharedPosition:
    """The epoch a stream reads and the batches it skips, in shared memory: persistent DataLoader
    workers keep the copy of the stream they were started with, and read each new epoch's position
    from here when the loader starts the epoch (open_clip's SharedEpoch does this for the epoch).
    Pickled while a worker process starts, it stays shared; pickled otherwise (a deep copy), it
    becomes a detached copy of the values."""

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


def _loader_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator a fresh DataLoader for ``epoch`` draws its worker base seed from (a private one:
    creating the iterator must not consume the caller's global RNG)."""
    return torch.Generator().manual_seed(_seed(seed, epoch))


def loader_base_seed(generator: torch.Generator) -> int:
    """The base seed a fresh DataLoader iterator draws from ``generator`` for its workers (torch's draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def seed_worker_as_fresh(base_seed: int, worker: int) -> None:
    """Seed this worker's global generators (random, torch, numpy) exactly as torch seeds worker
    ``worker`` of a fresh DataLoader iterator with ``base_seed``: a persistent worker that calls this
    when a new epoch starts is in the state a newly started one would be in, so a transform or a
    tokenizer drawing from those generators sees the same numbers as with a loader made per epoch."""
    from torch.utils.data._utils.worker import _generate_state  # torch's numpy seeding of workers

    random.seed(base_seed + worker)
    torch.manual_seed(base_seed + worker)
    np.random.seed(_generate_state(base_seed, worker))


class _ShardStream(IterableDataset):
    """The iterable each DataLoader worker runs: shards -> samples -> shuffled -> batches."""

    def __init__(self, sources: list[list[str]], opts: ShardPipelineOptions, *, weights, preprocess, tokenizer,
                 rank: int, world_size: int):
        super().__init__()
        self.sources = sources
        self.urls = [u for s in sources for u in s]
        self.weights = weights
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.batch_size = int(opts.batch_size)
        self.seed = int(opts.seed)
        self.resampled = bool(opts.resampled)
        self.shuffle = bool(opts.shuffle)
        self.shuffle_buffer = int(opts.shuffle_buffer)
        self.shuffle_initial = int(opts.shuffle_initial)
        self.caption_key = opts.caption_key
        self.image_keys = tuple(opts.image_keys)
        self.clean_fn = opts.caption_cleaner()
        self.prepend_subreddit = bool(opts.prepend_subreddit)
        self.num_samples = opts.num_samples
        self.drop_last = bool(opts.drop_last)
        self.rank = rank
        self.world_size = world_size
        self.with_keys = bool(opts.with_keys)
        self.max_skips = int(opts.max_consecutive_skips)
        # set by WdsLoader before each iteration; persistent workers read them from shared memory
        self.position = _SharedPosition()
        self.num_workers = 0  # fixed while a DataLoader's workers live (WdsLoader remakes it on a change)

    @property
    def epoch(self) -> int:
        return self.position.get()[0]

    @property
    def skip_batches(self) -> int:
        return self.position.get()[1]

    # ---- schedule
    def batches_per_worker(self) -> Optional[int]:
        if self.num_samples is None:
            return None
        nw = max(1, self.num_workers)
        return max(1, math.ceil(self.num_samples / (self.batch_size * self.world_size * nw)))

    def assigned_shards(self, worker: int, nw: int, epoch: int) -> list[str]:
        """Shards this (rank, worker) reads in a non-resampled epoch (before repeats)."""
        urls = list(self.urls)
        if self.shuffle:
            random.Random(_seed(self.seed, epoch, 0xA11)).shuffle(urls)
        return urls[self.rank::self.world_size][worker::nw]

    def _shard_iter(self, worker: int, nw: int, epoch: int, repeat: bool) -> Iterator[str]:
        if self.resampled:
            rng = random.Random(_seed(self.seed, epoch, self.rank, worker, 0x5E5))
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
            if self.shuffle:
                random.Random(_seed(self.seed, epoch, self.rank, worker, p, 0xAE7)).shuffle(again)
            yield from again
            p += 1

    # ---- reading
    def _read_shard(self, url: str, counts: _Counts) -> Iterator[dict]:
        if remote.is_local(url) and not os.path.isfile(remote.local_path(url)):
            counts.bad("missing_shard", f"{url} does not exist")
            return
        try:
            stream = open_shard(url)
        except Exception as e:
            counts.bad("missing_shard", f"{url}: {e!r}")
            return
        counts.add("shards_opened")
        current: Optional[dict] = None
        failed = False
        members = 0
        try:
            for f in tar_file_iterator(stream):
                members += 1
                prefix, suffix = base_plus_ext(f["fname"])
                if prefix is None:
                    continue
                suffix = suffix.lower()
                if current is None or current["__key__"] != prefix:
                    if current is not None:
                        yield current
                    current = {"__key__": prefix, "__url__": url}
                if suffix in current:
                    counts.bad("bad_sample", f"duplicate member {f['fname']} in {url}")
                    current["__bad__"] = True
                current[suffix] = f["data"]
        except Exception as e:  # tarfile.ReadError, EOFError, OSError, a failing pipe: ...
            failed = True
            # nothing readable at all (empty / garbage file, a URL that returned nothing):
            # the shard is as good as missing; otherwise it broke off in the middle
            counts.bad("missing_shard" if members == 0 else "truncated_shard",
                       f"{url}: {type(e).__name__}: {e}")
        finally:
            try:
                stream.close()
            except Exception as e:  # e.g. a pipe: command exiting with an error status
                if not failed:
                    failed = True
                    counts.bad("missing_shard" if members == 0 else "truncated_shard", f"{url}: {e!r}")
        if current is not None:
            if failed and not self._complete(current):
                return  # half a sample at the cut: part of the truncation already counted
            yield current

    def _complete(self, s: dict) -> bool:
        cap = self.caption_key.split(":", 1)[0]
        return any(k in s for k in self.image_keys) and cap in s

    def _samples(self, shard_urls: Iterable[str], counts: _Counts) -> Iterator[dict]:
        # repeating / resampled shard streams are endless: stop when shard after shard gives
        # nothing (every shard missing or broken) instead of spinning forever
        limit = 10 * len(self.urls) + 10
        empty = 0
        for url in shard_urls:
            n = 0
            for sample in self._read_shard(url, counts):
                n += 1
                yield sample
            empty = 0 if n else empty + 1
            if empty >= limit:
                log.warning("zsprob.data: %s: %d shards in a row had no readable sample; "
                            "this worker stops", counts.where, empty)
                return

    # ---- decoding
    def _caption(self, s: dict, seed: int, counts: _Counts) -> Optional[str]:
        key = self.caption_key
        meta = None
        if key.startswith("json:"):
            field = key[5:]
            if "json" not in s:
                counts.bad("missing_caption", f"{s['__key__']}: no json member")
                return None
            try:
                meta = json.loads(s["json"])
            except Exception as e:
                counts.bad("bad_caption", f"{s['__key__']}.json: {e}")
                return None
            cap = meta.get(field) if isinstance(meta, dict) else None
            if isinstance(cap, (list, tuple)):
                # strings, or dicts with a "text" / "caption" field (SynthWorld's caption records)
                cap = [c if isinstance(c, str) else (c.get("text") or c.get("caption"))
                       if isinstance(c, dict) else None for c in cap]
                cap = [c for c in cap if isinstance(c, str)]
                cap = random.Random(seed).choice(cap) if cap else None
            if cap is None or not isinstance(cap, str):
                counts.bad("missing_caption", f"{s['__key__']}: json has no {field!r}")
                return None
        else:
            if key not in s:
                counts.bad("missing_caption", f"{s['__key__']}: no .{key} member")
                return None
            try:
                cap = s[key].decode("utf-8")
            except UnicodeDecodeError as e:
                counts.bad("bad_caption", f"{s['__key__']}.{key}: {e}")
                return None
        cap = self.clean_fn(cap)
        if not cap:
            counts.bad("empty_caption", f"{s['__key__']}: empty caption")
            return None
        if self.prepend_subreddit:
            if meta is None and "json" in s:
                try:
                    meta = json.loads(s["json"])
                except Exception:
                    meta = None
            sub = meta.get("subreddit") if isinstance(meta, dict) else None
            if isinstance(sub, str) and sub.strip():
                cap = f"{sub.strip()}: {cap}"
        return cap

    def _image(self, s: dict, counts: _Counts):
        from PIL import Image

        for k in self.image_keys:
            if k in s:
                try:
                    im = Image.open(io.BytesIO(s[k]))
                    im.load()  # full decode here, so a corrupt or truncated file fails now
                    return im if im.mode == "RGB" else im.convert("RGB")
                except Exception as e:
                    counts.bad("bad_image", f"{s['__key__']}.{k}: {type(e).__name__}: {e}")
                    return None
        counts.bad("missing_image", f"{s['__key__']}: no {'/'.join(self.image_keys)} member")
        return None

    # ---- the worker loop
    def __iter__(self):
        info = get_worker_info()
        worker, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        counts = _Counts(worker, self.rank)
        epoch, k = self.position.get()
        if info is not None:  # a persistent worker starts each epoch as a fresh one would
            seed_worker_as_fresh(loader_base_seed(_loader_generator(self.seed, epoch)), worker)
        per_worker = self.batches_per_worker()
        my_skip = max(0, -(-(k - worker) // nw)) if k > 0 else 0
        shards = self._shard_iter(worker, nw, epoch, repeat=per_worker is not None)
        samples = self._samples(shards, counts)
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(_seed(self.seed, epoch, self.rank, worker, 0x5B0))
            samples = wds.filters._shuffle(samples, self.shuffle_buffer,
                                           min(self.shuffle_initial, self.shuffle_buffer), rng=rng)
        sample_base = _seed(self.seed, epoch, self.rank, worker, 0x5A3)
        private = _PrivateRNG()
        imgs = _BatchBuffer(self.batch_size, shared=info is not None)
        caps: list[str] = []
        keys: list[str] = []
        produced = 0
        last_good = -1  # the index of the last sample put into a batch
        for idx, s in enumerate(samples):
            if per_worker is not None and produced >= per_worker:
                break
            if idx - last_good > self.max_skips:  # nothing usable comes: stop instead of spinning forever
                yield self._fatal(counts, idx - last_good - 1)
                return
            if s.get("__bad__"):
                continue
            skipping = produced < my_skip
            sseed = (sample_base + idx) & 0x7FFFFFFFFFFFFFFF
            cap = self._caption(s, sseed, counts)
            if cap is None:
                continue
            img = self._image(s, counts)
            if img is None:
                continue
            if not skipping:
                try:
                    img = private(sseed, self.preprocess, img) if self.preprocess is not None else img
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
            if len(caps) == self.batch_size:
                counts.add("samples", len(caps))
                if skipping:
                    counts.add("skipped_batches")
                    yield self._placeholder(counts)
                else:
                    yield self._emit(imgs, caps, keys, counts)
                produced += 1
                caps, keys = [], []
        if caps and per_worker is None:
            if self.drop_last or produced < my_skip:
                counts.add("dropped_partial" if self.drop_last else "samples", len(caps))
                if not self.drop_last:
                    counts.add("skipped_batches")
            else:
                counts.add("samples", len(caps))
                yield self._emit(imgs, caps, keys, counts)
        yield self._placeholder(counts)  # flush the last counts

    def _fatal(self, counts: _Counts, run: int):
        """A placeholder carrying the one-line error of a stream that skipped ``run`` samples in a row
        (raised by :class:`WdsLoader` in the main process, so a DataLoader worker reports it as one line)."""
        reasons = ", ".join(f"{k} {v}" for k, v in counts.seen.most_common()) or "none counted"
        msg = (f"the shard stream skipped {run} samples in a row on {counts.where} and made no progress "
               f"(reasons: {reasons}); check the shards, data.pipeline.caption_key and the image preprocessing "
               f"(data.pipeline.max_consecutive_skips={self.max_skips} sets the limit)")
        d = counts.take()
        d["__fatal__"] = msg
        return (None, None, None, d) if self.with_keys else (None, None, d)

    def _placeholder(self, counts: _Counts):
        return (None, None, None, counts.take()) if self.with_keys else (None, None, counts.take())

    def _emit(self, imgs: _BatchBuffer, caps, keys, counts: _Counts):
        counts.add("batches")
        images = imgs.take()  # a tensor, or a list of PIL images with preprocess=None
        tokens = self.tokenizer(caps) if self.tokenizer is not None else list(caps)
        if self.with_keys:
            return images, tokens, list(keys), counts.take()
        return images, tokens, counts.take()


def _identity_collate(x):
    return x


# --------------------------------------------------------------------------- loader

class WdsLoader:
    """Iterable over ``(images [B,3,H,W], tokens [B,L])`` batches of one rank (see module doc).

    Attributes: ``epoch`` (the epoch the next iteration reads), ``num_batches`` (batches per
    epoch on this rank when fixed by ``num_samples``, else None), ``num_shards``,
    ``batch_size``, ``num_workers``, ``rank``, ``world_size``.
    """

    def __init__(self, stream: _ShardStream, *, epoch: int, num_workers: int, pin_memory: bool,
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
        d["skipped_total"] = sum(d[k] for k in _ERROR_KEYS)
        d["epoch"] = self.epoch
        return d

    def reset_stats(self) -> None:
        self._stats = Counter({k: 0 for k in STAT_KEYS})

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
        """The one DataLoader of this loader, made at the first iteration and kept across epochs: with
        workers they are persistent (started once; each epoch's position reaches them through the
        stream's shared memory). Remade only when ``num_workers`` or ``pin_memory`` changed."""
        config = (self.num_workers, bool(self.pin_memory), self.prefetch_factor, self.timeout)
        if self._loader is not None and self._loader_config == config:
            return self._loader
        self._stream.num_workers = self.num_workers
        kw: dict[str, Any] = dict(batch_size=None, shuffle=False, num_workers=self.num_workers,
                                  collate_fn=_identity_collate, pin_memory=bool(self.pin_memory),
                                  generator=_loader_generator(self._stream.seed, self.epoch))
        if self.num_workers > 0:
            kw["timeout"] = self.timeout
            kw["persistent_workers"] = True
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


def build_wds_pipeline(shards, options: Optional[ShardPipelineOptions] = None, *,
                       preprocess: Optional[Callable], tokenizer: Optional[Callable], epoch: int = 0,
                       skip_batches: int = 0, **changes) -> WdsLoader:
    """Build the shard loader; see the module docstring for the exact semantics.

    ``options``: a :class:`ShardPipelineOptions`; keyword ``changes`` name its fields (``batch_size=4,
    num_workers=2``) and replace them (without ``options`` they start from the defaults).
    ``preprocess``: PIL image -> tensor (the model's open_clip transform, optionally with
    :class:`zsprob.data.transforms.SizeAugment`); ``tokenizer``: list[str] -> LongTensor [B, L]
    (called once per batch, in the worker). ``tokenizer=None`` yields caption strings,
    ``preprocess=None`` PIL images. ``with_keys=True`` yields ``(images, tokens, keys)``.
    ``epoch`` / ``skip_batches``: where the first iteration starts.
    """
    opts = ShardPipelineOptions.build(options, **changes)
    sources = expand_shards(shards)
    w = _parse_weights(opts.weights, len(sources))
    if w is not None and not opts.resampled and len(set(w)) > 1:
        raise UserError("source sampling weights need resampled=True (sampling shards with "
                        "replacement); a plain epoch reads every shard exactly once")
    r, ws = _dist_info(opts.rank, opts.world_size)
    if not 0 <= r < ws:
        raise UserError(f"rank {r} outside world size {ws}")
    urls = [u for s in sources for u in s]
    _check_some_exist(urls)
    if not opts.resampled and opts.num_samples is not None and len(urls) < ws * max(1, opts.num_workers):
        raise UserError(f"{len(urls)} shards cannot feed {ws} ranks x {max(1, opts.num_workers)} workers "
                        f"with a fixed epoch length; use fewer workers or resampled=True")
    stream = _ShardStream(sources, opts, weights=w, preprocess=preprocess, tokenizer=tokenizer, rank=r,
                          world_size=ws)
    loader = WdsLoader(stream, epoch=epoch, num_workers=opts.num_workers, pin_memory=opts.pin_memory,
                       prefetch_factor=opts.prefetch_factor, timeout=opts.timeout)
    if skip_batches:
        loader.set_epoch(epoch, skip_batches)
    return loader
