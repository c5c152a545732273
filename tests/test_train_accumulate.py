"""Gradient accumulation equals the K-times-larger batch (loss, gradients, the loop's losses), random
parts inside the towers are replayed, activation checkpointing leaves gradients unchanged, bf16
autocast runs on the CPU with the loss in float32, and bad values are one line, exit 2."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import TINY_TOWERS, run_cli
from zsprob.errors import UserError

TINY = TINY_TOWERS
B = 16
# each loss with a term that reaches every part of the scheme: PCME++ pseudo-positives and VIB,
# ProLIP's inclusion and occlusion terms on masked copies (a quarter of the rows), InfoNCE's scale
METHODS = {
    "pcmepp": ({}, {"pp_alpha": 0.1, "vib_beta": 1e-2}),
    "prolip": ({"sigma_head": "unc"}, {"inclusion_alpha": 1e-3, "inclusion_alpha_occ": 1e-2, "vib_beta": 1e-2,
                                       "drop_ratio": 0.25, "mask_patch_size": 8}),
    "infonce": ({"deterministic": True}, {}),
}


def batch(seed: int = 0, n: int = B, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g, dtype=dtype)
    tokens = torch.randint(1, 400, (n, 16), generator=g)
    soft = torch.eye(n)  # soft targets as MSDA makes them
    soft[1, 1], soft[1, 2] = 0.7, 0.3
    soft[9, 9], soft[9, 4] = 0.4, 0.6
    return images, tokens, soft


def step_module(method: str, seed: int = 0, dtype=torch.float64, **model_kw):
    """Model + loss; float64 by default, so the equalities below hold to rounding (1e-10 asserted)."""
    from zsprob.models import create_model
    from zsprob.prob import create_loss
    from zsprob.train.step import ContrastiveStep
    model_over, loss_kw = METHODS[method]
    model = create_model("zsprob-tiny", embed_dim=16, seed=seed, **{**TINY, **model_over, **model_kw}).train()
    return ContrastiveStep(model.to(dtype), create_loss(method, **loss_kw).to(dtype), seed=3)


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_same_grads(ref: dict, got: dict, rel: float = 1e-10):
    """Every element within ``rel`` of its tensor's largest gradient (sums run in another order)."""
    assert ref.keys() == got.keys() and len(ref) > 20
    for k in ref:
        scale = ref[k].abs().max().item()
        err = (ref[k] - got[k]).abs().max().item()
        assert err <= rel * scale + 1e-12, (k, err, scale)


@pytest.mark.parametrize("method", list(METHODS))
def test_accumulated_step_equals_the_whole_batch(method):
    from zsprob.train.accumulate import accumulated_step
    torch.set_num_threads(1)
    images, tokens, soft = batch(dtype=torch.float64)
    whole = step_module(method)
    loss_ref, stats_ref = whole(images, tokens, soft, step=2)
    loss_ref.backward()
    ref = grads(whole)
    acc4 = step_module(method)
    loss, stats = accumulated_step(acc4, acc4, images, tokens, soft, step=2, k=4)
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-12)
    assert_same_grads(ref, grads(acc4))
    # the loss's own parameters were counted once, as in the whole batch
    loss_params = [k for k in ref if k.startswith("loss.")]
    assert loss_params
    for k in loss_params:
        assert grads(acc4)[k].item() == pytest.approx(ref[k].item(), rel=1e-10)
    for k, v in stats_ref.items():
        if torch.is_tensor(v) and v.numel() == 1 and v.is_floating_point():
            assert stats[k].item() == pytest.approx(v.item(), rel=1e-10, abs=1e-12), k
    if method == "prolip":  # the masked copies were encoded and their term is in the loss
        assert int(stats["n_masked"]) == 4 and stats["img_inclusion"].item() != 0


def test_random_parts_inside_the_towers_are_replayed():
    """Patch dropout and image SizeAugment draw from torch's generator; the re-encoding pass sees the
    draws of the no-gradient pass, so the gradient equals that of encoding the micro-batches with
    gradients one after the other from the same generator state."""
    from zsprob.train.accumulate import accumulated_step
    torch.set_num_threads(1)
    images, tokens, soft = batch(1, dtype=torch.float64)
    noisy = {"patch_dropout": 0.5, "size_augment": 0.5}
    ref_module = step_module("pcmepp", **noisy)
    torch.manual_seed(7)
    outs = [ref_module.model(i, t) for i, t in zip(images.split(4), tokens.split(4))]
    cat = {s: torch.cat([o[s] for o in outs]) for s in outs[0]}
    loss_ref, _ = ref_module.pairwise_loss(cat["img_mu"], cat["img_logvar"], cat["txt_mu"], cat["txt_logvar"],
                                           soft, 0, {})
    loss_ref.backward()
    after_ref = torch.get_rng_state()
    module = step_module("pcmepp", **noisy)
    torch.manual_seed(7)
    loss, _ = accumulated_step(module, module, images, tokens, soft, step=0, k=4)
    assert torch.equal(torch.get_rng_state(), after_ref)
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-12)
    assert_same_grads(grads(ref_module), grads(module))
    # the draws matter: another generator state gives other embeddings
    with torch.no_grad():
        torch.manual_seed(8)
        other = module.model(images[:4], tokens[:4])["img_mu"]
    assert not torch.allclose(other, outs[0]["img_mu"].detach(), atol=1e-3)


