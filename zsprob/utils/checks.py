"""Checks of user-given counts, inputs and output locations, shared by every command and the training config,
so that every command words the same mistake the same way; the command line wraps them into click types
(``zsprob.cli.types``). An output must be writable (probed before any work starts) and must not replace an
input, a dataset's file, or a pipe / device / socket (zsprob renames a new file over its outputs); it never lies
in a training run's directory or a SynthWorld that the command does not own (:func:`refuse_owned`).
"""
from __future__ import annotations

import fnmatch
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zsprob.errors import UserError, not_found
from zsprob.utils.io import path_kind


#: files a saved Hugging Face tokenizer directory holds (any one marks the directory)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.txt")


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding one of :data:`TOKENIZER_FILES` (no library imported)."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def rule_text(rule: str) -> str:
    """How a count rule reads in a message: ">=1" -> "at least 1"."""
    return {">=1": "at least 1", ">=0": "0 or more", ">0": "above 0"}[rule]


def check_count(value: Any, what: str | None, rule: str = ">=1", integer: bool = True):
    """``value`` if it is a number obeying ``rule`` (">=1", ">=0" or ">0"); None passes (unset).
    ``what`` names it in the message (None: the caller adds the name, as click does)."""
    if value is None:
        return None
    prefix = f"{what} " if what else ""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isfinite(value):
        raise UserError(f"{prefix}must be a finite number {rule_text(rule)}, got {value!r}")
    if not number or (integer and float(value) != int(value)):
        raise UserError(f"{prefix}must be {'an integer' if integer else 'a number'} {rule_text(rule)}, got {value!r}")
    bound = 1 if rule == ">=1" else 0
    if value < bound or (rule == ">0" and value <= 0):
        raise UserError(f"{prefix}must be {rule_text(rule)}, got {value!r}")
    return int(value) if integer else value


def _is_url(path: str) -> bool:
    head = path.split("://", 1)[0]
    return "://" in path and head.isidentifier()


def _probe_dir(d: Path, what: str) -> None:  # what: "--out: " or ""
    """Create ``d`` if missing, write and delete a probe file, then remove what this call created; safe when
    the ranks of one torchrun job probe the same new directory at once."""
    created: list[Path] = []
    p = d
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{what}cannot create {d}: {p} is not a directory")
    try:
        for attempt in range(5):
            try:
                for q in reversed([d, *d.parents]):
                    if not q.exists():
                        try:
                            q.mkdir()
                            created.append(q)
                        except FileExistsError:
                            pass
                fd, probe = tempfile.mkstemp(prefix=".zsprob-write-probe-", dir=d)
                os.close(fd)
                os.unlink(probe)
                break
            except FileNotFoundError:  # another process removed a directory it had made
                if attempt == 4:
                    raise
    except OSError as e:
        raise UserError(f"{what}cannot create or write {d} ({e.strerror or e})") from None
    finally:
        for q in sorted(set(created), key=lambda x: len(x.parts), reverse=True):
            try:
                q.rmdir()
            except OSError:
                pass


def check_input(path: str | os.PathLike, what: str, kind: str = "dir", hint: str = "") -> str | os.PathLike:
    """``path`` if it exists as a directory (``kind="dir"``), a file (``"file"``) or either
    (``"any"``); ``what`` names it in the message, ``hint`` says where it comes from."""
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise not_found(what, p, hint)
    if kind == "dir" and not p.is_dir():
        raise UserError(f"{what} {p} is a file, not a directory")
    if kind == "file" and p.is_dir():
        raise UserError(f"{what} {p} is a directory, not a file")
    return str(p) if os.fspath(path).startswith("~") else path  # a quoted ~ reaches the code expanded


def check_shards(kind: str, shards) -> None:
    """The shard source of ``--data KIND``: given, and for SynthWorld a local path that exists (a brace
    pattern, a URL or a '::'-joined list is the loader's business)."""
    if not shards:
        raise UserError(f"--data {kind} needs --shards (a directory of .tar files or a brace pattern)")
    if kind == "synthetic" and not any(c in str(shards) for c in "{}:") and not Path(str(shards)).exists():
        raise UserError(f"SynthWorld shards not found: {shards} (make them with `zsprob data synthetic --out DIR`,"
                        " then pass --shards DIR/pretrain)")


def owner_kind(folder: Path) -> str | None:
    """"run" when ``folder`` is a training run's directory (config.yaml with metrics.jsonl, summary.json or
    checkpoints/), "world" when it is a SynthWorld (its parameters, or its manifest beside its folders), else None."""
    if (folder / "config.yaml").is_file() and any((folder / n).exists() for n in ("metrics.jsonl", "summary.json",
                                                                                   "checkpoints")):
        return "run"
    if (folder / ".synthworld-params.json").is_file() or ((folder / "manifest.json").is_file() and any(
            (folder / sub).is_dir() for sub in ("pretrain", "classify", "retrieval"))):
        return "world"
    return None


