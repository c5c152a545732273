"""SynthWorld: the embedded, offline image-caption world (see shared spec ``synthworld.md``).

Public API::

    world = SynthWorld(seed=0, image_size=64)
    s = world.sample("pretrain", 17, noise=0.0)   # SynthSample(image: PIL.Image, captions, meta)
    caption_matches(caption_meta, scene_meta) -> bool
    generate(out, image_size=64, num_pretrain=20000, ...) -> manifest dict
    load_retrieval_split(root, split="test") -> RetrievalSplit
    read_pretrain_items(out / "pretrain"); paired_split(n, paired_fraction)   # jWAE's unpaired streams
    make_scene([{"shape": "star"}, {"shape": "circle"}]) -> scene; world.render(scene)
    SHAPES                                           # the 20 class names

Every sample is a pure function of (seed, split, index): a random stream is seeded from a
BLAKE2 hash of the three (``synth_scene.scene_rng``). Scenes are sampled in
:mod:`zsprob.data.synth_scene`, drawn by Pillow in :mod:`zsprob.data.synth_render`, captioned
and matched in :mod:`zsprob.data.synth_captions` (analytic ambiguity, exact predicate).

What libraries do: Pillow renders and encodes JPEG; ``tarfile`` writes the WebDataset
shards (fixed mtime / uid / gid / names so output is byte-identical; ``webdataset`` reads
them unchanged); scipy.sparse holds the plausible-match matrix (stored in the ``.npz``
layout ``scipy.sparse.load_npz`` reads, written by zsprob with fixed zip timestamps);
``multiprocessing`` spreads whole work units (shards, image chunks) over processes, each
unit a pure function of its arguments, so ``workers`` never changes a byte. Every file is
written to a temporary name and renamed, so an interrupted run never leaves a half-written
file; a re-run with the same arguments skips pretraining shards and images that exist.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zsprob.data.synth_captions import (ambiguity, caption_key, caption_matches, make_caption, match_matrix)
from zsprob.data.synth_render import render_scene
from zsprob.data.synth_scene import (BACKGROUNDS, COLOR_NAMES, COND_P, CONDITIONS, FILLS, NUM_OBJECTS_P,
                                     POSITIONS, SHAPES, SIZES, sample_scene, scene_rng)
from zsprob.errors import UserError
from zsprob.utils.io import atomic_write_bytes

__all__ = ["SynthWorld", "SynthSample", "RetrievalSplit", "caption_matches", "generate",
           "load_retrieval_split", "write_preview", "make_scene", "SHAPES", "CONDITIONS", "PRESETS", "DEFAULTS",
           "read_pretrain_items", "paired_split", "PretrainItems"]

FORMAT_VERSION = 1
MIN_SIZE, MAX_SIZE = 32, 224
CAPTIONS_PER_IMAGE = 5
AMBIGUITY_METHOD = ("analytic: ln P(caption true | scene ~ world prior), exact enumeration over the "
                    "sampling priors (zsprob.data.synth_captions.caption_probability)")
# defaults: ~23k samples, < 1 min to generate on 2 cores, a demo-sized world
DEFAULTS: dict[str, Any] = dict(image_size=64, num_pretrain=20000, num_classify_select=10,
                                num_classify_eval=50, num_retrieval=1000, num_retrieval_val=500,
                                noise=0.0, seed=0, shard_size=1000)
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "quick": dict(num_pretrain=2000, num_classify_select=4, num_classify_eval=10, num_retrieval=200,
                  num_retrieval_val=100, shard_size=500),
}
RETRIEVAL_ID_BASE = {"test": 1_000_000, "val": 2_000_000}


@dataclass
class SynthSample:
    image: Any  # PIL.Image.Image (RGB, image_size x image_size)
    captions: list[str]
    meta: dict


def _check_size(image_size: int) -> int:
    if not isinstance(image_size, (int, np.integer)) or not MIN_SIZE <= int(image_size) <= MAX_SIZE:
        raise UserError(f"SynthWorld image size must be an integer from {MIN_SIZE} to {MAX_SIZE}, got {image_size!r}")
    return int(image_size)


class SynthWorld:
    """The world: ``sample(split, index)`` renders one scene with five captions and ground truth.

    Splits whose name starts with ``classify`` hold one main object whose shape is the class
    ``SHAPES[index % len(SHAPES)]`` (the condition is random; "many" shows copies of it);
    every other split name draws from the world prior (1-3 objects).
    """

    def __init__(self, seed: int = 0, image_size: int = 64):
        self.seed = int(seed)
        self.image_size = _check_size(image_size)

    def scene(self, split: str, index: int, condition: str | None = None) -> tuple[dict, Any]:
        rng = scene_rng(self.seed, split, index)
        if str(split).startswith("classify"):
            sc = sample_scene(rng, shape=SHAPES[int(index) % len(SHAPES)], single=True, condition=condition)
        else:
            sc = sample_scene(rng, condition=condition)
        return sc, rng

    def captions_for(self, scene: dict, rng, split: str, index: int,
                     noise: float = 0.0) -> list[dict]:
        metas = []
        seen: set = set()
        for k in range(CAPTIONS_PER_IMAGE):
            u = rng.random()  # always drawn so clean captions do not depend on the noise rate
            cm = make_caption(rng, scene)
            key = caption_key(cm)
            for _ in range(30):  # five captions saying different things, when the scene allows
                if key not in seen:
                    break
                cm = make_caption(rng, scene)
                key = caption_key(cm)
            seen.add(key)
            cm["noisy"] = False
            if u < noise:
                orng = scene_rng(self.seed, split, index, "noise", k)
                other = sample_scene(orng)
                cm = make_caption(orng, other)
                cm["noisy"] = True
                key = caption_key(cm)
            cm["ambiguity"] = ambiguity(cm, key)
            metas.append(cm)
        return metas

    def render(self, scene: dict):
        """Render a scene dict (from ``scene()`` or :func:`make_scene`) at this world's size."""
        return render_scene(scene, self.image_size)

    def meta(self, split: str, index: int, noise: float = 0.0, condition: str | None = None) -> dict:
        """The ground truth of ``sample(split, index)`` without rendering the image."""
        sc, rng = self.scene(split, index, condition)
        cms = self.captions_for(sc, rng, split, index, float(noise))
        return {"seed": self.seed, "split": str(split), "index": int(index), "image_size": self.image_size,
                **sc, "captions": cms}

    def sample(self, split: str, index: int, noise: float = 0.0, condition: str | None = None) -> SynthSample:
        """The (seed, split, index) sample; ``condition`` forces a condition (previews only)."""
        if not 0.0 <= float(noise) <= 1.0:
            raise UserError(f"noise must be in [0, 1], got {noise}")
        sc, rng = self.scene(split, index, condition)
        cms = self.captions_for(sc, rng, split, index, float(noise))
        image = render_scene(sc, self.image_size)
        meta = {"seed": self.seed, "split": str(split), "index": int(index), "image_size": self.image_size,
                **sc, "captions": cms}
        return SynthSample(image=image, captions=[c["text"] for c in cms], meta=meta)


