#!/usr/bin/env python
"""Compare two demo reports (``OUT/report.json`` of ``zsprob demo``) figure by figure.

Every leaf of the two JSON trees is a figure, named by its path (``retrieval/pcmepp/i2t/r@1``,
``zeroshot/infonce/rows[oracle]/top1``: rows that carry unique ``name`` keys are matched by name,
other lists by position). Timings and paths are left out: the keys ``created``,
``wall_seconds``, ``steps_seconds_total``, ``resumed_steps``, ``samples_per_s``, ``wall_s``, the
top-level ``steps`` (seconds per demo step), every ``files`` table and any string that is an
absolute path; ``--ignore GLOB`` leaves out more (``fnmatch`` on the path). Numbers are equal within
``--rtol`` (relative to the larger magnitude) or ``--atol``; NaN equals NaN; strings are equal when
they are the same text, or when they differ only in the numbers they hold and each of those is
within the tolerance (the checks' evidence quotes figures, rounded). A figure present in one report
only differs, unless ``--allow-added`` and it is only in the second (a report that gained fields).

Prints each differing figure with both values and its relative difference, then one summary line.
Exit status: 0 when nothing differs beyond the tolerance, 1 when something does, 2 on a file that is
missing or not JSON.

    python scripts/compare_reports.py demo_before/report.json demo_after/report.json
    python scripts/compare_reports.py A/report.json B/report.json --rtol 1e-3
    python scripts/compare_reports.py old/report.json new/report.json --allow-added --ignore '*/table'
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterator

#: keys whose values are timings or dates, wherever they stand
TIMING_KEYS = ("created", "wall_seconds", "steps_seconds_total", "resumed_steps", "samples_per_s", "wall_s")
#: keys whose values are file paths, wherever they stand
PATH_KEYS = ("files",)
#: top-level keys that are timings (``training/NAME/steps`` is a step count and stays)
TOP_TIMING_KEYS = ("steps",)

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
MISSING = object()


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every leaf of a JSON tree; an empty dict or list is a leaf."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            if key in TIMING_KEYS or key in PATH_KEYS or (not path and key in TOP_TIMING_KEYS):
                continue
            yield from leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(tree, list) and tree:
        names = [v.get("name") for v in tree if isinstance(v, dict)]
        keyed = len(names) == len(tree) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
        for i, value in enumerate(tree):  # rows that carry unique names (strategies) are matched by name
            yield from leaves(value, f"{path}[{names[i]}]" if keyed else f"{path}[{i}]")
    elif not (isinstance(tree, str) and tree.startswith("/")):
        yield path, tree


def relative_difference(a: float, b: float) -> float:
    """|a - b| over the larger magnitude (0 for two zeros or two NaNs, inf for one NaN or one infinity)."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def within(a: float, b: float, rtol: float, atol: float) -> bool:
    rel = relative_difference(a, b)
    return rel <= rtol or (not math.isinf(rel) and abs(a - b) <= atol)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def compare_values(a: Any, b: Any, rtol: float, atol: float) -> tuple[bool, float | None]:
    """(equal within the tolerance, relative difference or None where none applies)."""
    if is_number(a) and is_number(b):
        return within(float(a), float(b), rtol, atol), relative_difference(float(a), float(b))
    if isinstance(a, str) and isinstance(b, str) and a != b:
        na, nb = NUMBER.findall(a), NUMBER.findall(b)
        if NUMBER.sub("#", a) != NUMBER.sub("#", b) or len(na) != len(nb):
            return False, None
        pairs = [(float(x), float(y)) for x, y in zip(na, nb)]
        return all(within(x, y, rtol, atol) for x, y in pairs), max(relative_difference(x, y) for x, y in pairs)
    return a == b, None


def compare(before: Any, after: Any, rtol: float = 0.0, atol: float = 0.0,
            ignore: tuple[str, ...] = (), allow_added: bool = False) -> dict:
    """Every figure of the two reports compared: ``differing`` lists (path, before, after, relative
    difference or None, beyond the tolerance) for each figure that is not identical; with
    ``allow_added``, a figure only the second report holds goes to ``added`` instead."""
    a, b = dict(leaves(before)), dict(leaves(after))
    paths = [p for p in list(a) + [p for p in b if p not in a] if not any(fnmatch.fnmatchcase(p, g) for g in ignore)]
    differing, added, max_rel = [], [], 0.0
    for path in paths:
        va, vb = a.get(path, MISSING), b.get(path, MISSING)
        if va is MISSING and allow_added:
            added.append(path)
            continue
        if va is MISSING or vb is MISSING:
            differing.append((path, va, vb, None, True))
            continue
        ok, rel = compare_values(va, vb, rtol, atol)
        if rel is not None:
            max_rel = max(max_rel, rel)
        identical = rel == 0 if rel is not None else va == vb
        if not identical:
            differing.append((path, va, vb, rel, not ok))
    return {"figures": len(paths), "differing": differing, "max_relative_difference": max_rel,
            "beyond_tolerance": sum(1 for d in differing if d[4]), "added": added}


def _show(value: Any) -> str:
    return "(absent)" if value is MISSING else json.dumps(value)


class ReportError(Exception):
    """A report that cannot be read (one line)."""


def load_report(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not JSON: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="the first report.json")
    ap.add_argument("after", help="the second report.json")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance per figure (default 0: identical)")
    ap.add_argument("--atol", type=float, default=0.0, help="absolute tolerance per figure (default 0)")
    ap.add_argument("--ignore", action="append", default=[], metavar="GLOB",
                    help="leave out the figures whose path matches (fnmatch; repeatable)")
    ap.add_argument("--allow-added", action="store_true",
                    help="figures only the second report holds (a report that gained fields) are counted, not differences")
    args = ap.parse_args(argv)
    if not (args.rtol >= 0 and args.atol >= 0):
        ap.error("--rtol and --atol must be numbers >= 0")
    try:
        result = compare(load_report(args.before), load_report(args.after), args.rtol, args.atol,
                         tuple(args.ignore), args.allow_added)
    except ReportError as e:
        print(f"compare_reports: error: {e}", file=sys.stderr)
        return 2
    for path, va, vb, rel, beyond in result["differing"]:
        rel_text = "n/a" if rel is None else f"{rel:.3g}"
        print(f"{'DIFFERS' if beyond else 'within '}  {path}: {_show(va)} -> {_show(vb)}  (relative {rel_text})")
    print(f"{result['figures']} figures compared, {len(result['differing'])} not identical, "
          f"{result['beyond_tolerance']} beyond rtol {args.rtol:g} / atol {args.atol:g}; "
          f"max relative difference {result['max_relative_difference']:.3g}"
          + (f"; {len(result['added'])} only in the second report" if args.allow_added else ""))
    return 1 if result["beyond_tolerance"] else 0


if __name__ == "__main__":
    sys.exit(main())
