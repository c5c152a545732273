#!/usr/bin/env python
"""The one prepared GPU check of zsprob: versions, CPU-vs-device equality, training throughput
against open_clip's own trainer, and a COCO-5K-sized evaluation, written to OUT/gpu_check.json and
OUT/gpu_check.md.

Device tool ``run`` (after ``bash scripts/gpu_wheels.sh`` here), with ``carry: [".whl", ".whl-oc"]``
and ``timeout_s: 540``; the command, one line:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/wds0286 .whl-oc/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && python3 scripts/gpu_check.py --device cuda --out $OUT --wds0286 /tmp/wds0286 2>&1 | tee $OUT/gpu_check.log

(prefix ``ZSPROB_GIT_HEAD=<git rev-parse HEAD> `` to record the commit: the copied tree has no .git).
On the CPU, as CI runs it: ``python scripts/gpu_check.py --device cpu --quick --out DIR``. Before a lent
session, ``--plan`` prints what the run will do, section by section, with its estimated seconds and the
measured cost of the CPU quick run (``--plan-from`` an earlier gpu_check.json adds that run's seconds).

Sections (each timed; an exception is recorded in the JSON and the next section runs; no section
starts when the budget would be overrun). Every figure, run and section is written to the report as
soon as it is made (scripts/gpu_check_record.py), so a run killed at any point keeps what it measured;
the exit status is 1 when a section failed or a figure is out of its tolerance:

1. ``versions``: torch, CUDA, cuDNN, the device, python, zsprob's git HEAD.
2. ``losses``: PCMEPPLoss, InfoNCELoss, ProLIPLoss and CSD on the device in float32 against the CPU in
   float64 (values and input gradients); ``forward``: a ProbCLIP forward on the CPU and on the
   device (float32, TF32 off); ``train_steps``: three ``zsprob pretrain`` steps on the CPU and on the
   device (same seed and data, float32, TF32 off): logged losses and final weights; ``bf16``: the
   same three steps in bf16 against float32 on the device, and embedding cosines.
3. ``throughput``: ``zsprob pretrain`` (InfoNCE, PCME++) against ``open_clip_train.main`` on the
   device (scripts/bench_train.py): median samples/s, peak memory, optimizer-step ms, host syncs per
   steady step, FLOPs per step and MFU; a run that fails is recorded as ``{"status": "error"}`` beside
   the others' figures.
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

from gpu_check_eval import encode_all, eval_cpu, eval_images, eval_rank, same_up_to_ties, sync  # noqa: E402,F401
from gpu_check_plan import ESTIMATE, THROUGHPUT_RUNS, estimate, plan_text  # noqa: E402,F401  (tests read them)
from gpu_check_record import Check, figure  # noqa: E402

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

# ----------------------------------------------------------------------------- helpers

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
    code. Not rehearsed: CUDA's float16 kernels and CUDA autocast's list of float16 ops (the CPU's differs)."""
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
                           skip=s.tp_skip, batch_size=s.tp_batch, threads=c.args.threads, workers=s.tp_workers,
                           probe=True, wds0286=c.args.wds0286, oc_min_one_worker=False, timeout=c.sub_timeout(),
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
        print(plan_text(args, sizes, [name for name, _ in SECTIONS]))
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
