"""The shard pipeline's options: one frozen :class:`ShardPipelineOptions`, checked once where it is built
and handed down unchanged to the stream of every epoch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Sequence

from zsprob.data.captions import SHARD_KINDS
from zsprob.errors import UserError


@dataclass(frozen=True)
class ShardPipelineOptions:
    """Every option of the shard pipeline but the shards, the two callables and the position (docs/data.md).
    ``clean`` overrides the caption cleaning of ``dataset_type``; ``rank`` / ``world_size`` default to
    ``torch.distributed``, else the ``RANK`` / ``WORLD_SIZE`` environment."""

    batch_size: int
    seed: int = 0
    resampled: bool = False
    weights: Any = None
    shuffle: bool = True
    shuffle_buffer: int = 2000
    shuffle_initial: int = 500
    num_workers: int = 0
    caption_key: str = "txt"
    image_keys: Sequence[str] = ("jpg", "jpeg", "png", "webp")
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
    def build(cls, base: Optional["ShardPipelineOptions"] = None, **changes) -> "ShardPipelineOptions":
        """``base`` (or the defaults) with ``changes``, checked; an unknown option is a UserError."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise UserError(f"unknown shard pipeline option(s) {', '.join(unknown)} "
                            f"(data.pipeline); known: {', '.join(names)}")
        opts = cls(**changes) if base is None else replace(base, **changes)
        if opts.dataset_type not in SHARD_KINDS:
            raise UserError(f"unknown dataset type {opts.dataset_type!r}; choose one of {', '.join(SHARD_KINDS)}")
        if opts.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {opts.batch_size}")
        if opts.num_workers < 0:
            raise UserError(f"num_workers must be >= 0, got {opts.num_workers}")
        if not isinstance(opts.max_consecutive_skips, int) or opts.max_consecutive_skips < 1:
            raise UserError(f"max_consecutive_skips must be an integer >= 1, got {opts.max_consecutive_skips!r}")
        if opts.num_samples is not None and opts.num_samples < 1:
            raise UserError(f"num_samples must be >= 1, got {opts.num_samples}")
        return opts