def make_scene(objects: list[dict], *, condition: str = "normal", background: str = "plain",
               seed: int = 0) -> dict:
    """A hand-made scene for controlled experiments, e.g. Pishdad et al.'s test (an image with
    object A vs one with A and B, captions "A" vs "A and B").

    ``objects``: dicts with ``shape`` (required), ``color`` (default "red"), ``size``
    ("medium"), ``position`` (distinct cells, default: the first free of center, left,
    right, ...), ``fill`` ("solid"). Render it with ``SynthWorld.render(scene)``; match
    captions with :func:`caption_matches`. Rendering details are drawn from ``seed``.
    """
    from zsprob.data.synth_scene import VOCAB, finish_scene

    if condition not in CONDITIONS:
        raise UserError(f"unknown condition {condition!r}; one of {CONDITIONS}")
    if background not in BACKGROUNDS:
        raise UserError(f"unknown background {background!r}; one of {BACKGROUNDS}")
    order = ["center", "left", "right", "top", "bottom", "top left", "top right", "bottom left", "bottom right"]
    used = {o["position"] for o in objects if o.get("position")}
    objs = []
    for o in objects:
        o = dict(o)
        if "shape" not in o:
            raise UserError("every object needs a shape")
        o.setdefault("color", "red")
        o.setdefault("size", "medium")
        o.setdefault("fill", "solid")
        if not o.get("position"):
            o["position"] = next(p for p in order if p not in used)
            used.add(o["position"])
        if condition in ("black and white", "drawing"):
            o["color"] = None
        if condition == "drawing":
            o["fill"] = "outline"
        for a in ("shape", "color", "size", "position", "fill"):
            if o[a] is not None and o[a] not in VOCAB[a]:
                raise UserError(f"unknown {a} {o[a]!r}; one of {VOCAB[a]}")
        objs.append({a: o[a] for a in ("shape", "color", "size", "position", "fill")})
    if len({o["position"] for o in objs}) != len(objs):
        raise UserError("objects must be in distinct positions")
    key = json.dumps([objs, condition, background], sort_keys=True)
    rng = scene_rng(seed, "custom:" + key, 0)
    return finish_scene(rng, condition, "plain" if condition == "drawing" else background, objs)


