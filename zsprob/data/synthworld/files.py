"""SynthWorld's byte-exact file writers: JPEG, JSON, tar shards and ``.npz`` files with fixed metadata, so
the same arguments give the same bytes. Pillow encodes JPEG, ``tarfile`` writes the shards, ``zipfile``
holds the ``.npz`` arrays in the layout ``scipy.sparse.load_npz`` reads; :mod:`zsprob.utils.io` makes
each write atomic.
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


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """A tar of ``(name, bytes)`` members with fixed mtime / mode / owner (tarfile's PAX format: plain USTAR
    headers for short ASCII names)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 0
            ti.mode = 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


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

