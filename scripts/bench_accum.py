#!/usr/bin/env python
"""Gradient accumulation and activation checkpointing on the CPU: time per sample and peak memory.

Every configuration runs in a fresh subprocess (so its peak RSS, ``getrusage`` ru_maxrss, is its
own), on random images and tokens, through the training step's own pieces: ``ContrastiveStep``
(PCME++ by default), ``zsprob.train.accumulate.accumulated_step`` when K > 1, AdamW. Measured:

    time   K = 1 vs K = --k at the same micro-batch (--micro): seconds per sample over --steps
           optimiser steps after one warm-up step; runs alternate, --repeat times, best kept
    memory one step of --mem-batch samples, K = 1, with and without model.grad_checkpointing:
           peak RSS of the process, and that minus the RSS before the first step (the step's own)

    nice -n 19 python scripts/bench_accum.py --model zsprob-tiny --micro 32 --k 4 --mem-batch 256
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def worker(cfg: dict) -> dict:
    import torch
    from zsprob.models import create_model
    from zsprob.prob import create_loss
    from zsprob.train.accumulate import accumulated_step, enable_grad_checkpointing
    from zsprob.train.step import ContrastiveStep

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    model = create_model(cfg["model"], seed=0).train()
    if cfg["ckpt"]:
        enable_grad_checkpointing(model)
    module = ContrastiveStep(model, create_loss(cfg["method"]))
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    size = model.image_size
    batch = cfg["micro"] * cfg["k"]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 3, size, size, generator=g), torch.randint(1, 1000, (batch, 32), generator=g))
            for _ in range(2)]
    rss_before = rss_mb()
    times = []
    for i in range(cfg["steps"] + 1):
        images, tokens = data[i % 2]
        t = time.perf_counter()
        if cfg["k"] > 1:
            accumulated_step(module, module, images, tokens, None, i, cfg["k"])
        else:
            loss, _ = module(images, tokens, None, step=i)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    measured = times[1:] or times
    return {"s_per_sample": sum(measured) / (len(measured) * batch), "peak_rss_mb": peak,
            "rss_before_step_mb": rss_before, "step_mb": peak - rss_before}


def run(cfg: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise SystemExit(f"worker failed ({cfg}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zsprob-tiny")
    ap.add_argument("--method", default="pcmepp")
    ap.add_argument("--micro", type=int, default=32, help="micro-batch of the timing runs")
    ap.add_argument("--k", type=int, default=4, help="micro-batches per step of the accumulated run")
    ap.add_argument("--steps", type=int, default=4, help="timed optimiser steps per run (after one warm-up)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mem-batch", type=int, default=256, help="batch of the memory runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    base = {"model": args.model, "method": args.method, "threads": args.threads, "ckpt": False}
    best: dict[int, float] = {}
    for _ in range(args.repeat):
        for k in (1, args.k):
            # K = 1 runs --k times as many steps, so both runs see the same number of samples
            res = run({**base, "micro": args.micro, "k": k, "steps": args.steps * (args.k if k == 1 else 1)})
            best[k] = min(best.get(k, float("inf")), res["s_per_sample"])
    memory = {}
    for ckpt in (False, True):
        memory["on" if ckpt else "off"] = run({**base, "ckpt": ckpt, "micro": args.mem_batch, "k": 1, "steps": 1})
    result = {"config": vars(args) | {"out": str(args.out) if args.out else None},
              "ms_per_sample": {f"K={k}": 1000 * v for k, v in best.items()},
              "time_ratio": best[args.k] / best[1], "memory": memory,
              "step_memory_saving": 1 - memory["on"]["step_mb"] / memory["off"]["step_mb"]}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
