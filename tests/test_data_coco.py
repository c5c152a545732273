"""COCO Karpathy splits + official ids + instance labels, on a tiny COCO generated here."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zsprob.errors import UserError
from zsprob.data.coco import CocoCaptions, CocoImages, CocoPairs

# (cocoid, folder, karpathy split, number of captions)
IMAGES = [
    (391895, "val2014", "test", 5),
    (522418, "val2014", "test", 6),     # 6 captions: only the first 5 are kept
    (184613, "train2014", "train", 5),
    (318219, "val2014", "restval", 5),
    (554625, "val2014", "val", 5),
]
CATS = [(1, "person"), (2, "bicycle"), (3, "car"), (18, "dog"), (90, "toothbrush")]


def _official(cocoid: int, j: int) -> str:
    return f"A caption number {j} of image {cocoid}."


def make_coco(root: Path, instances=True) -> dict:
    """Writes dataset_coco.json, annotations/captions_*2014.json, instances_*2014.json, images.

    Returns the expected official caption ids per (cocoid, j). The Karpathy raw text of
    caption j differs from the official one as in the real files: trailing space (exact
    match fails only on the whitespace tier), doubled inner space, and once a case change.
    """
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    kimages, anns, expected = [], {"train2014": [], "val2014": []}, {}
    inst = {"train2014": [], "val2014": []}
    sentid = 0
    for n, (cocoid, folder, split, ncap) in enumerate(IMAGES):
        fname = f"COCO_{folder}_{cocoid:012d}.jpg"
        (root / folder).mkdir(exist_ok=True)
        Image.new("RGB", (20 + n, 16), (n * 40, 80, 120)).save(root / folder / fname)
        sents = []
        official_ids = [1000 * cocoid + 7 * j + 3 for j in range(ncap)]
        # official annotation order is shuffled relative to the Karpathy order
        for j in reversed(range(ncap)):
            anns[folder].append({"image_id": cocoid, "id": official_ids[j], "caption": _official(cocoid, j)})
        for j in range(ncap):
            raw = _official(cocoid, j)
            if j == 1:
                raw = raw + " "                           # exact fails -> whitespace tier
            if j == 2:
                raw = raw.replace(" number", "  number")  # doubled space
            if j == 3 and cocoid == 391895:
                raw = raw.upper()                         # case tier
            sents.append({"raw": raw, "tokens": raw.lower().split(), "sentid": sentid, "imgid": n})
            expected[(cocoid, j)] = official_ids[j]
            sentid += 1
        kimages.append({"filepath": folder, "filename": fname, "cocoid": cocoid, "split": split,
                        "imgid": n, "sentids": [s["sentid"] for s in sents], "sentences": sents})
        inst[folder].append({"image_id": cocoid, "category_id": CATS[n % len(CATS)][0], "id": 5 * n, "bbox": [0, 0, 1, 1]})
        inst[folder].append({"image_id": cocoid, "category_id": 90, "id": 5 * n + 1, "bbox": [0, 0, 1, 1]})
    # one extra official caption for an image, which stays unused
    anns["val2014"].append({"image_id": 391895, "id": 99, "caption": "An unrelated caption."})
    (root / "dataset_coco.json").write_text(json.dumps({"images": kimages, "dataset": "coco"}))
    for folder in ("train2014", "val2014"):
        imgs = [{"id": c, "file_name": f"COCO_{folder}_{c:012d}.jpg"} for c, f, _, _ in IMAGES if f == folder]
        (root / "annotations" / f"captions_{folder}.json").write_text(
            json.dumps({"images": imgs, "annotations": anns[folder]}))
        if instances:
            cats = [{"id": i, "name": nm, "supercategory": "x"} for i, nm in reversed(CATS)]
            (root / "annotations" / f"instances_{folder}.json").write_text(
                json.dumps({"images": imgs, "annotations": inst[folder], "categories": cats}))
    return expected


@pytest.fixture()
def coco_root(tmp_path):
    root = tmp_path / "coco"
    return root, make_coco(root)


def test_test_split_ids_and_captions(coco_root):
    root, expected = coco_root
    ds = CocoCaptions(root, split="test")
    assert ds.image_ids == [391895, 522418]
    assert len(ds.captions) == 10 and ds.images_with_extra_captions == 1
    assert ds.caption_image.tolist() == [0] * 5 + [1] * 5
    assert ds.image_captions == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    want = [expected[(c, j)] for c in (391895, 522418) for j in range(5)]
    assert ds.caption_ids == want
    assert ds.mapping == {"exact": 5, "whitespace": 4, "case": 1, "unmapped": 0}
    assert ds.unmapped == []
    assert ds.image_paths[0] == root / "val2014" / "COCO_val2014_000000391895.jpg"
    assert ds.captions[1] == _official(391895, 1)     # stripped


def test_train_is_train_plus_restval_and_needs_both_caption_files(coco_root):
    root, expected = coco_root
    ds = CocoCaptions(root, split="train")
    assert sorted(ds.image_ids) == [184613, 318219]
    assert all(cid > 0 for cid in ds.caption_ids)
    assert CocoCaptions(root, split="val").image_ids == [554625]
    (root / "annotations" / "captions_train2014.json").unlink()
    with pytest.raises(UserError, match=r"captions_train2014\.json.*cocodataset\.org"):
        CocoCaptions(root, split="train")
    CocoCaptions(root, split="test")   # test only needs val2014 annotations


def test_instance_labels_in_category_id_order(coco_root):
    root, _ = coco_root
    ds = CocoCaptions(root, split="test")
    assert ds.category_ids == [1, 2, 3, 18, 90]
    assert ds.category_names == ["person", "bicycle", "car", "dog", "toothbrush"]
    lab = ds.instance_labels
    assert lab.shape == (2, 5)
    assert lab.tolist() == [[1, 0, 0, 0, 1], [0, 1, 0, 0, 1]]
    no = CocoCaptions(root, split="test", instances=False)
    assert no.instance_labels is None


def test_unmapped_captions_are_reported(coco_root, caplog):
    root, _ = coco_root
    data = json.loads((root / "dataset_coco.json").read_text())
    data["images"][0]["sentences"][4]["raw"] = "Something nobody wrote."
    (root / "dataset_coco.json").write_text(json.dumps(data))
    ds = CocoCaptions(root, split="test")
    assert ds.caption_ids[4] == -1
    assert ds.mapping["unmapped"] == 1
    assert ds.unmapped[0]["image_id"] == 391895 and ds.unmapped[0]["caption"] == "Something nobody wrote."
    assert "no official caption id" in caplog.text


def test_missing_files_give_one_clear_error(tmp_path, coco_root):
    root, _ = coco_root
    with pytest.raises(UserError, match=r"dataset_coco\.json.*Karpathy"):
        CocoCaptions(tmp_path, split="test")
    with pytest.raises(UserError, match=r"Karpathy"):
        CocoCaptions(root, split="test", karpathy_json=tmp_path / "nope.json")
    (root / "annotations" / "captions_val2014.json").unlink()
    with pytest.raises(UserError, match=r"captions_val2014\.json not found"):
        CocoCaptions(root, split="test")
    with pytest.raises(UserError, match="instances_val2014"):
        (root / "annotations" / "instances_val2014.json").unlink()
        CocoCaptions(root, split="test", official_ids=False, instances=True)


def test_image_and_pair_datasets(coco_root):
    root, _ = coco_root
    ds = CocoCaptions(root, split="test")
    to_t = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1)
    images = CocoImages(ds, to_t)
    x, i = images[1]
    assert i == 1 and x.shape == (3, 16, 21)
    pairs = CocoPairs(ds, to_t, mode="all")
    assert len(pairs) == 10
    img, cap, ii, ci = pairs[7]
    assert (ii, ci, cap) == (1, 7, ds.captions[7])
    rnd = CocoPairs(ds, None, mode="random", seed=0)
    assert len(rnd) == 2
    seen = set()
    for e in range(30):
        rnd.set_epoch(e)
        _, cap, ii, ci = rnd[0]
        assert ii == 0 and ci in ds.image_captions[0] and cap == ds.captions[ci]
        seen.add(ci)
    assert len(seen) > 2                      # a different caption across epochs
    rnd.set_epoch(3)
    assert rnd.caption_index(0) == rnd.caption_index(0)
