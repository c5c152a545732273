#!/usr/bin/env python
"""Benchmark: forward + backward time and peak memory of the PCME++ and ProLIP losses.

Compares, side by side in one run (D = 512, float32):
  1. zsprob.prob.PCMEPPLoss (CSD through one matmul, O(N^2) memory) against the direct broadcast
     formulation of the PCME++ App. A.4 pseudo-code (tests/prob_reference.py, O(N^2 D) memory),
     both directions, pseudo-positives (alpha 0.1) and VIB (beta 1e-4) on; same loss to 1e-5
     relative is checked and printed;
  2. PCMELoss (Monte Carlo match probability, J = 7 samples) against PCMEPPLoss (CSD);
  3. ProLIPLoss (PPCL + both inclusion terms + VIB, recipe weights, masked copies of the first
     N / 8 rows as ProLIP's drop_ratio 0.125) against InfoNCELoss (CLIP) on the same batch.

Peak memory (CPU): the increase of the process's peak resident set size during one forward +
backward, read from Linux's VmHWM after resetting it through /proc/self/clear_refs; glibc's mmap
threshold is fixed at 128 KiB (mallopt) so that freed tensors go back to the OS and RSS follows the
live tensors. On CUDA (``--device cuda``): torch.cuda.max_memory_allocated. Time: median of
``--repeats`` runs (the broadcast runs at large batches once), on ``--threads`` threads (default 1:
stable numbers on a shared machine). A configuration whose estimated
memory exceeds ``--mem-fraction`` of MemAvailable is printed as skipped with the estimate.

    nice .venv/bin/python scripts/bench_losses.py            # batches 256 1024 4096
    .venv/bin/python scripts/bench_losses.py --batches 256 1024 --device cuda
    nice .venv/bin/python scripts/bench_losses.py --sections 3 --batches 1024   # ProLIP vs InfoNCE only
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from prob_reference import pcmepp_pseudocode_loss  # noqa: E402
from zsprob.prob import InfoNCELoss, PCMELoss, PCMEPPLoss, ProLIPLoss  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- memory probes

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


class CpuPeak:
    method = ("peak RSS increase (VmHWM after /proc/self/clear_refs reset; glibc mmap threshold "
              "128 KiB so freed tensors return to the OS)")

    def __init__(self):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except OSError:
            pass
        self.ok = os.access("/proc/self/clear_refs", os.W_OK)

    def __enter__(self):
        if self.ok:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = (_status("VmHWM") - self.base) if self.ok else float("nan")


class CudaPeak:
    method = "torch.cuda.max_memory_allocated increase"

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.base


# ----------------------------------------------------------------------------- workloads

def make_inputs(n: int, d: int, device, seed: int = 0):
    """L2-normalised means with matching captions nearby, log-variances around -7 (CSD ~ 1-3)."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    txt = F.normalize(img + 0.6 * torch.randn(n, d, generator=g) / math.sqrt(d) * 8, dim=-1)
    lv_i = -7.0 + 0.5 * torch.randn(n, d, generator=g)
    lv_t = -7.0 + 0.5 * torch.randn(n, d, generator=g)
    return [t.to(device).requires_grad_(True) for t in (img, lv_i, txt, lv_t)]


def run_once(kind: str, x, crits: dict, sync):
    for t in x:
        t.grad = None
    for crit in crits.values():
        for p in crit.parameters():
            p.grad = None
    crit, pcme = crits["pcmepp"], crits["pcme"]
    t0 = time.perf_counter()
    if kind == "prolip":  # x: the batch, then the masked copies of its first rows
        loss, _ = crits["prolip"](*x[:4], masked_img=(x[4], x[5]), masked_txt=(x[6], x[7]))
        npp = -1
    elif kind == "infonce":
        loss, _ = crits["infonce"](*x)
        npp = -1
    elif kind == "pcmepp":
        loss, stats = crit(*x)
        npp = int(stats["n_pseudo_positives"])
    elif kind == "broadcast":
        loss = pcmepp_pseudocode_loss(*x, a=crit.scale, b=crit.shift, alpha=crit.pp_alpha, beta=crit.vib_beta)
        npp = -1
    else:
        loss, _ = pcme(*x, generator=torch.Generator(device=x[0].device).manual_seed(0))
        npp = -1
    loss.backward()
    sync()
    dt = time.perf_counter() - t0
    grads = [t.grad.detach().clone() for t in x[:1]]
    return dt, float(loss.detach()), npp, grads


