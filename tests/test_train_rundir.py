"""Nothing lost, nothing hung: `zsprob pretrain` end to end on the tiny SynthWorld.

A run directory is never clobbered (reuse needs --resume or --overwrite, OUT/.lock keeps a second
writer out, --resume never moves backwards, a finished run is left as it is); a stream that makes no
progress stops with one line (in-process and from a DataLoader worker), and SIGTERM stops it while
it waits for data; --steps with --epochs, unknown config keys and non-finite or non-numeric float
hyper-parameters are one line. Every refusal leaves every file under --out byte-identical.
"""
from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import read_losses, run_cli, tiny_model_args
from test_train_resilience import env


def args_for(tiny_world: Path, out: Path, *extra: str, steps: int = 5) -> list[str]:
    return ["pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), "--out", str(out),
            *tiny_model_args(), "--batch-size", "16", "--workers", "0", "--threads", "1", "--steps", str(steps),
            "--log-every", "1", "--checkpoint-every", "3", "--no-progress", "--set", "train.tensorboard=false",
            *extra]


def tree_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (an absent root: empty)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_error(r, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("zsprob: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in errors[0], errors[0]


@pytest.fixture(scope="module")
def finished(tiny_world, tmp_path_factory) -> Path:
    """A finished 5-step run (checkpoints at 3 and 5), never changed by the tests that read it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    r = run_cli(*args_for(tiny_world, out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_reusing_a_run_directory_needs_resume_or_overwrite(tiny_world, finished):
    before = tree_hashes(finished)
    r = run_cli(*args_for(tiny_world, finished))
    assert_one_error(r, "--resume", "--overwrite", "already holds a run")
    assert tree_hashes(finished) == before and not (finished / ".lock").exists()
    # --overwrite with --resume contradict each other
    r = run_cli(*args_for(tiny_world, finished, "--overwrite", "--resume"))
    assert_one_error(r, "--overwrite", "--resume")
    assert tree_hashes(finished) == before


def test_an_empty_out_is_fine_and_overwrite_starts_afresh(tiny_world, finished, tmp_path):
    import shutil
    out = tmp_path / "empty"
    out.mkdir()
    r = run_cli(*args_for(tiny_world, out, "--checkpoint-every", "0", steps=2))
    assert r.returncode == 0, r.stderr[-2000:]
    # a copy of the finished 5-step run (plus a later step directory), overwritten by a 4-step run
    old = tmp_path / "old"
    shutil.copytree(finished, old)
    (old / "checkpoints" / "step-0000099").mkdir()
    r = run_cli(*args_for(tiny_world, old, "--overwrite", steps=4))
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(read_losses(old)) == [1, 2, 3, 4]
    assert json.loads((old / "summary.json").read_text())["steps"] == 4
    steps = sorted(p.name for p in (old / "checkpoints").glob("step-*"))  # the old step-5 and step-99 are gone
    assert steps[-1] == "step-0000004" and set(steps) <= {"step-0000003", "step-0000004"}
    assert json.loads((old / "checkpoints" / "latest.json").read_text())["step"] == 4
    assert not (old / ".lock").exists()


def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(tiny_world, finished, tmp_path):
    import os
    import shutil
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    # a live process on this host holds the lock (this test's own interpreter)
    (out / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    before = tree_hashes(out)
    r = run_cli(*args_for(tiny_world, out, "--resume", steps=6))
    assert_one_error(r, "in use by another run", ".lock")
    assert tree_hashes(out) == before
    # a lock of a process that is gone: taken over with a warning, the run continues, the lock released
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    r = run_cli(*args_for(tiny_world, out, "--resume", steps=6))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stale lock" in r.stderr
    assert sorted(read_losses(out)) == [1, 2, 3, 4, 5, 6] and not (out / ".lock").exists()
    assert "trained pcmepp for step 6 (resumed at step 5)" in r.stdout  # not "for 6 steps": one step ran


def test_resume_never_moves_backwards(tiny_world, finished):
    before = tree_hashes(finished)
    r = run_cli(*args_for(tiny_world, finished, "--resume", steps=3))
    assert_one_error(r, "step 5", "3 steps", "never goes back")
    assert tree_hashes(finished) == before and not (finished / ".lock").exists()


def test_resuming_a_finished_run_changes_nothing(tiny_world, finished):
    before = tree_hashes(finished)
    for resume in (["--resume"], ["--resume", "auto"]):
        r = run_cli(*args_for(tiny_world, finished, *resume))
        assert r.returncode == 0, r.stderr[-2000:]
        assert "already finished" in r.stdout and "nan" not in r.stdout
        assert tree_hashes(finished) == before and not (finished / ".lock").exists()


def test_steps_with_epochs_is_one_line(tiny_world, tmp_path):
    out = tmp_path / "run"
    r = run_cli(*args_for(tiny_world, out, "--epochs", "2"))
    assert_one_error(r, "--steps", "--epochs", "drop one")
    r = run_cli(*args_for(tiny_world, out, "--set", "schedule.epochs=2"))
    assert_one_error(r, "schedule.steps", "schedule.epochs", "drop one")
    assert tree_hashes(out) == {}


@pytest.mark.parametrize("setting, words", [
    ("optim.lrr=1", ("unknown config key optim.lrr", "optim.lr?")),
    ("train.chekpoint_every=5", ("train.chekpoint_every", "train.checkpoint_every?")),
    ("optim.grad_clip=nan", ("optim.grad_clip", "finite")),
    ("loss.pcmepp.pp_alpha=nan", ("loss.pcmepp.pp_alpha", "finite")),
    ("optim.lr=abc", ("optim.lr", "finite number")),
    ("optim.betas=5", ("optim.betas", "2 finite numbers")),
    ("model.overrides.image_size=0", ("model.overrides.image_size", "at least 1")),
])
def test_bad_config_values_are_one_line(tiny_world, finished, tmp_path, setting, words):
    before = tree_hashes(finished)
    r = run_cli(*args_for(tiny_world, finished, "--resume", "--set", setting, steps=6))
    assert_one_error(r, *words)
    assert tree_hashes(finished) == before


def test_lr_inf_and_a_typo_in_a_recipe_are_one_line(tiny_world, tmp_path):
    out = tmp_path / "run"
    r = run_cli(*args_for(tiny_world, out, "--lr", "inf"))
    assert_one_error(r, "optim.lr", "finite")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("base: synthetic_tiny.yaml\noptim:\n  weight_decy: 0.1\n")
    r = run_cli(*args_for(tiny_world, out, "--config", str(recipe)))
    assert_one_error(r, "optim.weight_decy", "optim.weight_decay?")
    assert tree_hashes(out) == {}


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_stream_that_skips_everything_stops_with_one_line(tiny_world, tmp_path, workers):
    out = tmp_path / "run"
    r = run_cli(*args_for(tiny_world, out, "--workers", workers, "--set", "data.pipeline.caption_key=json:nokey",
                          "--set", "data.pipeline.max_consecutive_skips=300"), timeout=300)
    assert_one_error(r, "skipped 300 samples in a row", "missing_caption 300", "max_consecutive_skips")
    assert not (out / ".lock").exists()


@pytest.mark.slow
def test_sigterm_stops_a_run_stuck_in_data_loading(tiny_world, tmp_path):
    out = tmp_path / "run"
    args = args_for(tiny_world, out, "--workers", "1", "--set", "data.pipeline.caption_key=json:nokey",
                    "--set", "data.pipeline.max_consecutive_skips=1000000000")
    proc = subprocess.Popen([sys.executable, "-m", "zsprob", *args], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:  # skipping samples: the loop is waiting for its first batch
            lines.append(line)
            if "#1000 on" in line:
                break
        proc.send_signal(signal.SIGTERM)
        started = time.time()
        rest = proc.communicate(timeout=90)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - started < 60
    assert proc.returncode == 143, rest[-2000:]
    stops = [line for line in rest.splitlines() if line.startswith("zsprob:") and " warning: " not in line]
    assert len(stops) == 1 and "waiting for training data" in stops[0] and "SIGTERM" in stops[0]
    assert not (out / ".lock").exists()


@pytest.mark.slow
def test_the_demo_runner_resumes_an_interrupted_run_and_replaces_one_with_other_arguments(tiny_world, tmp_path,
                                                                                         monkeypatch):
    """zsprob demo's step runner: a finished pretrain re-run with other arguments starts over (--overwrite);
    an interrupted one (config.yaml, no step marker) continues (--resume auto)."""
    from zsprob.report.pipeline import Step, run_steps

    for name, value in env().items():  # the steps inherit it: this checkout, one thread, no GPU
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"

    def step(steps: int) -> Step:
        return Step("pretrain", "tiny pretrain", args_for(tiny_world, run, steps=steps)[:],
                    outputs=[run / "model" / "zsprob.json"], resume_args=["--resume", "auto"],
                    fresh_args=["--overwrite"], started_marker=run / "config.yaml")

    log: list[str] = []
    run_steps(tmp_path, [step(4)], echo=log.append, stream=False)
    run_steps(tmp_path, [step(3)], echo=log.append, stream=False)  # other arguments: start over
    assert any("starting over" in line for line in log)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["start_step"]) == (3, 0) and sorted(read_losses(run)) == [1, 2, 3]
    # interrupted after its checkpoint at step 3 of 5: the marker of the 3-step run is gone, the run resumes
    (tmp_path / ".steps" / "pretrain.json").unlink()
    (run / "summary.json").unlink()
    run_steps(tmp_path, [step(5)], echo=log.append, stream=False)
    assert any("resuming" in line for line in log)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["start_step"]) == (5, 3) and sorted(read_losses(run)) == [1, 2, 3, 4, 5]


def test_a_warmup_as_long_as_the_run_is_one_warning_line(tiny_world, tmp_path):
    r = run_cli(*args_for(tiny_world, tmp_path / "run", "--set", "schedule.warmup_steps=10", steps=2))
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [line for line in r.stderr.splitlines() if "warm-up" in line]
    assert warned == ["zsprob: warning: the warm-up (10 steps) is not shorter than the run (2 steps): the learning "
                      "rate never reaches optim.lr; shorten it with --set schedule.warmup_steps=N"], r.stderr[-2000:]
    assert "UserWarning" not in r.stderr and "warnings.warn(" not in r.stderr


def test_the_warmup_warning_only_when_the_warmup_fills_the_run():
    import warnings as w

    from zsprob.train.defaults import resolve_config
    from zsprob.train.schedule import resolve_schedule, warn_if_warmup_fills

    plan = resolve_schedule(resolve_config({"schedule": {"steps": 5, "warmup_steps": 5}}), None)
    with pytest.warns(UserWarning, match=r"warm-up \(5 steps\) is not shorter than the run \(5 steps\)"):
        warn_if_warmup_fills(plan.warmup, plan.total_steps)
    with w.catch_warnings():
        w.simplefilter("error")
        warn_if_warmup_fills(5, 6)