# --------------------------------------------------------------------------- writing helpers

def _jpeg(image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality, optimize=False, progressive=False)
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """tmp file + rename through zsprob.utils.io (no fsync: many small files; never a torn file)."""
    atomic_write_bytes(path, data, fsync=False)


def _dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False,
                      separators=(",", ": ") if indent else (",", ":"))


def _tar_bytes_tarfile(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    """Reference writer: the tarfile module, fixed mtime / mode / owner."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 0
            ti.mode = 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _ustar_header(name: bytes, size: int) -> bytes:
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b"        "
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """The same bytes as :func:`_tar_bytes_tarfile` (checked by the tests), about 10x faster.

    Names are short ASCII keys (< 100 bytes) and sizes < 8 GiB, so plain USTAR headers
    suffice; anything else falls back to the tarfile module (PAX format).
    """
    parts = []
    total = 0
    for name, data in members:
        nb = name.encode("ascii", "strict") if name.isascii() else None
        if nb is None or len(nb) >= 100 or len(data) >= 8 ** 11:
            return _tar_bytes_tarfile(members, tarfile.PAX_FORMAT)
        parts.append(_ustar_header(nb, len(data)))
        parts.append(data)
        pad = -len(data) % 512
        if pad:
            parts.append(b"\0" * pad)
        total += 512 + len(data) + pad
    total += 1024
    parts.append(b"\0" * (1024 + (-total % tarfile.RECORDSIZE)))
    return b"".join(parts)


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz (numpy's zip of .npy files) with fixed timestamps: byte-identical across runs."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            zi = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            b = io.BytesIO()
            np.lib.format.write_array(b, np.asanyarray(arr), allow_pickle=False)
            zf.writestr(zi, b.getvalue())
    return buf.getvalue()


def _sparse_npz_bytes(m) -> bytes:
    m = m.tocsr()
    m.sort_indices()
    return _npz_bytes({"indices": m.indices.astype(np.int32), "indptr": m.indptr.astype(np.int32),
                       "format": np.array("csr"), "shape": np.array(m.shape, dtype=np.int64),
                       "data": m.data})


# --------------------------------------------------------------------------- work units
# each unit is a pure function of its arguments (run in any process, any order)

def _pretrain_unit(args: dict) -> dict:
    out = Path(args["out"])
    path = out / "pretrain" / f"shard-{args['shard']:06d}.tar"
    n = args["end"] - args["start"]
    if path.is_file() and args.get("resume", True):
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
                    (f"{key}.json", _dumps(rec).encode("utf-8"))]
    _write_atomic(path, _tar_bytes(members))
    return {"kind": "pretrain", "n": n, "skipped": False}


def _classify_unit(args: dict) -> dict:
    out = Path(args["out"])
    world = SynthWorld(args["seed"], args["image_size"])
    part = args["part"]
    done = 0
    skipped = 0
    for i in range(args["start"], args["end"]):
        cls = SHAPES[i % len(SHAPES)]
        path = out / "classify" / part / cls / f"{cls}_{i // len(SHAPES):05d}.jpg"
        if path.is_file() and args.get("resume", True):
            skipped += 1
            continue
        s = world.sample(f"classify-{part}", i)
        _write_atomic(path, _jpeg(s.image, args["quality"]))
        done += 1
    return {"kind": "classify", "n": args["end"] - args["start"], "skipped": skipped == args["end"] - args["start"]}


def _retrieval_unit(args: dict) -> dict:
    out = Path(args["out"])
    world = SynthWorld(args["seed"], args["image_size"])
    split = args["split"]
    metas = []
    skipped = 0
    for i in range(args["start"], args["end"]):
        path = out / "retrieval" / "images" / split / f"{RETRIEVAL_ID_BASE[split] + i}.jpg"
        if path.is_file() and args.get("resume", True):  # ground truth without rendering
            meta = world.meta(f"retrieval-{split}", i)
            skipped += 1
        else:
            s = world.sample(f"retrieval-{split}", i)
            _write_atomic(path, _jpeg(s.image, args["quality"]))
            meta = s.meta
        metas.append(meta)
    return {"kind": "retrieval", "n": len(metas), "skipped": skipped == len(metas), "metas": metas,
            "split": split, "start": args["start"]}


def _run_unit(args: dict) -> dict:
    return {"pretrain": _pretrain_unit, "classify": _classify_unit, "retrieval": _retrieval_unit}[args["kind"]](args)


# --------------------------------------------------------------------------- generate

def _params(image_size, num_pretrain, num_classify_select, num_classify_eval, num_retrieval,
            num_retrieval_val, noise, seed, shard_size, quality) -> dict:
    return {"format_version": FORMAT_VERSION, "seed": seed, "image_size": image_size, "noise": noise,
            "num_pretrain": num_pretrain, "num_classify_select": num_classify_select,
            "num_classify_eval": num_classify_eval, "num_retrieval": num_retrieval,
            "num_retrieval_val": num_retrieval_val, "shard_size": shard_size, "jpeg_quality": quality}


def _validate(image_size, counts: dict, noise, seed, shard_size, quality, workers) -> None:
    _check_size(image_size)
    for k, v in counts.items():
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise UserError(f"{k} must be a non-negative integer, got {v!r}")
    if not 0.0 <= float(noise) <= 1.0:
        raise UserError(f"noise must be in [0, 1], got {noise}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    if shard_size < 1:
        raise UserError(f"shard size must be >= 1, got {shard_size}")
    if not 1 <= quality <= 100:
        raise UserError(f"JPEG quality must be in [1, 100], got {quality}")
    if workers < 1:
        raise UserError(f"workers must be >= 1, got {workers}")


def generate(out: str | os.PathLike, *, image_size: int = 64, num_pretrain: int = 20000,
             num_classify_select: int = 10, num_classify_eval: int = 50, num_retrieval: int = 1000,
             num_retrieval_val: int | None = 500, noise: float = 0.0, seed: int = 0,
             shard_size: int = 1000, jpeg_quality: int = 90, workers: int = 1, progress: bool = True,
             overwrite: bool = False, preview: bool = False,
             callback: Callable[[str, int], None] | None = None) -> dict:
    """Write a SynthWorld under ``out`` and return its manifest (also ``out/manifest.json``).

    ``num_classify_select`` / ``num_classify_eval`` are images *per class*; ``num_retrieval``
    (test) and ``num_retrieval_val`` are images (five captions each). ``noise`` is the noisy
    correspondence rate of the pretraining captions (evaluation splits are always clean).
    ``workers > 1`` uses processes; the bytes written do not depend on it. Re-running with the
    same arguments resumes (existing shards / images are kept); different arguments on an
    existing world raise :class:`UserError` unless ``overwrite=True`` (which deletes the
    world's ``pretrain/``, ``classify/`` and ``retrieval/`` folders first).
    """
    if num_retrieval_val is None:
        num_retrieval_val = num_retrieval // 2
    counts = dict(num_pretrain=num_pretrain, num_classify_select=num_classify_select,
                  num_classify_eval=num_classify_eval, num_retrieval=num_retrieval,
                  num_retrieval_val=num_retrieval_val)
    _validate(image_size, counts, noise, seed, shard_size, jpeg_quality, workers)
    image_size, seed, noise = int(image_size), int(seed), float(noise)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out must be a directory, but {out} is a file")
    params = _params(image_size, num_pretrain, num_classify_select, num_classify_eval, num_retrieval,
                     num_retrieval_val, noise, seed, shard_size, jpeg_quality)
    pfile = out / ".synthworld-params.json"
    old = None
    if pfile.is_file():
        try:
            old = json.loads(pfile.read_text())
        except ValueError:
            old = None
    elif (out / "manifest.json").is_file():
        old = {"unknown": True}
    if old is not None and old != params:
        if not overwrite:
            raise UserError(f"{out} already holds a SynthWorld generated with other arguments; "
                            "use another --out or --overwrite")
    if overwrite and old is not None:  # only ever delete what a SynthWorld run wrote
        for sub in ("pretrain", "classify", "retrieval"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("manifest.json", "preview.png"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("pretrain", "classify", "retrieval"):  # temp files of a killed run
        if (out / sub).is_dir():
            for tmp in (out / sub).rglob(".*.tmp"):
                tmp.unlink(missing_ok=True)
    _write_atomic(pfile, (_dumps(params, indent=2) + "\n").encode())

    base = dict(out=str(out), seed=seed, image_size=image_size, quality=jpeg_quality, resume=True)
    units: list[dict] = []
    n_shards = (num_pretrain + shard_size - 1) // shard_size
    for k in range(n_shards):
        units.append(dict(base, kind="pretrain", shard=k, start=k * shard_size,
                          end=min(num_pretrain, (k + 1) * shard_size), noise=noise))
    chunk = 250
    for part, per_class in (("select", num_classify_select), ("eval", num_classify_eval)):
        total = per_class * len(SHAPES)
        for a in range(0, total, chunk):
            units.append(dict(base, kind="classify", part=part, start=a, end=min(total, a + chunk)))
    for split, n in (("test", num_retrieval), ("val", num_retrieval_val)):
        for a in range(0, n, chunk):
            units.append(dict(base, kind="retrieval", split=split, start=a, end=min(n, a + chunk)))
    total_samples = num_pretrain + (num_classify_select + num_classify_eval) * len(SHAPES) + \
        num_retrieval + num_retrieval_val

    retrieval_metas: dict[str, list] = {"test": [None] * num_retrieval, "val": [None] * num_retrieval_val}
    t0 = time.perf_counter()
    rendered = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=total_samples, desc="SynthWorld", unit="img", disable=not progress, dynamic_ncols=True)
    try:
        if workers > 1 and len(units) > 1:
            import multiprocessing as mp

            # fork where the platform has it (no re-import of the caller's __main__); the units
            # use numpy / Pillow only, so a parent holding torch threads is not an issue
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
    gen_s = time.perf_counter() - t0

    # retrieval annotations (main process)
    for split, metas in retrieval_metas.items():
        _write_retrieval_split(out, split, metas, image_size)
    _write_karpathy_json(out, retrieval_metas)

    (out / "classify").mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "classify" / "classnames.txt", ("\n".join(SHAPES) + "\n").encode())

    from zsprob import __version__

    manifest = {
        "name": "SynthWorld",
        "format_version": FORMAT_VERSION,
        "zsprob_version": __version__,
        "seed": seed,
        "image_size": image_size,
        "noise": noise,
        "jpeg_quality": jpeg_quality,
        "counts": {
            "pretrain": num_pretrain, "pretrain_shards": n_shards, "shard_size": shard_size,
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
    _write_atomic(out / "manifest.json", (_dumps(manifest, indent=2) + "\n").encode())
    if preview:
        write_preview(out / "preview.png", seed=seed, image_size=image_size)
    elapsed = time.perf_counter() - t0
    manifest_ret = dict(manifest)
    manifest_ret["stats"] = {"rendered": rendered, "generation_seconds": gen_s, "total_seconds": elapsed,
                             "samples_per_second": rendered / gen_s if gen_s > 0 else float("nan"),
                             "workers": workers}
    return manifest_ret


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
    _write_atomic(out / "retrieval" / f"{split}_positives.npz", _sparse_npz_bytes(pos))
    base = RETRIEVAL_ID_BASE[split]
    image_meta = []
    for i, m in enumerate(metas):
        im = {k: v for k, v in m.items() if k != "captions"}
        im["image_id"] = base + i
        image_meta.append(im)
    caption_meta = []
    for i, m in enumerate(metas):
        for k, cm in enumerate(m["captions"]):
            caption_meta.append(dict(cm, caption_id=(base + i) * 10 + k, image_index=i, image_id=base + i))
    doc = {"split": split, "image_size": image_size, "num_images": len(metas), "num_captions": len(capt),
           "ambiguity_method": AMBIGUITY_METHOD, "image_meta": image_meta, "caption_meta": caption_meta,
           "caption_ambiguity": [cm["ambiguity"] for cm in caption_meta]}
    _write_atomic(out / "retrieval" / f"{split}_meta.json", (_dumps(doc) + "\n").encode())


def _write_karpathy_json(out: Path, retrieval_metas: dict[str, list]) -> None:
    """dataset_coco.json-style: images with imgid / cocoid / sentids / sentences (raw, tokens)."""
    images = []
    imgid = 0
    for split in ("test", "val"):
        base = RETRIEVAL_ID_BASE[split]
        for i, m in enumerate(retrieval_metas[split]):
            sents = []
            for k, cm in enumerate(m["captions"]):
                sid = (base + i) * 10 + k
                toks = cm["text"].lower().replace(",", " ").split()
                sents.append({"tokens": toks, "raw": cm["text"], "imgid": imgid, "sentid": sid})
            images.append({"filepath": split, "filename": f"{base + i}.jpg", "imgid": imgid, "split": split,
                           "cocoid": base + i, "sentids": [s["sentid"] for s in sents], "sentences": sents})
            imgid += 1
    _write_atomic(out / "retrieval" / "dataset_synthworld.json",
                  (_dumps({"dataset": "synthworld", "images": images}) + "\n").encode())


# --------------------------------------------------------------------------- loading

@dataclass
class RetrievalSplit:
    """One SynthWorld retrieval split with exact plausible-match ground truth."""
    image_paths: list[Path]
    image_ids: list[int]
    captions: list[str]
    caption_ids: list[int]
    caption_image: np.ndarray          # [n_cap] index of the source image
    positives: Any                     # scipy.sparse.csr_matrix [n_img, n_cap] bool
    caption_ambiguity: np.ndarray      # [n_cap] ln fraction of the world the caption is true of
    image_meta: list[dict] = field(default_factory=list)
    caption_meta: list[dict] = field(default_factory=list)
    split: str = "test"
    root: Path | None = None

    def __len__(self) -> int:
        return len(self.image_paths)


def load_retrieval_split(root: str | os.PathLike, split: str = "test") -> RetrievalSplit:
    """Read ``root/retrieval`` (root = a SynthWorld OUT folder) for ``split`` ("test" or "val")."""
    import scipy.sparse as sp

    from zsprob.errors import require_dir, require_file

    root = Path(root)
    if split not in RETRIEVAL_ID_BASE:
        raise UserError(f"SynthWorld retrieval split must be 'test' or 'val', got {split!r}")
    hint = "generate it with `zsprob data synthetic --out DIR`"
    require_dir(root, "SynthWorld folder", hint)
    rdir = require_dir(root / "retrieval", "SynthWorld retrieval folder", hint)
    kj = require_file(rdir / "dataset_synthworld.json", "SynthWorld Karpathy-format JSON", hint)
    mfile = require_file(rdir / f"{split}_meta.json", f"SynthWorld retrieval {split} metadata", hint)
    pfile = require_file(rdir / f"{split}_positives.npz", f"SynthWorld retrieval {split} positives", hint)
    from zsprob.utils.io import read_json

    data = read_json(kj, "SynthWorld Karpathy-format JSON")
    meta = read_json(mfile, f"SynthWorld retrieval {split} metadata")
    try:
        pos = sp.load_npz(pfile).tocsr().astype(bool)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"SynthWorld positives file is corrupted: {pfile} ({e})") from None
    imgs = [im for im in data.get("images", []) if im.get("split") == split]
    paths, ids, caps, cids, cimg = [], [], [], [], []
    for i, im in enumerate(imgs):
        paths.append(rdir / "images" / im["filepath"] / im["filename"])
        ids.append(int(im["cocoid"]))
        for s in im["sentences"]:
            caps.append(s["raw"])
            cids.append(int(s["sentid"]))
            cimg.append(i)
    n_img, n_cap = len(paths), len(caps)
    if pos.shape != (n_img, n_cap) or len(meta["caption_meta"]) != n_cap or len(meta["image_meta"]) != n_img:
        raise UserError(f"SynthWorld retrieval {split} files disagree (JSON {n_img} images / {n_cap} captions, "
                        f"positives {pos.shape}); regenerate with --overwrite")
    for p in paths[:1] + paths[-1:]:
        require_file(p, "SynthWorld retrieval image", hint)
    return RetrievalSplit(image_paths=paths, image_ids=ids, captions=caps, caption_ids=cids,
                          caption_image=np.asarray(cimg, dtype=np.int64), positives=pos,
                          caption_ambiguity=np.asarray(meta["caption_ambiguity"], dtype=np.float64),
                          image_meta=meta["image_meta"], caption_meta=meta["caption_meta"], split=split,
                          root=root)


# --------------------------------------------------------------------------- semi-supervised streams

@dataclass
class PretrainItems:
    """Every sample of SynthWorld pretraining shards: JPEG bytes and the five captions, in key order."""
    keys: list[str]
    jpegs: list[bytes]
    captions: list[list[str]]

    def __len__(self) -> int:
        return len(self.keys)


def read_pretrain_items(shards: str | os.PathLike) -> PretrainItems:
    """Read a directory of SynthWorld pretraining shards (``OUT/pretrain``) into memory."""
    d = Path(shards)
    tars = sorted(d.glob("*.tar")) if d.is_dir() else []
    if not tars:
        raise UserError(f"no SynthWorld pretraining shards (*.tar) in {d} (make them with `zsprob data synthetic "
                        "--out DIR`, then pass --shards DIR/pretrain)")
    found: dict[str, dict] = {}
    for t in tars:
        try:
            with tarfile.open(t) as tf:
                for m in tf.getmembers():
                    key, _, ext = m.name.rpartition(".")
                    if ext in ("jpg", "json") and m.isfile():
                        found.setdefault(key, {})[ext] = tf.extractfile(m).read()
        except (tarfile.TarError, OSError) as e:
            raise UserError(f"cannot read SynthWorld shard {t}: {e}") from None
    keys = sorted(k for k, v in found.items() if "jpg" in v and "json" in v)
    if not keys:
        raise UserError(f"the shards in {d} hold no SynthWorld samples (.jpg + .json)")
    caps = []
    for k in keys:
        rec = json.loads(found[k]["json"])
        caps.append([c["text"] if isinstance(c, dict) else str(c) for c in rec.get("captions") or [rec["caption"]]])
    return PretrainItems(keys=keys, jpegs=[found[k]["jpg"] for k in keys], captions=caps)


def paired_split(n: int, paired_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The semi-supervised split of ``n`` pretraining samples: (paired indices, unpaired indices).

    ``round(paired_fraction * n)`` samples (at least one), drawn by a permutation seeded by
    ``seed``, keep their image-caption pairing; the rest give unpaired images and unpaired
    captions (jWAE's limited-supervision setting: the remaining pairs are used without labels).
    Sorted index arrays; the paired set of a smaller fraction is a subset of a larger one's.
    """
    f = float(paired_fraction)
    if not 0.0 < f <= 1.0:
        raise UserError(f"data.paired_fraction must be in (0, 1], got {paired_fraction!r}")
    order = np.random.default_rng([int(seed), 0x9A1D]).permutation(n)
    k = max(1, int(round(f * n)))
    return np.sort(order[:k]), np.sort(order[k:])


# --------------------------------------------------------------------------- preview

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
                for line in _wrap(cap, 30)[:3]:
                    d.text((x, ty), line, fill=((20, 20, 130), (120, 25, 25))[k], font=font)
                    ty += 14
    path = Path(path)
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    _write_atomic(path, buf.getvalue())
    return path


def _wrap(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = (cur + " " + w).strip()
    if cur:
        lines.append(cur)
    return lines
