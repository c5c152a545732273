"""Atomic writes, small JSON helpers and the SHA-256 of a file.

Every file a crash must not leave half-written goes through :func:`atomic_write`: written to a
temporary file beside the target, fsync'ed, then renamed over it. A symlink is written through (its
target replaced, the link kept); a directory, pipe, device or socket is refused with one
:class:`zsprob.UserError` line, since a rename would replace it with a plain file.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable


@functools.cache
def _umask() -> int:
    """The process's umask, read once (reading it means setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: what a path is that a write must not replace, by its ``st_mode`` test
_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def path_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is, symlinks followed: None when absent (a dangling symlink too), "regular file",
    or "directory", "named pipe (FIFO)", "character device", "block device", "socket"."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return "regular file"
    return next((name for test, name in _KINDS if test(mode)), "special file")


def write_target(path: str | os.PathLike) -> Path:
    """The file a write to ``path`` replaces: ``path``, or for a symlink the file it points to (written
    through; a dangling link's target is created). :class:`zsprob.UserError` (one line) when that exists
    and is not a regular file."""
    from zsprob.errors import UserError

    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    kind = path_kind(target)
    if kind not in (None, "regular file"):
        shown = path if target == path else f"{path} (a symlink to {target})"
        raise UserError(f"{shown} is a {kind}, not a regular file: zsprob writes a new file and renames it over "
                        f"the old one, which would replace the {kind.split(' (')[0]}; give a file path")
    return target


def atomic_write(path: str | os.PathLike, writer: Callable[[str], None], *, fsync: bool = True) -> Path:
    """Call ``writer(tmp_path)`` to produce the file, then atomically rename it to ``path`` (mode 0666 less the
    umask, not mkstemp's 0600); returns ``path``. ``fsync=False`` skips the flush to disk for bulk writes of many
    small files (a power loss may then lose the latest ones)."""
    path = Path(path)
    target = write_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        writer(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        write_target(target)  # what the writer ran for: a pipe made there meanwhile is not replaced either
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if _disk_full(e):  # safetensors and FAISS word it their own way, and Python's names no file
            raise OSError(errno.ENOSPC, "no space left on device (the previous file is kept)", str(target)) from None
        raise
    return path


def _disk_full(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) or "os error 28" in str(e)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), fsync=fsync)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def _default(o: Any) -> Any:
    """numpy / torch scalars and arrays, and Paths, as JSON values."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """``o`` with every NaN / infinity (floats, numpy / torch values) replaced by None."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, (str, int, bool)) or o is None:
        return o
    try:
        return _finite(_default(o))
    except TypeError:
        return o


def _dumps(obj: Any, indent: int | None) -> str:
    """Strict JSON: NaN and infinities (not JSON) are written as null; only a payload holding one is walked."""
    try:
        return json.dumps(obj, indent=indent, default=_default, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), indent=indent, default=_default, allow_nan=False)


def to_json(obj: Any, indent: int | None = 2) -> str:
    """JSON text of ``obj`` (numpy / torch values and Paths converted; NaN and infinities as null)."""
    return _dumps(obj, indent) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    return atomic_write_text(path, to_json(obj, indent=indent))


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON, turning a missing or malformed file into a :class:`zsprob.UserError`."""
    from zsprob.errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} not found: {p}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} is not valid JSON: {p} ({e})") from None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON record as a line (used for metrics logs; appends are line-atomic)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        f.write(_dumps(record, None) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records (JSON objects) of a JSONL log, [] when it is absent; a blank or torn line (a crash
    mid-write) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    records = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks (``hashlib`` hashes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
