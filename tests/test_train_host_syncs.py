"""A steady training step makes at most one host sync (the finiteness verdict), counted on the CPU.

Counted as on a GPU each would stall the launch queue: item, tolist, bool / int / float of a
tensor, cpu, numpy, unique, nonzero, ... (:class:`zsprob.utils.host_sync.HostSyncCounter`) inside
the step, with the host-side batch preparation (``next_batch``) left out and torch.optim's own
host-side step counters skipped. Two recipes: the demo's sigma recipe (whose lossy image views
include JPEG, coded on the device off the CPU) and the RedCaps flagship recipe (AdamP, GPO, bf16)
with tiny towers. Counted on the accelerator's path: on the CPU, where a host
read stalls nothing, the towers keep data-dependent shortcuts (GPO and the text transformer cut a
batch at its longest caption), which ``zsprob.utils.host_sync.HOST_READ_FREE`` turns off here.
"""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, TINY_TOWERS
from helpers_train import count_step_syncs


def _count_per_step(cfg, out, monkeypatch) -> list:
    from zsprob.train import build
    from zsprob.train import step as step_module
    from zsprob.train.loop import train

    return count_step_syncs(monkeypatch, build, step_module, "next_batch", lambda: train(cfg, out, progress=False))


def _overrides(world, steps: int = 6) -> list[str]:
    return [f"data.shards={world / 'pretrain'}", f"schedule.steps={steps}", "data.batch_size=16",
            "data.num_workers=0", "data.shuffle_buffer=32", "train.log_every=100", "train.checkpoint_every=0",
            "train.tensorboard=false", "train.threads=1"]


def _assert_steady(counters, first_steady: int = 2):
    worst = max(counters[first_steady:], key=lambda c: c.total)
    assert worst.total <= 1, dict(worst.where)
    return [c.total for c in counters]


@pytest.mark.slow
def test_sigma_recipe_step_has_at_most_one_host_sync(tiny_world, tmp_path, monkeypatch):
    from zsprob.train.defaults import load_train_config
    cfg = load_train_config(ROOT / "configs" / "synthetic_tiny_sigma.yaml", _overrides(tiny_world))
    # the recipe's lossy views include JPEG: off the CPU it runs on the device (zsprob.data.jpeg_torch), and
    # the steady steps below do draw it (the rows are counted as they pass)
    from zsprob.data import degrade
    assert "jpeg" in cfg.loss.pcmepp.image_degrade_ops
    jpeg_rows, real_roundtrip = [], degrade.jpeg_roundtrip

    def roundtrip(images, qualities):
        jpeg_rows.append(len(qualities))
        return real_roundtrip(images, qualities)

    monkeypatch.setattr(degrade, "jpeg_roundtrip", roundtrip)
    counts = _assert_steady(_count_per_step(cfg, tmp_path / "run", monkeypatch))
    assert len(counts) == 6 and sum(jpeg_rows) >= 2, jpeg_rows


@pytest.mark.slow
def test_flagship_recipe_step_has_at_most_one_host_sync(tiny_world, tmp_path, monkeypatch):
    from zsprob.train.defaults import load_train_config
    flow = json.dumps(TINY_TOWERS).replace('"', "")
    cfg = load_train_config(ROOT / "configs" / "pretrain_redcaps_vits16.yaml", _overrides(tiny_world) + [
        "model.name=zsprob-tiny", "model.embed_dim=16", f"model.overrides={flow}", "data.kind=synthetic",
        "data.resampled=false", "data.samples_per_epoch=null", "data.pipeline.caption_key=json:captions",
        "schedule.warmup_steps=2"])
    assert cfg.optim.name == "adamp" and cfg.model.pooling == "gpo" and cfg.train.precision == "bf16"
    _assert_steady(_count_per_step(cfg, tmp_path / "run", monkeypatch))
