"""The shard pipeline's options: one frozen :class:`ShardPipelineOptions`, checked once and handed down
unchanged to the stream of every epoch, and the caption cleaner its ``dataset_type`` picks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Sequence

from zsprob.data.captions import SHARD_KINDS, clean_caption, clean_redcaps_caption
from zsprob.errors import UserError

DATASET_TYPES = SHARD_KINDS
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


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
