"""Image classification datasets for zero-shot evaluation: ImageNet (synset folders, or flat files with a
label file), any folder-per-class set, SynthWorld's classify splits; docs/data.md gives the layouts.

Every dataset has ``classnames``, ``targets``, ``samples`` ([(path, label)]) and ``ds[i] -> (image, label)``;
unreadable images are left out when it is listed (``skipped``, one warning). timm ships the ImageNet synsets in
class order, which aligns folders and label files with ``prompts/imagenet_classnames.txt``.
"""
from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from zsprob.errors import UserError, not_found, require_dir, require_file

__all__ = ["FolderDataset", "ImageNetDataset", "build_classification_dataset", "imagenet_synsets",
           "imagenet_classnames", "IMAGE_EXTENSIONS", "KINDS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm")
KINDS = ("imagenet", "folder", "synthetic")
_WNID = re.compile(r"^n\d{8}$")
IMAGENET_HINT = ("ImageNet-1k validation images from image-net.org (ILSVRC2012_img_val.tar), as one "
                 "folder per synset or flat files with LOC_val_solution.csv")

PathLike = Union[str, Path]


def imagenet_synsets() -> list[str]:
    """The 1,000 ImageNet-1k WordNet ids in class-index order (timm's ``imagenet_synsets.txt``)."""
    import importlib.util

    spec = importlib.util.find_spec("timm")  # timm's data file, without importing timm (slow)
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / "data" / "_info" / "imagenet_synsets.txt"
        if p.is_file():
            syn = p.read_text().split()
            if len(syn) == 1000:
                return syn
    from timm.data import ImageNetInfo

    return list(ImageNetInfo().label_names())


def imagenet_classnames(path: Optional[PathLike] = None) -> list[str]:
    """CLIP's 1,000 ImageNet class names (``prompts/imagenet_classnames.txt``) in synset order."""
    from zsprob.utils.paths import prompts_dir

    p = Path(path) if path is not None else prompts_dir() / "imagenet_classnames.txt"
    names = _read_lines(p, "ImageNet class-name file")
    if len(names) != 1000:
        raise UserError(f"{p} has {len(names)} class names; ImageNet-1k needs 1000 (one per line, synset order)")
    return names


