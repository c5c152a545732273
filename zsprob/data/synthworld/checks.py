"""Checking a SynthWorld on disk against its manifest: the size and SHA-256 of every file a run wrote
(recorded in ``manifest.json``; a re-run regenerates the files that differ), and the cheap check a
reader of the pretraining shards makes before training. Worlds written before the manifest had
checksums are checked for shards that are unreadable, empty or cut short.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from zsprob.errors import UserError
from zsprob.utils.io import sha256_file

#: the folders whose files a SynthWorld run writes (and the manifest records)
DATA_FOLDERS = ("pretrain", "classify", "retrieval")
REGENERATE = "re-run `zsprob data synthetic` with the same arguments to regenerate it"


def written_files(out: Path) -> list[Path]:
    """Every file under the world's data folders, sorted (temp files of a killed run excluded)."""
    found = []
    for sub in DATA_FOLDERS:
        if (out / sub).is_dir():
            found += [p for p in (out / sub).rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(out).as_posix())


def file_checksums(out: str | os.PathLike) -> dict[str, dict]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file :func:`written_files` lists."""
    out = Path(out)
    return {p.relative_to(out).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in written_files(out)}


def read_manifest(out: Path) -> dict | None:
    """``out/manifest.json`` as a dict, or None when absent or unreadable."""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def damaged_files(out: str | os.PathLike, checksums: dict) -> list[str]:
    """The recorded files that are missing or whose size or SHA-256 differs from ``checksums``, sorted (only the
    recorded files are read, and a file of another size is not hashed)."""
    out = Path(out)

    def intact(rel: str, want) -> bool:
        f = out / rel
        return (isinstance(want, dict) and f.is_file() and f.stat().st_size == want.get("size")
                and {"size": want.get("size"), "sha256": sha256_file(f)} == want)
    return sorted(rel for rel, want in checksums.items() if not intact(rel, want))


_VERIFIED: set[tuple[str, str]] = set()


def verify_recorded(out: str | os.PathLike, prefixes: tuple[str, ...]) -> None:
    """Check the files of ``out`` under ``prefixes`` (e.g. ``retrieval/test_``) against the SHA-256 its manifest
    records (:func:`damaged_files`), once per process: an evaluation reads what the world wrote, or says which
    file changed."""
    out = Path(out).resolve()
    todo = tuple(p for p in prefixes if (str(out), p) not in _VERIFIED)
    recorded = ((read_manifest(out) or {}).get("checksums") or {}) if todo else {}
    damaged = damaged_files(out, {rel: want for rel, want in recorded.items() if rel.startswith(todo)})
    if damaged:
        raise UserError(f"{out / damaged[0]} is not the file this SynthWorld recorded (missing, or its size or "
                        f"SHA-256 differs from manifest.json); {REGENERATE}")
    _VERIFIED.update((str(out), p) for p in todo)


def broken_shards(out: str | os.PathLike) -> list[str]:
    """The pretraining shards of ``out`` that are unreadable, hold no member or end inside a member (cut
    short): what can be told without recorded checksums (a world written before the manifest had them)."""
    import tarfile

    out = Path(out)
    bad = []
    for tar in sorted((out / "pretrain").glob("*.tar")) if (out / "pretrain").is_dir() else []:
        try:
            with tarfile.open(tar) as archive:
                members = archive.getmembers()
            ok = bool(members) and members[-1].offset_data + members[-1].size <= tar.stat().st_size
        except (tarfile.TarError, OSError, EOFError):
            ok = False
        if not ok:
            bad.append(tar.relative_to(out).as_posix())
    return bad


def _world_of(shards: Path) -> Path | None:
    for candidate in (shards, shards.parent):
        if (candidate / "manifest.json").is_file():
            return candidate
    return None


def _empty_tar(path: Path) -> bool:
    """A tar whose first header block is missing or all zeros holds no member."""
    with open(path, "rb") as f:
        head = f.read(512)
    return len(head) < 512 or not any(head)


def check_pretrain_shards(shards: str | os.PathLike) -> None:
    """Before training on a local SynthWorld ``pretrain/`` folder: its world must have pretraining images,
    each shard the manifest records must have the recorded size, and some shard must hold a sample; each
    failure is one :class:`UserError` line (a brace pattern or URL is the loader's business)."""
    shards = Path(shards)
    if not shards.is_dir():
        return
    world = _world_of(shards)
    manifest = read_manifest(world) if world is not None else None
    counts = (manifest or {}).get("counts") or {}
    if counts.get("pretrain") == 0:
        raise UserError(f"the SynthWorld {world} has no pretraining images (generated with --num-pretrain 0); "
                        "generate one with --num-pretrain N")
    tars = sorted(shards.glob("*.tar"))
    recorded = (manifest or {}).get("checksums") or {}
    for tar in tars:
        want = recorded.get(tar.relative_to(world).as_posix()) if world is not None else None
        if isinstance(want, dict) and tar.stat().st_size != want.get("size"):
            raise UserError(f"SynthWorld shard {tar} is damaged ({tar.stat().st_size} bytes, the manifest records "
                            f"{want.get('size')}); {REGENERATE}")
    if tars and all(_empty_tar(t) for t in tars):
        raise UserError(f"the shards in {shards} hold no samples ({len(tars)} empty .tar files); {REGENERATE}")

