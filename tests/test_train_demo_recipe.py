"""The demo recipe's first 20 steps log the same losses as before the GPU work (the demo's figures must
not move): every term of ``metrics.jsonl`` against ``fixtures/demo_recipe_20_steps.json``.

The fixture was recorded with the code before the device-side step (commit 6abb2a9) on the tiny
SynthWorld of ``conftest.tiny_world``, one thread. On the machine that recorded it the run after the
change matches it bit for bit; the tolerance leaves room for another CPU's float kernels (AVX-512,
AMX), far below what any change to a loss term, the data or the update would move.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT

FIXTURE = Path(__file__).parent / "fixtures" / "demo_recipe_20_steps.json"


@pytest.mark.slow
def test_demo_recipe_losses_over_20_steps_are_unchanged(tiny_world, tmp_path):
    from zsprob.train.defaults import load_train_config
    from zsprob.train.loop import train
    over = [f"data.shards={tiny_world / 'pretrain'}", "schedule.steps=20", "data.batch_size=16", "data.num_workers=0",
            "data.shuffle_buffer=32", "train.log_every=1", "train.checkpoint_every=0", "train.tensorboard=false",
            "train.threads=1"]
    train(load_train_config(ROOT / "configs" / "synthetic_tiny_sigma.yaml", over), tmp_path / "run", progress=False)
    logged = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("loss") is not None:
            logged[str(record["step"])] = record
    expected = json.loads(FIXTURE.read_text())
    assert sorted(logged, key=int) == sorted(expected, key=int) == [str(s) for s in range(1, 21)]
    for step, terms in expected.items():
        for key, value in terms.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-3, abs=1e-5), (step, key)
