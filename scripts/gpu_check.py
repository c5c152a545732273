#!/usr/bin/env python
"""The one prepared GPU check of zsprob: versions, CPU-vs-device equality, training throughput
against open_clip's own trainer, and a COCO-5K-sized evaluation, written to OUT/gpu_check.json and
OUT/gpu_check.md.

Device tool ``run`` (after ``bash scripts/gpu_wheels.sh`` here), with ``carry: [".whl", ".whl-oc"]``
and ``timeout_s: 540``; the command, one line:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/wds0286 .whl-oc/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && python3 scripts/gpu_check.py --device cuda --out $OUT --wds0286 /tmp/wds0286 2>&1 | tee $OUT/gpu_check.log

(prefix ``ZSPROB_GIT_HEAD=<git rev-parse HEAD> `` to record the commit: the copied tree has no .git).
On the CPU, as CI runs it: ``python scripts/gpu_check.py --device cpu --quick --out DIR``.

Sections (each timed; an exception is recorded in the JSON and the next section runs; no section
starts when the budget would be overrun):

1. ``versions``: torch, CUDA, cuDNN, the device, python, zsprob's git HEAD.
2. ``losses``: PCMEPPLoss, InfoNCELoss, ProLIPLoss and CSD on the device in float32 against the CPU in
   float64 (values and input gradients); ``forward``: a ProbCLIP forward on the CPU and on the
   device (float32, TF32 off); ``train_steps``: three ``zsprob pretrain`` steps on the CPU and on the
   device (same seed and data, float32, TF32 off): logged losses and final weights; ``bf16``: the
   same three steps in bf16 against float32 on the device, and embedding cosines.
3. ``throughput``: ``zsprob pretrain`` (InfoNCE, PCME++) against ``open_clip_train.main`` on the
   device (scripts/bench_train.py): median samples/s, peak memory, optimizer-step ms, host syncs per
   steady step, FLOPs per step and MFU.
4. ``evaluation``: 5,000 images (224 px, random) and 25,000 captions through the ProbCLIP on the
   device, CSD top-k ranking on the device and on the CPU from the same embeddings (float32 and
   float64), and zsprob's evaluation on the CPU: identical rankings and metrics, and times.
5. ``degrade``: the JPEG round trip of the degraded views in tensor arithmetic on the device against
   libjpeg on the CPU (pixels that differ: 0), and the host reads of one ``degrade_images`` call there.

torch, zsprob (models, prob, retrieval, the ``pretrain`` CLI) and open_clip's trainer do the work;
this script times, compares and writes the tables.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_record import Check, figure  # noqa: E402  (after the path: run as a script)

#: dense bf16 tensor peak in FLOP/s (first match in the device name wins)
BF16_PEAK = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12))


@dataclass
class Sizes:
    model: str              # ProbCLIP of the forward, bf16 and evaluation checks
    train_model: str        # towers of the three training steps and of the throughput runs
    loss_n: int
    loss_d: int
    fwd_batch: int
    train_batch: int
    tp_batch: int
    tp_steps: int
    tp_skip: int
    tp_image_size: int
    tp_num_pretrain: int
    tp_workers: int
    tp_precision: str
    eval_images: int
    eval_cpu_images: int
    eval_k: int = 10


FULL = Sizes("ViT-B-16", "ViT-B-16", 256, 512, 4, 8, 256, 15, 5, 224, 2048, 8, "bf16", 5000, 128)
QUICK = Sizes("ViT-B-16", "ViT-B-16", 64, 512, 2, 4, 64, 8, 3, 224, 512, 8, "bf16", 1000, 32)
assert FULL.eval_cpu_images <= 250 and QUICK.eval_cpu_images <= 250  # within the first image chunk
CPU_QUICK = Sizes("zsprob-tiny", "zsprob-tiny", 32, 64, 2, 4, 8, 3, 1, 64, 16, 0, "fp32", 40, 8)

#: seconds of each section by mode; a section starts only if its figure fits in what is left of the budget.
#: "cuda" (full sizes on one H200): guesses that add up to the 2026-11-28 calls (docs/benchmarks.md): all
#: eight sections 162 s; versions, bf16 and throughput 93 s; evaluation about 41 s. "cuda-quick": guesses.
#: "cpu-quick": wall seconds of a --device cpu --quick run on the project's 2-core CPU (measured, the
#: open_clip baseline and the fp16 stand-in included; CPU_QUICK_MEASURED has its CPU seconds).
ESTIMATE = {"versions": {"cuda": 5, "cuda-quick": 5, "cpu-quick": 3},
            "losses": {"cuda": 3, "cuda-quick": 2, "cpu-quick": 0.1},
            "forward": {"cuda": 8, "cuda-quick": 5, "cpu-quick": 0.5},
            "train_steps": {"cuda": 20, "cuda-quick": 10, "cpu-quick": 1.5},
            "bf16": {"cuda": 20, "cuda-quick": 10, "cpu-quick": 2.5},
            "throughput": {"cuda": 70, "cuda-quick": 40, "cpu-quick": 13},
            "evaluation": {"cuda": 45, "cuda-quick": 15, "cpu-quick": 0.5},
            "degrade": {"cuda": 5, "cuda-quick": 3, "cpu-quick": 0.1}}
#: (wall s, CPU s) of each section in one --device cpu --quick run, 2-core AMD EPYC, torch 2.14.1, 2026-11-28
CPU_QUICK_MEASURED: dict = {}
#: one lent session: 900 device-seconds; each call costs about 120 s besides the script (start, transfers,
#: wheel installs, idle: 2026-11-28, 3 calls in 750 device-seconds, 389 s of them in the script)
SESSION_S, CALL_OVERHEAD_S = 900, 120


# ----------------------------------------------------------------------------- helpers

def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


class no_tf32:
    """float32 matmuls and convolutions in full float32 (TF32 off) inside the block."""

    def __enter__(self):
        import torch
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        import torch
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def max_rel(a, ref) -> float:
    """max |a - ref| / max |ref| (float64, on the CPU)."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def git_head() -> str:
    if os.environ.get("ZSPROB_GIT_HEAD"):
        return os.environ["ZSPROB_GIT_HEAD"]
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no git repository here; set ZSPROB_GIT_HEAD)"


