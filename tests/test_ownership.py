"""A command writes only into what it created or what ``--overwrite`` names (docs/ownership.md).

End to end in child processes on the quick SynthWorld with tiny runs: a finished run is never trained over by
``--resume auto`` (nor by torchrun's default), no output of any command lands inside a run or a world,
``data synthetic`` never writes into a folder of other files and two of them never share one, a refused run
leaves nothing behind, ``--resume`` takes the newest complete checkpoint when the pointer or the latest one is
damaged, and a run records its data path absolutely, so a resume from another folder or with another spelling
of the same path trains on what the run began with. Each test copies the run it may touch.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from test_outputs_guard import digest, refused

TINY = ["--config", "configs/synthetic_tiny.yaml", "--batch-size", "8", "--no-progress", "--workers", "0"]


def _ok(r) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """BASE/world (quick preset, seed 5) and BASE/run: 4 steps with checkpoints at steps 2 and 4, trained from
    BASE with the relative --shards world/pretrain."""
    base = tmp_path_factory.mktemp("own")
    _ok(run_cli("data", "synthetic", "--preset", "quick", "--seed", "5", "--out", "world", "--no-progress", cwd=base))
    _ok(run_cli("pretrain", *TINY, "--data", "synthetic", "--shards", "world/pretrain", "--steps", "4",
                "--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=2", "--out", "run",
                cwd=base))
    return base


@pytest.fixture
def run(base, tmp_path):
    """A copy of the finished run (absolute paths inside it still name BASE/world)."""
    return Path(shutil.copytree(base / "run", tmp_path / "run"))


def _resume(run: Path, *extra: str, cwd, steps: int = 6):
    return run_cli("pretrain", "--out", run, "--steps", str(steps), "--no-progress", "--workers", "0", *extra, cwd=cwd)


# ----------------------------------------------------------------- a finished run is never trained over
@pytest.mark.parametrize("how", ["--resume auto", "torchrun's default"])
def test_a_finished_run_without_checkpoints_is_never_trained_over(base, run, how):
    shutil.rmtree(run / "checkpoints")  # a normal way to save disk once a run is done
    before = digest(run)
    extra, env = (["--resume", "auto"], None) if how == "--resume auto" else ([], {"TORCHELASTIC_RUN_ID": "own"})
    r = run_cli("pretrain", *TINY, "--data", "synthetic", "--shards", "world/pretrain", "--steps", "4",
                "--out", run, *extra, cwd=base, env=env)
    refused(r, "holds a finished run", "--overwrite")
    assert digest(run) == before


# ----------------------------------------------------------------- one rule for every output
FILE_OUT = ["select-prompts", "zeroshot synthetic", "eval synthetic", "index search"]
DIR_OUT = ["index build", "export", "convert", "posthoc", "demo", "data synthetic", "pretrain", "finetune coco"]


@pytest.mark.parametrize("command", FILE_OUT + DIR_OUT)
def test_no_output_lands_inside_a_run(base, run, command):
    """--out first, so that it is the first value checked: every command refuses it in the one shared rule."""
    target = (run / "config.yaml" if command in FILE_OUT else run / "checkpoints" / "step-0000004" / "model")
    before = digest(run)
    refused(run_cli(*command.split(), "--out", target, cwd=base), "is inside the training run", str(run))
    assert digest(run) == before


def test_select_prompts_never_replaces_a_checkpoint_or_writes_into_a_world(base, run):
    weights = run / "checkpoints" / "step-0000004" / "model" / "model.safetensors"
    before, world = digest(run), digest(base / "world")
    args = ["select-prompts", "--checkpoint", run / "model", "--dataset", "synthetic", "--root", base / "world",
            "--device", "cpu", "--workers", "0"]
    refused(run_cli(*args, "--out", weights, cwd=base), "inside the training run")
    refused(run_cli(*args, "--out", base / "world" / "sel.json", cwd=base), "inside the SynthWorld")
    assert digest(run) == before and digest(base / "world") == world


def test_pretrain_into_a_world_is_refused(base, tmp_path):
    before = digest(base / "world")
    refused(run_cli("pretrain", *TINY, "--data", "synthetic", "--shards", "world/pretrain", "--steps", "4",
                    "--out", base / "world", cwd=base), "is the SynthWorld")
    assert digest(base / "world") == before


# ----------------------------------------------------------------- data synthetic
def test_data_synthetic_writes_only_into_a_new_folder_or_its_own_world(base, run, tmp_path):
    mine = tmp_path / "mine"
    (mine / "pretrain").mkdir(parents=True)
    (mine / "pretrain" / "shard-000000.tar").write_text("the user's own file")
    (mine / "notes.txt").write_text("keep me")
    before = digest(mine)
    for out, needle in ((mine, "holds files but no SynthWorld"), (run, "is the training run")):
        refused(run_cli("data", "synthetic", "--preset", "quick", "--out", out, "--no-progress", "--overwrite",
                        cwd=tmp_path), needle)
    assert digest(mine) == before
    assert not (run / "manifest.json").exists()


def test_two_concurrent_data_synthetic_runs_never_both_succeed(tmp_path):
    """Two real processes, other seeds, one folder: the second, started once the first has begun writing, is
    refused by the first's lock (while the first runs); the first's world is whole."""
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def start(seed: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "zsprob", "data", "synthetic", "--preset", "quick", "--seed",
                                 str(seed), "--num-pretrain", "6000", "--out", str(tmp_path / "w"), "--no-progress"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start(1)
    while not (tmp_path / "w" / ".synthworld-params.json").exists() and first.poll() is None:
        time.sleep(0.05)  # synchronisation only: the first run has claimed the folder
    second = start(2)
    _, err = second.communicate(timeout=300)
    first_running = first.poll() is None
    assert second.returncode == 2 and err.count("\n") == 1, err[-3000:]
    if first_running:  # (on a very slow start of the second, the first may be done: refused by its manifest)
        assert "in use by another run" in err, err
    out, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1[-3000:]
    assert json.loads((tmp_path / "w" / "manifest.json").read_text())["seed"] == 1
    assert not (tmp_path / "w" / ".lock").exists()
    r = _ok(run_cli("data", "synthetic", "--preset", "quick", "--seed", "1", "--num-pretrain", "6000", "--out",
                    tmp_path / "w", "--no-progress", cwd=tmp_path))
    assert '"rendered": 0' in r.stdout  # the world is whole: the rerun regenerates nothing


# ----------------------------------------------------------------- refused commands leave nothing
def test_a_refused_run_leaves_no_folder_config_or_tensorboard(base, tmp_path):
    shards = tmp_path / "bad"
    shards.mkdir()
    (shards / "a.tar").write_text("not a tar file")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["--data", "webdataset", "--shards", shards], tmp_path / "new", "no full batch"),
             (["--data", "synthetic", "--shards", base / "world" / "pretrain", "--set", "model.name=nonexistent"],
              empty, "unknown model"),
             (["--data", "synthetic", "--shards", base / "world" / "pretrain", "--method", "infonce",
               "--batch-size", "1"], tmp_path / "one", "--batch-size 1")]
    for args, out, needle in cases:
        r = run_cli("pretrain", *TINY, "--steps", "4", *args, "--out", out, cwd=tmp_path)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "new").exists() and not (tmp_path / "one").exists()
    assert empty.is_dir() and not list(empty.iterdir())  # the user's empty folder stays, empty


def test_an_invalid_topk_writes_no_cache(base, tmp_path):
    r = run_cli("select-prompts", "--checkpoint", base / "run" / "model", "--dataset", "synthetic", "--root",
                base / "world", "--device", "cpu", "--workers", "0", "--topk", "81", "--out", tmp_path / "sel.json",
                cwd=tmp_path)
    refused(r, "--topk must be between 1 and 80")
    assert not list(tmp_path.iterdir())


def test_a_killed_export_does_not_block_the_rerun_with_overwrite(tmp_path):
    from test_export import _tiny
    from zsprob.models import save
    from zsprob.models.open_clip_dir import CONFIG_NAME, WEIGHTS_NAME

    save(_tiny(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    _ok(run_cli("export", tmp_path / "ckpt", "--out", out, cwd=tmp_path))
    for name in (CONFIG_NAME, "README.md"):  # what a kill during the weights' write leaves: weights, a temp file
        (out / name).unlink()
    (out / f".{WEIGHTS_NAME}.k1ll3d.tmp").write_bytes(b"half")
    _ok(run_cli("export", tmp_path / "ckpt", "--out", out, "--overwrite", cwd=tmp_path))
    assert (out / CONFIG_NAME).is_file() and not list(out.glob(".*.tmp"))


# ----------------------------------------------------------------- resume takes what is whole
def test_resume_without_latest_json_takes_the_newest_complete_checkpoint(base, run):
    (run / "checkpoints" / "latest.json").unlink()
    r = _ok(_resume(run, "--resume", cwd=base))
    assert "latest.json is missing" in r.stderr and "step-0000004" in r.stderr
    assert json.loads((run / "summary.json").read_text())["start_step"] == 4


def test_resume_auto_falls_back_from_a_damaged_latest_checkpoint(base, run):
    state = run / "checkpoints" / "step-0000004" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    r = _ok(_resume(run, "--resume", "auto", cwd=base))
    warnings = [line for line in r.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and "step-0000002" in warnings[0], r.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["start_step"] == 2


# ----------------------------------------------------------------- a run's data path is recorded absolutely
def test_another_spelling_of_the_same_shards_is_no_change(base, run):
    r = _ok(_resume(run, "--data", "synthetic", "--shards", "./world/pretrain/", "--resume", "auto", cwd=base))
    assert "data.shards" not in r.stderr, r.stderr[-3000:]


def test_resume_from_another_folder_trains_on_the_recorded_shards(base, run, tmp_path):
    other = tmp_path / "elsewhere"  # holds another world under the same relative name
    _ok(run_cli("data", "synthetic", "--preset", "quick", "--seed", "6", "--num-pretrain", "64", "--out",
                other / "world", "--no-progress", cwd=tmp_path))
    r = _ok(_resume(run, "--resume", "auto", cwd=other))  # no --shards: the run's own, as recorded
    assert "data.shards" not in r.stderr, r.stderr[-3000:]
    assert str(base / "world" / "pretrain") in (run / "config.yaml").read_text()
    r = _ok(_resume(run, "--data", "synthetic", "--shards", "world/pretrain", "--resume", "auto", cwd=other,
                    steps=8))
    line = next((ln for ln in r.stderr.splitlines() if "data.shards" in ln), "")
    assert str(base / "world" / "pretrain") in line and str(other / "world" / "pretrain") in line, r.stderr[-3000:]
