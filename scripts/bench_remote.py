#!/usr/bin/env python
"""Benchmark: reading the same shards through each kind of source, and the cost of a remote copy.

Shards (photo-like JPEGs, img2dataset layout, written by ``scripts/bench_data.py``'s writer) are
read by :func:`zsprob.data.webdataset.build_wds_pipeline` as a local brace pattern, a ``file://``
URL, a ``pipe:cat`` command and an fsspec ``memory://`` URL, with the same batch size, workers,
shuffle buffer and the open_clip training transform; the runs alternate between the kinds so that
machine load hits all alike; medians of ``--repeats`` are reported (samples/s from the start of
iteration to the last batch, worker start-up included). Then
:class:`zsprob.train.remote_sync.RemoteSync` copies a run directory holding one checkpoint of
``--model`` to a ``file://`` mirror (first copy, and a second one with nothing changed).

    python scripts/bench_remote.py                         # 8 shards x 128 samples, workers 0 and 2
    python scripts/bench_remote.py --workers 2 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_rate(spec: str, workers: int, batch: int, preprocess) -> float:
    from zsprob.data.webdataset import build_wds_pipeline
    loader = build_wds_pipeline(spec, preprocess=preprocess, tokenizer=None, batch_size=batch,
                                num_workers=workers, shuffle_buffer=500, shuffle_initial=100)
    start, n = time.perf_counter(), 0
    for images, _ in loader:
        n += images.shape[0]
    return n / (time.perf_counter() - start)


def sources(root: Path, n_shards: int) -> dict[str, str]:
    import fsspec
    brace = f"{{000000..{n_shards - 1:06d}}}.tar"
    fs = fsspec.filesystem("memory")
    for tar in sorted(root.glob("*.tar")):
        fs.pipe(f"/bench-remote/{tar.name}", tar.read_bytes())
    return {"local": f"{root}/{brace}", "file://": f"file://{root}/{brace}",
            "pipe:cat": f"pipe:cat {root}/{brace}", "memory://": f"memory://bench-remote/{brace}"}


def bench_reads(args, root: Path) -> dict:
    import open_clip
    from bench_data import make_shards
    make_shards(root, args.shards, args.per_shard, args.src_size)
    preprocess = open_clip.image_transform(args.image_size, is_train=True)
    specs = sources(root, args.shards)
    out = {}
    for workers in args.workers:
        rates: dict[str, list[float]] = {k: [] for k in specs}
        for _ in range(args.repeats):
            for kind, spec in specs.items():
                rates[kind].append(read_rate(spec, workers, args.batch_size, preprocess))
        out[f"workers={workers}"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
        print(json.dumps({f"workers={workers}": out[f"workers={workers}"]}), flush=True)
    return out


def bench_sync(args, tmp: Path) -> dict:
    from zsprob.models import create_model, save
    from zsprob.train.remote_sync import RemoteSync
    run = tmp / "run"
    step = run / "checkpoints" / "step-0000001"
    save(create_model(args.model), step / "model")
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 1, "dir": step.name}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    sync = RemoteSync(f"file://{tmp / 'mirror'}", run)
    t0 = time.perf_counter()
    sync.push()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync.push()
    again = time.perf_counter() - t0
    res = {"model": args.model, "bytes": size, "first_copy_s": round(first, 3), "unchanged_copy_s": round(again, 4)}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=128)
    ap.add_argument("--src-size", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="zsprob-tiny")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reads = bench_reads(args, Path(tmp) / "shards")
        sync = bench_sync(args, Path(tmp))
    print(json.dumps({"reads_samples_per_s": reads, "remote_sync": sync}, indent=2))


if __name__ == "__main__":
    main()