def test_accum_steps_must_divide_the_batch():
    from zsprob.train.accumulate import check_accum_steps
    from zsprob.train.defaults import resolve_config
    assert check_accum_steps(4, 16) == 4 and check_accum_steps(1, 7) == 1
    for bad in (0, -2, 2.5, "x", True, None):  # a count, checked with the config
        with pytest.raises(UserError, match="accum_steps") as e:
            resolve_config({"train": {"accum_steps": bad}})
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="does not divide the per-process batch 16"):
        check_accum_steps(3, 16)


def _tensor_cfg(**over):
    from zsprob.config import deep_merge
    cfg = {"seed": 0, "method": "pcmepp", "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY},
           "data": {"batch_size": B, "text_size_augment": 0.2}, "msda": {"enabled": True},
           "optim": {"name": "adamw", "lr": 1e-3}, "schedule": {"name": "constant", "steps": 3},
           "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    return deep_merge(cfg, over)


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_loop_with_accumulation_follows_the_big_batch(tmp_path):
    """Three optimiser steps with MSDA and text SizeAugment: K = 4 logs the losses of K = 1."""
    from zsprob.train import train
    from helpers_train import TensorSource
    batches = [batch(s)[:2] for s in range(3)]
    train(_tensor_cfg(), tmp_path / "k1", source=TensorSource(batches), progress=False)
    train(_tensor_cfg(train={"accum_steps": 4}, model={"grad_checkpointing": True}), tmp_path / "k4",
          source=TensorSource(batches), progress=False)
    one, four = _losses(tmp_path / "k1"), _losses(tmp_path / "k4")
    assert len(one) == 3 and one[0] != one[2]
    assert four == pytest.approx(one, rel=1e-5)
    with pytest.raises(UserError, match="does not divide"):
        train(_tensor_cfg(train={"accum_steps": 3}), tmp_path / "k3", source=TensorSource(batches), progress=False)


def test_grad_checkpointing_gives_identical_gradients():
    from zsprob.train.accumulate import accumulated_step, enable_grad_checkpointing
    torch.set_num_threads(1)
    images, tokens, soft = batch(2, dtype=torch.float64)
    plain = step_module("pcmepp")
    plain(images, tokens, soft)[0].backward()
    ckpt = step_module("pcmepp")
    assert enable_grad_checkpointing(ckpt.model) == ["image", "text"] and ckpt.model.grad_checkpointing
    ckpt(images, tokens, soft)[0].backward()
    assert_same_grads(grads(plain), grads(ckpt))
    both = step_module("pcmepp")
    enable_grad_checkpointing(both.model)
    accumulated_step(both, both, images, tokens, soft, step=0, k=2)
    assert_same_grads(grads(plain), grads(both))


def test_grad_checkpointing_errors_and_warnings():
    from zsprob.models import create_model
    from zsprob.train.accumulate import enable_grad_checkpointing
    with pytest.raises(UserError, match="has no set_grad_checkpointing") as e:
        enable_grad_checkpointing(torch.nn.Linear(2, 2))
    assert "\n" not in str(e.value)
    bow = create_model("zsprob-tiny-bow", embed_dim=16, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert enable_grad_checkpointing(bow) == ["image"]
    assert any("text tower" in str(w.message) for w in caught)
    bow._vision.num_blocks = 0  # a model with no tower to recompute
    with pytest.raises(UserError, match="no transformer blocks or CNN stages"):
        enable_grad_checkpointing(bow)


def test_loss_is_computed_in_float32_inside_bf16_autocast():
    seen = {}
    module = step_module("pcmepp", dtype=torch.float32)
    inner = module.loss.forward

    def recording(*args, **kwargs):
        seen["dtypes"] = {a.dtype for a in args[:4] if torch.is_tensor(a)}
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["matmul"] = (args[0] @ args[2].t()).dtype
        return inner(*args, **kwargs)

    module.loss.forward = recording
    images, tokens, soft = batch(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16  # autocast is on out here
        loss, _ = module(images, tokens, soft)
    assert seen == {"dtypes": {torch.float32}, "autocast": False, "matmul": torch.float32}
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state whose precision cannot change: reset it around the test."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_autocast_training_on_the_cpu(tmp_path, fresh_accelerate_state):
    """A few bf16 steps (accelerate autocast on the CPU), also with accumulation: finite, close to fp32."""
    from accelerate.state import AcceleratorState
    from zsprob.train import train
    from helpers_train import TensorSource
    batches = [batch(s)[:2] for s in range(3)]
    train(_tensor_cfg(), tmp_path / "fp32", source=TensorSource(batches), progress=False)
    for name, extra in (("bf16", {}), ("bf16k2", {"accum_steps": 2})):
        AcceleratorState._reset_state(reset_partial_state=True)
        train(_tensor_cfg(train={"precision": "bf16", **extra}), tmp_path / name, source=TensorSource(batches),
              progress=False)
        assert AcceleratorState().mixed_precision == "bf16"
    fp32, bf16, bf16k2 = (_losses(tmp_path / d) for d in ("fp32", "bf16", "bf16k2"))
    assert all(torch.isfinite(torch.tensor(x)).all() for x in (bf16, bf16k2))
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16k2 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != fp32  # bf16 really ran


@pytest.mark.slow
def test_cli_accumulation_and_checkpointing_end_to_end(tmp_path):
    from zsprob.data.synthetic import generate
    generate(tmp_path / "sw", image_size=32, num_pretrain=32, num_classify_select=0, num_classify_eval=0,
             num_retrieval=4, num_retrieval_val=0, shard_size=32, progress=False)
    common = ["pretrain", "--data", "synthetic", "--shards", str(tmp_path / "sw" / "pretrain"), "--batch-size", "8",
              "--steps", "2", "--set", "data.num_workers=0"]  # the default model: CNN + bag-of-words
    r = run_cli(*common, "--set", "train.accum_steps=3", "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "accum_steps 3" in r.stderr, r.stderr
    r = run_cli(*common, "--set", "train.accum_steps=2", "--set", "model.grad_checkpointing=true",
                "--out", str(tmp_path / "ok"))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["global_batch_size"] == 8 and summary["final_loss"] is not None


WORKER = '''
import json, os, sys
import torch
from accelerate import Accelerator
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[2])
from test_train_accumulate import METHODS, B, batch, grads, step_module, _tensor_cfg
from zsprob.train import train
from zsprob.train.accumulate import accumulated_step
from helpers_train import TensorSource
from zsprob.train import distributed as D

out = sys.argv[1]
torch.set_num_threads(1)
acc = Accelerator(cpu=True)
rank, world = acc.process_index, acc.num_processes
n = B // world
sl = slice(rank * n, (rank + 1) * n)
images, tokens, soft = batch(4, dtype=torch.float64)
local = (images[sl], tokens[sl], soft[sl, sl].contiguous())
losses = {}
for method in METHODS:
    for mode in ("plain", "accum"):
        module = acc.prepare(step_module(method))
        raw = acc.unwrap_model(module)
        if mode == "plain":
            loss, _ = module(*local, step=2)
            acc.backward(loss)
        else:
            loss, _ = accumulated_step(module, raw, *local, step=2, k=2, acc=acc)
        losses[f"{method}/{mode}"] = float(D.mean_across(loss.detach()))
        if acc.is_main_process:
            save_file(grads(raw), os.path.join(out, f"{method}-{mode}.safetensors"))
batches = [batch(s)[:2] for s in range(3)]
cfg = _tensor_cfg(data={"text_size_augment": 0.0}, msda={"enabled": False}, train={"accum_steps": 2})
train(cfg, os.path.join(out, "run"), source=TensorSource(batches, rank, world), progress=False)
if acc.is_main_process:
    json.dump(losses, open(os.path.join(out, "losses.json"), "w"))
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_with_accumulation_match_one_process(tmp_path):
    """torchrun, 2 CPU processes x 2 micro-batches: the gradients of the plain 2-process step (itself
    equal to one process, tests/test_train_distributed.py) and of one process on the global batch."""
    import os
    import subprocess
    import sys
    from safetensors.torch import load_file
    from zsprob.train import train
    from helpers_train import TensorSource
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29531", str(script), str(tmp_path), str(Path(__file__).parent)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    images, tokens, soft = batch(4, dtype=torch.float64)
    block = torch.block_diag(soft[:B // 2, :B // 2], soft[B // 2:, B // 2:])
    for method in METHODS:
        plain = load_file(str(tmp_path / f"{method}-plain.safetensors"))
        accum = load_file(str(tmp_path / f"{method}-accum.safetensors"))
        assert losses[f"{method}/accum"] == pytest.approx(losses[f"{method}/plain"], rel=1e-12)
        assert_same_grads(plain, accum)
        if method != "prolip":  # ProLIP masks each process's first rows: its 2-process batch differs
            one = step_module(method)
            loss, _ = one(images, tokens, block, step=2)
            loss.backward()
            assert losses[f"{method}/accum"] == pytest.approx(loss.item(), rel=1e-12)
            assert_same_grads(grads(one), accum)
    batches = [batch(s)[:2] for s in range(3)]
    cfg = _tensor_cfg(data={"text_size_augment": 0.0}, msda={"enabled": False})
    train(cfg, tmp_path / "one", source=TensorSource(batches), progress=False)
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
