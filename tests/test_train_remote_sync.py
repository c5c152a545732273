"""Checkpoints and logs mirrored to an fsspec URL (``train.remote_sync``): a run killed after a
checkpoint, whose local directory is then lost, resumes from the remote copy to the losses of an
uninterrupted run; a copy that fails half-way never leaves the remote naming a partial checkpoint."""
from __future__ import annotations

import json
import shutil
import uuid

import fsspec
import pytest

from conftest import read_losses, run_cli
from test_train_loop import tiny_cfg
from zsprob.errors import UserError
from zsprob.train.remote_sync import RemoteSync


def _memory_url() -> str:
    return f"memory://zsprob-test-{uuid.uuid4().hex[:8]}/run"


def _fake_checkpoint(out, step: int) -> None:
    d = out / "checkpoints" / f"step-{step:07d}"
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text(json.dumps({"step": step}))
    (d / "model" / "weights.bin").write_bytes(bytes([step]) * 100)
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": step, "dir": d.name}))
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")


def test_push_order_pruning_and_a_failed_copy(tmp_path, monkeypatch):
    url = _memory_url()
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    sync = RemoteSync(url, tmp_path)
    sync.check()
    _fake_checkpoint(tmp_path, 1)
    (tmp_path / "checkpoints" / ".tmp-step-0000002").mkdir()          # hidden: never copied
    (tmp_path / "checkpoints" / ".tmp-step-0000002" / "x").write_text("partial")
    assert sync.push() == 4 and sync.push() == 0                      # nothing changed: nothing copied
    assert json.loads(fs.cat(f"{root}/checkpoints/latest.json"))["step"] == 1
    assert not fs.exists(f"{root}/checkpoints/.tmp-step-0000002")

    # the copy of checkpoint 2 fails after its first file: the remote still names checkpoint 1
    _fake_checkpoint(tmp_path, 2)
    real_put, calls = sync.fs.put_file, []

    def failing_put(src, dst, **kw):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("connection reset")
        return real_put(src, dst, **kw)
    monkeypatch.setattr(sync.fs, "put_file", failing_put)
    with pytest.warns(UserWarning, match="retrying at the next checkpoint"):
        sync.try_push()
    assert json.loads(fs.cat(f"{root}/checkpoints/latest.json"))["step"] == 1
    monkeypatch.setattr(sync.fs, "put_file", real_put)

    # the next push completes it; a checkpoint pruned locally goes from the remote after the pointer moved
    shutil.rmtree(tmp_path / "checkpoints" / "step-0000001")
    sync.push()
    assert json.loads(fs.cat(f"{root}/checkpoints/latest.json"))["step"] == 2
    assert fs.cat(f"{root}/checkpoints/step-0000002/model/weights.bin") == bytes([2]) * 100
    assert not fs.exists(f"{root}/checkpoints/step-0000001")
    assert fs.cat(f"{root}/metrics.jsonl") == (tmp_path / "metrics.jsonl").read_bytes()

    # a fresh directory pulls the latest checkpoint and the logs; an up-to-date one pulls nothing
    fresh = tmp_path.parent / f"{tmp_path.name}-fresh"
    fresh.mkdir()
    assert RemoteSync(url, fresh).pull_latest() == 2
    assert (fresh / "checkpoints" / "step-0000002" / "model" / "weights.bin").read_bytes() == bytes([2]) * 100
    assert json.loads((fresh / "checkpoints" / "latest.json").read_text())["dir"] == "step-0000002"
    assert (fresh / "metrics.jsonl").read_bytes() == (tmp_path / "metrics.jsonl").read_bytes()
    assert RemoteSync(url, fresh).pull_latest() is None


@pytest.mark.parametrize("url, message", [("foo://bucket/run", "unknown URL scheme 'foo'"),
                                          ("pipe:cat x", "pipe: command cannot hold checkpoints")])
def test_bad_remote_urls_are_one_line_errors(tmp_path, url, message):
    from zsprob.train.remote_sync import check_target  # with the config (resolve_config); RemoteSync trusts it
    with pytest.raises(UserError, match=message) as e:
        check_target(url, tmp_path)
    assert "\n" not in str(e.value)


def test_a_lost_run_directory_resumes_from_the_remote_exactly(tiny_world, tmp_path):
    from zsprob.train import train
    over = dict(schedule={"name": "cosine", "steps": 8, "warmup_steps": 2}, train={"checkpoint_every": 3})
    train(tiny_cfg(tiny_world / "pretrain", **over), tmp_path / "full", progress=False)

    class Kill(Exception):
        pass

    def kill_at_5(model, step):
        if step == 5:
            raise Kill()
    url = _memory_url()
    cut = tiny_cfg(tiny_world / "pretrain", **over)
    cut["train"].update(eval_every=5, remote_sync=url)
    with pytest.raises(Kill):
        train(cut, tmp_path / "cut", progress=False, eval_hooks=[kill_at_5])
    shutil.rmtree(tmp_path / "cut")                                     # the node and its disk are gone
    train(cut, tmp_path / "cut", resume=True, progress=False)
    a, b = read_losses(tmp_path / "full"), read_losses(tmp_path / "cut")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in range(1, 9):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7), (s, a[s], b[s])
    fs, root = fsspec.filesystem("memory"), url[len("memory://"):]
    assert json.loads(fs.cat(f"{root}/checkpoints/latest.json"))["step"] == 8
    assert json.loads(fs.cat(f"{root}/summary.json"))["steps"] == 8
    assert fs.exists(f"{root}/model/model.safetensors")
    assert fs.cat(f"{root}/metrics.jsonl") == (tmp_path / "cut" / "metrics.jsonl").read_bytes()


def test_cli_remote_sync_to_a_file_url_and_a_bad_scheme(tiny_world, tmp_path):
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), "--steps", "1",
                "--remote-sync", "foo://bucket/run", "--out", str(tmp_path / "bad"), "--no-progress")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "unknown URL scheme 'foo'" in r.stderr
    mirror = tmp_path / "mirror"
    r = run_cli("pretrain", "--config", "synthetic_tiny.yaml", "--data", "synthetic", "--shards",
                str(tiny_world / "pretrain"), "--steps", "2", "--batch-size", "8", "--workers", "0",
                "--set", "model.embed_dim=16", "--set", "train.tensorboard=false",
                "--remote-sync", f"file://{mirror}", "--out", str(tmp_path / "run"), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    for rel in ("config.yaml", "metrics.jsonl", "summary.json", "model/model.safetensors",
                "checkpoints/latest.json", "checkpoints/step-0000002/state.json"):
        assert (mirror / rel).read_bytes() == (tmp_path / "run" / rel).read_bytes(), rel
