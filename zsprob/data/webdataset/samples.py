"""One shard's tar members grouped into samples, and a sample decoded into (caption, RGB image).

Members are grouped per shard, so a truncated shard cannot leak a half sample into the next one
(open_clip's ``group_by_keys_nothrow`` breaks on webdataset 1.0's end-of-shard markers). webdataset
streams the members; PIL decodes the images. Everything skipped is counted on the worker's ``Counts``.
"""
from __future__ import annotations

import io
import json
import random
from typing import Callable, Iterator, Optional

from webdataset.tariterators import base_plus_ext, tar_file_iterator

from zsprob.data.webdataset.counts import Counts
from zsprob.data.webdataset.options import ShardPipelineOptions
from zsprob.data.webdataset.shards import open_shard, shard_is_missing


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
        self.clean_fn = opts.caption_cleaner()
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
            if isinstance(cap, (list, tuple)):
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

    def image(self, s: dict, counts: Counts):
        """The sample's first image member fully decoded as RGB, or None (counted)."""
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
