"""A resumable chain of zsprob commands, each run as a real subprocess.

A :class:`Step` is a command line as a user would type it, the files it must leave and a fingerprint of its
arguments (``OUT/.steps/NAME.json`` once it succeeds): a later run skips a finished step and re-runs a changed
one and every step after it. :class:`StopGuard` passes SIGTERM / SIGINT / SIGUSR1 on to the running step (its
own session), waits :data:`STOP_GRACE_S`, then raises :class:`zsprob.errors.Preempted` (exit 130 for SIGINT,
else 143); the step stays unmarked. On Linux a step also gets SIGTERM when the runner dies."""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from zsprob.errors import Preempted, UserError, stop_exit_code
from zsprob.utils.io import atomic_write_json
from zsprob.utils.signals import install_stop_handlers, restore_handlers

#: seconds a step is given to exit after the runner passed a stop signal on to it; then it is killed
STOP_GRACE_S = 60.0
#: seconds between two looks at whether the running step has exited
POLL_S = 0.1


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


def step_command(args: Sequence[str]) -> list[str]:
    """The child process of a step with arguments ``args`` (after ``zsprob``)."""
    return [sys.executable, "-m", "zsprob", *args]


def _marker(out: Path, step: Step) -> Path:
    return out / ".steps" / f"{step.name}.json"


def is_done(out: Path, step: Step) -> bool:
    try:
        rec = json.loads(_marker(out, step).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return rec.get("fingerprint") == step.fingerprint() and all(Path(p).exists() for p in step.outputs)


class StopGuard:
    """Context manager: the stop signals are recorded (:attr:`received`) and passed on to the running step
    (:attr:`proc`); handlers in the main thread only, restored on exit. :attr:`active`: the one installed now."""

    active: "StopGuard | None" = None

    def __init__(self):
        self.received: str | None = None
        self.deadline: float | None = None  # time.monotonic() by which the step must have exited
        self.proc: subprocess.Popen | None = None
        self._old: dict = {}

    def __enter__(self) -> "StopGuard":
        self._old = install_stop_handlers(self._handler)
        StopGuard.active = self
        return self

    def __exit__(self, *exc) -> None:
        restore_handlers(self._old)
        if StopGuard.active is self:
            StopGuard.active = None

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self.deadline = time.monotonic() + STOP_GRACE_S
        self.forward()

    def forward(self) -> None:
        """Pass the stop on to the running step's main process (SIGINT as SIGTERM), if any."""
        proc = self.proc
        if self.received is None or proc is None or proc.returncode is not None:
            return
        sig = signal.SIGTERM if self.received == "SIGINT" else getattr(signal, self.received)
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stopped(self, where: str, detail: str = "", step: int = 0) -> Preempted:
        return Preempted(f"stopped {where} ({self.received}{detail}); run the same command to resume",
                         exit_code=stop_exit_code(self.received), step=step)

    def check(self, where: str) -> None:
        """Raise :class:`Preempted` if a stop signal has come."""
        if self.received is not None:
            raise self.stopped(where)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send the child SIGTERM when the runner dies (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the runner died before that: stop now
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class _Stderr(threading.Thread):
    """Copies a step's stderr to ours (``show``) until a stop signal has come; what follows is held back.
    Keeps the last 64 KB either way (:attr:`tail`)."""

    def __init__(self, pipe, show: bool, guard: StopGuard):
        super().__init__(daemon=True)
        self.pipe, self.show, self.guard = pipe, show, guard
        self.tail = ""
        self.open_line = False  # what we copied ends without a newline (a progress bar)

    def run(self) -> None:
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        fd = self.pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            text = decode(chunk, final=not chunk)
            if self.show and self.guard.received is None:
                self._write(text)
            self.tail = (self.tail + text)[-65536:]
            if not chunk:
                break
        self.pipe.close()

    def _write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):
            return
        if text:
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        """End a progress bar's line that was copied, so that a message after it starts a line of its own."""
        if self.open_line:
            self._write("\n")


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the step's process has exited, without reaping it (its pid, and so its process group id,
    stay reserved until :meth:`Popen.wait`)."""
    if hasattr(os, "waitid"):
        try:
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True
    return proc.poll() is not None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the step's process group (its session: the step and whatever it started)."""
    if os.name == "posix" and proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _run_child(args: list[str], env: dict, stream: bool, guard: StopGuard) -> tuple[int, bool, _Stderr]:
    """Run one step to its end: (exit code, whether it was killed after :data:`STOP_GRACE_S`, its stderr)."""
    posix = os.name == "posix"
    proc = subprocess.Popen(step_command(args), env=env, stdout=None if stream else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=posix,
                            preexec_fn=_die_with_parent() if posix else None)
    guard.proc = proc
    err = _Stderr(proc.stderr, stream, guard)
    err.start()
    killed = False
    try:
        guard.forward()  # a signal that came while it started
        while not _exited(proc):
            if guard.deadline is not None and time.monotonic() > guard.deadline and not killed:
                _kill_group(proc)
                killed = True
            time.sleep(POLL_S)
    finally:
        _kill_group(proc)  # what the step left behind (data loader workers, a pool) goes with it
        rc = proc.wait()
        guard.proc = None
    err.join(timeout=10)
    err.end_line()
    return rc, killed, err


