#!/usr/bin/env python
"""RedCaps preparation helpers (used by scripts/redcaps_download.sh; not run by CI).

    # 1. annotation JSONs -> one url/caption table per chunk, the input img2dataset reads
    python scripts/redcaps_prepare.py table ANNOTATIONS_DIR OUT_DIR [--format parquet|tsv]
        [--subreddits pics,itookapicture] [--years 2019,2020] [--chunk-rows 1000000]

    # 2. after img2dataset: read every shard once with zsprob's loader and report what it skips
    python scripts/redcaps_prepare.py verify "SHARDS/{00000..00999}.tar" [--limit-batches N]

RedCaps (Desai et al., NeurIPS 2021 Datasets track) ships annotations only: one JSON per
subreddit and year (``annotations/<subreddit>_<year>.json``) with ``{"info": ..., "annotations":
[{"image_id", "author", "url", "raw_caption", "caption", "subreddit", "score", "created_utc",
"permalink", ...}]}``. ``caption`` is RedCaps' own cleaned caption; zsprob cleans it again at
load time (idempotent rules, :func:`zsprob.data.webdataset.clean_redcaps_caption`), so the table
keeps the published text. Every other field is kept as a column, and img2dataset's
``--save_additional_columns`` copies them into each sample's ``KEY.json``, where
``build_wds_pipeline(..., dataset_type="redcaps", prepend_subreddit=True)`` finds the subreddit.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

COLUMNS = ["url", "caption", "raw_caption", "subreddit", "image_id", "author", "created_utc", "score"]


def _rows(ann_dir: Path, subreddits: set[str] | None, years: set[str] | None):
    files = sorted(ann_dir.glob("*.json"))
    if not files:
        sys.exit(f"no annotation JSON files in {ann_dir} (unzip redcaps_v1.0_annotations.zip first)")
    for f in files:
        stem = f.stem  # <subreddit>_<year>
        sub, _, year = stem.rpartition("_")
        if subreddits and sub.lower() not in subreddits:
            continue
        if years and year not in years:
            continue
        data = json.loads(f.read_text(encoding="utf-8"))
        for a in data.get("annotations", []):
            url = a.get("url")
            cap = a.get("caption") or a.get("raw_caption")
            if not url or not cap:
                continue
            yield {"url": url, "caption": " ".join(str(cap).split()),
                   "raw_caption": " ".join(str(a.get("raw_caption", "")).split()),
                   "subreddit": a.get("subreddit", sub), "image_id": str(a.get("image_id", "")),
                   "author": a.get("author", ""), "created_utc": a.get("created_utc", 0),
                   "score": a.get("score", 0)}


def _write_chunk(rows: list[dict], out: Path, idx: int, fmt: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pandas as pd

        p = out / f"redcaps-{idx:04d}.parquet"
        pd.DataFrame(rows, columns=COLUMNS).to_parquet(p, index=False)  # needs pyarrow
        return p
    p = out / f"redcaps-{idx:04d}.tsv"
    with open(p, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, delimiter="\t", quoting=csv.QUOTE_MINIMAL)
        w.writeheader()
        for r in rows:
            w.writerow({k: str(r[k]).replace("\t", " ") for k in COLUMNS})
    return p


def cmd_table(a) -> None:
    subs = {s.strip().lower() for s in a.subreddits.split(",")} if a.subreddits else None
    years = {y.strip() for y in a.years.split(",")} if a.years else None
    out = Path(a.out_dir)
    chunk, idx, total = [], 0, 0
    for r in _rows(Path(a.annotations_dir), subs, years):
        chunk.append(r)
        if len(chunk) >= a.chunk_rows:
            print(_write_chunk(chunk, out, idx, a.format))
            total += len(chunk)
            chunk, idx = [], idx + 1
    if chunk:
        print(_write_chunk(chunk, out, idx, a.format))
        total += len(chunk)
    print(f"{total} image-caption rows in {idx + (1 if chunk else 0)} {a.format} file(s) under {out}")


def cmd_verify(a) -> None:
    from zsprob.data.webdataset import build_wds_pipeline

    loader = build_wds_pipeline(a.shards, preprocess=None, tokenizer=None, batch_size=256,
                                num_workers=a.workers, dataset_type="redcaps",
                                prepend_subreddit=True, shuffle=False)
    example = None
    for i, (_, caps) in enumerate(loader):
        example = example or caps[:3]
        if a.limit_batches and i + 1 >= a.limit_batches:
            break
    st = loader.stats()
    print(json.dumps({"shards": loader.num_shards, "stats": st, "example_captions": example}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description="RedCaps preparation helpers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="annotation JSONs -> url/caption tables for img2dataset")
    t.add_argument("annotations_dir")
    t.add_argument("out_dir")
    t.add_argument("--format", choices=("parquet", "tsv"), default="parquet")
    t.add_argument("--subreddits", default=None, help="comma-separated subset (default: all 350)")
    t.add_argument("--years", default=None, help="comma-separated subset of years")
    t.add_argument("--chunk-rows", type=int, default=1_000_000)
    t.set_defaults(fn=cmd_table)
    v = sub.add_parser("verify", help="read shards with zsprob's loader and print skip counts")
    v.add_argument("shards")
    v.add_argument("--workers", type=int, default=4)
    v.add_argument("--limit-batches", type=int, default=0)
    v.set_defaults(fn=cmd_verify)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
