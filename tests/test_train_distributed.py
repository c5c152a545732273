"""Two CPU processes (torchrun, gloo) == one process on the same global batch: loss, gradients,
and the loss trajectory of the training loop."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from safetensors.torch import save_file
    from zsprob.models import create_model
    from zsprob.prob import create_loss, needs_sigma
    from zsprob.train.loop import train
    from zsprob.train.step import ContrastiveStep
    from zsprob.train import distributed as D
    sys.path.insert(0, sys.argv[2])
    from helpers_train import TensorSource

    out = sys.argv[1]
    TINY = {"open_clip_cfg": {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                              "image_size": 32},
                              "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    rank, world = acc.process_index, acc.num_processes
    B = 8
    n = B // world
    sl = slice(rank * n, (rank + 1) * n)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(B, 3, 32, 32, generator=g)
    tokens = torch.randint(1, 400, (B, 16), generator=g)
    # soft targets as MSDA makes them, block diagonal over the processes' halves
    soft = torch.eye(B)
    soft[1, 1], soft[1, 2] = 0.7, 0.3
    soft[5, 5], soft[5, 4] = 0.4, 0.6
    result = {}
    for method in ("pcmepp", "infonce", "mu-only", "triplet"):
        model = create_model("zsprob-tiny", embed_dim=16, seed=0, deterministic=not needs_sigma(method), **TINY)
        loss_fn = create_loss(method, **({"pp_alpha": 0.1} if method in ("pcmepp", "mu-only") else {}))
        step = acc.prepare(ContrastiveStep(model, loss_fn))
        local_soft = soft[sl, sl].contiguous() if method != "triplet" else None
        loss, stats = step(images[sl], tokens[sl], local_soft)
        acc.backward(loss)
        raw = acc.unwrap_model(step)
        grads = {f"{method}/{k}": p.grad.detach().clone() for k, p in raw.named_parameters() if p.grad is not None}
        result[method] = float(D.mean_across(loss.detach()))
        if acc.is_main_process:
            save_file(grads, os.path.join(out, f"grads-{method}.safetensors"))
    # the loop itself: 3 steps of training on fixed global batches
    batches = [(torch.randn(B, 3, 32, 32, generator=g), torch.randint(1, 400, (B, 16), generator=g))
               for _ in range(3)]
    cfg = {"method": "pcmepp", "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY},
           "data": {"batch_size": B}, "optim": {"name": "adamp", "lr": 1e-3},
           "schedule": {"steps": 3, "warmup_steps": 1},
           "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    train(cfg, os.path.join(out, "run"), source=TensorSource(batches, rank, world), progress=False)
    if acc.is_main_process:
        json.dump(result, open(os.path.join(out, "losses.json"), "w"))
    acc.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
''')


def _run(cmd, tmp, env):
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_match_one_process(tmp_path):
    if not shutil.which("torchrun") and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")):
        pytest.skip("torchrun not found")
    from safetensors.torch import load_file
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # gloo, on a GPU host too
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    tests = str(Path(__file__).parent)
    _run([sys.executable, str(script), str(one), tests], tmp_path, env)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
          str(script), str(two), tests], tmp_path, env)
    l1 = json.loads((one / "losses.json").read_text())
    l2 = json.loads((two / "losses.json").read_text())
    for method in l1:
        assert l2[method] == pytest.approx(l1[method], rel=1e-5, abs=1e-6), method
        g1 = load_file(str(one / f"grads-{method}.safetensors"))
        g2 = load_file(str(two / f"grads-{method}.safetensors"))
        assert g1.keys() == g2.keys() and len(g1) > 10
        for k in g1:
            # float32 reductions run in another order across 2 processes: compare each element
            # against 1e-5 of its tensor's scale (observed worst: 2.3e-6 of scale)
            atol = max(1e-6, 1e-5 * g1[k].abs().max().item())
            assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=atol), (k, (g1[k] - g2[k]).abs().max())
        # the sigma heads and the loss's scalars received gradients too
        if method == "pcmepp":
            assert any("sigma" in k for k in g1) and f"{method}/loss.scale" in g1
    m1 = [json.loads(x) for x in (one / "run" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [1, 2, 3]
    for a, b in zip(m1, m2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert m2[0]["loss"] != m2[2]["loss"]
