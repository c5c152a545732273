"""Caption cleaning for image-text shards: the generic rules and RedCaps' (Reddit post titles), both
idempotent; Python's ``re`` and ``unicodedata`` do the work. Imports nothing from zsprob, so the command
line reads the shard flavours without importing torch.
"""
from __future__ import annotations

import re
import unicodedata

__all__ = ["clean_caption", "clean_redcaps_caption", "FLAVOUR_CAPTION_KEYS", "SHARD_KINDS"]

# the caption member each shard flavour (`zsprob pretrain --data`) reads unless a recipe / --set names another
FLAVOUR_CAPTION_KEYS = {"webdataset": "txt", "redcaps": "txt", "synthetic": "json:captions"}
# the data.kind values read from WebDataset shards (the rest, coco, from a dataset folder)
SHARD_KINDS = tuple(FLAVOUR_CAPTION_KEYS)

_WS = re.compile(r"\s+")
# bracketed tags: [OC], [oc], [1920x1080], [x-post r/pics], [itap], (OC), (x-post ...), (1920 x 1080)
_BRACKET_TAG = re.compile(r"\[[^\[\]]{0,60}\]|\{[^{}]{0,60}\}")
_PAREN_TAG = re.compile(
    r"\(\s*(?:oc|o\.c\.|x-?post[^()]*|xpost[^()]*|crosspost[^()]*|\d{3,5}\s*[x×]\s*\d{3,5}|"
    r"more in comments?|album in comments?|via [^()]*|source[^()]*|self)\s*\)", re.IGNORECASE)
_RESOLUTION = re.compile(r"\b\d{3,5}\s*[x×]\s*\d{3,5}\b")
_ITAP = re.compile(r"^\s*(?:i\s+took\s+a\s+(?:picture|photo|pic)\s+of|itapo?\s+of|itap:?|itapot)\b[\s:,\-]*",
                   re.IGNORECASE)
_XPOST = re.compile(r"\b(?:x-?post(?:ed)?|crosspost(?:ed)?)\s+(?:from\s+)?(?:/?r/\w+)?", re.IGNORECASE)
_USER_SUB = re.compile(r"(?<!\w)/?[ur]/[A-Za-z0-9_\-]+")
_OC_EDGE = re.compile(r"^\s*oc\b[\s:\-]*|[\s\-]*\boc\s*$", re.IGNORECASE)
_EDGE_PUNCT = re.compile(r"^[\s\-:;,|/]+|[\s\-:;,|/]+$")


def _is_emoji(ch: str) -> bool:
    cp = ord(ch)
    if 0x1F000 <= cp <= 0x1FAFF or 0x2600 <= cp <= 0x27BF or 0x1F900 <= cp <= 0x1F9FF:
        return True
    if cp in (0x200D, 0x20E3) or 0xFE00 <= cp <= 0xFE0F or 0xE0020 <= cp <= 0xE007F:
        return True  # ZWJ, keycap, variation selectors, tag characters
    cat = unicodedata.category(ch)
    return cat in ("So", "Cs", "Co")


# control and format characters (C0/C1 controls, zero-width spaces, bidi marks, BOM), not ZWJ
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u200b\u200c\u200e\u200f\u2028-\u202e\u2060-\u2064\ufeff]")


def clean_caption(text: str) -> str:
    """Generic cleaning: Unicode NFC, control / zero-width characters -> space, collapse whitespace, strip."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return _WS.sub(" ", _CONTROL.sub(" ", text)).strip()


def clean_redcaps_caption(text: str, *, keep_emoji: bool = False) -> str:
    """A RedCaps caption (a Reddit post title) cleaned: :func:`clean_caption`, then tags (``[OC]``,
    ``(x-post ...)``, resolutions), ``u/`` / ``r/`` mentions, a leading "itap of" and an edge "OC" dropped,
    and emoji removed unless ``keep_emoji`` (RedCaps' published captions have none; CLIP's BPE would make
    them rare byte tokens). Case is kept; may return "" (the sample is skipped)."""
    t = clean_caption(text)
    if not keep_emoji:
        t = "".join(" " if _is_emoji(c) else c for c in t)
    t = _BRACKET_TAG.sub(" ", t)
    t = _PAREN_TAG.sub(" ", t)
    t = _XPOST.sub(" ", t)
    t = _USER_SUB.sub(" ", t)
    t = _RESOLUTION.sub(" ", t)
    t = _WS.sub(" ", t).strip()
    for _ in range(2):
        t = _ITAP.sub("", t)
        t = _OC_EDGE.sub("", t)
        t = _EDGE_PUNCT.sub("", t)
    t = re.sub(r"\(\s*\)", " ", t)
    return _WS.sub(" ", t).strip()
