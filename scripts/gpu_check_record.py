"""The records of scripts/gpu_check.py: figures, the sections' runner under a time budget, and the report
(OUT/gpu_check.json and OUT/gpu_check.md) rewritten whole after every figure, run and section, each file
through a temporary file and ``os.replace``, so that a run stopped at any point (a time limit, an
out-of-memory kill, the machine taken back) leaves every figure measured so far on disk, in a file that
parses. The section in flight shows as ``running`` (a hard kill) or ``interrupted`` (SIGTERM, Ctrl-C, a
``SystemExit``) with its figures so far."""
from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path


def figure(name: str, value, unit: str, tolerance: str | None = None, ok: bool | None = None, note: str = "") -> dict:
    """One reported number with its unit; ``tolerance`` and ``ok`` for the compared ones."""
    if isinstance(value, float) and not math.isfinite(value):
        value = str(value)
    return {"name": name, "value": value, "unit": unit, "tolerance": tolerance, "pass": ok, "note": note}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    import resource
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def atomic_write(path: Path, text: str) -> None:
    """``path`` holds either its old text or ``text``, never a part of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class LiveFigures(list):
    """A section's list of figures: each one added is on disk before the next line of the section runs."""

    def __init__(self, check: "Check"):
        super().__init__()
        self.check = check

    def append(self, item) -> None:
        super().append(item)
        self.check.save()

    def extend(self, items) -> None:
        super().extend(items)
        self.check.save()

    def __iadd__(self, items):
        self.extend(items)
        return self


class Check:
    """Runs the sections under a time budget and keeps their records, written to ``out`` as they grow."""

    def __init__(self, args, sizes, device: str, tmp: Path, out: Path | None = None, name: str = ""):
        self.args, self.sizes, self.device, self.tmp, self.out = args, sizes, device, tmp, out
        self.device_name = name
        self.t0 = time.perf_counter()
        self.sections: dict[str, dict] = {}
        self.shared: dict = {}
        self.current: dict = {}  # the record of the section in flight

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def figures(self) -> LiveFigures:
        """The figure list of the section in flight (saved on every append)."""
        figs = LiveFigures(self)
        self.current["figures"] = figs
        return figs

    def put(self, key: str, value) -> None:
        """Add ``key`` to the record of the section in flight and save."""
        self.current[key] = value
        self.save()

    def run(self, name: str, fn, need: float) -> None:
        """Run section ``name`` if ``need`` seconds are left of the budget; an exception is recorded
        (with the figures made before it) and the next section runs; an interrupt is recorded and raised."""
        if self.left() < need:
            self.sections[name] = {"status": "skipped", "reason": f"time budget: {self.left():.0f} s left of "
                                   f"{self.args.budget_s:.0f} s, the section needs about {need:g} s", "seconds": 0.0}
            print(f"[{name}] skipped (budget)", flush=True)
            self.save()
            return
        print(f"[{name}] ...", flush=True)
        t, cpu = time.perf_counter(), cpu_seconds()
        self.current = self.sections[name] = {"status": "running"}
        self.save()
        try:
            rec = {"status": "ok", **fn(self)}
        except Exception as e:  # one failing section is recorded; the next one runs
            rec = {**self.current, "status": "error", "error": f"{type(e).__name__}: {e}"[-2000:],
                   "traceback": traceback.format_exc()[-4000:]}
        except BaseException as e:  # SystemExit, KeyboardInterrupt: what was measured stays, then stop
            self.current.update(status="interrupted", error=f"{type(e).__name__}: {e}"[-500:],
                                seconds=round(time.perf_counter() - t, 2))
            self.save()
            raise
        rec["seconds"] = round(time.perf_counter() - t, 2)
        rec["cpu_seconds"] = round(cpu_seconds() - cpu, 2)
        if "figures" in rec:
            rec["figures"] = list(rec["figures"])
            flags = [f["pass"] for f in rec["figures"] if f["pass"] is not None]
            if flags:
                rec["equal"] = all(flags)
        self.current = self.sections[name] = rec
        self.save()
        print(f"[{name}] {rec['status']} in {rec['seconds']:.1f} s"
              + (f" equal={rec['equal']}" if "equal" in rec else "")
              + (f": {rec['error']}" if rec["status"] == "error" else ""), flush=True)

    def sub_timeout(self) -> float:
        """A subprocess may run until the budget is spent, plus a margin for writing the report."""
        return max(30.0, self.left() + 20.0)

    def failed(self) -> list[str]:
        """The sections that raised, stopped or have a figure out of its tolerance."""
        return [name for name, rec in self.sections.items() if rec["status"] in ("error", "interrupted", "running")
                or any(f["pass"] is False for f in rec.get("figures", []))]

    def document(self) -> dict:
        info = self.sections.get("versions", {}).get("info", {})
        return {"device": self.device, "device_name": info.get("device") or self.device_name,
                "quick": self.args.quick, "budget_s": self.args.budget_s, "total_s": round(self.elapsed(), 1),
                "cpu_s": round(cpu_seconds(), 1), "sizes": asdict(self.sizes), "sections": self.sections}

    def save(self) -> None:
        """Rewrite OUT/gpu_check.json and OUT/gpu_check.md from the records as they are now."""
        if self.out is None:
            return
        doc = json.loads(json.dumps(self.document(), default=str))  # a snapshot: later appends do not leak in
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / "gpu_check.json", json.dumps(doc, indent=1))
        atomic_write(self.out / "gpu_check.md", markdown(doc))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if (v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5)) else f"{v:.4g}"
    return "-" if v is None else str(v)


def cell(v) -> str:
    """Text for one Markdown table cell: pipes escaped, one line."""
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict) -> str:
    lines = [f"# zsprob GPU check: {doc['device_name']}", "",
             f"Device: `{doc['device']}` ({doc['device_name']}); quick: {doc['quick']}; "
             f"total {doc['total_s']} s wall ({doc['cpu_s']} CPU s) of a {doc['budget_s']} s budget.", ""]
    info = doc["sections"].get("versions", {}).get("info", {})
    if info:
        lines += ["| version | value |", "| --- | --- |"] + [f"| {k} | {cell(v)} |" for k, v in info.items()] + [""]
    lines += ["Per section: wall seconds (s) and CPU seconds of this process and its children (cpu s).", "",
              "| section | status | s | cpu s | figure | value | unit | tolerance | pass |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rec in doc["sections"].items():
        head = f"| {name} | {rec['status']} | {rec.get('seconds', '')} | {rec.get('cpu_seconds', '')} "
        if rec["status"] != "ok":
            lines.append(head + f"| {cell(rec.get('reason') or rec.get('error', ''))} | | | | |")
            head = "| | | | "
        for f in rec.get("figures", []):
            ok = "" if f["pass"] is None else ("yes" if f["pass"] else "**NO**")
            note = f" ({f['note']})" if f.get("note") else ""
            lines.append(head + f"| {cell(f['name'] + note)} | {cell(fmt(f['value']))} | {cell(f['unit'])} "
                         f"| {cell(f['tolerance'] or '')} | {ok} |")
            head = "| | | | "
        for s in rec.get("skipped", []):
            lines.append(head + f"| {cell(s['what'])}: skipped | | | {cell(s['reason'])} | |")
            head = "| | | | "
    return "\n".join(lines) + "\n"
