"""SynthWorld's work units: one pretraining shard, one chunk of classification or retrieval images. Each is
a pure function of its argument dict (any process, any order, skipped when its files exist), so
``generate(workers=N)`` writes the same bytes for every N.
"""
from __future__ import annotations

from pathlib import Path

# _jpeg is looked up at every call (the interrupted-run test replaces it here)
from zsprob.data.synthworld.files import dumps, jpeg_bytes as _jpeg, tar_bytes, write_atomic
from zsprob.data.synthworld.scene import SHAPES
from zsprob.data.synthworld.world import RETRIEVAL_ID_BASE, SynthWorld


def pretrain_unit(args: dict) -> dict:
    """Write pretraining shard ``args["shard"]`` (samples ``start`` .. ``end``: JPEG, first caption, metadata)."""
    out = Path(args["out"])
    path = out / "pretrain" / f"shard-{args['shard']:06d}.tar"
    n = args["end"] - args["start"]
    if path.is_file():
        return {"kind": "pretrain", "n": n, "skipped": True}
    world = SynthWorld(args["seed"], args["image_size"])
    members = []
    for i in range(args["start"], args["end"]):
        s = world.sample("pretrain", i, noise=args["noise"])
        key = f"{i:09d}"
        rec = {"key": key, "status": "success", "caption": s.captions[0], "width": world.image_size,
               "height": world.image_size, **s.meta}
        members += [(f"{key}.jpg", _jpeg(s.image, args["quality"])),
                    (f"{key}.txt", s.captions[0].encode("utf-8")),
                    (f"{key}.json", dumps(rec).encode("utf-8"))]
    write_atomic(path, tar_bytes(members))
    return {"kind": "pretrain", "n": n, "skipped": False}


def classify_unit(args: dict) -> dict:
    """Write classification images ``start`` .. ``end`` of ``args["part"]`` (select / eval), a folder per class."""
    out = Path(args["out"])
    world = SynthWorld(args["seed"], args["image_size"])
    part = args["part"]
    skipped = 0
    for i in range(args["start"], args["end"]):
        cls = SHAPES[i % len(SHAPES)]
        path = out / "classify" / part / cls / f"{cls}_{i // len(SHAPES):05d}.jpg"
        if path.is_file():
            skipped += 1
            continue
        s = world.sample(f"classify-{part}", i)
        write_atomic(path, _jpeg(s.image, args["quality"]))
    return {"kind": "classify", "n": args["end"] - args["start"], "skipped": skipped == args["end"] - args["start"]}


def retrieval_unit(args: dict) -> dict:
    """Write retrieval images ``start`` .. ``end`` of ``args["split"]``; returns their metadata for the annotations."""
    out = Path(args["out"])
    world = SynthWorld(args["seed"], args["image_size"])
    split = args["split"]
    metas = []
    skipped = 0
    for i in range(args["start"], args["end"]):
        path = out / "retrieval" / "images" / split / f"{RETRIEVAL_ID_BASE[split] + i}.jpg"
        if path.is_file():  # ground truth without rendering
            meta = world.meta(f"retrieval-{split}", i)
            skipped += 1
        else:
            s = world.sample(f"retrieval-{split}", i)
            write_atomic(path, _jpeg(s.image, args["quality"]))
            meta = s.meta
        metas.append(meta)
    return {"kind": "retrieval", "n": len(metas), "skipped": skipped == len(metas), "metas": metas,
            "split": split, "start": args["start"]}


def run_unit(args: dict) -> dict:
    """Run one unit by its ``kind`` (the function a process pool maps)."""
    return {"pretrain": pretrain_unit, "classify": classify_unit, "retrieval": retrieval_unit}[args["kind"]](args)

