"""Flickr30k with the Karpathy splits, read the way COCO is (:class:`zsprob.data.coco.KarpathyCaptions`:
the same attributes and image dataset). Files: ``dataset_flickr30k.json`` (Karpathy's NeuralTalk
splits) in ROOT, ROOT/annotations or ROOT/karpathy, and the images unpacked to ROOT/flickr30k-images,
ROOT/images or ROOT. :func:`karpathy_captions` picks the class of a data kind, the one switch the
trainer and ``zsprob eval`` use.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from zsprob.data.coco import KarpathyCaptions
from zsprob.errors import UserError, require_dir

__all__ = ["Flickr30kCaptions", "KARPATHY_KINDS", "SPLITS", "KARPATHY_HINT", "IMAGES_HINT", "karpathy_captions"]

SPLITS = ("train", "val", "test")
KARPATHY_KINDS = ("coco", "flickr30k")
KARPATHY_HINT = ("the Karpathy split file dataset_flickr30k.json, from Karpathy's NeuralTalk splits "
                 "(caption_datasets.zip, cs.stanford.edu/people/karpathy/deepimagesent); pass --karpathy-json or "
                 "put it in ROOT")
IMAGES_HINT = "flickr30k-images.tar.gz from the Flickr30k request form, unpacked to ROOT/flickr30k-images"
IMAGE_DIRS = ("flickr30k-images", "images", ".")

PathLike = Union[str, Path]


def _photo_id(entry: dict) -> int:
    stem = Path(str(entry.get("filename", ""))).stem
    return int(stem) if stem.isdigit() else int(entry.get("imgid", -1))


class Flickr30kCaptions(KarpathyCaptions):
    """One Karpathy split of Flickr30k (``split``: train, val or test), five captions per image, with the
    attributes of :class:`~zsprob.data.coco.KarpathyCaptions`: ``image_ids`` are the Flickr photo ids of
    the file names (else the Karpathy ``imgid``), ``caption_ids`` the Karpathy ``sentid``; no instance
    labels (so no PMRP).
    """

    KARPATHY_NAME = "dataset_flickr30k.json"
    WHAT = "Flickr30k Karpathy split JSON"

    def __init__(self, root: PathLike, split: str = "test", karpathy_json: Optional[PathLike] = None, *,
                 captions_per_image: Optional[int] = 5, check_images: bool = True, **_coco_only):
        if split not in SPLITS:
            raise UserError(f"unknown Flickr30k split {split!r}; choose one of {', '.join(SPLITS)}")
        self.root, self.split = require_dir(root, "Flickr30k root directory", IMAGES_HINT), split
        kjson, _, entries = self._split_entries(karpathy_json, KARPATHY_HINT, (split,))
        lacking = next((im for im in entries
                        if "filename" not in im or not isinstance(im.get("sentences") or [], list)), None)
        if lacking is not None:
            raise UserError(f"{kjson}: an image entry lacks 'filename' or 'sentences' (imgid {lacking.get('imgid')})")
        image_dir = self._image_dir(entries[0], check_images)
        self._read_images(entries, kjson, captions_per_image, _photo_id, lambda im: image_dir / str(im["filename"]))
        self.caption_ids = list(self.sent_ids)
        self.instance_labels = None
        self.unmapped: list[dict] = []

    def _image_dir(self, first: dict, check: bool) -> Path:
        for name in IMAGE_DIRS:
            cand = self.root / name
            if (cand / str(first.get("filename", ""))).is_file():
                return cand
        if check:
            raise UserError(f"Flickr30k image {first.get('filename')} not found under {self.root} "
                            f"(looked in {', '.join(IMAGE_DIRS)}; {IMAGES_HINT})")
        return self.root / IMAGE_DIRS[0]

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
