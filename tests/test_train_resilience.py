"""Training that survives a cluster, end to end through `zsprob pretrain` subprocesses: pre-emption
signals, interrupted checkpoint writes, `--resume auto`, and a torchrun group restarted after one
worker is SIGKILLed. Every resumed run must reproduce the per-step losses of an uninterrupted one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, read_losses, tiny_model_args

STEPS = 12


def pretrain_args(tiny_world: Path, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """`zsprob pretrain` on the tiny towers: 64 samples, batch 16 (4 steps per epoch), noisy captions and
    MSDA on (both draw random numbers every step), a loss record every step."""
    return ["pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), "--out", str(out),
            *tiny_model_args(), "--batch-size", "16", "--workers", "0", "--threads", "1",
            "--steps", str(steps), "--log-every", "1", "--checkpoint-every", "3", "--no-progress",
            "--set", "train.tensorboard=false", "--set", "train.keep_checkpoints=3",
            "--set", "data.shuffle_buffer=32", "--set", "schedule.name=cosine", "--set", "optim.name=adamw",
            "--set", "optim.lr=2e-3", "--set", "schedule.warmup_steps=2", "--precision", "fp32", "--msda",
            "--noise-ratio", "0.25", *extra]


def env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ZSPROB_TEST_"))}
    e.update(PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
             CUDA_VISIBLE_DEVICES="")  # CPU process groups (gloo) on a GPU host too
    e.update(extra)
    return e


def zsprob(*args: str, timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zsprob", *args], env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def zsprob_ok(*args: str) -> None:
    """A run that must succeed (each in its own interpreter: a signal to one never reaches pytest)."""
    r = zsprob(*args)
    assert r.returncode == 0, r.stderr[-3000:]


def signal_after_two_steps(args: list[str], out: Path, sig, group: bool):
    """Start `zsprob` with ``args``, send ``sig`` once OUT/metrics.jsonl has two records (to the process, or
    with ``group`` to its whole process group, as a terminal's Ctrl-C or a scheduler does); (proc, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "zsprob", *args], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=group)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            break
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=300)
    return proc, stdout, stderr


def latest_step(run: Path) -> int:
    return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]


def assert_same_losses(ref: dict, got: dict, steps: int = STEPS, rel: float = 1e-6) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=rel, abs=1e-7), (s, ref[s], got[s])


@pytest.fixture(scope="module")
def reference(tiny_world, tmp_path_factory) -> dict[int, float]:
    """The losses of an uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("ref") / "run"
    zsprob_ok(*pretrain_args(tiny_world, out))
    return read_losses(out)


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_exits_143_and_resumes_exactly(tiny_world, reference, tmp_path):
    out = tmp_path / "run"
    # no periodic checkpoint: the one after the signal is the only one
    args = pretrain_args(tiny_world, out, "--checkpoint-every", "0", steps=STEPS)
    proc, stdout, stderr = signal_after_two_steps(args, out, signal.SIGTERM, group=False)
    assert proc.returncode == 143, (proc.returncode, stderr[-3000:])
    assert stderr.strip().count("\n") == 0 and "pre-empted" in stderr and "--resume auto" in stderr
    stopped = latest_step(out)
    assert 2 <= stopped < STEPS and max(read_losses(out)) == stopped  # the step in progress was finished
    assert not (out / "model").exists()  # no final model: the run is not over
    zsprob_ok(*args, "--resume", "auto")
    assert_same_losses(reference, read_losses(out))


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_checkpoints_exits_130_and_resumes_exactly(tiny_world, reference, tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: the first SIGINT stops like a
    pre-emption (the step finished, a checkpoint written), says so at once, and exits 130."""
    out = tmp_path / "run"
    args = pretrain_args(tiny_world, out, "--checkpoint-every", "0", steps=STEPS)
    proc, stdout, stderr = signal_after_two_steps(args, out, signal.SIGINT, group=True)
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("zsprob: Ctrl-C: stopping after step") and "again" in lines[0]
    assert lines[1].startswith("zsprob: interrupted: stopped by SIGINT") and "--resume auto" in lines[1]
    stopped = latest_step(out)
    assert 2 <= stopped < STEPS and max(read_losses(out)) == stopped
    zsprob_ok(*args, "--resume", "auto")
    assert_same_losses(reference, read_losses(out))


def test_a_second_ctrl_c_stops_at_once():
    """The first SIGINT is noted (the loop stops after its step); the handler then gives SIGINT back to
    Python's default, so a second one raises KeyboardInterrupt (the CLI: "zsprob: interrupted", 130)."""
    from zsprob.errors import INTERRUPT_EXIT_CODE
    from zsprob.train.resilience import StopSignals
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(exit_code=143, step=4) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.received == "SIGINT" and stop.code() == INTERRUPT_EXIT_CODE == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before
    with StopSignals(exit_code=143) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.received == "SIGTERM" and stop.code() == 143


