"""Reading a SynthWorld back: the retrieval splits with exact ground truth, the pretraining shards, and
jWAE's paired / unpaired split.
"""
from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zsprob.data.synthworld.world import RETRIEVAL_ID_BASE
from zsprob.errors import UserError


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
    mfile = require_file(rdir / f"{split}_meta.json", f"SynthWorld retrieval {split} metadata", hint)
    pfile = require_file(rdir / f"{split}_positives.npz", f"SynthWorld retrieval {split} positives", hint)
    from zsprob.utils.io import read_json

    from zsprob.data.synthworld.checks import verify_recorded
    verify_recorded(root, (f"retrieval/{split}_", f"retrieval/images/{split}/"))
    meta = read_json(mfile, f"SynthWorld retrieval {split} metadata")
    try:
        pos = sp.load_npz(pfile).tocsr().astype(bool)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"SynthWorld positives file is corrupted: {pfile} ({e})") from None
    images, captions = meta["image_meta"], meta["caption_meta"]
    if not images:
        flag = "--num-retrieval" if split == "test" else "--num-retrieval-val"
        raise UserError(f"the SynthWorld {root} has no retrieval {split} images (generated with {flag} 0); "
                        f"generate one with {flag} N")
    if pos.shape != (len(images), len(captions)):
        raise UserError(f"SynthWorld retrieval {split} files disagree ({len(images)} images / {len(captions)} "
                        f"captions, positives {pos.shape}); regenerate with --overwrite")
    paths = [rdir / "images" / split / f"{im['image_id']}.jpg" for im in images]
    for p in paths[:1] + paths[-1:]:
        require_file(p, "SynthWorld retrieval image", hint)
    return RetrievalSplit(image_paths=paths, image_ids=[im["image_id"] for im in images],
                          captions=[c["text"] for c in captions], caption_ids=[c["caption_id"] for c in captions],
                          caption_image=np.asarray([c["image_index"] for c in captions], dtype=np.int64),
                          positives=pos, caption_ambiguity=np.asarray(meta["caption_ambiguity"], dtype=np.float64),
                          image_meta=images, caption_meta=captions, split=split, root=root)


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
    """jWAE's split of ``n`` pretraining samples into sorted (paired, unpaired) indices: ``round(paired_fraction
    * n)`` (at least one) keep their pairing; a smaller fraction's paired set is a subset of a larger one's."""
    order = np.random.default_rng([int(seed), 0x9A1D]).permutation(n)
    k = max(1, int(round(float(paired_fraction) * n)))
    return np.sort(order[:k]), np.sort(order[k:])



def classify_conditions(root: str | os.PathLike, part: str, paths) -> list[str]:
    """The rendering condition (normal, blurry, dark, cropped, ...) of each SynthWorld classification image,
    from the world's seed in ``root``'s manifest and the file name (``classify/<part>/<class>/<class>_<j>.jpg``
    is world index j x len(SHAPES) + the class's index), without rendering."""
    import re

    from zsprob.data.synthworld.checks import read_manifest
    from zsprob.data.synthworld.scene import SHAPES
    from zsprob.data.synthworld.world import SynthWorld

    manifest = read_manifest(Path(root))
    if manifest is None or "seed" not in manifest:
        raise UserError(f"{root} has no readable SynthWorld manifest.json with its seed")
    world = SynthWorld(int(manifest["seed"]), int(manifest.get("image_size", 64)))
    out = []
    for path in paths:
        p = Path(path)
        found = re.fullmatch(r"(.+)_(\d+)\.jpg", p.name)
        if found is None or found.group(1) != p.parent.name or p.parent.name not in SHAPES:
            raise UserError(f"{p} is not a SynthWorld classification image (<class>/<class>_<number>.jpg)")
        index = int(found.group(2)) * len(SHAPES) + SHAPES.index(p.parent.name)
        out.append(world.scene(f"classify-{part}", index)[0]["condition"])
    return out
