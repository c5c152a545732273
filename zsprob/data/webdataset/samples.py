"""One shard's tar members grouped into samples, a sample decoded into (caption, RGB image), and the
counts of everything a worker skips (they travel with its batches; the first few of a kind are logged).

Members are grouped per shard, so a truncated shard cannot leak a half sample into the next one
(open_clip's ``group_by_keys_nothrow`` breaks on webdataset 1.0's end-of-shard markers). webdataset
streams the members; PIL decodes the images.
"""
from __future__ import annotations

import json
import logging
import random
from collections import Counter
from functools import partial
from typing import Callable, Iterator, Optional

from webdataset.tariterators import base_plus_ext, tar_file_iterator

from zsprob.data.captions import clean_caption, clean_redcaps_caption
from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.shards import open_shard, shard_is_missing

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
    """One worker's counters since its last batch (``delta``) and in all (``seen``), with rate-limited warnings."""

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

    def stall_message(self, run: int, limit: int) -> str:
        """The one-line error of a stream that skipped ``run`` samples in a row (``limit`` allowed), with
        this worker's counts by reason."""
        reasons = ", ".join(f"{k} {v}" for k, v in self.seen.most_common()) or "none counted"
        return (f"the shard stream skipped {run} samples in a row on {self.where} and made no progress "
                f"(reasons: {reasons}); check the shards, data.pipeline.caption_key and the image preprocessing "
                f"(data.pipeline.max_consecutive_skips={limit} sets the limit)")


def read_shard(url: str, counts: Counts, complete: Callable[[dict], bool]) -> Iterator[dict]:
    """The samples of one shard as ``{"__key__", "__url__", EXT: bytes, ...}`` (``"__bad__"`` on a
    duplicate member); a shard that breaks off ends without the half sample at the cut (one that is
    not ``complete``)."""
    if shard_is_missing(url):
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
        failed = True  # nothing readable at all: as good as missing; else it broke off in the middle
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
        if failed and not complete(current):
            return  # half a sample at the cut: part of the truncation already counted
        yield current


class SampleDecoder:
    """A grouped sample -> its caption (cleaned, drawn from a list, subreddit prepended) and its image,
    as the options' ``caption_key``, ``image_keys``, cleaning and ``prepend_subreddit`` say."""

    def __init__(self, opts: ShardPipelineOptions):
        self.caption_key = opts.caption_key
        self.image_keys = tuple(opts.image_keys)
        self.clean_fn = opts.clean or clean_caption
        if opts.clean is None and opts.dataset_type == "redcaps":
            self.clean_fn = partial(clean_redcaps_caption, keep_emoji=opts.keep_emoji)
        self.prepend_subreddit = bool(opts.prepend_subreddit)

    def complete(self, s: dict) -> bool:
        """Whether ``s`` has an image member and its caption member (the test for a sample at a cut)."""
        cap = self.caption_key.split(":", 1)[0]
        return any(k in s for k in self.image_keys) and cap in s

    def caption(self, s: dict, seed: int, counts: Counts) -> Optional[str]:
        """The sample's caption, or None (counted); ``seed`` draws one caption from a list."""
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
            if isinstance(cap, (list, tuple)):  # strings or records with a "text" / "caption" field
                texts = [(c.get("text") or c.get("caption")) if isinstance(c, dict) else c for c in cap]
                texts = [c for c in texts if isinstance(c, str)]
                cap = random.Random(seed).choice(texts) if texts else None
            if not isinstance(cap, str):
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

    def image(self, s: dict, counts: Counts):
        """The sample's first image member fully decoded as RGB, or None (counted)."""
        from zsprob.data.images import open_rgb

        for k in self.image_keys:
            if k in s:
                try:  # full decode here, so a corrupt or truncated file fails now
                    return open_rgb(s[k], f"{s['__key__']}.{k}")
                except Exception as e:
                    counts.bad("bad_image", f"{s['__key__']}.{k}: {type(e).__name__}: {e}")
                    return None
        counts.bad("missing_image", f"{s['__key__']}: no {'/'.join(self.image_keys)} member")
        return None
