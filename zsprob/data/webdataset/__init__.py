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

What zsprob writes itself (this package): the epoch-aware, seeded shard schedule (split
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

Rooms
-----
    shards    shard specs -> URLs per source, the check that some shard exists, weights, opening a shard
    options   ShardPipelineOptions (every option but the shards, the callables and the position)
    counts    STAT_KEYS, the per-worker counters and their warnings, a stalled stream's one line
    samples   tar members grouped into samples per shard; a sample -> caption and RGB image
    seeding   seed mixing, the DataLoader's worker seeds, private seeding around ``preprocess``
    stream    the worker's iterable: schedule -> samples -> shuffle -> batches, skipping and stalls
    loader    WdsLoader (one DataLoader for every epoch, stats, resuming) and build_wds_pipeline
"""
from __future__ import annotations

from zsprob.data.captions import (FLAVOUR_CAPTION_KEYS, SHARD_KINDS, clean_caption,  # noqa: F401 (re-exported)
                                  clean_redcaps_caption)
from zsprob.data.webdataset.counts import STAT_KEYS
from zsprob.data.webdataset.loader import WdsLoader, build_wds_pipeline
from zsprob.data.webdataset.options import DATASET_TYPES, IMAGE_KEYS, ShardPipelineOptions  # noqa: F401
from zsprob.data.webdataset.seeding import loader_base_seed, seed_worker_as_fresh  # noqa: F401 (train.data)
from zsprob.data.webdataset.shards import GOPEN_SCHEMES, expand_shards, open_shard  # noqa: F401

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
