"""A run directory mirrored to an fsspec URL (``train.remote_sync``), and pulled back on resume.

As open_clip's ``--remote-sync``; fsspec does the I/O. zsprob writes the order that keeps the remote consistent
(changed files, then the pointer ``checkpoints/latest.json``, then pruning), so a reader never finds a partial
checkpoint. Hidden files are never copied; a failed copy is a warning, retried at the next checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

from zsprob.errors import UserError
from zsprob.utils import remote
from zsprob.utils.io import atomic_write_json

POINTER = "checkpoints/latest.json"


def check_target(url: str, out: str | os.PathLike) -> None:
    """One UserError line unless ``url`` can hold the mirror of the run directory ``out``: a scheme fsspec can
    open (not ``pipe:``), and a local mirror apart from ``out``. Reads nothing remote (checked with the config)."""
    if remote.check_url(str(url), "train.remote_sync") == "pipe":
        raise UserError(f"train.remote_sync: a pipe: command cannot hold checkpoints ({url!r}); use a local path, "
                        "file:// or an fsspec protocol (s3://, gs://, ...)")
    if remote.is_local(str(url).rstrip("/")):  # a mirror that is, holds or lies in the run copies onto itself
        mirror, run = Path(remote.local_path(str(url).rstrip("/"))).resolve(), Path(out).resolve()
        if mirror == run or run in mirror.parents or mirror in run.parents:
            raise UserError(f"train.remote_sync {url!r} is the run directory {out}, or holds it, or lies "
                            "inside it: give a mirror elsewhere")


class RemoteSync:
    """Mirror of one local run directory ``out`` at ``url``."""

    def __init__(self, url: str, out: str | os.PathLike):
        self.url = str(url).rstrip("/")
        self.out = Path(out)
        self.fs, self.root = remote.url_fs(self.url)
        self.root = self.root.rstrip("/")
        self._sent: dict[str, tuple[int, int]] = {}

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def check(self) -> None:
        """Fail early (UserError) when the remote cannot be written."""
        probe = self._remote(".zsprob-write-probe")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            remote.write_bytes_atomic(self.fs, probe, b"ok\n")
            self.fs.rm(probe)
        except Exception as e:
            raise UserError(f"train.remote_sync: cannot write to {self.url}: {type(e).__name__}: "
                            f"{' '.join(str(e).split())}") from None

    # ------------------------------------------------------------------ push
    def _changed(self) -> list[tuple[str, Path]]:
        found = []
        for p in sorted(self.out.rglob("*")):
            rel = p.relative_to(self.out).as_posix()
            if not p.is_file() or any(part.startswith(".") for part in rel.split("/")):
                continue
            st = p.stat()
            if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
                found.append((rel, p))
        return found

    def _put(self, rel: str, path: Path) -> None:
        st = path.stat()
        target = self._remote(rel)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if rel.startswith("checkpoints/step-"):
            self.fs.put_file(str(path), target)  # nothing names this directory yet
        else:
            remote.put_file_atomic(self.fs, path, target)
        self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def push(self) -> int:
        """Copy what changed (pointer last, then prune); returns the number of files copied."""
        changed = self._changed()
        pointer = [c for c in changed if c[0] == POINTER]
        for rel, path in [c for c in changed if c[0] != POINTER] + pointer:
            self._put(rel, path)
        if pointer:
            self._prune()
        return len(changed)

    def _prune(self) -> None:
        local = {p.name for p in (self.out / "checkpoints").glob("step-*")}
        try:
            listed = self.fs.ls(self._remote("checkpoints"), detail=False)
        except FileNotFoundError:
            return
        for entry in listed:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step-") and name not in local:
                self.fs.rm(entry, recursive=True)

    def try_push(self) -> None:
        """:meth:`push`, with a failure turned into a warning (retried at the next call)."""
        try:
            self.push()
        except Exception as e:  # network, quota, credentials: training goes on
            warnings.warn(f"train.remote_sync: copy to {self.url} failed ({type(e).__name__}: {e}); "
                          "retrying at the next checkpoint")

    # ------------------------------------------------------------------ pull
    def _read_json(self, rel: str) -> Any:
        try:
            with self.fs.open(self._remote(rel), "rb") as f:
                return json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return None
        except ValueError:
            raise UserError(f"train.remote_sync: {self.url}/{rel} is not valid JSON") from None

    def pull_latest(self) -> int | None:
        """Fetch the remote's latest checkpoint (and logs) when it is newer than the local one; its step, or None."""
        info = self._read_json(POINTER)
        if not info:
            return None
        local = self.out / POINTER
        if local.is_file() and int(json.loads(local.read_text()).get("step", -1)) >= int(info["step"]):
            return None
        step_dir = self.out / "checkpoints" / info["dir"]
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"  # nodes sharing OUT may pull at the same time
        tmp = self.out / "checkpoints" / f".pull-{info['dir']}-{tag}"
        base = self._remote(f"checkpoints/{info['dir']}")
        for src in self.fs.find(base):
            dst = tmp / src[len(base):].lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(src, str(dst))
        if (step_dir / "state.json").is_file():  # step directories appear complete (renamed into place)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(step_dir, ignore_errors=True)
            os.replace(tmp, step_dir)
        for rel in ("metrics.jsonl", "config.yaml"):
            if self.fs.exists(self._remote(rel)):
                self.fs.get_file(self._remote(rel), str(self.out / f".{rel}.{tag}"))
                os.replace(self.out / f".{rel}.{tag}", self.out / rel)
        atomic_write_json(local, {"step": int(info["step"]), "dir": info["dir"]})
        return int(info["step"])


def for_run(cfg: Any, out: Path, acc: Any, resume: Any) -> RemoteSync | None:
    """The run's mirror on the main process (None elsewhere, or without ``train.remote_sync``), its remote
    probed; when ``resume`` asks for the latest checkpoint, a newer remote one is pulled into ``out`` first."""
    url = cfg.train.remote_sync
    if not url:
        return None
    sync = RemoteSync(url, out)
    if acc.is_main_process:
        sync.check()
    if (resume is True or resume in ("auto", "latest")) and acc.is_local_main_process:
        out.mkdir(parents=True, exist_ok=True)
        sync.pull_latest()
    acc.wait_for_everyone()
    return sync if acc.is_main_process else None


__all__ = ["RemoteSync", "check_target", "for_run", "POINTER"]
