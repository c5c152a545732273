"""COCO Captions with the Karpathy splits, official COCO ids and optional instance labels, and the parts every
Karpathy-split caption set shares (:class:`KarpathyCaptions`; Flickr30k is :mod:`zsprob.data.flickr`).

CxC and ECCV Caption are keyed by official COCO ids, which the Karpathy file lacks, so each Karpathy caption is
matched to an official annotation of its image (exact text, then whitespace-normalised, then case-insensitive);
the unmatched get id -1 and a warning. Files and layout: docs/data.md. Train is train + restval (VSE / PCME)."""
from __future__ import annotations

import logging
import random
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from zsprob.errors import UserError, require_dir, require_file
from zsprob.utils.io import read_json

__all__ = ["CocoCaptions", "CocoImages", "CocoPairs", "SPLITS", "KARPATHY_HINT", "ANNOTATIONS_HINT"]

log = logging.getLogger("zsprob.data")

SPLITS = {"train": ("train", "restval"), "val": ("val",), "test": ("test",),
          "restval": ("restval",), "train-only": ("train",)}
KARPATHY_HINT = ("the Karpathy split file dataset_coco.json, from Karpathy's NeuralTalk splits "
                 "(caption_datasets.zip, cs.stanford.edu/people/karpathy/deepimagesent); pass "
                 "karpathy_json=... or put it in ROOT or ROOT/annotations")
ANNOTATIONS_HINT = ("from cocodataset.org, '2014 Train/Val annotations' "
                    "(annotations_trainval2014.zip), unpacked to ROOT/annotations")
IMAGES_HINT = "from cocodataset.org, '2014 Train images' / '2014 Val images', unpacked in ROOT"

PathLike = Union[str, Path]


def _ws(s: str) -> str:
    return " ".join(s.split())


def _check_coco_entries(entries: list, data: dict, kjson) -> None:
    """One line when the split file's image entries are not COCO's (Flickr30k's Karpathy file has the same
    layout, with ``imgid`` and no ``cocoid``)."""
    if any("cocoid" not in im or "filename" not in im for im in entries):
        flickr = str(data.get("dataset", "")).startswith("flickr")
        raise UserError(f"{kjson} is not COCO's Karpathy split: an image entry has no 'cocoid' / 'filename' "
                        f"(a {'Flickr30k' if flickr else 'another dataset'} file?); give dataset_coco.json")


def _sentences(im: dict, where: str) -> list[tuple[str, int]]:
    """(raw text, sentid or -1) of an entry's captions: ``raw``, else its ``tokens`` joined."""
    sents = im.get("sentences")
    if not isinstance(sents, list):
        raise UserError(f"{where}: 'sentences' must be a list of captions, got {type(sents).__name__}")
    out = []
    for s in sents:
        raw = s.get("raw") if isinstance(s, dict) else None
        tokens = s.get("tokens") if isinstance(s, dict) and raw is None else None
        if raw is None and isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
            raw = " ".join(tokens)
        sent_id = s.get("sentid", -1) if isinstance(s, dict) else None
        if not isinstance(raw, str) or isinstance(sent_id, bool) or not isinstance(sent_id, int):
            raise UserError(f"{where}: a caption is not {{'raw': text, 'sentid': integer}}: {str(s)[:80]}")
        out.append((raw, sent_id))
    return out


