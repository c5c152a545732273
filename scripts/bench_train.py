#!/usr/bin/env python
"""Training throughput: `zsprob pretrain` (PCME++, InfoNCE) vs open_clip's own trainer, on the CPU.

All runs read the same SynthWorld shards, use the same tower config (configs/models/zsprob-tiny.json,
registered with open_clip for its trainer), the same global batch, fp32, the same number of torch
threads and data workers, and log every step; the reported number is the median of the per-step
samples/s (data loading included) after the first ``--skip`` steps. One run, side by side:

    zsprob pretrain --method infonce --set model.pooling=native   same towers and pooling as open_clip's CLIP
    zsprob pretrain --method infonce                              + GPO pooling (PCME++ architecture)
    zsprob pretrain --method pcmepp                               + GPO + log sigma^2 heads (one block per tower)
    open_clip_train.main                                          open_clip's trainer, CLIP InfoNCE

open_clip's trainer needs pandas and webdataset 0.2.86 (its pipeline breaks on webdataset 1.0):
``pip install --no-deps --target /tmp/wds0286 webdataset==0.2.86`` and pass ``--wds0286 /tmp/wds0286``
(put first on its PYTHONPATH, only for that subprocess).

    nice python scripts/bench_train.py --world /tmp/sw --steps 20 --batch-size 64
"""
from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]


def ensure_world(path: Path, n: int) -> Path:
    if not (path / "manifest.json").is_file():
        from zsprob.data.synthetic import generate
        generate(path, num_pretrain=n, num_classify_select=1, num_classify_eval=1, num_retrieval=10,
                 num_retrieval_val=0, progress=False)
    return path


def run_zsprob(world: Path, out: Path, method: str, args, extra=()) -> dict:
    cmd = [sys.executable, "-m", "zsprob", "pretrain", "--config", "synthetic_tiny.yaml", "--data", "synthetic",
           "--shards", str(world / "pretrain"), "--method", method, "--out", str(out), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--log-every", "1", "--workers", str(args.workers),
           "--threads", str(args.threads), "--checkpoint-every", "0", "--no-progress",
           "--set", "train.tensorboard=false", "--set", "data.pipeline.caption_key=txt", *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"zsprob run failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sps = [x["samples_per_s"] for x in recs if "samples_per_s" in x][args.skip:]
    return {"median_sps": statistics.median(sps), "steps_measured": len(sps), "wall_s": wall}


OC_RUNNER = """
import sys, open_clip
open_clip.add_model_config(sys.argv[1])
from open_clip_train.main import main
main(sys.argv[2:])
"""


def run_open_clip(world: Path, out: Path, args) -> dict:
    cfg_dir = out / "model_configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "configs" / "models" / "zsprob-tiny.json", cfg_dir / "bench-tiny.json")
    shards = sorted((world / "pretrain").glob("*.tar"))
    pattern = str(world / "pretrain" / f"shard-{{000000..{len(shards) - 1:06d}}}.tar")
    runner = out / "runner.py"
    runner.write_text(OC_RUNNER)
    n = args.steps * args.batch_size
    argv = ["--train-data", pattern, "--train-num-samples", str(n), "--dataset-type", "webdataset",
            "--batch-size", str(args.batch_size), "--epochs", "1", "--model", "bench-tiny", "--device", "cpu",
            "--precision", "fp32", "--workers", str(max(args.workers, 1) if args.oc_min_one_worker else args.workers),
            "--lr", "1e-3", "--warmup", "10", "--wd", "0.1", "--log-every-n-steps", "1",
            "--logs", str(out / "logs"), "--name", "bench", "--save-frequency", "0", "--seed", "0",
            "--grad-clip-norm", "2.0"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.wds0286:
        env["PYTHONPATH"] = os.pathsep.join([args.wds0286, env.get("PYTHONPATH", "")])
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(runner), str(cfg_dir), *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    log = out / "logs" / "bench" / "out.log"
    text = log.read_text() if log.is_file() else ""
    if r.returncode != 0 or not text:
        raise SystemExit(f"open_clip run failed:\n{r.stderr[-3000:]}")
    sps = [float(m) for m in re.findall(r"Batch \(t\): [0-9.]+, ([0-9.]+)/s,", text)][args.skip:]
    return {"median_sps": statistics.median(sps), "steps_measured": len(sps), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=Path, default=None, help="SynthWorld directory (generated if missing)")
    ap.add_argument("--num-pretrain", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps not measured (warm-up)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--oc-min-one-worker", action="store_true")
    ap.add_argument("--wds0286", default="/tmp/wds0286", help="directory with webdataset 0.2.86 for open_clip")
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    world = ensure_world(args.world or tmp / "sw", args.num_pretrain)
    rows = []
    runs = [("zsprob infonce, native pooling", lambda: run_zsprob(world, tmp / "zi_native", "infonce", args,
                                                                   ["--set", "model.pooling=native"])),
            ("open_clip_train (CLIP InfoNCE)", lambda: run_open_clip(world, tmp / "oc", args)),
            ("zsprob infonce (GPO)", lambda: run_zsprob(world, tmp / "zi", "infonce", args)),
            ("zsprob pcmepp (GPO + sigma heads)", lambda: run_zsprob(world, tmp / "zp", "pcmepp", args))]
    for name, fn in runs:
        res = fn()
        rows.append((name, res))
        print(f"{name:38s} {res['median_sps']:8.1f} samples/s  ({res['steps_measured']} steps, "
              f"{res['wall_s']:.0f} s wall)", flush=True)
    oc = dict(rows)["open_clip_train (CLIP InfoNCE)"]["median_sps"]
    print(f"\nbatch {args.batch_size}, {args.threads} threads, {args.workers} data worker(s), zsprob-tiny towers, "
          f"64 px, fp32, CPU, {args.steps} steps (median per-step samples/s after {args.skip})")
    print(f"{'run':38s} {'samples/s':>10s} {'vs open_clip':>13s}")
    for name, res in rows:
        print(f"{name:38s} {res['median_sps']:10.1f} {res['median_sps'] / oc:12.2f}x")
    if args.out:
        args.out.write_text(json.dumps({n: r for n, r in rows}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
