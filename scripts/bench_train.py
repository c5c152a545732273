#!/usr/bin/env python
"""Training throughput: `zsprob pretrain` (PCME++, InfoNCE) vs open_clip's own trainer, on the CPU or a GPU.

All runs read the same SynthWorld shards, use the same tower config (``--model``, default
configs/models/zsprob-tiny.json, registered with open_clip for its trainer; an open_clip name such
as ViT-B-16 is used by both as is), the same global batch, precision, torch threads and data
workers, on the same device (``--device cpu|cuda``), and log every step; the reported number is the
median of the per-step samples/s (data loading included) after the first ``--skip`` steps. One run,
side by side:

    zsprob pretrain --method infonce --set model.pooling=native   same towers and pooling as open_clip's CLIP
    open_clip_train.main                                          open_clip's trainer, CLIP InfoNCE
    zsprob pretrain --method infonce --set model.pooling=gpo      + GPO pooling (PCME++ architecture)
    zsprob pretrain --method pcmepp                               + log sigma^2 heads (one block per tower)

``--probe`` adds five instrumented steps after the measured ones to each zsprob run (not counted
in samples/s): host syncs per step (``torch.cuda.set_sync_debug_mode("warn")`` warnings on CUDA,
``zsprob.utils.host_sync.HostSyncCounter`` on the CPU), optimizer-step ms and the model FLOPs of
one step (``torch.utils.flop_counter.FlopCounterMode``); on CUDA every run also reports its peak
``torch.cuda.max_memory_allocated``. scripts/gpu_check.py uses these pieces.

open_clip's trainer needs pandas (``pip install -e '.[bench]'``) and webdataset 0.2.86 (its pipeline
breaks on webdataset 1.0): ``pip install --no-deps --target /tmp/wds0286 webdataset==0.2.86`` and pass
``--wds0286 /tmp/wds0286`` or set ``ZSPROB_WDS0286`` (put first on its PYTHONPATH, only for that subprocess).

    nice python scripts/bench_train.py --world /tmp/sw --steps 20 --batch-size 64
    python scripts/bench_train.py --device cuda --model ViT-B-16 --precision bf16 --image-size 224 \\
        --batch-size 256 --workers 8 --probe
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
PROBE_STEPS = 5  # 2 counting host syncs, 2 timing the optimizer step, 1 counting FLOPs
OC_PRECISION = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}
#: the optimisation both trainers run (AdamW, this peak learning rate after this many linear warm-up
#: steps, weight decay 0.1, gradient norm clipped at 2). A ViT-B-16 from scratch diverges in a few dozen
#: steps at the tiny recipe's 2e-3 (PCME++'s image sigma^2 went from 1e-3 to 1e6 in three steps, the same
#: on the CPU in float32), and a benchmark should time a run that trains.
BENCH_LR, BENCH_WARMUP = "1e-4", 10


def ensure_world(path: Path, n: int, image_size: int = 64, shard_size: int = 1000, workers: int = 1) -> Path:
    if not (path / "manifest.json").is_file():
        from zsprob.data.synthetic import generate
        generate(path, image_size=image_size, num_pretrain=n, num_classify_select=1, num_classify_eval=1,
                 num_retrieval=10, num_retrieval_val=0, shard_size=shard_size, workers=workers, progress=False)
    return path


# ----------------------------------------------------------------------------- zsprob, in a child process

ZS_RUNNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import bench_train
bench_train.zsprob_child(json.loads(sys.argv[2]), sys.argv[3:])
"""


def zsprob_child(opts: dict, argv: list[str]) -> None:
    """Inside the child process: :func:`run_zsprob_inprocess`, then the probe record to ``opts["probe_path"]``."""
    record = run_zsprob_inprocess(argv, opts)
    if opts.get("probe_path"):
        Path(opts["probe_path"]).write_text(json.dumps(record, indent=1))