def device_name(device: str) -> str:
    import torch
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores)"


def bf16_peak(name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK if key in name), None)


# ----------------------------------------------------------------------------- 1. versions

def section_versions(c: Check) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": device_name(c.device), "zsprob_git_head": git_head(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}
    for mod in ("open_clip", "timm", "accelerate", "webdataset", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # a missing package is a finding, not a failure of the section
            info[mod] = f"not importable ({type(e).__name__})"
    c.put("info", info)
    figs = c.figures()
    if c.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        figs.append(figure("GPU memory", round(props.total_memory / 2**30, 1), "GiB"))
        peak = bf16_peak(props.name)
        figs.append(figure("dense bf16 peak (datasheet)", None if peak is None else peak / 1e12, "TFLOP/s",
                           note="" if peak else "unknown GPU: no MFU"))
    return {"info": info, "figures": figs}


# ----------------------------------------------------------------------------- 2. equality

def loss_inputs(n: int, d: int, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    img_mu = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    txt_mu = torch.nn.functional.normalize(img_mu + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    img_lv = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5 - 4.0
    txt_lv = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5 - 4.0
    return img_mu, img_lv, txt_mu, txt_lv


def loss_and_grads(fn, inputs, dtype, device):
    xs = [x.detach().to(device=device, dtype=dtype).clone().requires_grad_(True) for x in inputs]
    value = fn(*xs)
    value.sum().backward()
    return value.detach(), [x.grad for x in xs]


def loss_cases():
    from zsprob.prob import InfoNCELoss, PCMEPPLoss, create_loss
    return [("PCMEPPLoss", lambda: PCMEPPLoss(), 1e-5, 1e-4),
            ("InfoNCELoss", lambda: InfoNCELoss(), 1e-5, 1e-4),
            ("ProLIPLoss", lambda: create_loss("prolip", inclusion_alpha_occ=0.0), 1e-4, 1e-3),
            ("CSD", None, 1e-5, 1e-4)]


def section_losses(c: Check) -> dict:
    import torch

    from zsprob.prob import csd
    inputs = loss_inputs(c.sizes.loss_n, c.sizes.loss_d)
    figs = c.figures()
    for name, make, tol_v, tol_g in loss_cases():
        results = []
        for dtype, device in (("float64", "cpu"), ("float32", c.device)):
            if make is None:
                fn = csd
            else:
                module = make().to(device=device, dtype=getattr(torch, dtype))
                fn = (lambda m: lambda a, b, x, y: m(a, b, x, y)[0])(module)
            with no_tf32():
                results.append(loss_and_grads(fn, inputs, getattr(torch, dtype), device))
        (ref, ref_g), (got, got_g) = results
        err_v = max_rel(got, ref)
        if [g is None for g in got_g] != [r is None for r in ref_g]:
            raise RuntimeError(f"{name}: the inputs with a gradient differ between the devices")
        err_g = max(max_rel(g, r) for g, r in zip(got_g, ref_g) if r is not None)
        what = "max relative error, [N, M] matrix" if make is None else "relative error"
        figs.append(figure(f"{name} value, {c.device} float32 vs CPU float64", err_v, what, f"<= {tol_v:g}",
                           err_v <= tol_v))
        figs.append(figure(f"{name} input gradients", err_g, "max |diff| / max |ref|", f"<= {tol_g:g}", err_g <= tol_g))
    return {"figures": figs, "inputs": f"N = {c.sizes.loss_n}, D = {c.sizes.loss_d}, seed 0"}


def make_probclip(name: str, device: str = "cpu"):
    from zsprob.models import create_model
    model = create_model(name, seed=0).eval()
    return model.to(device)


def forward_inputs(model, n: int, seed: int = 0):
    import torch
    size = model.image_size or 224
    size = size if isinstance(size, int) else size[0]
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    tokens = model.tokenizer([caption(i) for i in range(n)])
    return images, tokens


def encode(model, images, tokens, device: str, bf16: bool = False):
    import torch
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
        img = model.encode_image(images.to(device))
        txt = model.encode_text(tokens.to(device))
    return [t.float().cpu() for t in (*img, *txt)]


def section_forward(c: Check) -> dict:
    model = make_probclip(c.sizes.model)
    images, tokens = forward_inputs(model, c.sizes.fwd_batch)
    with no_tf32():
        ref = encode(model, images, tokens, "cpu")
        model.to(c.device)
        got = encode(model, images, tokens, c.device)
    c.shared["forward_fp32"] = got
    figs = c.figures()
    for i, (part, tol) in enumerate((("image mu", 1e-4), ("image logvar", 1e-3), ("text mu", 1e-4),
                                     ("text logvar", 1e-3))):
        diff = float((got[i] - ref[i]).abs().max())
        figs.append(figure(f"{c.sizes.model} {part}, {c.device} vs CPU (float32, TF32 off)", diff, "max |diff|",
                           f"<= {tol:g}", diff <= tol))
    return {"figures": figs, "inputs": f"{c.sizes.fwd_batch} random images + captions, create_model seed 0"}


WORDS = (("red", "blue", "green", "yellow", "purple", "orange"), ("small", "large", "striped", "dotted"),
         ("square", "circle", "triangle", "star", "ellipse", "rectangle"), ("left of", "above", "below", "next to"))


def caption(i: int) -> str:
    """A deterministic SynthWorld-like caption for index ``i``."""
    c, s, shape, rel = (WORDS[k][(i // (1 + 7 * k)) % len(WORDS[k])] for k in range(4))
    other = WORDS[2][(i * 5 + 3) % len(WORDS[2])]
    return f"a {s} {c} {shape} {rel} a {other}"


def world(c: Check, n: int, image_size: int) -> Path:
    """A SynthWorld of ``n`` pretraining images (made once per size and reused)."""
    from bench_train import ensure_world
    key = f"sw_{n}_{image_size}"
    if key not in c.shared:
        c.shared[key] = ensure_world(c.tmp / key, n, image_size, shard_size=max(8, n // 8),
                                     workers=max(1, min(8, (os.cpu_count() or 2) - 1)))
    return c.shared[key]


def three_steps(c: Check, device: str, precision: str, tag: str) -> dict:
    """Three ``zsprob pretrain`` steps (PCME++, seed 0, TF32 off) in this process: logged losses, lrs
    and the final weights."""
    from safetensors.torch import load_file

    from bench_train import run_zsprob_inprocess, zsprob_command
    ns = SimpleNamespace(model=c.sizes.train_model, precision=precision, batch_size=c.sizes.train_batch, workers=0,
                         threads=c.args.threads, device=device)
    out = c.tmp / f"steps_{tag}"
    argv = zsprob_command(world(c, c.sizes.train_batch * 4, 64), out, "pcmepp", ns, 3, ["--seed", "0"])
    t = time.perf_counter()
    run_zsprob_inprocess(argv, {"no_tf32": True})
    wall = time.perf_counter() - t
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        weights.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return {"losses": [r["loss"] for r in recs], "lrs": [r["lr"] for r in recs], "weights": weights, "wall_s": wall,
            "skipped": [int(r.get("nonfinite_total") or 0) + int(r.get("scaler_skipped_total") or 0) for r in recs],
            "loss_scales": [r.get("loss_scale") for r in recs]}


def weight_diff(a: dict, b: dict) -> tuple[float, float]:
    """max |a - b| over every tensor, and ||a - b|| / ||b|| over all of them."""
    worst, num, den = 0.0, 0.0, 0.0
    for k, v in b.items():
        d = (a[k].double() - v.double())
        worst = max(worst, float(d.abs().max()) if d.numel() else 0.0)
        num += float(d.square().sum())
        den += float(v.double().square().sum())
    return worst, math.sqrt(num) / max(math.sqrt(den), 1e-300)


def section_train_steps(c: Check) -> dict:
    cpu = three_steps(c, "cpu", "fp32", "cpu_fp32")
    dev = cpu if c.device == "cpu" else three_steps(c, c.device, "fp32", f"{c.device}_fp32")
    c.shared["steps_fp32"] = dev
    figs = c.figures()
    for i, (a, b) in enumerate(zip(dev["losses"], cpu["losses"])):
        rel = abs(a - b) / abs(b)
        figs.append(figure(f"step {i + 1} loss {a:.6f} ({c.device}) vs {b:.6f} (CPU)", rel, "relative difference",
                           "<= 1e-3", rel <= 1e-3))
    if len(dev["losses"]) != 3 or len(cpu["losses"]) != 3:
        figs.append(figure("logged steps", len(dev["losses"]), "steps", "== 3", False))
    worst, rel = weight_diff(dev["weights"], cpu["weights"])
    bound = 3.0 * sum(cpu["lrs"])
    figs.append(figure("final weights, max |diff|", worst, "absolute",
                       f"<= 3 x sum of the 3 lrs = {bound:.2e} (an AdamW step moves a weight by about lr)",
                       worst <= bound))
    figs.append(figure("final weights, ||diff|| / ||w||", rel, "relative L2"))
    figs.append(figure("CPU run wall (3 steps + model build + save)", round(cpu["wall_s"], 1), "s"))
    note = "the device is the CPU: one run, compared with itself" if c.device == "cpu" else ""
    return {"figures": figs, "model": c.sizes.train_model, "batch": c.sizes.train_batch, "note": note}


def section_bf16(c: Check) -> dict:
    import torch
    fp32 = c.shared.get("steps_fp32") or three_steps(c, c.device, "fp32", f"{c.device}_fp32")
    bf16 = three_steps(c, c.device, "bf16", f"{c.device}_bf16")
    figs = c.figures()
    for i, (a, b) in enumerate(zip(bf16["losses"], fp32["losses"])):
        rel = abs(a - b) / abs(b)
        figs.append(figure(f"step {i + 1} loss {a:.5f} (bf16) vs {b:.5f} (fp32)", rel, "relative difference",
                           "<= 5e-2", rel <= 5e-2))
    model = make_probclip(c.sizes.model, c.device)
    images, tokens = forward_inputs(model, c.sizes.fwd_batch)
    with no_tf32():
        ref = c.shared.get("forward_fp32") or encode(model, images, tokens, c.device)
    got = encode(model, images, tokens, c.device, bf16=True)
    for i, part in ((0, "image mu"), (2, "text mu")):
        cos = float(torch.nn.functional.cosine_similarity(got[i], ref[i], dim=-1).min())
        figs.append(figure(f"{c.sizes.model} {part}, bf16 autocast vs fp32: min cosine", cos, "cosine",
                           ">= 0.99", cos >= 0.99))
    for i, part in ((1, "image logvar"), (3, "text logvar")):
        diff = float((got[i] - ref[i]).abs().max())
        figs.append(figure(f"{c.sizes.model} {part}, bf16 vs fp32", diff, "max |diff|", "<= 0.25", diff <= 0.25))
    if c.device == "cuda":
        figs += fp16_figures(three_steps(c, c.device, "fp16", f"{c.device}_fp16"), fp32)
    else:  # the CUDA-only fp16 steps rehearsed: the same path, float16 autocast and a GradScaler on the CPU
        with cpu_fp16_stand_in():
            rehearsal = three_steps(c, "cpu", "fp16", "cpu_fp16_stand_in")
        figs += fp16_figures(rehearsal, fp32, FP16_STAND_IN, note="on the CPU: float16 autocast and "
                             "torch.amp.GradScaler('cpu') in place of CUDA's (cpu_fp16_stand_in)")
    return {"figures": figs, "device": c.device}


FP16_STAND_IN = "fp16 stand-in"


@contextlib.contextmanager
def cpu_fp16_stand_in():
    """fp16 training on the CPU in place of CUDA's, so that the fp16 steps of this check run in CI:
    zsprob's refusal of fp16 on the CPU is lifted (``build.training_on_cpu`` answers False; with no GPU
    visible accelerate still picks the CPU) and accelerate's ``Accelerator`` is given what it gives a GPU
    under fp16, float16 autocast and a GradScaler (``torch.amp.GradScaler("cpu")``). Everything after
    (the optimizer wrapper, zsprob's unscale, clip, skipped-step count and loss-scale log) is the real
    code. Not rehearsed: CUDA's float16 kernels and the CUDA GradScaler's fused unscale."""
    import accelerate
    import torch

    import zsprob.train.build as build
    base, on_cpu = accelerate.Accelerator, build.training_on_cpu

    class StandIn(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.state.mixed_precision == "fp16" and self.device.type == "cpu":
                self.native_amp = True
                self.scaler = torch.amp.GradScaler("cpu")
    accelerate.Accelerator, build.training_on_cpu = StandIn, (lambda tc: False)
    try:
        yield
    finally:
        accelerate.Accelerator, build.training_on_cpu = base, on_cpu


def fp16_figures(fp16: dict, fp32: dict, label: str = "fp16", note: str = "") -> list[dict]:
    """The three steps in fp16 (accelerate's GradScaler) against float32: a scaler ran (a loss scale in
    every log record), every logged loss finite and, while no step has been skipped (a scaler starting at
    2^16 may skip the first ones and back off), within 5%; the skipped steps and the final weights'
    finiteness are reported."""
    import torch
    skipped = fp16["skipped"]  # cumulative, one per logged step
    scaled = bool(fp16["loss_scales"]) and all(s is not None for s in fp16["loss_scales"])
    figs = [figure(f"{label}: updates skipped (GradScaler or non-finite loss), cumulative per step", str(skipped),
                   "steps", note=f"loss scale after each step {fp16['loss_scales']}; the scaler starts at 2^16 and "
                                 "halves on each skip"),
            figure(f"{label}: a GradScaler ran (loss scale logged every step)", scaled, "yes/no", "yes", scaled,
                   note),
            figure(f"{label}: logged steps", len(fp16["losses"]), "steps", "== 3", len(fp16["losses"]) == 3)]
    for i, (a, b) in enumerate(zip(fp16["losses"], fp32["losses"])):
        if a is None or not math.isfinite(a):
            figs.append(figure(f"step {i + 1} loss ({label})", str(a), "loss", "finite", False))
            continue
        rel = abs(a - b) / abs(b)
        judged = i == 0 or skipped[i - 1] == 0  # same weights as fp32 until an update is skipped
        figs.append(figure(f"step {i + 1} loss {a:.5f} ({label}) vs {b:.5f} (fp32)", rel, "relative difference",
                           "<= 5e-2" if judged else None, rel <= 5e-2 if judged else None,
                           note="" if judged else "after a skipped step: not comparable, reported only"))
    finite = all(bool(torch.isfinite(v.float()).all()) for v in fp16["weights"].values())
    figs.append(figure(f"{label}: final weights finite", finite, "yes/no", "all finite", finite))
    return figs


# ----------------------------------------------------------------------------- 3. throughput

def throughput_args(c: Check) -> SimpleNamespace:
    s = c.sizes
    return SimpleNamespace(device=c.device, model=s.train_model, precision=s.tp_precision, steps=s.tp_steps,
                           skip=s.tp_skip, batch_size=s.tp_batch, threads=c.args.threads, workers=s.tp_workers, probe=True,
                           wds0286=c.args.wds0286, oc_min_one_worker=False, timeout=c.sub_timeout(),
                           inprocess=True)


def throughput_runs(c: Check, world: Path, ns) -> dict:
    """Each run in turn, its result (or ``{"status": "error", ...}``) saved as soon as it ends: one
    failing run (open_clip's trainer is the likeliest) costs only its own figures."""
    import bench_train
    runs = {"zsprob infonce": lambda: bench_train.run_zsprob(world, c.tmp / "tp_zi", "infonce", ns,
                                                             ["--set", "model.pooling=native"]),
            "zsprob pcmepp": lambda: bench_train.run_zsprob(world, c.tmp / "tp_zp", "pcmepp", ns,
                                                            ["--set", "model.pooling=native"])}
    results: dict = {}
    skipped: list = []
    c.put("runs", results)
    c.put("skipped", skipped)
    why = bench_train.open_clip_ready(ns.wds0286)
    if why is None:
        runs["open_clip_train infonce"] = lambda: bench_train.run_open_clip(world, c.tmp / "tp_oc", ns)
    else:
        skipped.append({"what": "open_clip_train", "reason": why})
    for name, fn in runs.items():
        ns.timeout = c.sub_timeout()
        try:
            results[name] = {"status": "ok", **fn()}
        except Exception as e:  # one failing run is recorded beside the others; the others still run
            results[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"[-2000:]}
        print(f"[throughput] {name}: {results[name]['status']}", flush=True)
        c.save()
    return {"runs": results, "skipped": skipped}


def run_figures(name: str, res: dict, ns, peak: float | None) -> list[dict]:
    if res.get("status") == "error":
        return [figure(f"{name}: failed", None, "", note=res["error"][-300:])]
    figs = [figure(f"{name}: median samples/s", round(res["median_sps"], 1), "samples/s",
                   note=f"{res['steps_measured']} steps after {ns.skip} warm-up")]
    if "peak_mem_bytes" in res:
        figs.append(figure(f"{name}: peak memory", round(res["peak_mem_bytes"] / 2**20), "MiB (max_memory_allocated)"))
    if "opt_step_ms" in res:
        figs.append(figure(f"{name}: optimizer step", round(res["opt_step_ms"], 2), "ms"))
    for suffix, what, unit in (("", "HostSyncCounter", "calls"), ("_data", "HostSyncCounter, in next_batch", "calls"),
                               ("_debug", "sync debug mode", "warnings"),
                               ("_debug_data", "sync debug mode, in next_batch", "warnings")):
        if f"host_syncs{suffix}_per_step" in res:
            figs.append(figure(f"{name}: host syncs per steady step ({what})", res[f"host_syncs{suffix}_per_step"],
                               unit, note=f"where: {res.get(f'host_sync{suffix}_where', {})}"[:600]))
    if "flops_per_step" in res:
        figs.append(figure(f"{name}: model FLOPs per step", round(res["flops_per_step"] / 1e9, 1), "GFLOP",
                           note="FlopCounterMode, forward + backward of one step"))
    return figs


def mfu_figures(runs: dict, peak: float | None, device: str, batch: int) -> tuple[list, list]:
    if peak is None:
        why = "needs CUDA and a known GPU" if device == "cpu" else "no dense bf16 peak known for this GPU"
        return [], [{"what": "MFU", "reason": why}]
    figs = []
    flops = runs.get("zsprob infonce", {}).get("flops_per_step")
    for name, res in runs.items():
        f = res.get("flops_per_step") or flops  # open_clip: the same towers as zsprob infonce (native pooling)
        if "median_sps" in res and f:
            mfu = f * res["median_sps"] / batch / peak
            figs.append(figure(f"{name}: MFU", round(100 * mfu, 2), "% of dense bf16 peak",
                               note=f"peak {peak / 1e12:.0f} TFLOP/s"))
    return figs, []


def section_throughput(c: Check) -> dict:
    s = c.sizes
    ns = throughput_args(c)
    got = throughput_runs(c, world(c, s.tp_num_pretrain, s.tp_image_size), ns)
    runs, skipped = got["runs"], got["skipped"]
    peak = bf16_peak(device_name(c.device)) if c.device == "cuda" else None
    figs = c.figures()
    figs += [f for name, res in runs.items() for f in run_figures(name, res, ns, peak)]
    oc = runs.get("open_clip_train infonce", {})
    for name in ("zsprob infonce", "zsprob pcmepp"):
        if oc.get("median_sps") and "median_sps" in runs[name]:
            figs.append(figure(f"{name} / open_clip_train", round(runs[name]["median_sps"] / oc["median_sps"], 3),
                               "x (samples/s)"))
        if oc.get("peak_mem_bytes") and runs[name].get("peak_mem_bytes"):
            ratio = runs[name]["peak_mem_bytes"] / oc["peak_mem_bytes"]
            figs.append(figure(f"{name} / open_clip_train peak memory", round(ratio, 3), "x (bytes)"))
    mfu, why = mfu_figures(runs, peak, c.device, s.tp_batch)
    figs += mfu
    skipped += why
    if c.device == "cpu":
        skipped.append({"what": "host syncs with torch.cuda.set_sync_debug_mode", "reason": "needs CUDA; counted "
                        "with zsprob.utils.host_sync.HostSyncCounter instead"})
    out = {"figures": figs, "skipped": skipped, "setup": {k: v for k, v in vars(ns).items() if k != "timeout"},
           "runs": runs}
    failed = [n for n, r in runs.items() if r["status"] == "error"]
    if failed:  # the section is marked failed, every figure of the other runs kept
        out.update(status="error", error=f"runs failed: {', '.join(failed)}: "
                   + "; ".join(runs[n]["error"][-400:] for n in failed))
    return out


# ----------------------------------------------------------------------------- 4. evaluation

def eval_images(n: int, size: int, device: str, chunk: int = 250):
    """Random images, generated chunk by chunk on ``device`` (seeded): the same on every call."""
    import torch
    for i, a in enumerate(range(0, n, chunk)):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        yield torch.randn(min(chunk, n - a), 3, size, size, generator=g, device=device)


def encode_all(model, n_images: int, tokens, device: str, bf16: bool, batch: int = 250):
    """(img_mu, img_lv, cap_mu, cap_lv) on ``device`` and the seconds it took."""
    import torch
    sync(device)
    t = time.perf_counter()
    parts: list[list] = [[], [], [], []]
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
        for images in eval_images(n_images, model.image_size or 224, device):
            mu, lv = model.encode_image(images)
            parts[0].append(mu.float())
            parts[1].append(lv.float())
        for a in range(0, len(tokens), batch * 4):
            mu, lv = model.encode_text(tokens[a:a + batch * 4].to(device))
            parts[2].append(mu.float())
            parts[3].append(lv.float())
    out = [torch.cat(p) for p in parts]
    sync(device)
    return out, time.perf_counter() - t


def rank_both(emb: list, k: int, device: str, dtype):
    """CSD top-k of both directions on ``device`` from ``emb`` (cast to ``dtype``): indices and seconds."""
    from zsprob.retrieval.scoring import chunked_topk
    img_mu, img_lv, cap_mu, cap_lv = (e.to(device=device, dtype=dtype) for e in emb)
    sync(device)
    t = time.perf_counter()
    i2t = chunked_topk("csd", img_mu, img_lv, cap_mu, cap_lv, k)[1]
    t2i = chunked_topk("csd", cap_mu, cap_lv, img_mu, img_lv, k)[1]
    return (i2t, t2i), time.perf_counter() - t


def recalls(ranked, positives, ks=(1, 5, 10)) -> dict:
    from zsprob.retrieval.metrics import metrics_from_ranking
    res = metrics_from_ranking(ranked, positives, ks=ks, r_metrics=False)
    return {key: float(v.mean()) * 100 for key, v in res.values.items()}


def eval_embed(c: Check, n_img: int, figs: list) -> tuple[list, list, object]:
    import torch
    model = make_probclip(c.sizes.model, c.device)
    tokens = model.tokenizer([caption(i) for i in range(5 * n_img)])
    with no_tf32():
        emb, secs = encode_all(model, n_img, tokens, c.device, bf16=False)
    figs.append(figure(f"encode {n_img} images + {5 * n_img} captions, {c.device} float32 (TF32 off)",
                       round(secs, 2), "s"))
    if c.device == "cuda":
        emb_bf16, secs = encode_all(model, n_img, tokens, c.device, bf16=True)
        cos = float(torch.nn.functional.cosine_similarity(emb_bf16[0], emb[0], dim=-1).min())
        figs.append(figure(f"encode, {c.device} bf16 autocast", round(secs, 2), "s", note=f"min image-mu cosine vs "
                           f"float32 {cos:.5f}"))
    return emb, tokens, model


def eval_cpu_subsample(c: Check, model, tokens, emb: list, figs: list) -> None:
    """The first images / captions encoded on the CPU too: time and agreement with the device."""
    m = c.sizes.eval_cpu_images
    model.cpu()
    # the first chunk again, whole: a generator's first m draws need not be those of a longer draw
    images = next(eval_images(c.sizes.eval_images, model.image_size or 224, c.device))[:m].cpu()
    t = time.perf_counter()
    with no_tf32():
        got = encode(model, images, tokens[:5 * m], "cpu")
    secs = time.perf_counter() - t
    figs.append(figure(f"encode {m} images + {5 * m} captions on the CPU (subsample)", round(secs, 2), "s",
                       note=f"{(m * 6) / secs:.1f} items/s"))
    ref = [emb[0][:m], emb[1][:m], emb[2][:5 * m], emb[3][:5 * m]]
    diff = max(float((g - r.cpu()).abs().max()) for g, r in zip(got, ref))
    figs.append(figure(f"CPU vs {c.device} embeddings of the subsample (mu, logvar)", diff, "max |diff|", "<= 1e-3",
                       diff <= 1e-3))


def eval_rank(c: Check, emb: list, n_img: int, figs: list) -> dict:
    import numpy as np
    import torch

    from zsprob.retrieval.metrics import positives_from_assignment
    cap_img = np.repeat(np.arange(n_img), 5)
    i2t_pos = positives_from_assignment(cap_img, n_img)
    t2i_pos = i2t_pos.T.tocsr()
    emb_cpu = [e.cpu() for e in emb]
    metrics = {}
    for dtype in (torch.float32, torch.float64):
        tag = str(dtype).split(".")[-1]
        (d_i2t, d_t2i), d_s = rank_both(emb, c.sizes.eval_k, c.device, dtype)
        (c_i2t, c_t2i), c_s = rank_both(emb_cpu, c.sizes.eval_k, "cpu", dtype)
        figs.append(figure(f"CSD top-{c.sizes.eval_k} both directions, {tag}, {c.device}", round(d_s, 3), "s"))
        figs.append(figure(f"CSD top-{c.sizes.eval_k} both directions, {tag}, CPU", round(c_s, 3), "s"))
        same = float(torch.cat([(d_i2t == c_i2t).all(1), (d_t2i == c_t2i).all(1)]).float().mean())
        tied = float(torch.cat([same_up_to_ties(d_i2t, c_i2t, emb_cpu, False),
                                same_up_to_ties(d_t2i, c_t2i, emb_cpu, True)]).float().mean())
        tol = 0.999 if dtype == torch.float64 else 0.99
        figs.append(figure(f"{tag} ranked lists identical, {c.device} vs CPU", same, "fraction of queries",
                           note="exact ties (repeated captions) may be ordered differently by each device"))
        figs.append(figure(f"{tag} ranked lists identical up to exact ties, {c.device} vs CPU", tied,
                           "fraction of queries", f">= {tol}", tied >= tol,
                           note="the float64 CSD of each listed pair, rank by rank, equal to 1e-12 relative"))
        dev_m = {**{f"i2t {k}": v for k, v in recalls(d_i2t, i2t_pos).items()},
                 **{f"t2i {k}": v for k, v in recalls(d_t2i, t2i_pos).items()}}
        cpu_m = {**{f"i2t {k}": v for k, v in recalls(c_i2t, i2t_pos).items()},
                 **{f"t2i {k}": v for k, v in recalls(c_t2i, t2i_pos).items()}}
        diff = max(abs(dev_m[k] - cpu_m[k]) for k in dev_m)
        mtol = 0.0 if dtype == torch.float64 else 0.1
        figs.append(figure(f"{tag} R@1/5/10 both directions, {c.device} vs CPU", diff, "max |diff|, percentage points",
                           f"<= {mtol:g}", diff <= mtol))
        metrics[tag] = dev_m
    return metrics


def same_up_to_ties(dev, cpu, emb: list, captions_first: bool):
    """Per query: the two top-k lists rank the same gallery scores, i.e. they are equal up to the order
    of exactly tied items. The float64 CSD of each listed (query, item) pair is compared rank by rank
    (relative 1e-12), so lists that differ only among repeated, identical captions count as equal."""
    import torch

    from zsprob.prob.distances import csd
    img_mu, img_lv, cap_mu, cap_lv = (e.cpu().double() for e in emb)
    q_mu, q_lv, g_mu, g_lv = (cap_mu, cap_lv, img_mu, img_lv) if captions_first else (img_mu, img_lv, cap_mu, cap_lv)
    ok = []
    for a in range(0, len(dev), 1024):
        rows = slice(a, a + 1024)
        score = csd(q_mu[rows], q_lv[rows], g_mu, g_lv)  # [chunk, gallery] in float64
        d = score.gather(1, dev[rows].cpu().long())
        c = score.gather(1, cpu[rows].cpu().long())
        ok.append(((d - c).abs() <= 1e-12 * c.abs().clamp_min(1.0)).all(1))
    return torch.cat(ok)


def eval_cpu(emb: list, n_img: int, ref: dict, figs: list) -> None:
    import numpy as np

    from zsprob.retrieval import Embeddings, evaluate_embeddings
    from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
    from zsprob.retrieval.metrics import positives_from_assignment
    import scipy.sparse as sp
    cap_img = np.repeat(np.arange(n_img), 5)
    pos = positives_from_assignment(cap_img, n_img)
    task = RetrievalTask("coco5k-sized", np.arange(n_img), np.arange(5 * n_img), cap_img,
                         sets=[BenchmarkSet("caption", pos, sp.csr_matrix(pos.T))])
    e = [t.cpu() for t in emb]
    data = Embeddings(image_ids=task.image_ids, caption_ids=task.caption_ids, image_mu=e[0], caption_mu=e[2],
                      image_logvar=e[1], caption_logvar=e[3], caption_image=cap_img)
    t = time.perf_counter()
    res = evaluate_embeddings(data, task, score="csd")
    figs.append(figure("zsprob evaluation (CSD, every metric), CPU", round(time.perf_counter() - t, 3), "s",
                       note=res.metrics.get("setup", {}).get("method", "")))
    got = flat_recalls(res.metrics)
    common = [k for k in ref if k in got]
    diffs = {k: round(got[k] - ref[k], 6) for k in common}
    # float32 scores on both sides, computed differently: near-ties may order a few queries otherwise
    ok = bool(common) and all(abs(diffs[k]) <= 0.1 for k in common)
    figs.append(figure(f"CPU evaluation R@K vs float32 top-k on the device ({len(common)} values)",
                       max((abs(v) for v in diffs.values()), default=float("nan")), "max |diff|, percentage points",
                       "<= 0.1", ok, note=f"differences: {diffs}"))


def flat_recalls(metrics: dict) -> dict:
    """{"i2t r@1": value, ...} from an EvalResult's nested metrics (first recall set)."""
    out = {}

    def walk(d, path):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, path + [str(k)])
            elif isinstance(v, (int, float)) and str(k).lower() in ("r@1", "r@5", "r@10"):
                direction = next((p for p in path if p in ("i2t", "t2i")), None)
                if direction and f"{direction} {k.lower()}" not in out:
                    out[f"{direction} {k.lower()}"] = float(v)
    walk(metrics, [])
    return out


def section_evaluation(c: Check) -> dict:
    figs = c.figures()
    n_img = c.sizes.eval_images
    emb, tokens, model = eval_embed(c, n_img, figs)
    metrics = eval_rank(c, emb, n_img, figs)
    eval_cpu(emb, n_img, {k.replace("R@", "r@"): v for k, v in metrics["float32"].items()}, figs)
    eval_cpu_subsample(c, model, tokens, emb, figs)
    return {"figures": figs, "metrics_float64_device": metrics["float64"],
            "setup": f"{n_img} random {model.image_size} px images, {5 * n_img} captions, {c.sizes.model} "
                     "random init (seed 0): chance-level metrics; what is compared is identity across devices"}


def section_degrade(c: Check) -> dict:
    """The degraded views on the device: JPEG's round trip in tensor arithmetic equals libjpeg on the CPU
    pixel for pixel, and a whole degrade_images call on the device makes no host read."""
    import torch

    from zsprob.data.degrade import degrade_images
    from zsprob.data.jpeg_torch import jpeg_roundtrip, libjpeg_roundtrip
    from zsprob.utils.host_sync import HostSyncCounter

    n, side = (8, 64) if c.args.quick else (64, 224)
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(n, 3, side, side + 5, generator=g) * 255).round().to(torch.uint8)
    qualities = [5 + i % 16 for i in range(n)]
    ref = libjpeg_roundtrip(images, qualities)
    t = time.perf_counter()
    got = jpeg_roundtrip(images.to(c.device), qualities)
    sync(c.device)
    seconds = time.perf_counter() - t
    differ = int((got.cpu() != ref).sum())
    figs = c.figures()
    figs += [figure(f"JPEG round trip on {c.device} vs libjpeg (CPU), {n} images {side}x{side + 5}, q 5..20",
                   differ, "pixels that differ", "0", differ == 0),
            figure(f"JPEG round trip on {c.device}, first call", seconds, "s")]
    normed = (torch.rand(n, 3, side, side, generator=g) - 0.5).to(c.device)
    counter = HostSyncCounter()
    with counter:
        degrade_images(normed, torch.Generator().manual_seed(1), mean=(0.5,) * 3, std=(0.25,) * 3,
                       ops=("jpeg", "blur", "dim", "crop"))
    figs.append(figure(f"host reads in one degrade_images call on {c.device} (jpeg, blur, dim, crop)",
                       counter.total, "calls", "0" if c.device != "cpu" else None,
                       counter.total == 0 if c.device != "cpu" else None,
                       "" if c.device != "cpu" else "the CPU keeps libjpeg, a host read that is free there"))
    return {"figures": figs}


SECTIONS = [("versions", section_versions), ("losses", section_losses), ("forward", section_forward),
            ("train_steps", section_train_steps), ("bf16", section_bf16), ("throughput", section_throughput),
            ("evaluation", section_evaluation), ("degrade", section_degrade)]


def mode(args) -> str:
    return f"{args.device}-quick" if args.quick else ("cuda" if args.device == "cuda" else "cpu")


def estimate(name: str, args) -> float:
    """The seconds section ``name`` is expected to take in this mode (full CPU runs: not estimated, 0)."""
    return ESTIMATE[name].get(mode(args), 0)


SECTION_WORK = {
    "versions": lambda s: "versions of python, torch, CUDA, cuDNN, open_clip, ...; the device's name and memory",
    "losses": lambda s: f"PCME++, InfoNCE, ProLIP losses and CSD at N {s.loss_n}, D {s.loss_d}: device float32 vs "
                        "CPU float64, values and input gradients",
    "forward": lambda s: f"{s.model} forward of {s.fwd_batch} images + captions on the CPU and on the device",
    "train_steps": lambda s: f"3 pretrain steps (PCME++, {s.train_model}, batch {s.train_batch}, float32) on the CPU "
                             "and on the device",
    "bf16": lambda s: f"3 steps in bf16 and 3 in fp16 (GradScaler; on the CPU the fp16 stand-in), a bf16 "
                      f"{s.model} forward",
    "throughput": lambda s: f"SynthWorld {s.tp_num_pretrain} images at {s.tp_image_size} px; runs "
                            f"{', '.join(THROUGHPUT_RUNS)}: {s.tp_steps} steps (+5 probe steps for zsprob), batch "
                            f"{s.tp_batch}, {s.tp_precision}, {s.tp_workers} workers",
    "evaluation": lambda s: f"{s.eval_images} images + {5 * s.eval_images} captions encoded on the device, CSD "
                            f"top-{s.eval_k} on the device and the CPU, {s.eval_cpu_images} images on the CPU",
    "degrade": lambda s: "JPEG round trip of 8 (quick) or 64 images on the device vs libjpeg, one degrade_images call"}
THROUGHPUT_RUNS = ("zsprob infonce", "zsprob pcmepp", "open_clip_train infonce")


def previous_sections(path: Path | None) -> dict:
    if path is None:
        return {}
    return json.loads(path.read_text()).get("sections", {})


def plan_text(args, sizes: Sizes) -> str:
    """What a run with these arguments would do, section by section, with its estimated seconds, the
    measured CPU cost of a --device cpu --quick run, and whether one lent session holds it."""
    from bench_train import open_clip_ready
    before = previous_sections(args.plan_from)
    only = set(args.only.split(",")) if args.only else None
    lines = [f"gpu_check plan: --device {args.device}{' --quick' if args.quick else ''}, budget {args.budget_s:g} s "
             "(no section starts past it)", "",
             f"| section | what runs | est. s ({mode(args)}) | CPU quick: wall s / CPU s (measured) "
             + (f"| {args.plan_from.name}: wall s / CPU s " if before else "") + "|",
             "| --- | --- | --- | --- |" + (" --- |" if before else "")]
    total = 0.0
    for name, _ in SECTIONS:
        if only is not None and name not in only:
            continue
        need = estimate(name, args)
        fits = total + need <= args.budget_s
        total += need if fits else 0
        wall, cpu = CPU_QUICK_MEASURED.get(name, ("-", "-"))
        row = (f"| {name} | {SECTION_WORK[name](sizes)} | {need:g}{'' if fits else ' (skipped: budget)'} "
               f"| {wall} / {cpu} |")
        if before:
            rec = before.get(name, {})
            row += f" {rec.get('seconds', '-')} / {rec.get('cpu_seconds', '-')} ({rec.get('status', 'not run')}) |"
        lines.append(row)
    why = open_clip_ready(args.wds0286)
    lines += ["", f"open_clip_train baseline here: {'ready' if why is None else 'skipped: ' + why}"
              f" (--wds0286 {args.wds0286})",
              f"estimated script time: {total:.0f} s of the {args.budget_s:g} s budget"]
    if args.device == "cuda":
        call = total + CALL_OVERHEAD_S
        lines.append(f"one device call: about {call:.0f} s ({CALL_OVERHEAD_S} s start, transfers and installs); "
                     f"a {SESSION_S} s session holds {int(SESSION_S // call)} such call(s)"
                     + ("" if call <= SESSION_S else ": TOO LONG, lower --budget-s or use --only"))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (on the CPU: tiny towers, well under a minute)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="no section starts when it would overrun this")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's, 1 with --device cpu --quick)")
    ap.add_argument("--wds0286", default=os.environ.get("ZSPROB_WDS0286", "/tmp/wds0286"),
                    help="directory with webdataset 0.2.86 for open_clip_train (default: $ZSPROB_WDS0286 or "
                         "/tmp/wds0286)")
    ap.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    ap.add_argument("--plan", action="store_true",
                    help="print the sections, runs, sizes and time estimates of this run and exit (runs nothing)")
    ap.add_argument("--plan-from", type=Path, default=None,
                    help="with --plan: also show each section's seconds from this earlier gpu_check.json")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - {name for name, _ in SECTIONS} if args.only else set()
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    return args


def stop_on_sigterm(signum, frame):
    """SIGTERM (a time limit's first signal) ends the run as Ctrl-C would: the report is written first."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = (CPU_QUICK if args.device == "cpu" else QUICK) if args.quick else FULL
    if args.plan:
        print(plan_text(args, sizes))
        return 0
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: error: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    # the CPU quick run's tensors are tiny: one thread wastes nothing and does not spin on a shared machine
    args.threads = args.threads or (1 if args.device == "cpu" and args.quick else torch.get_num_threads())
    torch.set_num_threads(args.threads)
    only = set(args.only.split(",")) if args.only else None
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    check = Check(args, sizes, args.device, tmp, args.out, device_name(args.device))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm) if main_thread else None
    try:
        for name, fn in SECTIONS:
            if only is None or name in only:
                check.run(name, fn, estimate(name, args))  # each figure is on disk as soon as it is made
    finally:
        check.save()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
    failed = check.failed()
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'} in {check.elapsed():.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
