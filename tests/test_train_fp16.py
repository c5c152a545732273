"""fp16's gradient scaling through the real training step, on the CPU with torch's CPU GradScaler.

accelerate gives no scaler on the CPU, so the tests attach ``torch.amp.GradScaler("cpu")`` to the run's
accelerator before the optimiser is prepared: the step then scales the loss, unscales once, clips
each set (``optim.grad_clip_split``), and updates the scaler on skipped steps, exactly as under CUDA
fp16. A power-of-two scale makes the scaled run bit-identical to the plain one.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import read_losses
from test_train_loop import tiny_cfg


def _train(cfg, out, monkeypatch, scale: float | None, nan_at: int | None = None):
    from zsprob.train import loop
    from zsprob.train import step as step_module

    real_make, real_next = loop.make_accelerator, step_module.next_batch
    scalers = []

    def make_accelerator(cfg, out):
        acc, log_with = real_make(cfg, out)
        if scale is not None:
            acc.scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
            scalers.append(acc.scaler)
        return acc, log_with

    def next_batch(run, step):
        images, tokens, matched = real_next(run, step)
        if step == nan_at:
            images = torch.full_like(images, float("nan"))
        return images, tokens, matched

    monkeypatch.setattr(loop, "make_accelerator", make_accelerator)
    monkeypatch.setattr(step_module, "next_batch", next_batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = loop.train(cfg, out, progress=False)
    return summary, read_losses(out), scalers


def _cfg(world):
    return tiny_cfg(world / "pretrain", optim={"name": "adamw", "lr": 2e-3, "weight_decay": 0.01, "grad_clip": 2.0,
                                                "grad_clip_split": True},
                    schedule={"name": "constant", "steps": 6, "warmup_steps": 0})


@pytest.mark.slow
def test_scaled_step_with_split_clipping_equals_the_plain_step(tiny_world, tmp_path, monkeypatch):
    _, plain, _ = _train(_cfg(tiny_world), tmp_path / "plain", monkeypatch, scale=None)
    summary, scaled, scalers = _train(_cfg(tiny_world), tmp_path / "scaled", monkeypatch, scale=2.0 ** 10)
    assert scaled == plain  # unscaled once (twice would raise), clipped per set: bit-identical updates
    assert scalers[0].get_scale() == 2.0 ** 10 and summary["nonfinite_total"] == 0


@pytest.mark.slow
def test_a_nan_batch_is_skipped_and_the_scaler_backs_off_then_training_goes_on(tiny_world, tmp_path, monkeypatch):
    _, plain, _ = _train(_cfg(tiny_world), tmp_path / "plain", monkeypatch, scale=None, nan_at=2)
    summary, scaled, scalers = _train(_cfg(tiny_world), tmp_path / "scaled", monkeypatch, scale=2.0 ** 10, nan_at=2)
    assert summary["nonfinite_total"] == 1
    assert scalers[0].get_scale() == 2.0 ** 9  # the skipped step updated the scaler: inf seen, scale halved
    assert 3 not in scaled and scaled == plain  # step 3 skipped in both; every other step identical
    assert all(torch.isfinite(torch.tensor(v)) for v in scaled.values())


@pytest.mark.slow
def test_an_overflowing_gradient_is_skipped_by_the_scaler_counted_and_logged(tiny_world, tmp_path, monkeypatch):
    """The loss is finite but one gradient overflows at the scaler's scale: the GradScaler skips that
    update and halves its scale; metrics.jsonl says so (``scaler_skipped_total``, ``loss_scale``) and the
    run's own non-finite guard is not tripped."""
    import json

    from zsprob.train import step as step_module
    real_unscale, seen = step_module.unscale_once, []

    def unscale_once(run):
        seen.append(1)
        if len(seen) == 3:  # the third update: one gradient entry overflows
            next(p for p in run.raw.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        real_unscale(run)
    monkeypatch.setattr(step_module, "unscale_once", unscale_once)
    out = tmp_path / "scaled"
    summary, losses, scalers = _train(_cfg(tiny_world), out, monkeypatch, scale=2.0 ** 10)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["scaler_skipped_total"] for r in recs] == [0, 0, 1, 1, 1, 1]
    assert [r["loss_scale"] for r in recs] == [2.0 ** 10] * 2 + [2.0 ** 9] * 4
    assert summary["nonfinite_total"] == 0 and len(losses) == 6
    assert scalers[0].get_scale() == 2.0 ** 9