def _read_lines(path: Path, what: str) -> list[str]:
    require_file(path, what)
    lines = [ln.rstrip("\r\n") for ln in path.read_text(encoding="utf-8").splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    if any(not ln.strip() for ln in lines):
        raise UserError(f"{what} {path} has empty lines")
    return lines


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _images_under(d: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(d, followlinks=True):
        dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if _is_image(f))
    return out


def _subdirs(d: Path) -> list[str]:
    return sorted(x.name for x in d.iterdir() if x.is_dir() and not x.name.startswith("."))


def _open_rgb(path: Path):
    from zsprob.data.images import open_rgb

    try:
        return open_rgb(path)
    except (OSError, SyntaxError, ValueError) as e:  # damage the listing's check could not see
        raise UserError(f"cannot decode image {path} ({type(e).__name__}: {e}); remove or replace it") from None


_JPEG_START, _JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"
_PNG_START, _PNG_END = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


def image_problem(path: Path) -> str:
    """Why ``path`` cannot be used as an image ("" when it can). A JPEG or PNG that ends with its end marker
    costs two small reads; a JPEG with no end marker after its last scan is cut short (PIL would decode it
    with a grey band, silently); anything else is decoded in full by PIL."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            f.seek(max(0, path.stat().st_size - 16))
            tail = f.read(16).rstrip(b"\0\r\n ")
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    if head.startswith(_JPEG_START):
        if tail.endswith(_JPEG_END):
            return ""
        data = path.read_bytes()
        return "" if data.rfind(_JPEG_END) > data.rfind(b"\xff\xda") >= 0 else "JPEG cut short (no end marker)"
    if head.startswith(_PNG_START) and tail.endswith(_PNG_END):
        return ""
    return _decode_problem(path)


def _decode_problem(path: Path) -> str:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
    except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged or foreign files
        return f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    return ""


def readable_images(paths: list[Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the paths that are usable images, [(path, reason)] for the others), checked by :func:`image_problem`."""
    good, bad = [], []
    for p in paths:
        problem = image_problem(p)
        if problem:
            bad.append((p, problem))
        else:
            good.append(p)
    return good, bad


def require_readable(good: list, bad: list[tuple[Path, str]], where: Path) -> None:
    """One :class:`UserError` line when every image under ``where`` is unreadable."""
    if bad and not good:
        raise UserError(f"no readable images under {where}: all {len(bad)} are damaged or not images "
                        f"(e.g. {bad[0][0]}: {bad[0][1]})")


def warn_skipped(skipped: list[tuple[Path, str]], where: Path) -> None:
    """One stderr line for the images a dataset skipped: their count and one example."""
    if skipped:
        print(f"zsprob: warning: skipped {len(skipped)} unreadable image(s) under {where} "
              f"(e.g. {skipped[0][0]}: {skipped[0][1]})", file=sys.stderr, flush=True)


class _ImageList:
    """Shared item access: ``samples`` = [(path, label)], ``transform``."""

    samples: list[tuple[Path, int]]
    classnames: list[str]
    transform: Optional[Callable]

    @property
    def targets(self) -> list[int]:
        return [t for _, t in self.samples]

    @property
    def num_classes(self) -> int:
        return len(self.classnames)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        img = _open_rgb(path)
        return (self.transform(img) if self.transform is not None else img), label


def _folder_samples(base: Path, labelled: list[tuple[str, int]], what: str):
    """([(path, label)], [(path, why)] skipped as unreadable, the folders with no readable image) of the class
    folders ``labelled`` [(folder, label)] under ``base``; a folder without images, or no readable image at
    all, is a UserError."""
    samples, skipped, unreadable = [], [], []
    for folder, label in labelled:
        files = _images_under(base / folder)
        if not files:
            raise UserError(f"{what} {base / folder} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        files, bad = readable_images(files)
        skipped += bad
        if not files:
            unreadable.append(folder)
        samples.extend((p, label) for p in files)
    require_readable(samples, skipped, base)
    return samples, skipped, unreadable


def class_key(name: str) -> str:
    """A class name as matched against another list of them: underscores read as spaces, whitespace and
    case ignored (``Oak_tree`` matches "oak tree")."""
    return " ".join(name.replace("_", " ").split()).lower()


def _resolve_classnames(folders: list[str], spec, where: Path) -> tuple[list[str], list[str]]:
    """Return (class folders in class order, display names) for a folder-per-class dataset."""
    if spec is None:
        return folders, [f.replace("_", " ") for f in folders]
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        lines = _read_lines(path, "class-name file")
        source = str(path)
    else:
        lines = [str(x) for x in spec]
        source = "the classnames list"
    if lines and all("\t" in ln for ln in lines):
        mapping = {}
        for ln in lines:
            folder, name = ln.split("\t", 1)
            mapping[folder.strip()] = name.strip()
        missing = [f for f in folders if f not in mapping]
        extra = [f for f in mapping if f not in folders]
        if missing or extra:
            raise UserError(f"class-name mapping {source} does not match the class folders of {where}: "
                            f"no name for {missing[:5]}, no folder for {extra[:5]}")
        return folders, [mapping[f] for f in folders]
    by_norm = {}
    for f in folders:
        by_norm.setdefault(class_key(f), f)
    if len(lines) == len(folders) and len(by_norm) == len(folders) and \
            sorted(class_key(x) for x in lines) == sorted(by_norm):
        return [by_norm[class_key(x)] for x in lines], [x.strip() for x in lines]
    if len(lines) != len(folders):
        raise UserError(f"{source} has {len(lines)} class names but {where} has {len(folders)} class folders")
    return folders, [x.strip() for x in lines]


def align_classnames(dataset_names: Sequence[str], names: Sequence[str], source: str = "the class-name file") \
        -> list[str]:
    """``names`` (a user's class-name list) reordered so that entry i names the dataset's class i: matched
    to ``dataset_names`` by name (:func:`class_key`) when they name the classes, by position when they name
    none of them (ImageNet wnid folders); a partial match is refused."""
    names = [str(x).strip() for x in names]
    if len(names) != len(dataset_names):
        raise UserError(f"{source} has {len(names)} class names but the dataset has {len(dataset_names)} classes")
    by_norm = {class_key(x): x for x in names}
    if len(by_norm) != len(names):
        raise UserError(f"{source} has duplicate class names (after normalising spaces, underscores and case)")
    matched = [by_norm.get(class_key(c)) for c in dataset_names]
    if not any(matched):
        return names
    unmatched = [c for c, m in zip(dataset_names, matched) if m is None]
    if unmatched:
        raise UserError(f"{source} names only some class folders: no name for {', '.join(unmatched[:10])}"
                        f"{' ...' if len(unmatched) > 10 else ''} (name every folder, or none for positional order)")
    return matched


class FolderDataset(_ImageList):
    """A folder-per-class image dataset: classes are the sub-folders in sorted order (docs/data.md)."""

    def __init__(self, root: PathLike, transform: Optional[Callable] = None,
                 classnames: Union[None, PathLike, Sequence[str]] = None):
        self.root = require_dir(root, "image folder")
        self.transform = transform
        folders = _subdirs(self.root)
        if not folders:
            raise UserError(f"{self.root} has no class sub-folders (expected ROOT/<class>/<image>)")
        if classnames is None and (self.root / "classnames.txt").is_file():
            classnames = self.root / "classnames.txt"
        self.class_folders, self.classnames = _resolve_classnames(folders, classnames, self.root)
        # skipped: (path, why) of the images left out as unreadable
        self.samples, self.skipped, unreadable_classes = _folder_samples(
            self.root, [(folder, label) for label, folder in enumerate(self.class_folders)], "class folder")
        if unreadable_classes:
            example, why = self.skipped[0]
            raise UserError(f"class folder {self.root / unreadable_classes[0]} has no readable images "
                            f"({len(unreadable_classes)} such folder(s); e.g. {example}: {why})")
        warn_skipped(self.skipped, self.root)
        if len(set(self.classnames)) != len(self.classnames):
            raise UserError(f"duplicate class names for {self.root}")

    def __repr__(self) -> str:
        return f"FolderDataset({str(self.root)!r}, classes={len(self.classnames)}, images={len(self)})"


_LABEL_FILES = ("LOC_val_solution.csv", "val.txt", "val_labels.txt", "ILSVRC2012_val_labels.txt",
                "labels.txt")


class ImageNetDataset(_ImageList):
    """ImageNet-1k in either usual layout (docs/data.md); always the 1,000 classes, CLIP names."""

    def __init__(self, root: PathLike, split: str = "val", transform: Optional[Callable] = None, *,
                 label_file: Optional[PathLike] = None, classnames_file: Optional[PathLike] = None):
        self.root = require_dir(root, "ImageNet root", IMAGENET_HINT)
        self.split = split
        self.transform = transform
        base = self.root / split if split and (self.root / split).is_dir() else self.root
        self.image_dir = base
        self.synsets = imagenet_synsets()
        index = {w: i for i, w in enumerate(self.synsets)}
        self.classnames = imagenet_classnames(classnames_file)
        dirs = _subdirs(base)
        wnid_dirs = [d for d in dirs if _WNID.match(d)]
        if wnid_dirs and label_file is None:
            self.layout = "folders"
            unknown = [d for d in wnid_dirs if d not in index]
            if unknown:
                raise UserError(f"{len(unknown)} synset folders in {base} are not ImageNet-1k classes "
                                f"(e.g. {unknown[0]}); use kind 'folder' for other class sets")
            others = [d for d in dirs if d not in index]
            if others:
                raise UserError(f"{base} mixes synset folders with other folders ({others[:3]})")
            self.samples, self.skipped, _ = _folder_samples(base, [(d, index[d]) for d in wnid_dirs], "synset folder")
            self.present_classes = len({label for _, label in self.samples})
        else:
            self.layout = "flat"
            lf = self._find_label_file(base, label_file)
            self.label_file = lf
            labels = self._parse_labels(lf, index)
            files = [base / f for f in sorted(os.listdir(base)) if _is_image(f)]
            if not files:
                raise UserError(f"no images in {base} (and no synset folders) ({IMAGENET_HINT})")
            files, self.skipped = readable_images(files)
            require_readable(files, self.skipped, base)
            self.samples = []
            unlabelled = []
            for p in files:
                lab = labels.get(p.name, labels.get(p.stem))
                if lab is None:
                    unlabelled.append(p.name)
                else:
                    self.samples.append((p, lab))
            if unlabelled:
                raise UserError(f"{len(unlabelled)} images in {base} have no label in {lf} "
                                f"(e.g. {unlabelled[0]})")
            self.present_classes = len(set(self.targets))
        warn_skipped(self.skipped, base)

    @staticmethod
    def _find_label_file(base: Path, label_file) -> Path:
        if label_file is not None:
            return require_file(label_file, "ImageNet label file")
        for d in (base, base.parent):
            for name in _LABEL_FILES:
                if (d / name).is_file():
                    return d / name
        raise UserError(f"no synset folders in {base} and no label file ({', '.join(_LABEL_FILES)}) next to "
                        f"it; pass label_file=... ({IMAGENET_HINT})")

    @staticmethod
    def _parse_labels(path: Path, index: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        text = path.read_text(encoding="utf-8")
        first = text.lstrip().split("\n", 1)[0]
        if path.suffix.lower() == ".csv" or first.startswith("ImageId"):
            rows = list(csv.reader(text.splitlines()))
            if rows and rows[0] and rows[0][0] == "ImageId":
                rows = rows[1:]
            for r in rows:
                if len(r) < 2 or not r[1].split():
                    continue
                wnid = r[1].split()[0]
                if wnid not in index:
                    raise UserError(f"{path}: unknown synset {wnid!r} for {r[0]}")
                out[r[0]] = index[wnid]
            return out
        for n, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise UserError(f"{path}:{n}: expected 'filename label', got {line!r}")
            name, lab = parts
            if lab in index:
                out[Path(name).name] = index[lab]
            elif lab.isdigit() and int(lab) < 1000:
                out[Path(name).name] = int(lab)
            else:
                raise UserError(f"{path}:{n}: label {lab!r} is neither an ImageNet synset nor an index 0..999")
        return out

    def __repr__(self) -> str:
        return (f"ImageNetDataset({str(self.image_dir)!r}, layout={self.layout}, images={len(self)}, "
                f"synsets present={self.present_classes}/1000)")


def _synthetic(root: PathLike, split: str, transform) -> FolderDataset:
    from zsprob.data.synthworld.checks import read_manifest, verify_recorded

    root = Path(root)
    hint = "generate it with `zsprob data synthetic --out OUT`"
    cls_dir = root / "classify" if (root / "classify").is_dir() else root
    require_file(cls_dir / "classnames.txt", "SynthWorld classify split", hint)
    if split not in ("select", "eval"):
        raise UserError(f"SynthWorld classify split must be 'select' or 'eval', got {split!r}")
    d = cls_dir / split
    if not d.is_dir():
        counts = (read_manifest(cls_dir.parent) or {}).get("counts") or {}
        if counts.get(f"classify_{split}") == 0:
            raise UserError(f"the SynthWorld {cls_dir.parent} has no classify/{split} images (generated with "
                            f"--num-classify-{split} 0); generate one with --num-classify-{split} N")
        raise not_found("SynthWorld classify split", d, hint)
    verify_recorded(cls_dir.parent, ("classify/classnames.txt", f"classify/{split}/"))
    return FolderDataset(d, transform, classnames=cls_dir / "classnames.txt")


def build_classification_dataset(kind: str, root: PathLike, split: Optional[str] = None,
                                 transform: Optional[Callable] = None, **kwargs):
    """``kind``: ``"imagenet"`` (split default "val"), ``"folder"`` (``root/split`` when it exists, else
    ``root``), ``"synthetic"`` (root = SynthWorld OUT, split "select" or "eval", default "eval")."""
    if kind == "imagenet":
        return ImageNetDataset(root, split or "val", transform, **kwargs)
    if kind == "folder":
        r = Path(root)
        if split and (r / split).is_dir():
            r = r / split
        cn = kwargs.pop("classnames", None)
        if cn is None and r != Path(root) and (Path(root) / "classnames.txt").is_file():
            cn = Path(root) / "classnames.txt"
        return FolderDataset(r, transform, classnames=cn, **kwargs)
    if kind == "synthetic":
        return _synthetic(root, split or "eval", transform)
    raise UserError(f"unknown classification dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