def _safe_name(name, where: str) -> str:
    """An image's file name, refused when it is not a relative path inside the image folder."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise UserError(f"{where}: its filename {name!r} is not a file name inside the image folder")
    return name


def _load_json(path: Path, what: str, hint: str):
    return read_json(require_file(path, what, hint), what)


class KarpathyCaptions:
    """What every Karpathy-split caption set holds (images in split-file order, captions image-major):
    ``image_ids``, ``image_paths``, ``captions`` (raw text, stripped), ``sent_ids`` (Karpathy sentence
    ids), ``caption_ids``, ``caption_image`` (np.int64 [n_cap], each caption's image), ``image_captions``
    (caption indices per image), ``instance_labels`` (or None) and ``unmapped``."""

    KARPATHY_NAME = "dataset_coco.json"
    WHAT = "COCO Karpathy split JSON"

    def _find_karpathy(self, karpathy_json, hint: str) -> Path:
        """The split file: ``karpathy_json``, else ``KARPATHY_NAME`` in ROOT, ROOT/annotations or ROOT/karpathy."""
        if karpathy_json is not None:
            return require_file(karpathy_json, self.WHAT, hint)
        for folder in (self.root, self.root / "annotations", self.root / "karpathy"):
            if (folder / self.KARPATHY_NAME).is_file():
                return folder / self.KARPATHY_NAME
        raise UserError(f"{self.WHAT} not found: {self.root / self.KARPATHY_NAME} ({hint})")

    def _split_entries(self, karpathy_json, hint: str, splits: Sequence[str]) -> tuple[Path, dict, list]:
        """The split file, its content and its image entries of ``splits`` (a UserError when there is none)."""
        kjson = self._find_karpathy(karpathy_json, hint)
        data = _load_json(kjson, self.WHAT, hint)
        if not isinstance(data, dict) or not isinstance(data.get("images"), list):
            raise UserError(f"{kjson} is not a Karpathy split file (no 'images' list)")
        entries = [im for im in data["images"] if isinstance(im, dict) and im.get("split") in splits]
        if not entries:
            raise UserError(f"no images with split {' / '.join(splits)} in {kjson}")
        return kjson, data, entries

    def _read_images(self, entries: list, kjson: Path, captions_per_image: Optional[int], image_id, image_path) \
            -> list[str]:
        """Fill the caption lists from the split file's ``entries`` (the first ``captions_per_image`` of each
        image; fewer is an error; ``images_with_extra_captions`` counts the longer ones); returns the raw texts.
        An entry that is not what Karpathy's files hold, or an image, file name or sentence id named twice, is
        one line naming the file and the entry."""
        self.image_ids, self.image_paths, self.captions, self.sent_ids = [], [], [], []
        self.images_with_extra_captions = 0
        self.image_captions: list[list[int]] = []
        caption_image, raws, names, ids, sent_seen = [], [], set(), set(), set()
        for n, im in enumerate(entries):
            where = f"{kjson}: image entry {n} ({im.get('cocoid', im.get('filename'))!r})"
            sents = _sentences(im, where)
            if captions_per_image is not None:
                if len(sents) < captions_per_image:
                    raise UserError(f"{where} has {len(sents)} captions, fewer than {captions_per_image}")
                self.images_with_extra_captions += len(sents) > captions_per_image
                sents = sents[:captions_per_image]
            self.image_captions.append(list(range(len(self.captions), len(self.captions) + len(sents))))
            for raw, sent_id in sents:
                if sent_id != -1 and sent_id in sent_seen:
                    raise UserError(f"{where}: sentid {sent_id} is named twice in the file")
                sent_seen.add(sent_id)
                raws.append(raw)
                self.captions.append(raw.strip())
                self.sent_ids.append(sent_id)
                caption_image.append(len(self.image_ids))
            name = _safe_name(im.get("filename"), where)
            try:
                self.image_ids.append(image_id(im))
            except (TypeError, ValueError):
                raise UserError(f"{where}: its image id is not a number") from None
            if name in names or self.image_ids[-1] in ids:
                raise UserError(f"{where}: the image is named twice in the file (id {self.image_ids[-1]}, {name})")
            names.add(name)
            ids.add(self.image_ids[-1])
            self.image_paths.append(image_path(im))
        self.caption_image = np.asarray(caption_image, dtype=np.int64)
        return raws

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def image_dataset(self, transform: Optional[Callable] = None) -> "CocoImages":
        return CocoImages(self, transform)


class CocoCaptions(KarpathyCaptions):
    """One Karpathy split of COCO Captions with official ids (:class:`KarpathyCaptions` attributes).

    ``caption_ids``: official caption annotation ids (-1 when unmapped, or with ``official_ids=False``);
    ``instance_labels``: uint8 [n_img, 80] multi-hot in COCO category-id order (``category_ids``,
    ``category_names``), or None; ``mapping``: how many captions matched at each step. ``instances``:
    "auto" loads them when the files exist, True requires them. ``captions_per_image``: 5 as in every
    COCO benchmark (the first 5 in file order), None keeps all.
    """

    def __init__(self, root: PathLike, split: str = "test", karpathy_json: Optional[PathLike] = None, *,
                 annotations_dir: Optional[PathLike] = None, instances: Union[str, bool] = "auto",
                 official_ids: bool = True, captions_per_image: Optional[int] = 5,
                 check_images: bool = True):
        if split not in SPLITS:
            raise UserError(f"unknown COCO split {split!r}; choose one of {', '.join(SPLITS)}")
        self.root = require_dir(root, "COCO root directory", IMAGES_HINT)
        self.split = split
        ann_dir = Path(annotations_dir) if annotations_dir is not None else self.root / "annotations"
        self.annotations_dir = ann_dir
        kjson, data, entries = self._split_entries(karpathy_json, KARPATHY_HINT, SPLITS[split])
        _check_coco_entries(entries, data, kjson)
        dirs: dict[str, Path] = {}

        def image_path(im: dict) -> Path:
            folder = im.get("filepath") or ("val2014" if "val2014" in im["filename"] else "train2014")
            if folder not in dirs:
                dirs[folder] = self._image_dir(folder, check_images)
            return dirs[folder] / im["filename"]

        raws = self._read_images(entries, kjson, captions_per_image, lambda im: int(im["cocoid"]), image_path)
        folders = set(dirs)
        if check_images and self.image_paths and not self.image_paths[0].is_file():
            raise UserError(f"COCO image not found: {self.image_paths[0]} ({IMAGES_HINT})")

        self.caption_ids: list[int] = [-1] * len(self.captions)
        self.unmapped: list[dict] = []
        self.mapping = {"exact": 0, "whitespace": 0, "case": 0, "unmapped": 0}
        if official_ids:
            self._map_caption_ids(raws, folders)

        self.instance_labels: Optional[np.ndarray] = None
        self.category_ids: list[int] = []
        self.category_names: list[str] = []
        if instances:
            files = [ann_dir / f"instances_{f}.json" for f in sorted(folders)]
            if instances is True or all(f.is_file() for f in files):
                self._load_instances(files)

    def _image_dir(self, folder: str, check: bool) -> Path:
        for cand in (self.root / folder, self.root / "images" / folder):
            if cand.is_dir():
                return cand
        if check:
            raise UserError(f"COCO image folder not found: {self.root / folder} ({IMAGES_HINT})")
        return self.root / folder

    def _map_caption_ids(self, raws: list[str], folders: set[str]) -> None:
        by_image: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for folder in sorted(folders):
            path = self.annotations_dir / f"captions_{folder}.json"
            ann = _load_json(path, f"COCO caption annotations captions_{folder}.json", ANNOTATIONS_HINT)
            for a in ann.get("annotations", []):
                by_image[int(a["image_id"])].append((int(a["id"]), str(a["caption"])))
        keys = (lambda s: s, _ws, lambda s: _ws(s).lower())
        names = ("exact", "whitespace", "case")
        for img_idx, caps in enumerate(self.image_captions):
            pool = by_image.get(self.image_ids[img_idx], [])
            used: set[int] = set()
            todo = list(caps)
            for key, name in zip(keys, names):
                if not todo:
                    break
                table: dict[str, list[int]] = defaultdict(list)
                for aid, text in pool:
                    if aid not in used:
                        table[key(text)].append(aid)
                rest = []
                for ci in todo:
                    lst = table.get(key(raws[ci]))
                    if lst:
                        aid = lst.pop(0)
                        used.add(aid)
                        self.caption_ids[ci] = aid
                        self.mapping[name] += 1
                    else:
                        rest.append(ci)
                todo = rest
            for ci in todo:
                self.mapping["unmapped"] += 1
                self.unmapped.append({"caption_index": ci, "image_id": self.image_ids[img_idx],
                                      "sent_id": self.sent_ids[ci], "caption": raws[ci]})
        if self.unmapped:
            log.warning("zsprob.data: %d of %d COCO %s captions have no official caption id "
                        "(first: image %d, %r); their caption_ids are -1",
                        len(self.unmapped), len(self.captions), self.split,
                        self.unmapped[0]["image_id"], self.unmapped[0]["caption"])

    def _load_instances(self, files: Sequence[Path]) -> None:
        cats: dict[int, str] = {}
        pos = {iid: i for i, iid in enumerate(self.image_ids)}
        pairs = []
        for path in files:
            ann = _load_json(path, f"COCO instance annotations {path.name}", ANNOTATIONS_HINT)
            for c in ann.get("categories", []):
                cats[int(c["id"])] = str(c["name"])
            for a in ann.get("annotations", []):
                i = pos.get(int(a["image_id"]))
                if i is not None:
                    pairs.append((i, int(a["category_id"])))
        if len(cats) != 80:
            log.warning("zsprob.data: COCO instance files list %d categories (expected 80)", len(cats))
        self.category_ids = sorted(cats)
        self.category_names = [cats[c] for c in self.category_ids]
        col = {c: j for j, c in enumerate(self.category_ids)}
        labels = np.zeros((len(self.image_ids), len(self.category_ids)), dtype=np.uint8)
        for i, c in pairs:
            if c in col:
                labels[i, col[c]] = 1
        self.instance_labels = labels

    def __repr__(self) -> str:
        return (f"CocoCaptions(split={self.split!r}, images={len(self.image_ids)}, "
                f"captions={len(self.captions)}, unmapped={len(self.unmapped)}, "
                f"instances={'yes' if self.instance_labels is not None else 'no'})")


def _open_image(path: Path):
    from zsprob.data.images import open_rgb

    try:
        return open_rgb(path)
    except FileNotFoundError:
        raise UserError(f"COCO image not found: {path} ({IMAGES_HINT})") from None


class CocoImages:
    """torch-style map Dataset over the split's images: ``ds[i] -> (transform(image), i)``."""

    def __init__(self, coco: CocoCaptions, transform: Optional[Callable] = None):
        self.coco = coco
        self.transform = transform

    def __len__(self) -> int:
        return len(self.coco.image_paths)

    def __getitem__(self, i: int):
        img = _open_image(self.coco.image_paths[i])
        return (self.transform(img) if self.transform is not None else img), i


