#!/usr/bin/env python
"""Benchmark: zsprob's shard pipeline vs open_clip's own training data pipeline.

Both read the same WebDataset shards (synthetic JPEGs written by this script, img2dataset
layout: KEY.jpg / KEY.txt / KEY.json) and do the same work per sample: tar streaming, a sample
shuffle buffer of the same size (open_clip's 5000 / initial 1000), JPEG decode to RGB, the same
open_clip training transform (``open_clip.image_transform(size, is_train=True)``:
RandomResizedCrop(scale 0.9-1), ToTensor, Normalize), tokenisation with the same open_clip
tokenizer, batching, in the same number of DataLoader workers. Measured: samples/s from the
start of iteration to the last batch (worker start-up included, as a trainer sees it), and
samples/s per worker.

open_clip's pipeline (``open_clip_train.data.get_wds_dataset``) breaks with webdataset 1.0.x
(``KeyError: 'fname'``), so it runs in a subprocess with webdataset 0.2.86 first on
PYTHONPATH (installed with ``pip install --no-deps --target DIR webdataset==0.2.86`` if DIR
lacks it); zsprob's runs in a subprocess of the same interpreter with the venv's webdataset
1.0.2. The runs alternate (zsprob, open_clip, zsprob, ...) so machine load hits both alike;
medians are reported.

    python scripts/bench_data.py                       # 8 shards x 256 samples, workers 0, 1 and 2
    python scripts/bench_data.py --workers 1,2,4 --repeats 5 --image-size 224
    python scripts/bench_data.py --epochs 4 --workers 2 # zsprob only: one loader vs a loader per epoch

``--epochs N`` measures something else: zsprob's one loader kept across N epochs (persistent workers,
``set_epoch``) against a loader built for every epoch (what the trainer did before), same batches,
alternating runs in this process, medians of the wall time for all N epochs.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

WORDS = ("a photo of the red blue green small large dog cat car tree house street beach mountain "
         "sunset river bird flower old new bright dark city park my first garden lake snow").split()


def make_shards(out: Path, n_shards: int, per_shard: int, src_size: int, seed: int = 0) -> str:
    """Write JPEG shards with photo-like content (smooth gradients + shapes + noise)."""
    import numpy as np
    from PIL import Image, ImageDraw

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    for s in range(n_shards):
        path = out / f"{s:06d}.tar"
        if path.exists():
            continue
        tmp = path.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as tf:
            for i in range(per_shard):
                w = src_size + int(rng.integers(-src_size // 4, src_size // 4))
                h = int(w * rng.uniform(0.6, 1.0))
                yy, xx = np.mgrid[0:h, 0:w]
                base = np.stack([(xx * rng.uniform(0.2, 1) + yy * rng.uniform(0, 0.5)) % 255,
                                 (yy * rng.uniform(0.2, 1)) % 255,
                                 np.full((h, w), rng.uniform(0, 255))], -1)
                base += rng.normal(0, 12, base.shape)
                im = Image.fromarray(np.clip(base, 0, 255).astype("uint8"))
                d = ImageDraw.Draw(im)
                for _ in range(4):
                    x0, y0 = int(rng.integers(0, w - 10)), int(rng.integers(0, h - 10))
                    d.ellipse([x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))],
                              fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
                buf = io.BytesIO()
                im.save(buf, "JPEG", quality=90)
                key = f"{s:05d}{i:04d}"
                cap = " ".join(r.choice(WORDS) for _ in range(r.randint(5, 18)))
                for ext, data in (("jpg", buf.getvalue()), ("txt", cap.encode()),
                                  ("json", json.dumps({"key": key, "caption": cap, "width": w, "height": h}).encode())):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        os.replace(tmp, path)
    return str(out / f"{{000000..{n_shards - 1:06d}}}.tar")


# ----------------------------------------------------------------------------- children

def child(args) -> None:
    import open_clip
    import torch

    torch.set_num_threads(1)
    preprocess = open_clip.image_transform(args.image_size, is_train=True)
    tokenizer = open_clip.get_tokenizer(args.model)
    total = args.n_shards * args.per_shard
    if args.child == "zsprob":
        from zsprob.data.webdataset import build_wds_pipeline

        loader = build_wds_pipeline(args.pattern, preprocess=preprocess, tokenizer=tokenizer,
                                    batch_size=args.batch_size, num_workers=args.num_workers, seed=0,
                                    shuffle_buffer=5000, shuffle_initial=1000, drop_last=True,
                                    dataset_type="webdataset")
        iterable = loader
    else:
        from open_clip_train.data import get_wds_dataset
        import webdataset

        assert webdataset.__version__.startswith("0.2"), webdataset.__version__
        ns = argparse.Namespace(train_data=args.pattern, val_data=None, train_num_samples=total,
                                dataset_resampled=False, train_data_upsampling_factors=None, seed=0,
                                batch_size=args.batch_size, workers=args.num_workers, world_size=1)
        data = get_wds_dataset(ns, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
        # WebLoader = DataPipeline(DataLoader): iterate the torch DataLoader itself (same
        # batches) so that its persistent workers can be shut down and their CPU time counted
        iterable = data.dataloader.pipeline[0]
    import gc
    import resource

    def cpu_now():  # this process + every reaped child (DataLoader workers once joined)
        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + ch.ru_utime + ch.ru_stime

    n = 0
    c0 = cpu_now()
    t0 = time.perf_counter()
    t_first = None
    shape = None
    it = iter(iterable)
    for images, tokens in it:
        if t_first is None:
            t_first = time.perf_counter()
            n_first = images.shape[0]
            shape = [list(images.shape), list(tokens.shape)]
        n += images.shape[0]
    t1 = time.perf_counter()
    # make sure the workers have exited and were reaped (open_clip keeps persistent workers)
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    del it
    gc.collect()
    cpu = cpu_now() - c0
    steady = (n - n_first) / (t1 - t_first) if n > n_first and t1 > t_first else float("nan")
    out = {"pipeline": args.child, "samples": n, "seconds": t1 - t0, "samples_per_s": n / (t1 - t0),
           "steady_samples_per_s": steady, "first_batch_s": t_first - t0, "shapes": shape,
           "cpu_ms_per_sample": 1000 * cpu / n}
    if args.child == "zsprob":
        out["stats"] = {k: v for k, v in loader.stats().items() if v}
    print("RESULT " + json.dumps(out), flush=True)


def epochs_comparison(a, workers: int) -> None:
    """Wall time of ``a.epochs`` epochs: one loader (persistent workers) vs a loader per epoch."""
    import open_clip

    from zsprob.data.webdataset import build_wds_pipeline

    kw = dict(preprocess=open_clip.image_transform(a.image_size, is_train=True),
              tokenizer=open_clip.get_tokenizer(a.model), batch_size=a.batch_size, num_workers=workers, seed=0,
              shuffle_buffer=5000, shuffle_initial=1000, drop_last=True, dataset_type="webdataset")

    def per_epoch():
        return sum(len(b[0]) for e in range(a.epochs) for b in build_wds_pipeline(a.pattern, epoch=e, **kw))

    def one_loader():
        loader = build_wds_pipeline(a.pattern, **kw)
        n = 0
        for e in range(a.epochs):
            loader.set_epoch(e)
            n += sum(len(b[0]) for b in loader)
        return n

    times: dict[str, list[float]] = {"per-epoch": [], "one loader": []}
    for r in range(a.repeats):
        for name, fn in (("per-epoch", per_epoch), ("one loader", one_loader)):
            t0 = time.perf_counter()
            n = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"  workers={workers} run {r + 1} {name:10s}: {n} samples in {times[name][-1]:.2f}s", flush=True)
    per, one = (statistics.median(times[k]) for k in ("per-epoch", "one loader"))
    print(f"| workers {workers} | {a.epochs} epochs | per-epoch loaders {per:.2f}s | one loader {one:.2f}s "
          f"| per-epoch / one = {per / one:.2f}x |")


def run_child(kind: str, a, workers: int, legacy: str) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    if kind == "open_clip":
        env["PYTHONPATH"] = legacy + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, __file__, "--child", kind, "--pattern", a.pattern, "--num-workers", str(workers),
           "--batch-size", str(a.batch_size), "--image-size", str(a.image_size), "--model", a.model,
           "--n-shards", str(a.n_shards), "--per-shard", str(a.per_shard)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def ensure_legacy_webdataset(target: str) -> None:
    if (Path(target) / "webdataset" / "__init__.py").is_file():
        return
    print(f"installing webdataset 0.2.86 for open_clip's pipeline into {target} (pip --no-deps --target)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                    "webdataset==0.2.86"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="shard folder (default: a temp dir)")
    ap.add_argument("--n-shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=256)
    ap.add_argument("--src-size", type=int, default=320, help="mean source image width")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", default="0,1,2",
                    help="comma-separated DataLoader worker counts (0: in the main process, also reports CPU ms/sample)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="ViT-B-32", help="open_clip model whose tokenizer is used")
    ap.add_argument("--legacy-wds", default="/tmp/wds0286", help="dir with webdataset 0.2.86 for open_clip")
    ap.add_argument("--epochs", type=int, default=0,
                    help="N > 0: compare zsprob's one loader across N epochs with a loader per epoch instead")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pattern", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-workers", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    if not a.epochs:
        ensure_legacy_webdataset(a.legacy_wds)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="zsprob-bench-data-"))
    t = time.perf_counter()
    a.pattern = make_shards(out, a.n_shards, a.per_shard, a.src_size)
    total = a.n_shards * a.per_shard
    print(f"shards: {a.pattern} ({a.n_shards} x {a.per_shard} = {total} samples, JPEG ~{a.src_size}px, "
          f"written in {time.perf_counter() - t:.1f}s)")
    print(f"work per sample: decode JPEG, open_clip train transform {a.image_size}px, {a.model} tokenizer; "
          f"batch {a.batch_size}; shuffle buffer 5000 (initial 1000); {a.repeats} alternating repeats, medians")
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    if a.epochs:
        for w in [int(x) for x in a.workers.split(",")]:
            epochs_comparison(a, w)
        return
    rows = []
    for w in [int(x) for x in a.workers.split(",")]:
        res = {"zsprob": [], "open_clip": []}
        for r in range(a.repeats):
            for kind in ("zsprob", "open_clip"):
                o = run_child(kind, a, w, a.legacy_wds)
                res[kind].append(o)
                print(f"  workers={w} run {r + 1} {kind:9s}: {o['samples']} samples in {o['seconds']:.2f}s "
                      f"= {o['samples_per_s']:.1f} samples/s (steady {o['steady_samples_per_s']:.1f}, "
                      f"first batch {o['first_batch_s']:.2f}s"
                      + f", CPU {o['cpu_ms_per_sample']:.2f} ms/sample"
                      + ")", flush=True)
        z = statistics.median(x["samples_per_s"] for x in res["zsprob"])
        oc = statistics.median(x["samples_per_s"] for x in res["open_clip"])
        zs = statistics.median(x["steady_samples_per_s"] for x in res["zsprob"])
        ocs = statistics.median(x["steady_samples_per_s"] for x in res["open_clip"])
        cz = statistics.median(x["cpu_ms_per_sample"] for x in res["zsprob"])
        co = statistics.median(x["cpu_ms_per_sample"] for x in res["open_clip"])
        rows.append((w, z, oc, zs, ocs, cz, co, res["zsprob"][0]["samples"], res["open_clip"][0]["samples"]))
    print()
    print("| workers | zsprob samples/s | open_clip samples/s | zsprob / worker | open_clip / worker | "
          "ratio | steady ratio | CPU ms/sample zsprob | CPU ms/sample open_clip | CPU ratio | samples |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for w, z, oc, zs, ocs, cz, co, nz, no in rows:
        k = max(1, w)  # workers=0: everything runs in the main process
        print(f"| {w} | {z:.1f} | {oc:.1f} | {z / k:.1f} | {oc / k:.1f} | {z / oc:.2f}x | {zs / ocs:.2f}x "
              f"| {cz:.2f} | {co:.2f} | {co / cz:.2f}x | {nz} / {no} |")
    print("\nratio = zsprob / open_clip throughput (> 1: zsprob faster); CPU ratio = open_clip / zsprob CPU time "
          "per sample, main process + workers (> 1: zsprob cheaper; less sensitive to other load on the host)")


if __name__ == "__main__":
    main()
