"""The demo recipe's first step logs what its loss and gradients are, checked against a float64 replay of
that step made in the same process: the same model at initialisation, the same batch, the same masked
copies (seeded by step), every term of ``metrics.jsonl`` and both clipped gradient norms.

Nothing here is compared with figures recorded on another machine: float kernels differ between CPUs
(AVX-512, AMX) and training amplifies the last bit, so a refactor's "the demo's figures did not move"
is checked by running the old and the new code on one machine (``scripts/compare_reports.py``).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import ROOT

OVERRIDES = ["schedule.steps=2", "data.batch_size=16", "data.num_workers=0", "data.shuffle_buffer=32",
             "train.log_every=1", "train.checkpoint_every=0", "train.tensorboard=false", "train.threads=1"]


def _first_step(tiny_world, tmp_path, monkeypatch):
    """Train two steps of the demo recipe; return (step 1's metrics record, the step module before the
    first and before the second update, the first batch)."""
    from zsprob.train import build
    from zsprob.train import step as step_module
    from zsprob.train.defaults import load_train_config
    from zsprob.train.loop import train

    seen = {}
    real_one_step, real_next_batch = step_module.one_step, step_module.next_batch

    def next_batch(run, step):
        batch = real_next_batch(run, step)
        seen.setdefault("batch", batch)
        return batch

    def one_step(run, step):
        seen.setdefault("modules", []).append(copy.deepcopy(run.step_module))
        return real_one_step(run, step)

    monkeypatch.setattr(step_module, "next_batch", next_batch)
    monkeypatch.setattr(build, "one_step", one_step)
    cfg = load_train_config(ROOT / "configs" / "synthetic_tiny_sigma.yaml",
                            [f"data.shards={tiny_world / 'pretrain'}", *OVERRIDES])
    train(cfg, tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if r.get("loss") is not None}
    assert sorted(logged) == [1, 2]
    return logged[1], seen["modules"], seen["batch"]


def _replay(module, batch, dtype):
    """The first step's loss terms and the norms of the two clipping sets, in ``dtype``."""
    from zsprob.train.step import gradient_clip_sets

    module = copy.deepcopy(module).to(dtype)
    images, tokens, matched = batch
    loss, stats = module(images.to(dtype), tokens, None if matched is None else matched.to(dtype), step=0)
    loss.backward()
    norms = [torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
             for params in gradient_clip_sets(module, split=True)]
    terms = {k: float(v) for k, v in stats.items()}
    return {**terms, "loss": float(loss.detach()), "grad_norm": float(norms[0]), "grad_norm_sigma": float(norms[1])}


@pytest.mark.slow
def test_demo_recipe_logs_its_first_step_as_a_float64_replay_computes_it(tiny_world, tmp_path, monkeypatch):
    logged, (module, updated), batch = _first_step(tiny_world, tmp_path, monkeypatch)
    again = _replay(module, batch, torch.float32)
    exact = _replay(module, batch, torch.float64)
    expected_terms = {"loss", "grad_norm", "grad_norm_sigma", "match_i2t", "match_t2i", "img_inclusion",
                      "txt_inclusion", "caption_nll", "image_nll", "vib_img", "vib_txt", "img_sigma2", "txt_sigma2",
                      "n_masked", "occ_weight"}
    assert expected_terms <= set(logged) and expected_terms <= set(exact)
    assert logged["n_masked"] == exact["n_masked"] == 8  # drop_ratio 0.5 of the batch of 16
    off = {key: (logged[key], again[key], exact[key]) for key in expected_terms
           # the loop logs the float32 step exactly as the replay computes it in this process ...
           if logged[key] != pytest.approx(again[key], rel=1e-6, abs=1e-7)
           # ... and float64 agrees with it to float32's precision (the terms are sums of O(100) parts)
           or logged[key] != pytest.approx(exact[key], rel=1e-4, abs=1e-4)}
    assert not off, off
    # the loss's own a, b are logged as they stand after the step's update (read when the record is written)
    assert (logged["scale"], logged["shift"]) == (float(updated.loss.scale), float(updated.loss.shift))
    assert (exact["scale"], exact["shift"]) == (5.0, 5.0) != (logged["scale"], logged["shift"])