def run_zsprob_inprocess(argv: list[str], opts: dict) -> dict:
    """``zsprob pretrain`` (the CLI, ``argv``) in this process under a fresh accelerate state, TF32
    off if ``opts["no_tf32"]``, the probe from step ``opts["first_probe_step"]`` if given; returns the
    probe record (with the peak ``torch.cuda.max_memory_allocated`` on a CUDA machine)."""
    import torch
    from accelerate.state import AcceleratorState

    from zsprob.cli import main
    AcceleratorState._reset_state(True)  # each run builds its own Accelerator (device, precision)
    record: dict = {"opt_step_ms": [], "flops_per_step": None}
    first = opts.get("first_probe_step")
    restore = install_probe(record, int(first)) if first is not None else (lambda: None)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if opts.get("no_tf32"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if torch.cuda.is_available():  # what earlier runs in this process left is not this run's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        record["mem_before_bytes"] = torch.cuda.memory_allocated()
    try:
        main(["--debug", *argv])  # --debug: a failure raises with its message instead of exiting
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"zsprob {argv[0]} exited with status {e.code}") from None
    finally:
        restore()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    if torch.cuda.is_available():
        record["peak_mem_bytes"] = torch.cuda.max_memory_allocated() - record["mem_before_bytes"]
        gc.collect()
        torch.cuda.empty_cache()
    return record


def install_probe(record: dict, first: int):
    """Wrap ``zsprob.train.build.one_step`` (the pairwise step ``build_run`` gives a run when it is
    built): steps ``first`` and ``first + 1`` count host syncs, the next two time the optimizer step,
    the last counts FLOPs. Returns the function that puts the original back."""
    import zsprob.train.build as build
    inner = getattr(build, "one_step", None)
    if inner is None:
        record["error"] = "zsprob.train.build.one_step not found: no probe"
        return lambda: None

    def probed(run, step):
        k = step - first
        if k in (0, 1):
            return count_syncs(inner, run, step, record)
        if k in (2, 3):
            return time_optimizer(inner, run, step, record)
        if k == 4:
            return count_flops(inner, run, step, record)
        return inner(run, step)
    build.one_step = probed

    def restore() -> None:
        build.one_step = inner
    return restore


def count_syncs(inner, run, step: int, record: dict):
    """One step under zsprob's HostSyncCounter and, on CUDA, torch's sync debug mode ("warn"); the
    calls inside ``next_batch`` (host-side data preparation and the copy to the device) are counted
    apart, under the suffix "_data"."""
    import warnings

    import torch

    import zsprob.train.step as step_module  # one_step looks next_batch up here at call time
    from zsprob.utils.host_sync import HostSyncCounter
    cuda = run.acc.device.type == "cuda"
    spans: list = []  # (counter.where before, after, len(caught) before, after) of each next_batch call
    fetch = step_module.next_batch

    def next_batch(*args, **kwargs):
        before = (collections.Counter(counter.where), len(caught))
        try:
            return fetch(*args, **kwargs)
        finally:
            spans.append((before[0], collections.Counter(counter.where), before[1], len(caught)))
    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(warnings_with_sites())
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, 0)
        step_module.next_batch = next_batch
        stack.callback(setattr, step_module, "next_batch", fetch)
        counter = stack.enter_context(HostSyncCounter())
        stats = inner(run, step)
    # a site in this script is the probe's own call (entering the sync debug mode), never the step's
    own = Path(__file__).name
    sync_message = [cuda and "synchroniz" in str(w.message).lower() for w in caught]
    is_sync = [m and own not in w.site.split(" ")[0] for m, w in zip(sync_message, caught)]
    for w, sync in zip(caught, sync_message):  # other warnings go back to the warnings machinery
        if not sync:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    data_where = collections.Counter()
    data_hits = set()
    for where0, where1, i0, i1 in spans:
        data_where.update(where1 - where0)
        data_hits.update(i for i in range(i0, i1) if is_sync[i])
    record["sync_method"] = "zsprob.utils.host_sync.HostSyncCounter"
    add_syncs(record, "", list((counter.where - data_where).elements()))
    add_syncs(record, "_data", list(data_where.elements()))
    if cuda:
        sites = [(i, w.site) for i, w in enumerate(caught) if is_sync[i]]
        add_syncs(record, "_debug", [where for i, where in sites if i not in data_hits])
        add_syncs(record, "_debug_data", [where for i, where in sites if i in data_hits])
    return stats


