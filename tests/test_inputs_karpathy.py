"""Karpathy split files (COCO, Flickr30k) that are not what Karpathy's files hold are one line naming the file
and the entry, in the library and on the command line: before issue 50 a numeric caption, ``sentences`` as a
string or ``cocoid: null`` gave tracebacks, a repeated image was put in the gallery twice, and a file name
with ``../`` was read from outside the image root."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from test_data_coco import make_coco
from zsprob.data.coco import CocoCaptions
from zsprob.errors import UserError


def _edit(root, change):
    path = root / "dataset_coco.json"
    data = json.loads(path.read_text())
    change(data["images"])
    path.write_text(json.dumps(data))


def _test_images(images):
    return [im for im in images if im["split"] == "test"]


def _set(key, value, entry=0):
    return lambda images: _test_images(images)[entry].__setitem__(key, value)


CASES = {
    "numeric caption": (lambda images: _test_images(images)[0]["sentences"][0].__setitem__("raw", 42),
                        "a caption is not {'raw': text, 'sentid': integer}"),
    "sentences as text": (_set("sentences", "a dog on a bench"), "'sentences' must be a list of captions, got str"),
    "cocoid null": (_set("cocoid", None), "its image id is not a number"),
    "repeated cocoid": (lambda images: _test_images(images)[1].__setitem__("cocoid", _test_images(images)[0]["cocoid"]),
                        "the image is named twice in the file"),
    "repeated sentid": (lambda images: _test_images(images)[1]["sentences"][0].__setitem__(
        "sentid", _test_images(images)[0]["sentences"][0]["sentid"]), "is named twice in the file"),
    "filename outside the root": (_set("filename", "../../etc/passwd"), "is not a file name inside the image folder"),
    "absolute filename": (_set("filename", "/etc/passwd"), "is not a file name inside the image folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_karpathy_entry_is_one_line(tmp_path, case):
    root = tmp_path / "coco"
    make_coco(root)
    change, why = CASES[case]
    _edit(root, change)
    with pytest.raises(UserError, match="dataset_coco.json: image entry") as e:
        CocoCaptions(root, split="test", check_images=False)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_images_as_an_object_is_one_line(tmp_path):
    root = tmp_path / "coco"
    make_coco(root)
    (root / "dataset_coco.json").write_text(json.dumps({"images": {"0": {}}}))
    with pytest.raises(UserError, match="is not a Karpathy split file"):
        CocoCaptions(root, split="test", check_images=False)


def test_eval_coco_on_a_malformed_file_is_one_line_exit_2(tmp_path):
    root = tmp_path / "coco"
    make_coco(root)
    _edit(root, CASES["numeric caption"][0])
    r = run_cli("eval", "coco", "--model", "zsprob-tiny-bow", "--root", root, "--out", tmp_path / "out.json",
                timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "image entry 0" in lines[0] and "Traceback" not in r.stderr, lines


def test_a_repeated_flickr_file_name_is_one_line(tmp_path):
    from zsprob.data.flickr import Flickr30kCaptions
    images = [{"filename": name, "imgid": i, "split": "test",
               "sentences": [{"raw": f"caption {i} {j}", "sentid": 5 * i + j} for j in range(5)]}
              for i, name in enumerate(["1000.jpg", "1001.jpg", "1000.jpg"])]
    (tmp_path / "dataset_flickr30k.json").write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    with pytest.raises(UserError, match="image entry 2 .* the image is named twice"):
        Flickr30kCaptions(tmp_path, split="test", check_images=False)
