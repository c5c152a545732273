"""SynthWorld's byte-exact file writers: JPEG, JSON, USTAR tar shards and ``.npz`` files with fixed
metadata, so the same arguments give the same bytes. Pillow encodes JPEG; ``tarfile`` is the reference
tar writer and :func:`tar_bytes` writes the same bytes faster; ``zipfile`` holds the ``.npz`` arrays in
the layout ``scipy.sparse.load_npz`` reads; :mod:`zsprob.utils.io` makes each write atomic.
"""
from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from zsprob.utils.io import atomic_write_bytes


def jpeg_bytes(image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality, optimize=False, progressive=False)
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """tmp file + rename through zsprob.utils.io (no fsync: many small files; never a torn file)."""
    atomic_write_bytes(path, data, fsync=False)


def dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False,
                      separators=(",", ": ") if indent else (",", ":"))


def tar_bytes_tarfile(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    """Reference writer: the tarfile module, fixed mtime / mode / owner."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 0
            ti.mode = 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def ustar_header(name: bytes, size: int) -> bytes:
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b"        "
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """The bytes of :func:`tar_bytes_tarfile`, faster: plain USTAR headers for short ASCII names and sizes
    below 8 GiB, the tarfile module (PAX format) otherwise."""
    parts = []
    total = 0
    for name, data in members:
        nb = name.encode("ascii", "strict") if name.isascii() else None
        if nb is None or len(nb) >= 100 or len(data) >= 8 ** 11:
            return tar_bytes_tarfile(members, tarfile.PAX_FORMAT)
        parts.append(ustar_header(nb, len(data)))
        parts.append(data)
        pad = -len(data) % 512
        if pad:
            parts.append(b"\0" * pad)
        total += 512 + len(data) + pad
    total += 1024
    parts.append(b"\0" * (1024 + (-total % tarfile.RECORDSIZE)))
    return b"".join(parts)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz (numpy's zip of .npy files) with fixed timestamps: byte-identical across runs."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            zi = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            b = io.BytesIO()
            np.lib.format.write_array(b, np.asanyarray(arr), allow_pickle=False)
            zf.writestr(zi, b.getvalue())
    return buf.getvalue()


def sparse_npz_bytes(m) -> bytes:
    """A scipy.sparse matrix as the CSR ``.npz`` bytes ``scipy.sparse.load_npz`` reads (indices sorted)."""
    m = m.tocsr()
    m.sort_indices()
    return npz_bytes({"indices": m.indices.astype(np.int32), "indptr": m.indptr.astype(np.int32),
                       "format": np.array("csr"), "shape": np.array(m.shape, dtype=np.int64),
                       "data": m.data})


__all__ = ["jpeg_bytes", "write_atomic", "dumps", "tar_bytes", "tar_bytes_tarfile", "ustar_header", "npz_bytes",
           "sparse_npz_bytes"]
