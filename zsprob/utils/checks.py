"""Checks of user-given counts and output locations, shared by every command and the training config.

One rule per kind of input, so every command words the same mistake the same way:

- :func:`check_count`: steps, epochs, batch sizes, intervals, workers, threads ... must be numbers at
  least a minimum (``>= 1``, ``>= 0``) or above it (``> 0``); integers unless said otherwise.
  :func:`check_counts` applies a table of dotted config keys (``zsprob.train.defaults.COUNT_KEYS``).
- :func:`check_flags`, :func:`check_numbers`, :func:`check_known_keys`: a config against its defaults
  (true / false keys, finite floats and number lists, no unknown keys: the nearest known one is named).
  :func:`check_config` runs them all against one :class:`ConfigRules` (the defaults, the free
  sections, the count table, the real-valued keys that may be null, the keys that exclude each other),
  so a config is checked in one call.
- :func:`check_output`: an ``--out`` directory (or the folder of an ``--out`` file) that cannot be
  created or written is refused before any work starts. The check creates what is missing, writes a
  probe file, and removes both again (no side effect); URLs (``scheme://...``) are left to their
  writers. An ``--out`` file that exists and is not a regular file (a named pipe, a device, a socket)
  is refused: zsprob renames a new file over its outputs (:mod:`zsprob.utils.io`), which would
  replace it; a symlink is judged by what it points to (writes go through it).
- :func:`check_outputs_apart`: no output is one of the command's input files, lies inside an input
  model directory, or replaces a file a dataset root ships (its manifest, split files, images, shards).

The command line wraps both into click parameter types (``zsprob.cli.types``).
"""
from __future__ import annotations

import difflib
import fnmatch
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from zsprob.errors import UserError, check_range, not_found
from zsprob.utils.io import path_kind


#: files a saved Hugging Face tokenizer directory holds (any one marks the directory)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.txt")


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding one of :data:`TOKENIZER_FILES` (no library imported)."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def _rule_text(rule: str) -> str:
    return {">=1": "at least 1", ">=0": "0 or more", ">0": "above 0"}[rule]


def check_count(value: Any, what: str | None, rule: str = ">=1", integer: bool = True):
    """``value`` if it is a number obeying ``rule`` (">=1", ">=0" or ">0"); None passes (unset).
    ``what`` names it in the message (None: the caller adds the name, as click does)."""
    if value is None:
        return None
    prefix = f"{what} " if what else ""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isfinite(value):
        raise UserError(f"{prefix}must be a finite number {_rule_text(rule)}, got {value!r}")
    if not number or (integer and float(value) != int(value)):
        raise UserError(f"{prefix}must be {'an integer' if integer else 'a number'} {_rule_text(rule)}, got {value!r}")
    bound = 1 if rule == ">=1" else 0
    if value < bound or (rule == ">0" and value <= 0):
        raise UserError(f"{prefix}must be {_rule_text(rule)}, got {value!r}")
    return int(value) if integer else value


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_counts(cfg: Any, table: Iterable[tuple]) -> None:
    """Check every ``(key, flag, rule, integer[, most])`` of ``table`` in the nested config ``cfg`` (``most``:
    an upper bound, e.g. the threads torch can start)."""
    for key, flag, rule, integer, *most in table:
        what = f"{flag} ({key})" if flag else key
        value = check_count(_get(cfg, key), what, rule, integer)
        if most and value is not None and value > most[0]:
            raise UserError(f"{what} must be at most {most[0]}, got {value!r}")