def refuse_owned(path: str | os.PathLike, what: str, own: str | None = None) -> None:
    """The ownership rule of every output: one line when ``path`` (symlinks resolved) lies inside a run directory
    or a SynthWorld, or is one, unless ``own`` ("run" / "world") says the command writes that kind itself there
    (``pretrain --out RUN`` resumes, ``data synthetic --out WORLD`` completes it)."""
    real = Path(os.path.realpath(os.path.expanduser(os.fspath(path))))
    for folder in (real, *real.parents):
        kind = owner_kind(folder)
        if kind is not None and not (folder == real and kind == own):
            where = "is" if folder == real else "is inside"
            name = {"run": "the training run", "world": "the SynthWorld"}[kind]
            raise UserError(f"{what}{path} {where} {name} {folder}, which this command does not own; "
                            "write elsewhere (a run or a world is only ever written by the command that made it)")


def absolute_paths(cfg: dict, keys) -> dict:
    """``cfg`` (nested dicts) with each ``section.name`` key of ``keys`` that holds a local path made absolute and
    normal (``./x``, ``x/`` and ``$PWD/x`` alike; each '::'-joined part; URLs and ``scheme:`` sources as given), so
    that a run records where its data is and a resume from another folder compares like with like."""
    for key in keys:
        section, name = key.split(".")
        value = (cfg.get(section) or {}).get(name)
        if isinstance(value, str) and value:
            local = [p if ":" in p or not p else os.path.abspath(os.path.expanduser(p)) for p in value.split("::")]
            cfg[section][name] = "::".join(local)
    return cfg


def check_output(path: str | os.PathLike, what: str | None = "--out", kind: str = "dir",
                 own: str | None = None) -> str | os.PathLike:
    """``path`` if it can be written as a directory (``kind="dir"``) or a file (``"file"``; a symlink is judged
    by its target) and :func:`refuse_owned` lets it (``own``); URLs pass. ``what`` names it in the message
    (None: the caller adds the name)."""
    what = f"{what}: " if what else ""
    text = os.fspath(path)
    if _is_url(text):
        return path
    p = Path(text)
    refuse_owned(p, what, own)
    found = path_kind(p)
    if kind == "dir":
        if found not in (None, "directory"):
            raise UserError(f"{what}{p} is {'a file' if found == 'regular file' else 'a ' + found}, not a directory")
        _probe_dir(p, what)
    else:
        if found == "directory":
            raise UserError(f"{what}{p} is a directory, not a file")
        if found not in (None, "regular file"):
            raise UserError(f"{what}{p} is a {found}, not a regular file: zsprob renames a new file over its "
                            "outputs, which would replace it; give a file path")
        target = Path(os.path.realpath(p)) if p.is_symlink() else p  # writes go through a symlink
        _probe_dir(target.parent if str(target.parent) else Path("."), what)
    return path


#: files a dataset root ships that no output may replace (SynthWorld's manifest and split files, COCO /
#: Flickr30k Karpathy JSON and annotations, class-name lists), as fnmatch patterns of the file name
DATASET_FILES = ("manifest.json", ".synthworld-params.json", "preview.png", "dataset_*.json", "*_meta.json",
                 "captions_*.json", "instances_*.json", "classnames.txt", "LOC_*", "*.tar", "*.jpg", "*.jpeg",
                 "*.JPEG")


def _resolved(paths: Mapping[str, Any] | None) -> dict[str, tuple[Any, Path]]:
    """``{name: (path as given, resolved path)}`` of the local paths of ``paths`` (None and URLs skipped)."""
    return {name: (p, Path(os.fspath(p)).expanduser().resolve()) for name, p in (paths or {}).items()
            if p is not None and not _is_url(os.fspath(p))}


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_outputs_apart(outputs: Mapping[str, Any], files: Mapping[str, Any] | None = None,
                        dirs: Mapping[str, Any] | None = None, data: Mapping[str, Any] | None = None) -> None:
    """One line when an output would destroy an input, before anything is written. Each argument is ``{name:
    path}`` (None skipped, symlinks resolved): ``outputs`` may not be one of the input ``files``, lie in one of
    the input model ``dirs``, replace a file a ``data`` root ships (:data:`DATASET_FILES`), or be an existing
    pipe, device or socket."""
    outs = _resolved(outputs)
    for name, (p, real) in outs.items():  # a pipe / device where a file goes beside --out: refused up front too
        refuse_owned(real, f"{name} ")
        if path_kind(real) not in (None, "regular file", "directory"):
            raise UserError(f"{name} {p} is a {path_kind(real)}, not a regular file: zsprob renames a new file "
                            "over its outputs, which would replace it; move it or write the results elsewhere")
    given = {real: opt for opt, (_, real) in _resolved(files).items()}
    for name, (p, real) in outs.items():
        if real in given:
            raise UserError(f"{name} would write {p}, the file given as {given[real]}; choose another path so "
                            "that it is not overwritten")
    for opt, (d, folder) in _resolved(dirs).items():
        for name, (p, real) in outs.items():
            if _within(real, folder):
                where = f"is the {opt} directory" if real == folder else f"is inside the {opt} directory {d}"
                raise UserError(f"{name} {p} {where}; write the results elsewhere")
    for opt, (root, folder) in _resolved(data).items():
        for name, (p, real) in outs.items():
            if _within(real, folder) and real.is_file() and any(fnmatch.fnmatchcase(real.name, pattern)
                                                                for pattern in DATASET_FILES):
                raise UserError(f"{name} {p} would replace {real.name}, a file of the {opt} dataset {root}; "
                                "write the results elsewhere")
