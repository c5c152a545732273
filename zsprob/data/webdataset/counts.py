"""What the shard pipeline counts: every kind of skipped item, the per-worker counters that travel with
the batches, their rate-limited warnings, and the one line a stalled stream ends with.
"""
from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("zsprob.data")

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
#: the counters of skipped things (their sum is ``skipped_total``)
ERROR_KEYS = tuple(k for k in STAT_KEYS if k not in ("samples", "batches", "skipped_batches",
                                                     "shards_opened", "dropped_partial"))


class Counts:
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


def stall_message(counts: Counts, run: int, limit: int) -> str:
    """The one-line error of a stream that skipped ``run`` samples in a row (``limit`` allowed), with the
    counts of this worker by reason."""
    reasons = ", ".join(f"{k} {v}" for k, v in counts.seen.most_common()) or "none counted"
    return (f"the shard stream skipped {run} samples in a row on {counts.where} and made no progress "
            f"(reasons: {reasons}); check the shards, data.pipeline.caption_key and the image preprocessing "
            f"(data.pipeline.max_consecutive_skips={limit} sets the limit)")