def test_sigterm_to_the_whole_process_group_with_loader_workers_is_the_same_one_line(tiny_world, tmp_path):
    """A scheduler or `timeout` signals every process of the group, DataLoader workers too: they leave the stop
    to the main process (zsprob.utils.signals), which checkpoints as above; before, a worker killed by the
    signal surfaced as a traceback ("DataLoader worker ... is killed by signal")."""
    out = tmp_path / "run"
    args = pretrain_args(tiny_world, out, "--checkpoint-every", "0", "--workers", "1", steps=400)
    args[args.index("--workers") + 1] = "1"  # the base arguments' --workers 0 too
    proc, stdout, stderr = signal_after_two_steps(args, out, signal.SIGTERM, group=True)
    assert proc.returncode == 143, (proc.returncode, stderr[-3000:])
    assert stderr.strip().count("\n") == 0 and "pre-empted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert latest_step(out) >= 2


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_half_way_is_never_resumed(tiny_world, reference, tmp_path):
    out = tmp_path / "run"
    # the write of step 6 fails after the model, before the optimiser state: one line, exit 2
    r = zsprob(*pretrain_args(tiny_world, out), ZSPROB_TEST_FAULT="checkpoint-mid:6:raise")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "checkpoint of step 6 failed" in r.stderr and "step-0000003" in r.stderr
    assert latest_step(out) == 3 and not (out / "checkpoints" / "step-0000006").exists()
    # the same, killed outright (SIGKILL) half-way through the write of step 9 of a new run
    out2 = tmp_path / "run2"
    r = zsprob(*pretrain_args(tiny_world, out2), ZSPROB_TEST_FAULT="checkpoint-mid:9:kill")
    assert r.returncode == -signal.SIGKILL
    assert latest_step(out2) == 6 and list((out2 / "checkpoints").glob(".tmp-*"))  # a torn directory is left
    # even with latest.json gone, auto picks the newest complete step directory, never the torn one
    (out2 / "checkpoints" / "latest.json").unlink()
    for run in (out, out2):
        zsprob_ok(*pretrain_args(tiny_world, run), "--resume", "auto")
        assert_same_losses(reference, read_losses(run))
    assert not list((out2 / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_a_signal_during_a_checkpoint_write_loses_nothing(tiny_world, reference, tmp_path):
    out = tmp_path / "run"
    # SIGUSR1 arrives half-way through writing step 6: the write completes, then the run stops
    r = zsprob(*pretrain_args(tiny_world, out, "--requeue-exit-code", "99"), ZSPROB_TEST_FAULT="checkpoint-mid:6:SIGUSR1")
    assert r.returncode == 99, r.stderr[-3000:]
    assert "SIGUSR1" in r.stderr and "after step 6" in r.stderr
    assert latest_step(out) == 6 and max(read_losses(out)) == 6
    from zsprob.train.resilience import is_complete
    assert is_complete(out / "checkpoints" / "step-0000006")
    zsprob_ok(*pretrain_args(tiny_world, out), "--resume")  # --resume alone: latest
    assert_same_losses(reference, read_losses(out))


def test_resume_modes(tmp_path, monkeypatch):
    from zsprob.errors import UserError
    from zsprob.train.resilience import find_resume_dir, resume_mode
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)
    assert resume_mode(None) is None and resume_mode(False) is None and resume_mode(True) == "latest"
    assert find_resume_dir("auto", tmp_path) is None  # nothing yet: a fresh start
    with pytest.raises(UserError, match="nothing to resume"):
        find_resume_dir("latest", tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_mode(None) == "auto" and resume_mode(False) is None


def _torchrun(tiny_world: Path, out: Path, **extra_env: str) -> tuple[int, str]:
    """(exit code, the launcher's and the workers' output) of a 2-process torchrun allowed one restart."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "-m", "zsprob", *pretrain_args(tiny_world, out)]
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env(**extra_env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:  # kill the launcher and its workers, and show what they said
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"torchrun did not finish in 400 s; its log ends:\n{log.read_text()[-6000:]}")
    return rc, log.read_text()


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_restarts_a_group_after_sigkill_and_matches_the_uninterrupted_run(tiny_world, tmp_path):
    """torchrun --max-restarts 1: rank 1 is SIGKILLed right after the first checkpoint (step 3); the
    agent restarts both workers, which resume "auto" (the default under torchrun) and finish. The
    restarted group opens its process group under a fresh store prefix (no stale gloo addresses)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    rc, log = _torchrun(tiny_world, full)
    assert rc == 0, log[-4000:]
    rc, log = _torchrun(tiny_world, cut, ZSPROB_TEST_FAULT="checkpoint-done:3:kill:1")
    assert rc == 0, log[-4000:]
    assert "exitcode: -9" in log, log[-4000:]  # the agent saw rank 1 die of SIGKILL
    assert "connectFullMesh failed" not in log, log[-4000:]  # the restarted group met no stale address
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["start_step"] == 3 and summary["world_size"] == 2
    # the same tolerance as the two-process equality test of tests/test_train_distributed.py
    assert_same_losses(read_losses(full), read_losses(cut), rel=1e-4)
