"""`zsprob select-prompts` and `zsprob zeroshot` in real subprocesses, on a folder dataset and a
tiny zsprob checkpoint generated here."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

CLASSES = ["circle", "square", "triangle"]
TEMPLATES = ["a photo of a {}.", "a blurry photo of a {}.", "a drawing of a {}.", "a photo of many {}.",
             "a bright photo of the {}.", "a dark photo of the {}."]


def _draw(shape, i, size=64):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (20 * (i % 7), 90, 200 - 10 * (i % 9)))
    d = ImageDraw.Draw(img)
    o = 8 + (i % 5) * 3
    box = (o, o, size - o, size - o)
    col = ((60 * i) % 255, 255 - (30 * i) % 255, 120)
    if shape == "circle":
        d.ellipse(box, fill=col)
    elif shape == "square":
        d.rectangle(box, fill=col)
    else:
        d.polygon([(size // 2, o), (o, size - o), (size - o, size - o)], fill=col)
    return img


def _folder(root, n):
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(n):
            _draw(c, i + (0 if n < 5 else 100)).save(root / c / f"{i:03d}.png")
    (root / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import torch

    from zsprob.models import create_model, save

    base = tmp_path_factory.mktemp("zs")
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny"), base / "ckpt")
    (base / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return {"ckpt": str(ckpt), "eval": str(_folder(base / "eval", 6)), "select": str(_folder(base / "select", 3)),
            "templates": str(base / "templates.txt"), "base": base}


def _one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_bad_inputs_are_one_line_exit_2(tmp_path):
    _one_line_error(run_cli("zeroshot", "folder", "--model", "zsprob-tiny", "--root", tmp_path / "missing",
                            "--out", tmp_path / "r.json"))
    _one_line_error(run_cli("select-prompts", "--model", "zsprob-tiny", "--dataset", "folder", "--topk", "banana",
                            "--out", tmp_path / "s.json"))
    (tmp_path / "d").mkdir()
    _one_line_error(run_cli("zeroshot", "folder", "--model", "zsprob-tiny", "--root", tmp_path / "d",
                            "--prompts", tmp_path / "s.json", "--compare", "--out", tmp_path / "r.json"))


@pytest.mark.slow
def test_select_then_zeroshot_then_compare(world, tmp_path):
    sel_path = tmp_path / "selection.json"
    r = run_cli("select-prompts", "--checkpoint", world["ckpt"], "--dataset", "folder", "--root", world["eval"],
                "--select-root", world["select"], "--templates", world["templates"], "--topk", "auto",
                "--out", sel_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(sel_path.read_text())
    assert doc["strategy"] == "auto" and doc["uses_eval_labels"] is False
    assert doc["data"]["selection_split"]["n_images"] == 9 and "evaluation_split" not in doc["data"]
    assert [c["name"] for c in doc["classes"]] == CLASSES and doc["templates"] == TEMPLATES
    for c in doc["classes"]:
        assert len(c["kept"]) == c["k"] and len(c["mu"]) == 64 and len(c["sigma2"]) == 64
        us = [e["uncertainty"] for e in c["kept"]]
        assert all(u is not None and u > 0 for u in us)

    res_path = tmp_path / "results.json"
    r = run_cli("zeroshot", "folder", "--checkpoint", world["ckpt"], "--root", world["eval"], "--prompts", sel_path,
                "--score", "csd", "--out", res_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(res_path.read_text())
    m = res["metrics"]
    assert m["n_images"] == 18 and 0 <= m["top1"] <= m["top5"] == 100.0   # 3 classes: top-5 is trivial
    assert set(m["per_class"]) == set(CLASSES) and len(m["uncertainty_bins"]) == 10
    assert res["selection"]["file"] == str(sel_path) and "top-1" in r.stdout
    sep = res["class_separation"]
    assert -1.0 <= sep["mean_pairwise_cosine"] <= sep["max_pairwise_cosine"] <= 1.0 + 1e-6
    assert ("warning: the class text embeddings are nearly identical" in r.stderr) == sep["collapsed"]

    cmp_out = tmp_path / "cmp" / "results.json"
    r = run_cli("zeroshot", "folder", "--checkpoint", world["ckpt"], "--root", world["eval"], "--select-root",
                world["select"], "--templates", world["templates"], "--compare", "--out", cmp_out)
    assert r.returncode == 0, r.stderr[-3000:]
    cmp = json.loads(cmp_out.read_text())
    names = [row["name"] for row in cmp["rows"]]
    for n in ("all", "single", "global", "auto", "threshold", "fusion", "bprw", "zpe", "oracle"):
        assert n in names
    oracle = [row for row in cmp["rows"] if row["name"] == "oracle"][0]
    assert oracle["uses_eval_labels"] and "YES (oracle)" in r.stdout and "ProLIP BPRW" in r.stdout
    assert (tmp_path / "cmp" / "accuracy_vs_topk.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "per_class_k_hist.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "selections" / "auto.json").is_file()
    sel = cmp["selective"]  # which confidence flags the wrong predictions, for all-80 and auto
    assert set(sel) == {"all", "auto"} and set(sel["auto"]["scores"]) == {"msp", "entropy", "margin", "image_sigma2",
                                                                           "class_sigma2"}
    assert "minus_msp" in sel["auto"]["scores"]["image_sigma2"] and "Selective prediction, auto" in r.stdout
    # image embeddings and the prompt bank were cached and are reused
    cached = list((tmp_path / "cmp" / "cache").glob("*.safetensors"))
    assert any(p.name.startswith("images-") for p in cached) and any(p.name.startswith("promptbank-") for p in cached)


def _named_folders(root, counts):
    for i, (folder, n) in enumerate(counts.items()):
        (root / folder).mkdir(parents=True)
        for j in range(n):
            _draw(CLASSES[i % 3], 10 * i + j).save(root / folder / f"{j:03d}.png")
    return root


@pytest.mark.slow
def test_classes_file_is_matched_to_folders_by_name(world, tmp_path):
    """--classes lists "red car" before "oak tree": labels follow the folder names, not the file's order."""
    root = _named_folders(tmp_path / "ev", {"oak_tree": 2, "red_car": 5})
    sel_root = _named_folders(tmp_path / "sel", {"oak_tree": 2, "red_car": 2})
    (tmp_path / "classes.txt").write_text("red car\noak tree\n")
    common = ("zeroshot", "folder", "--checkpoint", world["ckpt"], "--root", root, "--templates", world["templates"],
              "--strategy", "all")
    by_file, by_folder = tmp_path / "file.json", tmp_path / "folder.json"
    r = run_cli(*common, "--classes", tmp_path / "classes.txt", "--out", by_file)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(*common, "--out", by_folder)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = json.loads(by_file.read_text()), json.loads(by_folder.read_text())
    assert got["metrics"]["per_class"] == want["metrics"]["per_class"]
    assert got["metrics"]["top1"] == want["metrics"]["top1"]

    # the same file with a labelled selection split (--select-root)
    out = tmp_path / "sel.json"
    r = run_cli("select-prompts", "--checkpoint", world["ckpt"], "--dataset", "folder", "--select-root", sel_root,
                "--templates", world["templates"], "--classes", tmp_path / "classes.txt", "--topk", "auto",
                "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c["name"] for c in json.loads(out.read_text())["classes"]] == ["oak tree", "red car"]

    # a file naming only some of the folders is refused, naming the folder left without a name
    (tmp_path / "partial.txt").write_text("red car\nbirch\n")
    r = run_cli(*common, "--classes", tmp_path / "partial.txt", "--out", tmp_path / "p.json")
    _one_line_error(r)
    assert "oak tree" in r.stderr and "red car" not in r.stderr.split("no name for", 1)[1]
