"""Flickr30k with the Karpathy splits, read the way COCO is (same attributes, same image / pair datasets).

Files read (all from the user's disk; nothing is downloaded):

- ``dataset_flickr30k.json``: the Karpathy split file (Karpathy's NeuralTalk splits,
  ``caption_datasets.zip``): ``{"images": [{"filename": "1000092795.jpg", "imgid": 0, "split":
  "train" | "val" | "test", "sentids": [...], "sentences": [{"raw": ..., "tokens": [...],
  "sentid": ..., "imgid": ...}]}], "dataset": "flickr30k"}``; 29,000 / 1,014 / 1,000 images with
  five captions each. Looked for in ROOT, ROOT/annotations and ROOT/karpathy unless given.
- the images (``flickr30k-images.tar.gz`` from the Flickr30k request form), unpacked to
  ROOT/flickr30k-images, ROOT/images or ROOT itself.

:class:`Flickr30kCaptions` has the attributes of :class:`zsprob.data.coco.CocoCaptions` that the
retrieval and training code read (``image_ids``: the Flickr photo id of the file name, else the
Karpathy ``imgid``; ``caption_ids``: the Karpathy ``sentid``; ``caption_image``; no instance
labels, so no PMRP), and serves the same :class:`~zsprob.data.coco.CocoImages` /
:class:`~zsprob.data.coco.CocoPairs` views. :func:`karpathy_captions` picks the class of a data
kind ("coco" or "flickr30k"), the one switch the trainer and ``zsprob eval`` use. Python's json
reads the file; the rest is zsprob's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from zsprob.data.coco import CocoImages, CocoPairs
from zsprob.errors import UserError

__all__ = ["Flickr30kCaptions", "KARPATHY_KINDS", "SPLITS", "KARPATHY_HINT", "IMAGES_HINT", "karpathy_captions"]

SPLITS = ("train", "val", "test")
KARPATHY_KINDS = ("coco", "flickr30k")
KARPATHY_NAME = "dataset_flickr30k.json"
KARPATHY_HINT = ("the Karpathy split file dataset_flickr30k.json, from Karpathy's NeuralTalk splits "
                 "(caption_datasets.zip, cs.stanford.edu/people/karpathy/deepimagesent); pass --karpathy-json or "
                 "put it in ROOT")
IMAGES_HINT = "flickr30k-images.tar.gz from the Flickr30k request form, unpacked to ROOT/flickr30k-images"
IMAGE_DIRS = ("flickr30k-images", "images", ".")

PathLike = Union[str, Path]


def _read_json(path: Path):
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"Flickr30k Karpathy split JSON is not valid JSON: {path} ({e})") from None


def _photo_id(entry: dict) -> int:
    stem = Path(str(entry.get("filename", ""))).stem
    return int(stem) if stem.isdigit() else int(entry.get("imgid", -1))


class Flickr30kCaptions:
    """One Karpathy split of Flickr30k (``split``: train, val or test), five captions per image.

    Attributes as :class:`zsprob.data.coco.CocoCaptions`: ``image_ids``, ``image_paths``,
    ``captions``, ``caption_ids`` (= ``sent_ids``), ``caption_image``, ``image_captions``,
    ``instance_labels`` (None), ``unmapped`` (empty).
    """

    def __init__(self, root: PathLike, split: str = "test", karpathy_json: Optional[PathLike] = None, *,
                 captions_per_image: Optional[int] = 5, check_images: bool = True, **_coco_only):
        if split not in SPLITS:
            raise UserError(f"unknown Flickr30k split {split!r}; choose one of {', '.join(SPLITS)}")
        self.root, self.split = Path(root), split
        if not self.root.is_dir():
            raise UserError(f"Flickr30k root directory not found: {self.root} ({IMAGES_HINT})")
        kjson = self._find_karpathy(karpathy_json)
        data = _read_json(kjson)
        if not isinstance(data, dict) or not isinstance(data.get("images"), list):
            raise UserError(f"{kjson} is not a Karpathy split file (no 'images' list)")
        entries = [im for im in data["images"] if isinstance(im, dict) and im.get("split") == split]
        if not entries:
            raise UserError(f"no images with split {split!r} in {kjson}")
        image_dir = self._image_dir(entries[0], check_images)
        self.image_ids, self.image_paths, self.captions, self.sent_ids = [], [], [], []
        self.image_captions: list[list[int]] = []
        caption_image = []
        for im in entries:
            sents = self._sentences(im, captions_per_image, kjson)
            idx = len(self.image_ids)
            self.image_ids.append(_photo_id(im))
            self.image_paths.append(image_dir / str(im["filename"]))
            self.image_captions.append(list(range(len(self.captions), len(self.captions) + len(sents))))
            for s in sents:
                raw = s.get("raw")
                self.captions.append((raw if raw is not None else " ".join(s.get("tokens", []))).strip())
                self.sent_ids.append(int(s.get("sentid", -1)))
                caption_image.append(idx)
        self.caption_image = np.asarray(caption_image, dtype=np.int64)
        self.caption_ids = list(self.sent_ids)
        self.instance_labels = None
        self.unmapped: list[dict] = []

    @staticmethod
    def _sentences(im: dict, captions_per_image: Optional[int], kjson: Path) -> list[dict]:
        sents = im.get("sentences") or []
        if "filename" not in im or not isinstance(sents, list):
            raise UserError(f"{kjson}: an image entry lacks 'filename' or 'sentences' (imgid {im.get('imgid')})")
        if captions_per_image is None:
            return sents
        if len(sents) < captions_per_image:
            raise UserError(f"image {im['filename']} has {len(sents)} captions in {kjson}, fewer than "
                            f"{captions_per_image}")
        return sents[:captions_per_image]

    def _find_karpathy(self, karpathy_json) -> Path:
        if karpathy_json is not None:
            p = Path(karpathy_json)
            if not p.is_file():
                raise UserError(f"Flickr30k Karpathy split JSON not found: {p} ({KARPATHY_HINT})")
            return p
        for cand in (self.root / KARPATHY_NAME, self.root / "annotations" / KARPATHY_NAME,
                     self.root / "karpathy" / KARPATHY_NAME):
            if cand.is_file():
                return cand
        raise UserError(f"Flickr30k Karpathy split JSON not found: {self.root / KARPATHY_NAME} ({KARPATHY_HINT})")

    def _image_dir(self, first: dict, check: bool) -> Path:
        for name in IMAGE_DIRS:
            cand = self.root / name
            if (cand / str(first.get("filename", ""))).is_file():
                return cand
        if check:
            raise UserError(f"Flickr30k image {first.get('filename')} not found under {self.root} "
                            f"(looked in {', '.join(IMAGE_DIRS)}; {IMAGES_HINT})")
        return self.root / IMAGE_DIRS[0]

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def image_dataset(self, transform: Optional[Callable] = None) -> CocoImages:
        return CocoImages(self, transform)

    def pair_dataset(self, transform: Optional[Callable] = None, tokenizer: Optional[Callable] = None,
                     mode: str = "random", seed: int = 0) -> CocoPairs:
        return CocoPairs(self, transform, tokenizer, mode=mode, seed=seed)

    def __repr__(self) -> str:
        return f"Flickr30kCaptions(split={self.split!r}, images={len(self.image_ids)}, captions={len(self.captions)})"


def karpathy_captions(kind: str, root: PathLike, split: str = "test", karpathy_json: Optional[PathLike] = None,
                      **kw):
    """The Karpathy-split caption set of a data kind: ``"coco"`` (:class:`~zsprob.data.coco.CocoCaptions`,
    COCO's split names: train is train + restval) or ``"flickr30k"`` (:class:`Flickr30kCaptions`)."""
    if kind == "coco":
        from zsprob.data.coco import CocoCaptions

        return CocoCaptions(root, split=split, karpathy_json=karpathy_json, **kw)
    if kind == "flickr30k":
        return Flickr30kCaptions(root, split=split, karpathy_json=karpathy_json, **kw)
    raise UserError(f"unknown Karpathy caption set {kind!r}; choose one of {', '.join(KARPATHY_KINDS)}")