def measure(kind, n, d, device, repeats, crits, Peak, sync):
    x = make_inputs(n, d, device)
    if kind == "prolip":
        x += make_inputs(max(1, n // 8), d, device, seed=1)
    gc.collect()
    with Peak() as pk:
        dt, loss, npp, grads = run_once(kind, x, crits, sync)
    times = [dt]
    for _ in range(max(0, repeats - 1)):
        times.append(run_once(kind, x, crits, sync)[0])
    del x
    gc.collect()
    return {"time": statistics.median(times), "peak": pk.peak, "loss": loss, "npp": npp, "grad": grads[0],
            "runs": len(times)}


def fmt_mem(b):
    if b != b:  # nan
        return "n/a"
    return f"{b / MiB:10.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--samples", type=int, default=7, help="J for PCMELoss")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sections", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                    help="which comparisons to run (1: PCME++ vs broadcast, 2: PCME vs PCME++, 3: ProLIP vs InfoNCE)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: stable timings on a shared machine; 0: torch's default)")
    ap.add_argument("--mem-fraction", type=float, default=0.6,
                    help="skip a configuration whose estimated peak exceeds this fraction of free memory")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="skip a configuration whose estimated time (from the previous batch size) exceeds this")
    args = ap.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        Peak, sync = CudaPeak, torch.cuda.synchronize
        free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731
    else:
        Peak, sync = CpuPeak, (lambda: None)
        free = _mem_available
    crit = PCMEPPLoss().to(device)
    pcme = PCMELoss(n_samples=args.samples, vib_beta=1e-4).to(device)
    crits = {"pcmepp": crit, "pcme": pcme, "prolip": ProLIPLoss().to(device), "infonce": InfoNCELoss().to(device)}
    d = args.dim

    print(f"zsprob scripts/bench_losses.py: forward+backward, D={d}, float32, device={device} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"memory: {Peak.method}; time: median of up to {args.repeats} runs "
          "(1 run for the broadcast above batch 256)")
    print("PCMEPPLoss: alpha=0.1 (pseudo-positives), beta=1e-4 (VIB), both directions; "
          "broadcast = App. A.4 pseudo-code on [N, N, D] tensors")
    # warm-up (library initialisation, thread pools) outside the measurements
    kinds = {1: ("pcmepp", "broadcast"), 2: ("pcmepp", "pcme"), 3: ("prolip", "infonce")}
    for kind in dict.fromkeys(k for sec in args.sections for k in kinds[sec]):
        measure(kind, 32, d, device, 1, crits, Peak, sync)

    rows = {}
    prev = {}

    def maybe(kind, n):
        """Run unless the estimate from the previous batch size is too large."""
        if kind in prev:
            pn, res = prev[kind]
            scale = (n / pn) ** 2
            est_mem, est_time = res["peak"] * scale, res["time"] * scale
            if est_mem > args.mem_fraction * free():
                return f"skipped (needs ~{est_mem / GiB:.1f} GiB, {free() / GiB:.1f} GiB free)"
            if est_time > args.max_seconds:
                return f"skipped (needs ~{est_time:.0f} s per run)"
        reps = args.repeats if kind != "broadcast" or n <= 256 else 1
        res = measure(kind, n, d, device, reps, crits, Peak, sync)
        prev[kind] = (n, res)
        return res

    header = f"{'batch':>6} | {'method':<34} | {'time (s)':>9} | {'peak (MiB)':>10} | {'loss':>12} | note"
    if 1 in args.sections:
        section_pcmepp(args, maybe, rows, header)
    if 2 in args.sections:
        section_pcme(args, maybe, rows, header)
    if 3 in args.sections:
        section_prolip(args, maybe, header)