def check_flags(cfg: Any, defaults: Any, prefix: str = "") -> None:
    """Every key of ``cfg`` whose default in ``defaults`` is true / false must be true / false (YAML's
    booleans): "maybe", 1 or "no" in a recipe or a ``--set`` is one line, not a silent ``bool()``."""
    for key, default in defaults.items():
        if key not in cfg:
            continue
        name = f"{prefix}{key}"
        if isinstance(default, bool) and not isinstance(cfg[key], bool):
            raise UserError(f"{name} must be true or false, got {cfg[key]!r}")
        if isinstance(default, Mapping) and isinstance(cfg[key], Mapping):
            check_flags(cfg[key], default, f"{name}.")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_float(x: Any) -> Any:
    """``x`` as a float when it is a number or a string that spells one (YAML reads ``2e-3`` as a
    string: it wants ``2.0e-3``); else ``x`` unchanged."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def check_numbers(cfg: Any, defaults: Any, prefix: str = "") -> None:
    """Every key of ``cfg`` whose default in ``defaults`` is a float must be a finite number (null is
    allowed: "off" for some keys; a string spelling a number, YAML's ``2e-3``, is stored as the float);
    a key whose default is a list of numbers (``optim.betas``) must be a list of as many finite numbers.
    ``--lr inf``, ``optim.grad_clip=nan`` or ``optim.lr=abc`` is one line."""
    for key, default in defaults.items():
        if key not in cfg or cfg[key] is None:
            continue
        name, value = f"{prefix}{key}", cfg[key]
        if isinstance(default, float):
            value = _as_float(value)
            if not (_is_number(value) and math.isfinite(value)):
                raise UserError(f"{name} must be a finite number, got {cfg[key]!r}")
            cfg[key] = value
        if isinstance(default, list) and default and all(_is_number(v) for v in default):
            items = [_as_float(v) for v in value] if isinstance(value, (list, tuple)) else None
            if not (items is not None and len(items) == len(default)
                    and all(_is_number(v) and math.isfinite(v) for v in items)):
                raise UserError(f"{name} must be a list of {len(default)} finite numbers like {default}, got {value!r}")
            cfg[key] = items
        if isinstance(default, Mapping) and isinstance(value, Mapping):
            check_numbers(value, default, f"{name}.")


def check_known_keys(cfg: Any, defaults: Any, free: Iterable[str] = (), prefix: str = "") -> None:
    """Every key of ``cfg`` must be a key of ``defaults``; a section whose default is empty or null, or
    that ``free`` names (dotted, ``*`` for any one name: ``loss.*``), takes any keys. An unknown key is
    one line naming the nearest known one (a typo such as ``optim.lrr`` is otherwise silently ignored)."""
    free = tuple(free)
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if key not in defaults:
            near = difflib.get_close_matches(str(key), [str(k) for k in defaults], n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else \
                f"known keys here: {', '.join(map(str, defaults)) or 'none'}"
            raise UserError(f"unknown config key {name} ({hint})")
        default = defaults[key]
        if isinstance(default, Mapping) and not isinstance(value, Mapping):  # `optim: null`, `--set model.overrides=5`
            raise UserError(f"{name} must be a section of keys (a mapping, as in the defaults), got {value!r}")
        if any(_matches(name, pattern) for pattern in free):
            continue
        if isinstance(default, Mapping) and default and isinstance(value, Mapping):
            check_known_keys(value, default, free, f"{name}.")


def check_nullable_numbers(cfg: Any, table: Iterable[tuple[str, float, float, bool]]) -> None:
    """Every ``(key, low, high, low excluded)`` of ``table`` that is set: a finite number in its range, stored
    as a float (a string spelling a number, YAML's ``2e-3``, included); null stays allowed."""
    check_ranges(cfg, table, nullable=True)


def check_ranges(cfg: Any, table: Iterable[tuple], nullable: bool = False) -> None:
    """Every ``(key, low, high, low excluded[, high excluded])`` of ``table``: a finite number in its range,
    stored as a float, or for a list (``optim.betas``) each of its numbers. Null is refused (these keys have no
    "off") unless ``nullable`` (:func:`check_nullable_numbers`; a list is then refused too). A negative
    learning rate, a beta of 1.5 or a min-lr ratio of 2 is one line, not a run that trains wrongly."""
    for key, low, high, low_open, *high_open in table:
        section, _, name = key.rpartition(".")
        node = _get(cfg, section) if section else cfg
        if not isinstance(node, dict) or name not in node or (nullable and node[name] is None):
            continue
        value = node[name]
        top = "<" if high_open and high_open[0] else "<="
        many = isinstance(value, list) and not nullable
        items = value if many and value else [value]
        try:
            checked = [check_range("not a number" if isinstance(v, (bool, list, dict)) or v is None else v,
                                   key, low, high, low_open) for v in items]
            if top == "<" and any(v >= high for v in checked):
                raise UserError(key)
        except UserError:
            raise UserError(f"{key} must be {'null or ' if nullable else ''}{'numbers' if many else 'a number'} "
                            f"{'>' if low_open else '>='} {low:g}{f' and {top} {high:g}' if high < float('inf') else ''}"
                            f", got {value!r}") from None
        node[name] = checked if many and value else checked[0]


def check_exclusive(cfg: Any, table: Iterable[tuple[str, str, str]]) -> None:
    """Every ``(key, other, why)`` of ``table``: not both set (one line naming both values and ``why``)."""
    for key, other, why in table:
        first, second = _get(cfg, key), _get(cfg, other)
        if first is not None and second is not None:
            raise UserError(f"{key} ({first}) and {other} ({second}) are both set: drop one ({why})")


@dataclass(frozen=True)
class ConfigRules:
    """What a nested config is checked against (:func:`check_config`)."""
    defaults: Mapping              #: every known key with its default (its type tells flags and numbers)
    free: tuple = ()               #: sections that take any keys (:func:`check_known_keys`)
    counts: tuple = ()             #: ``(key, flag, rule, integer)`` rows (:func:`check_counts`)
    nullable_numbers: tuple = ()   #: ``(key, low, high, low excluded)`` rows (:func:`check_nullable_numbers`)
    ranges: tuple = ()             #: ``(key, low, high, low excluded)`` rows of required numbers (:func:`check_ranges`)
    exclusive: tuple = ()          #: ``(key, other, why)`` rows (:func:`check_exclusive`)


def check_config(cfg: Any, rules: ConfigRules) -> None:
    """No unknown key (every section a mapping), every count, finite numbers (stored as floats), the nullable
    numbers, the ranges, no two keys that exclude each other, in that order (the first mistake is the one line)."""
    check_known_keys(cfg, rules.defaults, rules.free)
    check_counts(cfg, rules.counts)
    check_numbers(cfg, rules.defaults)
    check_nullable_numbers(cfg, rules.nullable_numbers)
    check_ranges(cfg, rules.ranges)
    check_exclusive(cfg, rules.exclusive)


def _matches(name: str, pattern: str) -> bool:
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


def _is_url(path: str) -> bool:
    head = path.split("://", 1)[0]
    return "://" in path and head.isidentifier()


def _probe_dir(d: Path, what: str) -> None:  # what: "--out: " or ""
    """Create ``d`` if missing, write and delete a probe file, then remove what this call created.

    Safe when several processes (the ranks of one torchrun job) probe the same new directory at
    once: a directory another process made counts as present, and one it removed under us is made
    again (a few tries), so no rank sees a spurious error.
    """
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


def check_output(path: str | os.PathLike, what: str | None = "--out", kind: str = "dir") -> str | os.PathLike:
    """``path`` if it can be written as a directory (``kind="dir"``) or a file (``kind="file"``);
    ``what`` names it in the message (None: the caller adds the name)."""
    what = f"{what}: " if what else ""
    text = os.fspath(path)
    if _is_url(text):
        return path
    p = Path(text)
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
    """One line when an output would destroy an input, before anything is written. Each argument is
    ``{name: path}`` (None skipped; symlinks resolved, so a link to an input counts as the input):

    - ``outputs``: every file or folder the command writes (``--out`` and what it writes beside it);
    - ``files``: input files (``--prompts``, ``--embeddings``, a checkpoint file ...): no output may be one;
    - ``dirs``: input model directories (``--checkpoint DIR``, ``--pretrained DIR``, ``--tokenizer DIR``):
      no output may be one or lie inside one;
    - ``data``: dataset roots: outputs may go there (results kept beside the data), but not replace an
      existing file the dataset ships (:data:`DATASET_FILES`).

    An output that exists as a named pipe, a device or a socket is refused as well (a write would replace it).
    """
    outs = _resolved(outputs)
    for name, (p, real) in outs.items():  # a pipe / device where a file goes beside --out: refused up front too
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