@contextlib.contextmanager
def warnings_with_sites():
    """``warnings.catch_warnings(record=True)`` with every filter "always", each record also carrying
    ``site``: the line that made the call (the first frame outside torch, the warnings machinery and
    zsprob's HostSyncCounter, whose wrapper is otherwise what torch's sync warning names), then the
    innermost torch frame it went through, if any."""
    import warnings

    from zsprob.utils.host_sync import caller_site
    log: list = []

    def hook(message, category, filename, lineno, file=None, line=None):
        log.append(SimpleNamespace(message=message, category=category, filename=filename, lineno=lineno,
                                   site=caller_site(sys._getframe(1), via=True)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        yield log


def count_flops(inner, run, step: int, record: dict):
    """One step under ``torch.utils.flop_counter.FlopCounterMode``; a counter that cannot start is
    recorded and the step runs plain."""
    from torch.utils.flop_counter import FlopCounterMode
    try:
        counter = FlopCounterMode(display=False)
        counter.__enter__()
    except Exception as e:  # the step must still run: the measured figures come from the other steps
        record["flops_error"] = f"{type(e).__name__}: {e}"
        return inner(run, step)
    try:
        stats = inner(run, step)
    finally:
        counter.__exit__(None, None, None)
    record["flops_per_step"] = counter.get_total_flops()
    return stats


def add_syncs(record: dict, suffix: str, where: list[str]) -> None:
    record.setdefault(f"sync_counts{suffix}", []).append(len(where))
    places = record.setdefault(f"sync_where{suffix}", {})
    for key in where:
        places[key] = places.get(key, 0) + 1


def time_optimizer(inner, run, step: int, record: dict):
    import torch
    cuda = run.acc.device.type == "cuda"
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # the torch optimiser the step calls
    original = optimizer.step

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = original(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        record["opt_step_ms"].append(1e3 * (time.perf_counter() - t))
        return result
    optimizer.step = timed
    try:
        return inner(run, step)
    finally:
        optimizer.step = original


def zsprob_command(world: Path, out: Path, method: str, args, steps: int, extra=()) -> list[str]:
    """The ``zsprob pretrain`` arguments of one run (the recipe, then the flags, then ``extra``)."""
    return ["pretrain", "--config", "synthetic_tiny.yaml", "--data", "synthetic", "--shards", str(world / "pretrain"),
            "--method", method, "--model", args.model, "--precision", args.precision, "--out", str(out),
            "--steps", str(steps), "--batch-size", str(args.batch_size), "--log-every", "1",
            "--workers", str(args.workers), "--threads", str(args.threads), "--checkpoint-every", "0",
            "--no-progress", "--set", "train.tensorboard=false", "--set", "data.pipeline.caption_key=txt",
            "--lr", BENCH_LR, "--set", f"schedule.warmup_steps={min(BENCH_WARMUP, steps - 1)}",
            "--set", f"train.cpu={'true' if args.device == 'cpu' else 'false'}", *extra]


def run_zsprob_child(argv: list[str], opts: dict, threads: int, timeout: float | None = None) -> float:
    """Run the CLI in a child process through :data:`ZS_RUNNER`; returns the wall time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", ZS_RUNNER, str(Path(__file__).parent), json.dumps(opts), *argv],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"zsprob run failed (exit {r.returncode}): {r.stderr[-3000:]}")
    return time.perf_counter() - t


def run_zsprob(world: Path, out: Path, method: str, args, extra=()) -> dict:
    """One zsprob run: in a child process, or in this one with ``args.inprocess`` (scripts/gpu_check.py)."""
    probe = bool(getattr(args, "probe", False))
    steps = args.steps + (PROBE_STEPS if probe else 0)
    opts: dict = {"first_probe_step": args.steps} if probe else {}
    argv = zsprob_command(world, out, method, args, steps, extra)
    t = time.perf_counter()
    if getattr(args, "inprocess", False):
        record = run_zsprob_inprocess(argv, opts)
    else:
        if args.device == "cuda" or probe:
            opts["probe_path"] = str(out.parent / f"{out.name}.probe.json")
        run_zsprob_child(argv, opts, args.threads, getattr(args, "timeout", None))
        record = json.loads(Path(opts["probe_path"]).read_text()) if "probe_path" in opts else {}
    wall = time.perf_counter() - t
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sps = [x["samples_per_s"] for x in recs if "samples_per_s" in x and x["step"] <= args.steps][args.skip:]
    res = {"median_sps": statistics.median(sps), "steps_measured": len(sps), "wall_s": wall}
    res.update(probe_summary(record, args.batch_size / res["median_sps"]))
    return res


def probe_summary(rec: dict, step_s: float) -> dict:
    out = {k: rec[k] for k in ("peak_mem_bytes", "error", "flops_error", "sync_method") if rec.get(k) is not None}
    for suffix in ("", "_data", "_debug", "_debug_data"):
        if rec.get(f"sync_counts{suffix}"):
            out[f"host_syncs{suffix}_per_step"] = statistics.median(rec[f"sync_counts{suffix}"])
            places = sorted(rec[f"sync_where{suffix}"].items(), key=lambda kv: -kv[1])[:10]
            out[f"host_sync{suffix}_where"] = dict(places)
    if rec.get("opt_step_ms"):
        out["opt_step_ms"] = statistics.median(rec["opt_step_ms"])
    if rec.get("flops_per_step"):
        out["flops_per_step"] = rec["flops_per_step"]
        out["flops_per_s"] = rec["flops_per_step"] / step_s
    return out


# ----------------------------------------------------------------------------- open_clip's trainer

OC_RUNNER = """
import atexit, json, os, sys, open_clip
open_clip.add_model_config(sys.argv[1])
import torch
def _peak():
    if os.environ.get("BENCH_PEAK_JSON") and torch.cuda.is_available():
        open(os.environ["BENCH_PEAK_JSON"], "w").write(json.dumps({"peak_mem_bytes": torch.cuda.max_memory_allocated()}))
atexit.register(_peak)
from open_clip_train.main import main
main(sys.argv[2:])
"""


def open_clip_model(out: Path, model: str) -> tuple[Path, str]:
    """A folder of model configs for open_clip's trainer and the name to pass: a zsprob config
    (configs/models) is copied in as bench-<name>; an open_clip name is used as is."""
    cfg_dir = out / "model_configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    src = ROOT / "configs" / "models" / f"{model}.json"
    if src.is_file():
        shutil.copy(src, cfg_dir / f"bench-{model}.json")
        return cfg_dir, f"bench-{model}"
    return cfg_dir, model


def open_clip_argv(world: Path, out: Path, args, name: str) -> list[str]:
    shards = sorted((world / "pretrain").glob("*.tar"))
    pattern = str(world / "pretrain" / f"shard-{{000000..{len(shards) - 1:06d}}}.tar")
    workers = max(args.workers, 1) if args.oc_min_one_worker else args.workers
    return ["--train-data", pattern, "--train-num-samples", str(args.steps * args.batch_size),
            "--dataset-type", "webdataset", "--dataset-resampled", "--batch-size", str(args.batch_size),
            "--epochs", "1", "--model", name, "--device", args.device, "--precision", OC_PRECISION[args.precision],
            "--workers", str(workers), "--lr", BENCH_LR, "--warmup", str(BENCH_WARMUP), "--wd", "0.1", "--log-every-n-steps", "1",
            "--logs", str(out / "logs"), "--name", "bench", "--save-frequency", "0", "--seed", "0",
            "--grad-clip-norm", "2.0"]


def run_open_clip(world: Path, out: Path, args) -> dict:
    cfg_dir, name = open_clip_model(out, args.model)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), BENCH_PEAK_JSON=str(out / "peak.json"))
    if args.wds0286:
        env["PYTHONPATH"] = os.pathsep.join([args.wds0286, env.get("PYTHONPATH", "")])
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", OC_RUNNER, str(cfg_dir), *open_clip_argv(world, out, args, name)],
                       capture_output=True, text=True, env=env, timeout=getattr(args, "timeout", None))
    wall = time.perf_counter() - t
    log = out / "logs" / "bench" / "out.log"
    text = log.read_text() if log.is_file() else ""
    if r.returncode != 0 or not text:
        raise RuntimeError(f"open_clip run failed (exit {r.returncode}): {r.stderr[-3000:]}")
    sps = [float(m) for m in re.findall(r"Batch \(t\): [0-9.]+, ([0-9.]+)/s,", text)][args.skip:]
    res = {"median_sps": statistics.median(sps), "steps_measured": len(sps), "wall_s": wall}
    if (out / "peak.json").is_file():
        res.update(json.loads((out / "peak.json").read_text()))
    return res


def open_clip_ready(wds0286: str | None) -> str | None:
    """None when open_clip's trainer can run here (pandas, open_clip_train, webdataset 0.2.86 in
    ``wds0286``, which goes first on the trainer's path), else why not."""
    from importlib.machinery import PathFinder
    path = ([wds0286] if wds0286 else []) + sys.path
    for mod in ("pandas", "open_clip", "open_clip_train"):
        if PathFinder.find_spec(mod, path) is None:
            return f"{mod} is not importable"
    if not wds0286 or not (Path(wds0286) / "webdataset").is_dir():
        return f"webdataset 0.2.86 not found in {wds0286!r} (pip install --no-deps --target DIR webdataset==0.2.86)"
    return None


# ----------------------------------------------------------------------------- the table

def bench_runs(world: Path, tmp: Path, args) -> list:
    return [("zsprob infonce, native pooling", lambda: run_zsprob(world, tmp / "zi_native", "infonce", args,
                                                                  ["--set", "model.pooling=native"])),
            ("open_clip_train (CLIP InfoNCE)", lambda: run_open_clip(world, tmp / "oc", args)),
            ("zsprob infonce (GPO)", lambda: run_zsprob(world, tmp / "zi", "infonce", args,
                                                        ["--set", "model.pooling=gpo"])),
            ("zsprob pcmepp (sigma heads)", lambda: run_zsprob(world, tmp / "zp", "pcmepp", args,
                                                               ["--set", "model.pooling=native"]))]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=Path, default=None, help="SynthWorld directory (generated if missing)")
    ap.add_argument("--num-pretrain", type=int, default=2000)
    ap.add_argument("--image-size", type=int, default=64, help="SynthWorld image size when generating")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device of every run")
    ap.add_argument("--model", default="zsprob-tiny", help="configs/models name or open_clip name (both sides)")
    ap.add_argument("--precision", choices=sorted(OC_PRECISION), default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps not measured (warm-up)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--probe", action="store_true", help="host syncs, optimizer-step ms, FLOPs (zsprob runs)")
    ap.add_argument("--oc-min-one-worker", action="store_true")
    ap.add_argument("--wds0286", default=os.environ.get("ZSPROB_WDS0286", "/tmp/wds0286"),
                    help="directory with webdataset 0.2.86 for open_clip (default: $ZSPROB_WDS0286 or /tmp/wds0286)")
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.exit(2, "bench_train.py: error: --device cuda but torch sees no CUDA device\n")
    return args


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    world = ensure_world(args.world or tmp / "sw", args.num_pretrain, args.image_size)
    rows = []
    for name, fn in bench_runs(world, tmp, args):
        res = fn()
        rows.append((name, res))
        print(f"{name:38s} {res['median_sps']:8.1f} samples/s  ({res['steps_measured']} steps, "
              f"{res['wall_s']:.0f} s wall)", flush=True)
    oc = dict(rows)["open_clip_train (CLIP InfoNCE)"]["median_sps"]
    print(f"\nbatch {args.batch_size}, {args.threads} threads, {args.workers} data worker(s), {args.model} towers, "
          f"{args.precision}, {args.device}, {args.steps} steps (median per-step samples/s after {args.skip})")
    print(f"{'run':38s} {'samples/s':>10s} {'vs open_clip':>13s} {'peak MiB':>9s}")
    for name, res in rows:
        peak = f"{res['peak_mem_bytes'] / 2**20:9.0f}" if "peak_mem_bytes" in res else f"{'-':>9s}"
        print(f"{name:38s} {res['median_sps']:10.1f} {res['median_sps'] / oc:12.2f}x {peak}")
    if args.out:
        args.out.write_text(json.dumps({n: r for n, r in rows}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
