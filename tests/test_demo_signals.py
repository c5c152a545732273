"""Stopping the demo's step runner (zsprob.report.pipeline) with a signal, through real subprocesses.

The runner is run the way `zsprob demo` runs it (a click command under zsprob's own error policy) in a
session of its own, with one long `zsprob pretrain` step on the tiny towers. A signal to the runner, or
to its whole process group, must be passed on to the step (which checkpoints and exits), end in one
stderr line and exit code 143 (130 for SIGINT), leave no process behind, and leave the step not done,
so the same command resumes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, tiny_model_args

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists() or not hasattr(os, "killpg"),
                                reason="needs POSIX signals and /proc")

RUNNER = """
import json, sys
from pathlib import Path
import click
from zsprob.cli import cli, main
from zsprob.report import pipeline

spec = json.loads(sys.argv[1])
if spec.get("grace") is not None:
    pipeline.STOP_GRACE_S = spec["grace"]
if spec.get("argv") is not None:  # the step runs this command instead of `python -m zsprob ARGS`
    pipeline.step_command = lambda args: spec["argv"]
step = pipeline.Step(spec["name"], "a long step", spec["args"], outputs=[Path(spec["output"])],
                     resume_args=["--resume", "auto"], started_marker=spec["started"])

@click.command("steps")
def steps():
    pipeline.run_steps(Path(spec["out"]), [step], echo=click.echo)

cli.add_command(steps)
main(["steps"])
"""

# a step that ignores the stop signals
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(300)")


def _env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ZSPROB_"))}
    e.update(PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return e


def _pretrain(tiny_world: Path, run: Path, workers: int) -> list[str]:
    """A tiny `zsprob pretrain` that would take far longer than a test: it is always stopped."""
    return ["pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), "--out", str(run),
            *tiny_model_args(), "--batch-size", "16", "--workers", str(workers), "--threads", "1",
            "--steps", "100000", "--log-every", "1", "--checkpoint-every", "0", "--no-progress",
            "--set", "train.tensorboard=false", "--precision", "fp32"]


def _start(spec: dict) -> subprocess.Popen:
    # a session of its own: os.killpg reaches the runner's group, never pytest
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(spec)], env=_env(), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _processes_with(marker: str) -> set[int]:
    """Live (not zombie) processes whose command line contains ``marker``."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.add(int(d.name))
    return found


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the runner ended before {what}: {proc.returncode} {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.05)


def _trained(run: Path, n: int = 2):
    return lambda: (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= n


def _stop(proc: subprocess.Popen, sig: int, group: bool) -> tuple[int, str, str]:
    (os.killpg if group else os.kill)(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _spec(tmp_path: Path, args: list[str], run: Path, **extra) -> dict:
    return {"out": str(tmp_path), "name": "pretrain-tiny", "args": args, "output": str(run / "model" / "zsprob.json"),
            "started": str(run / "config.yaml"), **extra}


def _assert_one_line(err: str, code: int, rc: int, signame: str) -> str:
    assert rc == code, (rc, err[-3000:])
    assert "Traceback" not in err and err.strip().count("\n") == 0, err[-3000:]
    line = err.strip()
    assert line.startswith("zsprob: pre-empted: stopped during step 'pretrain-tiny'"), line
    assert f"({signame}" in line and line.endswith("run the same command to resume"), line
    return line


def test_sigterm_to_the_runner_stops_the_step_which_checkpoints_and_the_same_command_resumes(tiny_world, tmp_path):
    run = tmp_path / "run"
    spec = _spec(tmp_path, _pretrain(tiny_world, run, workers=0), run)
    proc = _start(spec)
    _wait_for(_trained(run), proc, "training")
    assert len(_processes_with(str(run))) >= 2  # the runner and its pretrain step
    rc, out, err = _stop(proc, signal.SIGTERM, group=False)
    line = _assert_one_line(err, 143, rc, "SIGTERM")
    assert "it saved a checkpoint after step" in line, line
    assert not _processes_with(str(run)), "a step outlived the runner"
    assert not (tmp_path / ".steps" / "pretrain-tiny.json").exists()
    ckpt = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    assert ckpt >= 2
    # the same command resumes the step from its checkpoint; Ctrl-C (SIGINT) stops it the same way, exit 130
    proc = _start(spec)
    _wait_for(_trained(run, ckpt + 2), proc, "resumed training")
    rc, out, err = _stop(proc, signal.SIGINT, group=False)
    _assert_one_line(err, 130, rc, "SIGINT")
    assert "resuming" in out and "--resume auto" in out, out
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] > ckpt
    assert not _processes_with(str(run)) and not (tmp_path / ".steps" / "pretrain-tiny.json").exists()


def test_sigterm_to_the_whole_process_group_is_one_line_without_data_loader_tracebacks(tiny_world, tmp_path):
    run = tmp_path / "run"
    proc = _start(_spec(tmp_path, _pretrain(tiny_world, run, workers=1), run))
    _wait_for(_trained(run), proc, "training")
    assert len(_processes_with(str(run))) >= 3  # the runner, pretrain and its data loader worker
    rc, out, err = _stop(proc, signal.SIGTERM, group=True)
    line = _assert_one_line(err, 143, rc, "SIGTERM")
    assert "it saved a checkpoint after step" in line, line
    assert not _processes_with(str(run)), "a step or one of its workers outlived the runner"
    assert not (tmp_path / ".steps" / "pretrain-tiny.json").exists()
    assert (run / "checkpoints" / "latest.json").is_file()


def test_a_step_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path):
    marker = str(tmp_path / "stubborn")
    spec = _spec(tmp_path, ["stubborn"], tmp_path, grace=1.0,
                 argv=[sys.executable, "-c", STUBBORN, marker])
    proc = _start(spec)
    _wait_for(lambda: len(_processes_with(marker)) >= 2, proc, "the step")
    time.sleep(1.0)  # the moment it needs to start ignoring them
    t0 = time.monotonic()
    rc, out, err = _stop(proc, signal.SIGUSR1, group=False)
    line = _assert_one_line(err, 143, rc, "SIGUSR1")
    assert "did not exit within 1 s and was killed" in line, line
    assert time.monotonic() - t0 < 30
    assert not _processes_with(marker)
    assert not (tmp_path / ".steps" / "pretrain-tiny.json").exists()
