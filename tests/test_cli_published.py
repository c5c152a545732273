"""Every command on published-layout checkpoints, in real subprocesses: `zsprob convert`,
`select-prompts --topk auto`, `zeroshot imagenet` and `eval coco` with `--model NAME --pretrained
OFFICIAL [--tokenizer DIR]` (random weights in the official ProLIP / PCME++ layouts, written by
tests/test_models_published.py's writers; an ImageNet-layout folder and a tiny COCO drawn here)."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from test_data_coco import make_coco
from test_models_published import _assert_matches, _inputs, prolip_reference, write_pcmepp_hf, write_prolip
from test_zeroshot_cli import _draw

# three ImageNet-1k synsets (class indices 0, 1, 2: tench, goldfish, great white shark)
SYNSETS = ["n01440764", "n01443537", "n01484850"]
TEMPLATES = ["a photo of a {}.", "a drawing of a {}.", "{}."]  # short: prolip-tiny cuts at 16 tokens of a tiny vocabulary


def _imagenet(root, n):
    for i, wnid in enumerate(SYNSETS):
        (root / wnid).mkdir(parents=True)
        for j in range(n):
            _draw(("circle", "square", "triangle")[i], j + 10 * i, size=40).save(root / wnid / f"{wnid}_{j}.JPEG")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("published")
    write_prolip(base / "prolip")
    write_pcmepp_hf(base / "pcmepp")
    (base / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    make_coco(base / "coco")
    return {"base": base, "val": _imagenet(base / "imagenet" / "val", 3), "train": _imagenet(base / "train", 2),
            "templates": base / "templates.txt", "coco": base / "coco", "imagenet": base / "imagenet"}


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


# the ProLIP tokenizer is passed explicitly for one family and found beside the weights for the other
FAMILIES = {"prolip": ("prolip-tiny", ["--tokenizer", "{base}/prolip/tokenizer"], 64),
            "pcmepp": ("pcmepp-tiny", [], 32)}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_select_prompts_zeroshot_and_eval_coco_on_official_files(data, tmp_path, family):
    name, extra, dim = FAMILIES[family]
    model = ["--model", name, "--pretrained", data["base"] / family, *[e.format(base=data["base"]) for e in extra]]
    sel = tmp_path / "selection.json"
    _ok(run_cli("select-prompts", *model, "--dataset", "imagenet", "--root", data["imagenet"], "--select-root",
                data["train"], "--templates", data["templates"], "--topk", "auto", "--batch-size", "64",
                "--out", sel))
    doc = json.loads(sel.read_text())
    assert doc["strategy"] == "auto" and len(doc["classes"]) == 1000 and doc["templates"] == TEMPLATES
    kept = doc["classes"][0]["kept"]
    assert len(doc["classes"][0]["mu"]) == dim and all(e["uncertainty"] > 0 for e in kept)

    res = tmp_path / "results.json"
    r = _ok(run_cli("zeroshot", "imagenet", *model, "--root", data["imagenet"], "--prompts", sel, "--score", "csd",
                    "--out", res))
    metrics = json.loads(res.read_text())["metrics"]
    assert metrics["n_images"] == 9 and 0 <= metrics["top1"] <= metrics["top5"] <= 100 and "top-1" in r.stdout

    out = tmp_path / "coco" / "metrics.json"
    _ok(run_cli("eval", "coco", *model, "--root", data["coco"], "--no-analysis", "--out", out))
    got = json.loads(out.read_text())
    assert 0 <= got["metrics"]["coco"]["i2t"]["r@1"] <= 100


@pytest.mark.slow
def test_convert_then_every_command_sees_one_format(data, tmp_path):
    """`zsprob convert` writes a zsprob checkpoint equal to the in-memory conversion; bad files: one line, exit 2."""
    from zsprob.models import load

    out = tmp_path / "ckpt"
    r = _ok(run_cli("convert", data["base"] / "prolip", "--model", "prolip-tiny", "--out", out))
    assert "checkpoint:" in r.stdout
    model = load(out)
    assert model.config["official_layout"] == "prolip"
    state = {k: v for k, v in __import__("safetensors.torch", fromlist=["x"]).load_file(
        str(data["base"] / "prolip" / "model.safetensors")).items()}
    images, tokens = _inputs(model)
    _assert_matches(model, prolip_reference(state, images, tokens), images, tokens)
    # a zsprob checkpoint as --pretrained works too
    sel = tmp_path / "s.json"
    _ok(run_cli("select-prompts", "--model", "prolip-tiny", "--pretrained", out, "--dataset", "folder",
                "--root", data["val"], "--templates", data["templates"], "--topk", "2", "--out", sel))

    def error(*args):
        r = run_cli(*args)
        assert r.returncode == 2 and r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
        return r.stderr

    bad = dict(state)
    bad["text.ln_final.weights"] = bad.pop("text.ln_final.weight")
    from safetensors.torch import save_file

    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    err = error("zeroshot", "imagenet", "--model", "prolip-tiny", "--pretrained", tmp_path / "bad", "--tokenizer",
                data["base"] / "prolip" / "tokenizer", "--root", data["imagenet"], "--out", tmp_path / "r.json")
    assert "missing key for 'clip.text.ln_final.weight'" in err
    err = error("eval", "coco", "--model", "prolip-tiny", "--pretrained", tmp_path / "bad", "--root", data["coco"])
    assert "no Hugging Face tokenizer next to" in err
    err = error("convert", data["base"] / "pcmepp", "--model", "prolip-tiny", "--tokenizer",
                data["base"] / "prolip" / "tokenizer", "--out", tmp_path / "o")
    assert "missing key for" in err and not (tmp_path / "o").exists()
