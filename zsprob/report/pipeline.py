"""A resumable chain of zsprob commands, each run as a real subprocess.

`zsprob demo` is a list of :class:`Step` objects: a command line (``zsprob ...`` exactly as
a user would type it), the files it must leave behind, and a fingerprint of its arguments.
After a step succeeds its fingerprint is written to ``OUT/.steps/NAME.json``; a later run
with the same arguments skips it when its outputs still exist, and re-runs it (and every
step after it) when the arguments changed. A step that died half-way is simply run again;
commands that support it (training) resume from their own checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from zsprob.errors import UserError
from zsprob.utils.io import atomic_write_json


@dataclass
class Step:
    name: str
    title: str
    args: list[str]  # arguments after `zsprob`
    outputs: list[Path]  # files that must exist afterwards
    resume_args: list[str] = field(default_factory=list)  # appended when re-running a started step
    started_marker: Path | None = None  # a file whose presence means "started, can resume"
    fresh_args: list[str] = field(default_factory=list)  # appended instead when a started step must start over

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.args).encode()).hexdigest()[:16]

    def command(self) -> str:
        return "zsprob " + " ".join(shlex.quote(a) for a in self.args)


def _marker(out: Path, step: Step) -> Path:
    return out / ".steps" / f"{step.name}.json"


def is_done(out: Path, step: Step) -> bool:
    m = _marker(out, step)
    if not m.is_file():
        return False
    try:
        rec = json.loads(m.read_text())
    except json.JSONDecodeError:
        return False
    return rec.get("fingerprint") == step.fingerprint() and all(Path(p).exists() for p in step.outputs)


def run_steps(out: Path, steps: Sequence[Step], echo: Callable[[str], None] = print,
              env: dict | None = None, stream: bool = True) -> dict[str, dict]:
    """Run (or skip) each step in order; return {name: {seconds, skipped, command}}."""
    timings: dict[str, dict] = {}
    invalidated = False
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    n = len(steps)
    for i, step in enumerate(steps, 1):
        if not invalidated and is_done(out, step):
            rec = json.loads(_marker(out, step).read_text())
            echo(f"[{i}/{n}] {step.title}: done already ({rec.get('seconds', 0):.0f} s), skipping")
            timings[step.name] = {"seconds": rec.get("seconds", 0.0), "skipped": True,
                                  "command": step.command()}
            continue
        # a step that finished before (its marker: other arguments or lost outputs), or one downstream of a
        # re-run step, starts over; one that was interrupted resumes
        start_over = invalidated or _marker(out, step).is_file()
        invalidated = True  # everything downstream of a re-run step runs again
        args = list(step.args)
        started = step.started_marker is not None and Path(step.started_marker).exists()
        if started and start_over and step.fresh_args:
            args += step.fresh_args
            echo(f"[{i}/{n}] {step.title}: starting over")
        elif started and step.resume_args:
            args += step.resume_args
            echo(f"[{i}/{n}] {step.title}: resuming")
        else:
            echo(f"[{i}/{n}] {step.title}")
        echo(f"      $ zsprob {' '.join(shlex.quote(a) for a in args)}")
        t0 = time.time()
        cmd = [sys.executable, "-m", "zsprob", *args]
        if stream:
            proc = subprocess.run(cmd, env=full_env)
            err_tail = ""
        else:
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
            err_tail = (proc.stderr or "").strip().splitlines()[-1:] if proc.returncode else ""
        dt = time.time() - t0
        if proc.returncode != 0:
            tail = f": {err_tail[0]}" if err_tail else ""
            raise UserError(f"demo step '{step.name}' failed with exit code {proc.returncode}{tail} "
                            f"(command: {step.command()}); fix it and run the demo again to resume")
        missing = [str(p) for p in step.outputs if not Path(p).exists()]
        if missing:
            raise UserError(f"demo step '{step.name}' finished but did not write {missing[0]}")
        atomic_write_json(_marker(out, step), {"fingerprint": step.fingerprint(), "seconds": dt,
                                               "command": step.command()})
        timings[step.name] = {"seconds": dt, "skipped": False, "command": step.command()}
        echo(f"      done in {dt:.1f} s")
    return timings
