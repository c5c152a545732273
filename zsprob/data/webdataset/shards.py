"""Shard specs to URLs (``::`` sources, brace patterns, local or fsspec directories), the check that some
shard exists, per-source weights, and opening one shard as a byte stream. webdataset expands patterns
and opens ``pipe:`` commands; fsspec lists, probes and opens other URLs (:mod:`zsprob.utils.remote`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

from webdataset.gopen import gopen, gopen_schemes
from webdataset.shardlists import expand_urls

from zsprob.errors import UserError
from zsprob.utils import remote


def _split_sources(shards: Union[str, os.PathLike, Sequence]) -> list[str]:
    items = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
    if any(isinstance(item, (tuple, list)) for item in items):
        raise UserError("give weights with the weights= argument, not as (pattern, weight) pairs")
    return [p for item in items for p in str(item).split("::") if p.strip()]


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


def shard_is_missing(url: str) -> bool:
    """A local shard that does not exist (a URL or a command is found out only by reading it)."""
    return remote.is_local(url) and not os.path.isfile(remote.local_path(url))


def check_some_exist(urls: list[str]) -> None:
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


def parse_weights(weights, n_sources: int) -> Optional[list[float]]:
    """One sampling weight per source (``"1::3"`` or a list), or None; a malformed list is a UserError."""
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
