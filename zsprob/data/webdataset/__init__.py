"""WebDataset image-text shards (RedCaps, img2dataset output, SynthWorld's pretraining shards): one
:func:`build_wds_pipeline` call with one :class:`ShardPipelineOptions` gives a :class:`WdsLoader`.

webdataset expands patterns, streams tar members, shuffles and runs the workers; fsspec opens other URLs
(:mod:`zsprob.utils.remote`). zsprob writes the seeded shard schedule per epoch, rank and worker, skip counts,
caption cleaning, per-sample seeding, batched tokenisation and exact resumption (semantics: docs/data.md).
Modules: ``shards``, ``options``, ``samples``, ``seeding``, ``stream`` (a worker's iterable), ``loader``."""
from __future__ import annotations

from zsprob.data.captions import clean_caption, clean_redcaps_caption
from zsprob.data.webdataset.loader import WdsLoader, build_wds_pipeline
from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.samples import STAT_KEYS
from zsprob.data.webdataset.seeding import loader_base_seed, seed_worker_as_fresh
from zsprob.data.webdataset.shards import expand_shards

__all__ = ["build_wds_pipeline", "ShardPipelineOptions", "WdsLoader", "expand_shards", "clean_caption",
           "clean_redcaps_caption", "STAT_KEYS", "loader_base_seed", "seed_worker_as_fresh"]