class CocoPairs:
    """Image-caption training pairs: ``ds[i] -> (image, caption, image_index, caption_index)``. ``mode="random"``:
    one item per image, its caption drawn per (seed, epoch, image) (VSE / PCME's image-major sampling; call
    ``set_epoch``); ``"all"``: one item per caption (PCME++'s). ``caption`` is tokenised when a tokenizer is given.
    """

    def __init__(self, coco: CocoCaptions, transform: Optional[Callable] = None,
                 tokenizer: Optional[Callable] = None, *, mode: str = "random", seed: int = 0):
        if mode not in ("random", "all"):
            raise UserError(f"CocoPairs mode must be 'random' or 'all', got {mode!r}")
        self.coco = coco
        self.transform = transform
        self.tokenizer = tokenizer
        self.mode = mode
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.coco.captions) if self.mode == "all" else len(self.coco.image_ids)

    def caption_index(self, i: int) -> int:
        if self.mode == "all":
            return i
        caps = self.coco.image_captions[i]
        return caps[random.Random(hash((self.seed, self.epoch, i))).randrange(len(caps))]

    def __getitem__(self, i: int):
        ci = self.caption_index(i)
        ii = int(self.coco.caption_image[ci])
        img = _open_image(self.coco.image_paths[ii])
        if self.transform is not None:
            img = self.transform(img)
        cap = self.coco.captions[ci]
        if self.tokenizer is not None:
            cap = self.tokenizer([cap])[0]
        return img, cap, ii, ci
