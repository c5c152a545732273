#!/usr/bin/env python
"""Benchmark: one AdamP step, zsprob's (projection decided on the device) vs timm's, side by side.

The parameters are those of an open_clip tower built without weights (default: the image tower of
ViT-B-16, 86M parameters), in zsprob's two weight-decay groups. Every step gets the same random
gradients, except that every other weight matrix's gradient is made orthogonal to the rows of its
current weight (untimed), so AdamP projects about half the matrices (as a network with
normalisation layers does) and leaves the rest.
Both optimisers start from the same weights; the script reports the median time of
``optimizer.step()`` over ``--steps`` steps after ``--warmup``, the ratio, the largest difference
between the two optimisers' weights at the end, and the host syncs one step makes
(zsprob.utils.host_sync.HostSyncCounter, one extra untimed step). On CUDA it reports two times
per step: until ``step()`` returns (the host's time; timm's includes its waits on the device) and
until the device has finished (``torch.cuda.synchronize``); on a shared CPU the process's CPU time
(``time.process_time``, the sum over its threads: use ``--threads 1``) is the figure that load does
not inflate.

    nice python scripts/bench_adamp.py                                     # CPU, 1 thread, ViT-B-16 image tower
    python scripts/bench_adamp.py --device cuda --steps 20
    python scripts/bench_adamp.py --model ViT-S-16 --tower all
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build_parameters(model_name: str, tower: str, device: str) -> torch.nn.Module:
    import open_clip
    model = open_clip.create_model(model_name, pretrained=None)
    module = model.visual if tower == "visual" else model
    return module.to(device)


def random_gradients(params: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]


@torch.no_grad()
def set_gradients(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``grads`` as the gradients, every other weight matrix's made orthogonal to the rows of its weight
    (what a scale-invariant weight gets)."""
    matrices = 0
    for p, g in zip(params, grads):
        p.grad = g.clone()
        if p.ndim > 1:
            matrices += 1
            if matrices % 2 == 0:
                w, rows = p.reshape(p.shape[0], -1), p.grad.view(p.shape[0], -1)
                rows -= w * ((w * rows).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True).clamp_min(1e-30))


def run(impl: str, module: torch.nn.Module, start: list[torch.Tensor], grads: list[torch.Tensor],
        steps: int, warmup: int) -> dict:
    from zsprob.train import optim
    from zsprob.utils.host_sync import HostSyncCounter

    with torch.no_grad():
        for p, s in zip(module.parameters(), start):
            p.copy_(s)
    groups = optim.param_groups(module, lr=5e-4, weight_decay=0.2)
    opt = optim.create_optimizer(groups, name=impl, lr=5e-4, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
    params = list(module.parameters())
    cuda = params[0].device.type == "cuda"
    host, device, cpu = [], [], []
    for i in range(warmup + steps):
        set_gradients(params, grads)
        if cuda:
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2, c2 = time.perf_counter(), time.process_time()
        if i >= warmup:
            host.append(t1 - t0)
            device.append(t2 - t0)
            cpu.append(c2 - c0)
    final = [p.detach().clone() for p in params]
    set_gradients(params, grads)
    with HostSyncCounter() as counter:
        opt.step()
    return {"host": statistics.median(host), "device": statistics.median(device), "cpu": statistics.median(cpu),
            "syncs": counter.total,
            "params": final}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ViT-B-16", help="an open_clip model name (built without weights)")
    ap.add_argument("--tower", default="visual", choices=["visual", "all"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--steps and --threads must be at least 1, --warmup at least 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = build_parameters(args.model, args.tower, args.device)
    start = [p.detach().clone() for p in module.parameters()]
    grads = random_gradients(list(module.parameters()))
    results = {impl: run(impl, module, start, grads, args.steps, args.warmup) for impl in ("adamp-timm", "adamp")}
    n = sum(p.numel() for p in start)
    print(f"AdamP step on {args.model} ({args.tower}): {len(start)} tensors, {n / 1e6:.1f}M parameters, "
          f"{args.device}, {args.threads} thread(s), torch {torch.__version__}, median of {args.steps}")
    timm_res, ours = results["adamp-timm"], results["adamp"]
    diff = max((a - b).abs().max().item() for a, b in zip(timm_res["params"], ours["params"]))
    print("| implementation | ms / step, host | ms / step, device done | CPU ms / step (process) | host syncs / step |")
    print("|---|---|---|---|---|")
    for impl, res in results.items():
        print(f"| {impl} | {1e3 * res['host']:.1f} | {1e3 * res['device']:.1f} | {1e3 * res['cpu']:.1f} "
              f"| {res['syncs']} |")
    ratios = ", ".join(f"{key} {timm_res[key] / ours[key]:.2f}x" for key in ("host", "device", "cpu"))
    print(f"timm / zsprob: {ratios}; max |weight difference| {diff:.1e}")


if __name__ == "__main__":
    main()
