"""Writing a SynthWorld: :func:`generate` checks the arguments, makes ``out`` ready (resume, or refuse /
overwrite a world made with other arguments), runs the work units, then writes the retrieval annotations,
the class names and the manifest. A unit (one pretraining shard, one chunk of classification or retrieval
images) is a pure function of its argument dict, run in any process and order and skipped where its files
exist; every byte goes through ``files``, so the output does not depend on ``workers``. :func:`write_preview`
draws the preview sheet (one row per rendering condition).
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import textwrap
import time
from pathlib import Path
from typing import Callable

import numpy as np

from zsprob.data.synthworld.captions import match_matrix
from zsprob.data.synthworld.checks import DATA_FOLDERS, broken_shards, damaged_files, file_checksums, read_manifest
# _jpeg is looked up at every call (the interrupted-run test replaces it here)
from zsprob.data.synthworld.files import dumps, jpeg_bytes as _jpeg, sparse_npz_bytes, tar_bytes, write_atomic
from zsprob.data.synthworld.scene import (BACKGROUNDS, COLOR_NAMES, COND_P, CONDITIONS, FILLS, NUM_OBJECTS_P,
                                          POSITIONS, SHAPES, SIZES)
from zsprob.data.synthworld.world import (AMBIGUITY_METHOD, CAPTIONS_PER_IMAGE, DEFAULTS, FORMAT_VERSION,
                                          RETRIEVAL_ID_BASE, SynthWorld, check_image_size)
from zsprob.errors import UserError

#: images per classification / retrieval work unit
CHUNK = 250
log = logging.getLogger("zsprob.data")


def _validate(world: dict, quality) -> None:
    """The arguments the command line's types leave open (the counts, noise, shard size and workers are
    checked there)."""
    check_image_size(world["image_size"])
    if not isinstance(world["seed"], (int, np.integer)) or world["seed"] < 0:
        raise UserError(f"seed must be a non-negative integer, got {world['seed']!r}")
    if not 1 <= quality <= 100:
        raise UserError(f"JPEG quality must be in [1, 100], got {quality}")


def generate(out: str | os.PathLike, *, jpeg_quality: int = 90, workers: int = 1, progress: bool = True,
             overwrite: bool = False, preview: bool = False, callback: Callable[[str, int], None] | None = None,
             **world) -> dict:
    """Write a SynthWorld under ``out`` and return its manifest (docs/synthworld.md). ``world``: any of the
    keys of :data:`DEFAULTS` (image size, image counts, noise, seed, shard size), the rest as there;
    ``num_classify_*`` are images per class. The same arguments resume; others on an existing world are a
    UserError unless ``overwrite`` (which deletes the world's folders first)."""
    unknown = sorted(set(world) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments {unknown}")
    world = {**DEFAULTS, **world}
    _validate(world, jpeg_quality)
    counts = {k: v for k, v in world.items() if k.startswith("num_")}
    image_size, seed, noise = int(world["image_size"]), int(world["seed"]), float(world["noise"])
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out must be a directory, but {out} is a file")
    params = {"format_version": FORMAT_VERSION, "seed": seed, "image_size": image_size, "noise": noise, **counts,
              "shard_size": world["shard_size"], "jpeg_quality": jpeg_quality}
    if not any(counts.values()):
        raise UserError("nothing to generate: every image count (--num-pretrain, --num-classify-select, "
                        "--num-classify-eval, --num-retrieval, --num-retrieval-val) is 0")
    _prepare_out(out, params, overwrite)
    regenerated = _remove_damaged(out)

    base = dict(out=str(out), seed=seed, image_size=image_size, quality=jpeg_quality)
    units = _make_units(base, counts, world["shard_size"], noise)
    classify = (counts["num_classify_select"] + counts["num_classify_eval"]) * len(SHAPES)
    total_samples = counts["num_pretrain"] + classify + counts["num_retrieval"] + counts["num_retrieval_val"]
    t0 = time.perf_counter()
    rendered, retrieval_metas = _run_units(units, counts, workers, total_samples, progress, callback)
    gen_s = time.perf_counter() - t0

    # retrieval annotations (main process)
    for split, metas in retrieval_metas.items():
        _write_retrieval_split(out, split, metas, image_size)
    _write_karpathy_json(out, retrieval_metas)

    (out / "classify").mkdir(parents=True, exist_ok=True)
    write_atomic(out / "classify" / "classnames.txt", ("\n".join(SHAPES) + "\n").encode())

    manifest = _manifest(params, total_samples)
    manifest["checksums"] = file_checksums(out)
    write_atomic(out / "manifest.json", (dumps(manifest, indent=2) + "\n").encode())
    if preview:
        write_preview(out / "preview.png", seed=seed, image_size=image_size)
    elapsed = time.perf_counter() - t0
    manifest_ret = dict(manifest)
    manifest_ret["stats"] = {"rendered": rendered, "generation_seconds": gen_s, "total_seconds": elapsed,
                             "samples_per_second": rendered / gen_s if gen_s > 0 else float("nan"),
                             "workers": workers, "regenerated": regenerated}
    return manifest_ret


def _remove_damaged(out: Path) -> list[str]:
    """Before a re-run: delete the files that differ from the manifest's sizes and SHA-256 (without checksums:
    the broken shards), so the run writes them again; returns their paths relative to ``out``."""
    manifest = read_manifest(out)
    recorded = (manifest or {}).get("checksums")
    damaged = damaged_files(out, recorded) if isinstance(recorded, dict) else broken_shards(out)
    for rel in damaged:
        (out / rel).unlink(missing_ok=True)
    if damaged:
        log.warning("zsprob: warning: %d file(s) of %s did not match its manifest and are regenerated: %s%s",
                    len(damaged), out, ", ".join(damaged[:5]), " ..." if len(damaged) > 5 else "")
    return damaged


def _prepare_out(out: Path, params: dict, overwrite: bool) -> None:
    """Make ``out`` ready for a run with ``params``: resume a world made with the same arguments,
    refuse one made with others (or delete its folders with ``overwrite``), remove a killed run's
    temp files, and record ``params`` in ``out/.synthworld-params.json``."""
    pfile = out / ".synthworld-params.json"
    old = None
    if pfile.is_file():
        try:
            old = json.loads(pfile.read_text())
        except ValueError:
            old = None
    elif (out / "manifest.json").is_file():
        old = {"unknown": True}
    if old is not None and old != params and not overwrite:
        raise UserError(f"{out} already holds a SynthWorld generated with other arguments; "
                        "use another --out or --overwrite")
    if overwrite and old is not None:  # only ever delete what a SynthWorld run wrote
        for sub in DATA_FOLDERS:
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("manifest.json", "preview.png"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for sub in DATA_FOLDERS:  # temp files of a killed run
        if (out / sub).is_dir():
            for tmp in (out / sub).rglob(".*.tmp"):
                tmp.unlink(missing_ok=True)
    write_atomic(pfile, (dumps(params, indent=2) + "\n").encode())


def _make_units(base: dict, counts: dict, shard_size: int, noise: float) -> list[dict]:
    """The work units of a run, in order: pretraining shards, classification chunks (select, eval),
    retrieval chunks (test, val); ``base`` holds what every unit shares."""
    num_pretrain = counts["num_pretrain"]
    units: list[dict] = []
    for k in range(_num_shards(num_pretrain, shard_size)):
        units.append(dict(base, kind="pretrain", shard=k, start=k * shard_size,
                          end=min(num_pretrain, (k + 1) * shard_size), noise=noise))
    for part, per_class in (("select", counts["num_classify_select"]), ("eval", counts["num_classify_eval"])):
        total = per_class * len(SHAPES)
        for a in range(0, total, CHUNK):
            units.append(dict(base, kind="classify", part=part, start=a, end=min(total, a + CHUNK)))
    for split, n in (("test", counts["num_retrieval"]), ("val", counts["num_retrieval_val"])):
        for a in range(0, n, CHUNK):
            units.append(dict(base, kind="retrieval", split=split, start=a, end=min(n, a + CHUNK)))
    return units


def _pretrain_unit(args: dict) -> dict:
    """Write pretraining shard ``args["shard"]`` (samples ``start`` .. ``end``: JPEG, first caption, metadata)."""
    path = Path(args["out"]) / "pretrain" / f"shard-{args['shard']:06d}.tar"
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


def _images_unit(args: dict) -> dict:
    """Write images ``start`` .. ``end`` of a classification part (a folder per class) or of a retrieval split;
    a retrieval unit returns their metadata for the annotations (without rendering the images that exist)."""
    out, world = Path(args["out"]), SynthWorld(args["seed"], args["image_size"])
    retrieval = args["kind"] == "retrieval"
    metas, skipped = [], 0
    for i in range(args["start"], args["end"]):
        if retrieval:
            split = f"retrieval-{args['split']}"
            path = out / "retrieval" / "images" / args["split"] / f"{RETRIEVAL_ID_BASE[args['split']] + i}.jpg"
        else:
            split, cls = f"classify-{args['part']}", SHAPES[i % len(SHAPES)]
            path = out / "classify" / args["part"] / cls / f"{cls}_{i // len(SHAPES):05d}.jpg"
        if path.is_file():
            skipped += 1
            if retrieval:  # the ground truth without rendering
                metas.append(world.meta(split, i))
            continue
        s = world.sample(split, i)
        write_atomic(path, _jpeg(s.image, args["quality"]))
        metas.append(s.meta)
    n = args["end"] - args["start"]
    return {"kind": args["kind"], "n": n, "skipped": skipped == n, "metas": metas if retrieval else None,
            "split": args.get("split"), "start": args["start"]}


def _run_unit(args: dict) -> dict:
    """Run one unit by its ``kind`` (the function a process pool maps)."""
    return (_pretrain_unit if args["kind"] == "pretrain" else _images_unit)(args)


def _run_units(units: list[dict], counts: dict, workers: int, total_samples: int, progress: bool,
               callback) -> tuple[int, dict[str, list]]:
    """Run every unit (in a process pool when ``workers > 1``) under a progress bar; returns the
    number of images rendered (skipped units not counted) and the retrieval metadata by split."""
    retrieval_metas: dict[str, list] = {"test": [None] * counts["num_retrieval"],
                                        "val": [None] * counts["num_retrieval_val"]}
    rendered = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=total_samples, desc="SynthWorld", unit="img", disable=not progress, dynamic_ncols=True)
    try:
        if workers > 1 and len(units) > 1:
            import multiprocessing as mp

            # fork where the platform has it; the units use numpy / Pillow only
            methods = mp.get_all_start_methods()
            ctx = mp.get_context("fork" if "fork" in methods else "spawn")
            with ctx.Pool(min(workers, len(units))) as pool:
                results = pool.imap_unordered(_run_unit, units)
                for r in results:
                    rendered += _collect(r, retrieval_metas, bar, callback)
        else:
            for u in units:
                rendered += _collect(_run_unit(u), retrieval_metas, bar, callback)
    finally:
        bar.close()
    return rendered, retrieval_metas


def _num_shards(num_pretrain: int, shard_size: int) -> int:
    return (num_pretrain + shard_size - 1) // shard_size


def _manifest(params: dict, total_samples: int) -> dict:
    """``manifest.json``: the run's arguments and counts, the vocabulary, the priors and the file layout."""
    from zsprob import __version__

    n_shards = _num_shards(params["num_pretrain"], params["shard_size"])
    num_classify_select, num_classify_eval = params["num_classify_select"], params["num_classify_eval"]
    num_retrieval, num_retrieval_val = params["num_retrieval"], params["num_retrieval_val"]
    return {
        "name": "SynthWorld",
        "format_version": FORMAT_VERSION,
        "zsprob_version": __version__,
        "seed": params["seed"],
        "image_size": params["image_size"],
        "noise": params["noise"],
        "jpeg_quality": params["jpeg_quality"],
        "counts": {
            "pretrain": params["num_pretrain"], "pretrain_shards": n_shards, "shard_size": params["shard_size"],
            "classify_select_per_class": num_classify_select, "classify_eval_per_class": num_classify_eval,
            "classify_select": num_classify_select * len(SHAPES), "classify_eval": num_classify_eval * len(SHAPES),
            "retrieval_test": num_retrieval, "retrieval_val": num_retrieval_val,
            "retrieval_test_captions": num_retrieval * CAPTIONS_PER_IMAGE,
            "retrieval_val_captions": num_retrieval_val * CAPTIONS_PER_IMAGE,
            "captions_per_image": CAPTIONS_PER_IMAGE, "total_images": total_samples,
        },
        "classes": list(SHAPES),
        "vocabulary": {"shapes": list(SHAPES), "colors": list(COLOR_NAMES), "sizes": list(SIZES),
                       "positions": list(POSITIONS), "fills": list(FILLS), "backgrounds": list(BACKGROUNDS),
                       "conditions": list(CONDITIONS)},
        "priors": {"condition": dict(zip(CONDITIONS, COND_P.tolist())),
                   "num_objects": {"1": float(NUM_OBJECTS_P[0]), "2": float(NUM_OBJECTS_P[1]),
                                   "3": float(NUM_OBJECTS_P[2])}, "many_copies": [3, 4, 5]},
        "ambiguity_method": AMBIGUITY_METHOD,
        "files": {
            "pretrain": "pretrain/shard-{000000..%06d}.tar" % max(0, n_shards - 1),
            "classify_classnames": "classify/classnames.txt",
            "classify_select": "classify/select/<class>/<class>_NNNNN.jpg",
            "classify_eval": "classify/eval/<class>/<class>_NNNNN.jpg",
            "retrieval_karpathy_json": "retrieval/dataset_synthworld.json",
            "retrieval_images": "retrieval/images/<split>/<image_id>.jpg",
            "retrieval_positives": "retrieval/<split>_positives.npz",
            "retrieval_meta": "retrieval/<split>_meta.json",
        },
    }


def _collect(r: dict, retrieval_metas: dict, bar, callback) -> int:
    if r["kind"] == "retrieval":
        metas = retrieval_metas[r["split"]]
        metas[r["start"]:r["start"] + len(r["metas"])] = r["metas"]
    bar.update(r["n"])
    if callback is not None:
        callback(r["kind"], r["n"])
    return 0 if r["skipped"] else r["n"]


def _write_retrieval_split(out: Path, split: str, metas: list[dict], image_size: int) -> None:
    capt = [cm for m in metas for cm in m["captions"]]
    pos = match_matrix(capt, metas)
    write_atomic(out / "retrieval" / f"{split}_positives.npz", sparse_npz_bytes(pos))
    base = RETRIEVAL_ID_BASE[split]
    image_meta = [dict({k: v for k, v in m.items() if k != "captions"}, image_id=base + i) for i, m in enumerate(metas)]
    caption_meta = [dict(cm, caption_id=(base + i) * 10 + k, image_index=i, image_id=base + i)
                    for i, m in enumerate(metas) for k, cm in enumerate(m["captions"])]
    doc = {"split": split, "image_size": image_size, "num_images": len(metas), "num_captions": len(capt),
           "ambiguity_method": AMBIGUITY_METHOD, "image_meta": image_meta, "caption_meta": caption_meta,
           "caption_ambiguity": [cm["ambiguity"] for cm in caption_meta]}
    write_atomic(out / "retrieval" / f"{split}_meta.json", (dumps(doc) + "\n").encode())


def _write_karpathy_json(out: Path, retrieval_metas: dict[str, list]) -> None:
    """dataset_coco.json-style: images with imgid / cocoid / sentids / sentences (raw, tokens)."""
    images = []
    imgid = 0
    for split in ("test", "val"):
        base = RETRIEVAL_ID_BASE[split]
        for i, m in enumerate(retrieval_metas[split]):
            sents = [{"tokens": cm["text"].lower().replace(",", " ").split(), "raw": cm["text"], "imgid": imgid,
                      "sentid": (base + i) * 10 + k} for k, cm in enumerate(m["captions"])]
            images.append({"filepath": split, "filename": f"{base + i}.jpg", "imgid": imgid, "split": split,
                           "cocoid": base + i, "sentids": [s["sentid"] for s in sents], "sentences": sents})
            imgid += 1
    write_atomic(out / "retrieval" / "dataset_synthworld.json",
                  (dumps({"dataset": "synthworld", "images": images}) + "\n").encode())


def write_preview(path: str | os.PathLike, *, seed: int = 0, image_size: int = 64, per_condition: int = 6,
                  cell: int = 192) -> Path:
    """A PNG grid: one row per condition, ``per_condition`` images with two of their captions."""
    from PIL import Image, ImageDraw, ImageFont

    world = SynthWorld(seed, image_size)
    try:
        font = ImageFont.load_default(size=12)
        bold = ImageFont.load_default(size=15)
    except TypeError:  # Pillow < 10.1
        font = bold = ImageFont.load_default()
    disp = cell - 16
    label_w = 130
    text_h = 86
    W = label_w + per_condition * cell
    H = len(CONDITIONS) * (cell + text_h) + 10
    canvas = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(canvas)
    for r, cond in enumerate(CONDITIONS):
        y = 5 + r * (cell + text_h)
        d.text((6, y + cell // 2 - 8), cond, fill="black", font=bold)
        for c in range(per_condition):
            s = world.sample("preview", r * 1000 + c, condition=cond)
            im = s.image.resize((disp, disp), Image.NEAREST)
            x = label_w + c * cell + 8
            canvas.paste(im, (x, y + 8))
            ty = y + cell - 4
            for k, cap in enumerate(s.captions[:2]):
                for line in textwrap.wrap(cap, 30)[:3]:
                    d.text((x, ty), line, fill=((20, 20, 130), (120, 25, 25))[k], font=font)
                    ty += 14
    path = Path(path)
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    write_atomic(path, buf.getvalue())
    return path
