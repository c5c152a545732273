"""ImageNet (both layouts), folder-per-class datasets and SynthWorld classify splits."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from zsprob.errors import UserError
from zsprob.data.classification import (FolderDataset, ImageNetDataset, build_classification_dataset,
                                        imagenet_classnames, imagenet_synsets)

# three real ImageNet-1k synsets and their canonical indices / CLIP names
SYN = {"n01440764": (0, "tench"), "n01443537": (1, "goldfish"), "n15075141": (999, "toilet paper")}


def _img(path: Path, c=(10, 20, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), c).save(path)


def test_imagenet_synset_folders(tmp_path):
    for w in SYN:
        for i in range(2):
            _img(tmp_path / "val" / w / f"ILSVRC2012_val_{w}_{i}.JPEG")
    ds = build_classification_dataset("imagenet", tmp_path, "val")
    assert isinstance(ds, ImageNetDataset) and ds.layout == "folders"
    assert len(ds.classnames) == 1000 and ds.classnames == imagenet_classnames()
    assert sorted(set(ds.targets)) == [0, 1, 999]
    for (path, t) in ds.samples:
        assert SYN[path.parent.name][0] == t
        assert ds.classnames[t] == SYN[path.parent.name][1]
    img, label = ds[0]
    assert img.size == (8, 8) and label == 0
    assert imagenet_synsets()[999] == "n15075141"


def test_imagenet_flat_with_loc_csv_and_txt(tmp_path):
    val = tmp_path / "val"
    rows = ["ImageId,PredictionString"]
    txt = []
    for k, (w, (idx, _)) in enumerate(SYN.items()):
        name = f"ILSVRC2012_val_{k + 1:08d}"
        _img(val / f"{name}.JPEG")
        rows.append(f"{name},{w} 1 2 30 40 {w} 5 6 7 8")
        txt.append(f"{name}.JPEG {idx if k % 2 else w}")
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    ds = ImageNetDataset(tmp_path, "val")
    assert ds.layout == "flat" and ds.label_file.name == "LOC_val_solution.csv"
    assert ds.targets == [0, 1, 999]
    (tmp_path / "labels_any.txt").write_text("\n".join(txt) + "\n")
    ds2 = ImageNetDataset(tmp_path, "val", label_file=tmp_path / "labels_any.txt")
    assert ds2.targets == [0, 1, 999]
    # an image without a label is an error
    _img(val / "ILSVRC2012_val_00000099.JPEG")
    with pytest.raises(UserError, match="no label"):
        ImageNetDataset(tmp_path, "val")


def test_imagenet_errors(tmp_path):
    with pytest.raises(UserError, match="ImageNet root not found"):
        ImageNetDataset(tmp_path / "missing")
    _img(tmp_path / "val" / "n01440764" / "a.JPEG")
    bad = tmp_path / "names.txt"
    bad.write_text("\n".join(f"c{i}" for i in range(999)) + "\n")
    with pytest.raises(UserError, match="999 class names"):
        ImageNetDataset(tmp_path, "val", classnames_file=bad)
    (tmp_path / "val" / "n99999999").mkdir()
    _img(tmp_path / "val" / "n99999999" / "b.JPEG")
    with pytest.raises(UserError, match="not ImageNet-1k classes"):
        ImageNetDataset(tmp_path, "val")
    (tmp_path / "flat").mkdir()
    _img(tmp_path / "flat" / "x.JPEG")
    with pytest.raises(UserError, match="no label file"):
        ImageNetDataset(tmp_path / "flat", split="")


def test_folder_dataset_order_names_and_errors(tmp_path):
    for cls in ("zebra", "apple_tree", "cat"):
        for i in range(2):
            _img(tmp_path / cls / f"{i}.png")
    ds = FolderDataset(tmp_path)
    assert ds.class_folders == ["apple_tree", "cat", "zebra"]    # sorted folder order
    assert ds.classnames == ["apple tree", "cat", "zebra"]
    assert ds.targets == [0, 0, 1, 1, 2, 2]
    # positional names, one per sorted folder
    (tmp_path / "classnames.txt").write_text("an apple tree\na cat\na zebra\n")
    assert FolderDataset(tmp_path).classnames == ["an apple tree", "a cat", "a zebra"]
    # names equal to the folders: the file's order is the class order
    (tmp_path / "classnames.txt").write_text("zebra\ncat\napple tree\n")
    ds = FolderDataset(tmp_path)
    assert ds.classnames == ["zebra", "cat", "apple tree"]
    assert [p.parent.name for p, t in ds.samples if t == 0] == ["zebra", "zebra"]
    # folder<TAB>name mapping
    (tmp_path / "classnames.txt").write_text("cat\tkitty\nzebra\tstriped horse\napple_tree\ttree\n")
    assert FolderDataset(tmp_path).classnames == ["tree", "kitty", "striped horse"]
    # mismatches
    (tmp_path / "classnames.txt").write_text("one\ntwo\n")
    with pytest.raises(UserError, match="2 class names but .* 3 class folders"):
        FolderDataset(tmp_path)
    (tmp_path / "classnames.txt").write_text("cat\tkitty\ndog\tdoggo\n")
    with pytest.raises(UserError, match="does not match"):
        FolderDataset(tmp_path)
    (tmp_path / "classnames.txt").unlink()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no images"):
        FolderDataset(tmp_path)
    with pytest.raises(UserError, match="not found"):
        FolderDataset(tmp_path / "nothing")


def test_synthetic_classify_splits(tmp_path):
    out = tmp_path / "world"
    names = ["star", "circle", "heart"]          # SynthWorld order, not sorted
    (out / "classify").mkdir(parents=True)
    (out / "classify" / "classnames.txt").write_text("\n".join(names) + "\n")
    for split, n in (("select", 1), ("eval", 3)):
        for c in names:
            for i in range(n):
                _img(out / "classify" / split / c / f"{c}_{i:05d}.jpg")
    ev = build_classification_dataset("synthetic", out, "eval")
    assert ev.classnames == names and len(ev) == 9
    assert all(p.parent.name == names[t] for p, t in ev.samples)
    sel = build_classification_dataset("synthetic", out, "select")
    assert len(sel) == 3
    with pytest.raises(UserError, match="zsprob data synthetic"):
        build_classification_dataset("synthetic", tmp_path / "nowhere", "eval")
    with pytest.raises(UserError, match="'select' or 'eval'"):
        build_classification_dataset("synthetic", out, "train")
    with pytest.raises(UserError, match="unknown classification dataset kind"):
        build_classification_dataset("cifar", out)


def test_align_classnames_by_name_position_or_refused():
    from zsprob.data.classification import align_classnames
    from zsprob.errors import UserError

    # folder names are the class names: matched by name whatever the file's order, case and underscores
    assert align_classnames(["oak tree", "red car"], ["Red_Car", "oak tree"]) == ["oak tree", "Red_Car"]
    # no folder name matches (ImageNet wnids): the file's order is the folders' order
    assert align_classnames(["n01440764", "n01443537"], ["tench", "goldfish"]) == ["tench", "goldfish"]
    with pytest.raises(UserError, match="no name for oak tree"):
        align_classnames(["oak tree", "red car"], ["red car", "birch"])
    with pytest.raises(UserError, match="3 class names but the dataset has 2"):
        align_classnames(["oak tree", "red car"], ["red car", "oak tree", "elm"])
