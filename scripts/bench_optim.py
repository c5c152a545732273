#!/usr/bin/env python
"""Benchmark: one optimiser step on a model's parameters, torch's three implementations side by side.

zsprob.train.optim.create_optimizer runs torch's AdamW / Adam / SGD with ``foreach=True`` by default
(torch itself picks the per-tensor loop on the CPU) and torch's fused kernels with ``optim.fused``.
This script times ``optimizer.step()`` for the per-tensor loop (torch's CPU default), foreach and
fused on the trainable parameters of ``--model`` (two weight-decay groups, as the trainer builds
them), with fresh random gradients, and checks the updates against the loop's: foreach must be
bit-identical, fused equal to float rounding. Median of ``--steps`` steps after ``--warmup``.

    python scripts/bench_optim.py                                   # zsprob-tiny-bow, AdamW
    python scripts/bench_optim.py --model zsprob-tiny --optimizer sgd --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def run(model_name: str, optimizer: str, impl: str, steps: int, warmup: int) -> tuple[float, list]:
    from zsprob.models import create_model
    from zsprob.train import optim

    model = create_model(model_name, seed=0)
    groups = optim.param_groups(model, lr=1e-3, weight_decay=0.1)
    kwargs = {"foreach": False} if impl == "loop" else {"fused": True} if impl == "fused" else {}
    opt = optim.create_optimizer(groups, name=optimizer, lr=1e-3, weight_decay=0.1, **kwargs)
    params = [p for group in opt.param_groups for p in group["params"]]
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grads[i % 3]):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), [p.detach().clone() for p in params]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zsprob-tiny-bow")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--steps and --threads must be at least 1, --warmup at least 0")
    torch.set_num_threads(args.threads)
    results = {impl: run(args.model, args.optimizer, impl, args.steps, args.warmup)
               for impl in ("loop", "foreach", "fused")}
    base, ref = results["loop"]
    n = sum(p.numel() for p in ref)
    print(f"{args.optimizer} step on {args.model}: {len(ref)} tensors, {n / 1e6:.2f}M parameters, "
          f"{args.threads} thread(s), torch {torch.__version__}")
    print("| implementation | ms / step (median) | speed-up vs loop | max |update - loop's| |")
    print("|---|---|---|---|")
    for impl, (sec, params) in results.items():
        diff = max((a - b).abs().max().item() for a, b in zip(params, ref))
        print(f"| {impl} | {1e3 * sec:.2f} | {base / sec:.2f}x | {diff:.1e} |")
    if any(not torch.equal(a, b) for a, b in zip(results["foreach"][1], ref)):
        raise SystemExit("foreach's updates differ from the loop's")


if __name__ == "__main__":
    main()