def section_pcmepp(args, maybe, rows, header):
    print()
    print("1) PCMEPPLoss vs the broadcast pseudo-code")
    print(header)
    print("-" * len(header))
    for n in args.batches:
        fast = maybe("pcmepp", n)
        slow = maybe("broadcast", n)
        rows[n] = (fast, slow)
        for name, r in (("PCMEPPLoss (matmul CSD)", fast), ("pseudo-code broadcast [N,N,D]", slow)):
            if isinstance(r, str):
                print(f"{n:>6} | {name:<34} | {r}")
            else:
                note = f"pseudo-positives {r['npp']}" if r["npp"] >= 0 else ""
                print(f"{n:>6} | {name:<34} | {r['time']:9.3f} | {fmt_mem(r['peak'])} | {r['loss']:12.6f} | {note}")
        if not isinstance(fast, str) and not isinstance(slow, str):
            rel = abs(fast["loss"] - slow["loss"]) / abs(slow["loss"])
            gden = slow["grad"].abs().max().item()
            grel = (fast["grad"] - slow["grad"]).abs().max().item() / gden
            mem_ratio = slow["peak"] / max(fast["peak"], 1)
            print(f"{n:>6} | {'=> ratio broadcast / PCMEPPLoss':<34} | {slow['time'] / fast['time']:8.1f}x | "
                  f"{mem_ratio:9.1f}x | rel. loss diff {rel:.1e}, rel. grad diff {grel:.1e}")



def section_pcme(args, maybe, rows, header):
    print()
    print(f"2) PCMELoss (Monte Carlo, J={args.samples}) vs PCMEPPLoss (CSD)")
    print(header)
    print("-" * len(header))
    for n in args.batches:
        mc = maybe("pcme", n)
        fast = rows[n][0] if n in rows else maybe("pcmepp", n)
        for name, r in ((f"PCMELoss J={args.samples} (blocked)", mc), ("PCMEPPLoss (CSD)", fast)):
            if isinstance(r, str):
                print(f"{n:>6} | {name:<34} | {r}")
            else:
                print(f"{n:>6} | {name:<34} | {r['time']:9.3f} | {fmt_mem(r['peak'])} | {r['loss']:12.6f} |")
        if not isinstance(mc, str) and not isinstance(fast, str):
            print(f"{n:>6} | {'=> ratio PCMELoss / PCMEPPLoss':<34} | {mc['time'] / fast['time']:8.1f}x | "
                  f"{mc['peak'] / max(fast['peak'], 1):9.1f}x |")


def section_prolip(args, maybe, header):
    print()
    print("3) ProLIPLoss (PPCL + inclusion + occlusion inclusion on N/8 masked rows + VIB) vs InfoNCELoss "
          "(targets: <= 1.5x time, <= 2x memory)")
    print(header)
    print("-" * len(header))
    for n in args.batches:
        pro = maybe("prolip", n)
        clip = maybe("infonce", n)
        for name, r in (("ProLIPLoss", pro), ("InfoNCELoss", clip)):
            if isinstance(r, str):
                print(f"{n:>6} | {name:<34} | {r}")
            else:
                print(f"{n:>6} | {name:<34} | {r['time']:9.3f} | {fmt_mem(r['peak'])} | {r['loss']:12.6f} |")
        if not isinstance(pro, str) and not isinstance(clip, str):
            print(f"{n:>6} | {'=> ratio ProLIPLoss / InfoNCELoss':<34} | {pro['time'] / clip['time']:8.2f}x | "
                  f"{pro['peak'] / max(clip['peak'], 1):9.2f}x |")


if __name__ == "__main__":
    main()
