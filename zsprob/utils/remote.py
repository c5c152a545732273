"""Paths that may be URLs: scheme checks with one-line errors, opening and listing through fsspec.

fsspec does the I/O and knows the protocols; zsprob classifies a string (local path, ``file://``,
``pipe:`` command, fsspec URL), words the errors for an unknown scheme or a missing backend, and writes
small files atomically (a temporary name, then ``fs.mv``).
"""
from __future__ import annotations

import os
import re
import uuid
from typing import Iterable
from urllib.parse import urlparse
from urllib.request import url2pathname

from zsprob.errors import UserError, one_line

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

#: what a user reads when a URL names no protocol known here
KNOWN_HINT = ("local paths, file://, pipe:COMMAND, and fsspec protocols (s3://, gs://, https://, "
              "memory://, hf://, ...)")


def scheme_of(url: str | os.PathLike) -> str:
    """``""`` for a local path, ``"pipe"`` for a ``pipe:`` command, else the URL's scheme (lower case)."""
    s = str(url)
    if s.startswith("pipe:"):
        return "pipe"
    m = _SCHEME.match(s)
    return m.group(1).lower() if m else ""


def is_local(url: str | os.PathLike) -> bool:
    """A plain path or a ``file://`` URL."""
    return scheme_of(url) in ("", "file")


def local_path(url: str | os.PathLike) -> str:
    """The file-system path of a local path or ``file://`` URL (``~`` expanded)."""
    s = str(url)
    if scheme_of(s) == "file":
        return url2pathname(urlparse(s).path)
    return os.path.expanduser(s)


def fsspec_problem(scheme: str) -> str | None:
    """None when fsspec can open ``scheme://`` URLs here; else why not ("unknown", or the missing package)."""
    import fsspec
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        return one_line(e) or f"the fsspec backend of {scheme}:// is not installed"
    except ValueError:
        return "unknown"
    return None


def check_url(url: str, what: str, fallback: Iterable[str] = ()) -> str:
    """How ``url`` is opened: ``"local"``, ``"pipe"``, ``"fsspec"`` or ``"fallback"`` (a scheme in
    ``fallback`` that fsspec cannot open here but the caller can). Raises a one-line UserError for an
    unknown scheme or a protocol whose fsspec backend is missing."""
    scheme = scheme_of(url)
    if scheme in ("", "file"):
        return "local"
    if scheme == "pipe":
        return "pipe"
    problem = fsspec_problem(scheme)
    if problem is None:
        return "fsspec"
    if scheme in set(fallback):
        return "fallback"
    if problem == "unknown":
        raise UserError(f"{what}: unknown URL scheme {scheme!r} in {url!r}; use {KNOWN_HINT}")
    raise UserError(f"{what}: cannot read {scheme}:// URLs here: {problem} ({url!r})")


def url_fs(url: str):
    """``(filesystem, path)`` of a URL or local path (fsspec's ``url_to_fs``)."""
    from fsspec.core import url_to_fs
    return url_to_fs(local_path(url) if is_local(url) else url)


def open_url(url: str, mode: str = "rb"):
    """A file object for a local path or an fsspec URL."""
    if is_local(url):
        return open(local_path(url), mode)
    fs, path = url_fs(url)
    return fs.open(path, mode)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for URLs and paths alike (no normalisation of ``//`` after the scheme)."""
    out = str(base).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def list_tars(url: str) -> list[str]:
    """The ``*.tar`` files directly in a directory (path or URL), as full URLs / paths, sorted; [] when none."""
    fs, path = url_fs(url)
    try:
        if not fs.isdir(path):
            return []
        found = sorted(fs.glob(path.rstrip("/") + "/*.tar"))
    except (OSError, ValueError):
        return []
    return found if is_local(url) else [fs.unstrip_protocol(f) for f in found]


def put_file_atomic(fs, local: str | os.PathLike, path: str) -> None:
    """Copy a local file to ``path`` on ``fs`` under a temporary name, then move it into place."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fs.put_file(str(local), tmp)
    fs.mv(tmp, path)


def write_bytes_atomic(fs, path: str, data: bytes) -> None:
    """``data`` to ``path`` on ``fs`` under a temporary name, then moved into place."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


__all__ = ["scheme_of", "is_local", "local_path", "fsspec_problem", "check_url", "url_fs", "open_url",
           "join", "list_tars", "put_file_atomic", "write_bytes_atomic", "KNOWN_HINT"]