def _stop_detail(rc: int, killed: bool, saved: re.Match | None) -> str:
    if killed:
        return f"; it did not exit within {STOP_GRACE_S:.0f} s and was killed"
    if saved:
        return f"; it saved a checkpoint after step {saved[1]} of {saved[2]}"
    return f"; it exited with code {rc}"


def _child_env(stream: bool) -> dict:
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if stream and "COLUMNS" not in full_env and sys.stderr.isatty():
        # the step's stderr is a pipe: progress bars learn the terminal's width from here
        size = shutil.get_terminal_size()
        full_env.update(COLUMNS=str(size.columns), LINES=str(size.lines))
    return full_env


def _step_args(out: Path, step: Step, invalidated: bool, head: str, echo: Callable[[str], None]) -> list[str]:
    """The step's arguments, with ``resume_args`` / ``fresh_args`` when it was started before; echoes them."""
    # a step that finished before (its marker: other arguments or lost outputs), or one downstream of a
    # re-run step, starts over; one that was interrupted resumes
    start_over = invalidated or _marker(out, step).is_file()
    args = list(step.args)
    started = step.started_marker is not None and Path(step.started_marker).exists()
    if started and start_over and step.fresh_args:
        args += step.fresh_args
        echo(f"{head}: starting over")
    elif started and step.resume_args:
        args += step.resume_args
        echo(f"{head}: resuming")
    else:
        echo(head)
    echo(f"      $ zsprob {' '.join(shlex.quote(a) for a in args)}")
    return args


def _run_step(out: Path, step: Step, args: list[str], env: dict, stream: bool, guard: StopGuard) -> float:
    """Run one step; write its done-marker when it succeeded; return its seconds."""
    t0 = time.time()
    rc, killed, err = _run_child(args, env, stream, guard)
    dt = time.time() - t0
    if guard.received is not None and (rc != 0 or killed):
        saved = re.search(r"after step (\d+) of (\d+); checkpoint", err.tail)  # the step's own stop line
        raise guard.stopped(f"during step '{step.name}'", _stop_detail(rc, killed, saved),
                            step=int(saved[1]) if saved else 0)
    if rc != 0:
        lines = err.tail.strip().splitlines()[-1:] if not stream else []
        tail = f": {lines[0]}" if lines else ""
        raise UserError(f"step '{step.name}' failed with exit code {rc}{tail} "
                        f"(command: {step.command()}); fix it and run the same command again to resume")
    missing = [str(p) for p in step.outputs if not Path(p).exists()]
    if missing:
        raise UserError(f"step '{step.name}' finished but did not write {missing[0]}")
    atomic_write_json(_marker(out, step), {"fingerprint": step.fingerprint(), "seconds": dt,
                                           "command": step.command()})
    return dt


def run_steps(out: Path, steps: Sequence[Step], echo: Callable[[str], None] = print,
              stream: bool = True) -> dict[str, dict]:
    """Run (or skip) each step in order; return {name: {seconds, skipped, command}}. A stop signal raises
    :class:`zsprob.errors.Preempted` once the running step has exited (module docstring)."""
    timings: dict[str, dict] = {}
    invalidated = False
    full_env = _child_env(stream)
    n = len(steps)
    with (nullcontext(StopGuard.active) if StopGuard.active else StopGuard()) as guard:
        for i, step in enumerate(steps, 1):
            guard.check(f"before step '{step.name}'")
            if not invalidated and is_done(out, step):
                rec = json.loads(_marker(out, step).read_text())
                echo(f"[{i}/{n}] {step.title}: done already ({rec.get('seconds', 0):.0f} s), skipping")
                timings[step.name] = {"seconds": rec.get("seconds", 0.0), "skipped": True,
                                      "command": step.command()}
                continue
            args = _step_args(out, step, invalidated, f"[{i}/{n}] {step.title}", echo)
            invalidated = True  # everything downstream of a re-run step runs again
            dt = _run_step(out, step, args, full_env, stream, guard)
            timings[step.name] = {"seconds": dt, "skipped": False, "command": step.command()}
            echo(f"      done in {dt:.1f} s")
        guard.check(f"after step '{steps[-1].name}'" if steps else "before its first step")
    return timings
