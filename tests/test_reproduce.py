"""`zsprob reproduce`: every runnable recipe's --smoke end to end on real-format miniatures, the paper's
figures as the registry copies them from the papers, resumed runs, and missing or malformed data refused in
one line."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from zsprob.reproduce.recipes import PROLIP, RECIPES, TABLE1, TABLE6


def _one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_the_paper_figures_are_the_papers():
    """Spot checks against PCME++ Table 1 / C.9 / 6 and ProLIP's abstract, as printed."""
    assert TABLE1["ViT-B-32"]["CLIP ZS"]["RSUM"] == (471.9, None)
    assert TABLE1["ViT-B-32"]["Ours + SWA"]["ECCV R@1"] == (83.6, 0.4)
    assert TABLE1["ViT-L-14"]["Ours"]["COCO 5K R@1"] == (64.3, None)
    assert TABLE1["ViT-B-32"]["InfoNCE"]["CxC R@1"] == (54.9, 0.2)
    assert {strategy: top1 for strategy, top1 in TABLE6.values()} == {"single": 8.58, "all": 9.33,
                                                                       "oracle-global": 9.37, "oracle": 14.75}
    assert dict(PROLIP.values()) == {"all": 74.6, "bprw-fewshot": 75.8}


def test_list_names_every_recipe_and_the_one_it_cannot_run():
    r = run_cli("reproduce", "--list")
    assert r.returncode == 0, r.stderr
    for name in RECIPES:
        assert name in r.stdout
    assert "cannot run: PCME's published checkpoints" in r.stdout


def test_missing_and_malformed_inputs_are_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _one_line_error(run_cli("reproduce", "pcmepp-table1-train", "--data-root", data, "--out", tmp_path / "o"),
                    "coco/dataset_coco.json", "README 'Real data and many GPUs'")
    (data / "coco").mkdir()
    (data / "coco" / "dataset_coco.json").write_text("{not json")
    _one_line_error(run_cli("reproduce", "pcmepp-table1-train", "--data-root", data, "--out", tmp_path / "o"),
                    "not a readable Karpathy JSON")
    _one_line_error(run_cli("reproduce", "pcmepp-table1-eval", "--data-root", data, "--out", tmp_path / "o"),
                    "needs --pretrained")
    _one_line_error(run_cli("reproduce", "pcmepp-table6", "--data-root", data, "--out", tmp_path / "o"),
                    "redcaps")
    _one_line_error(run_cli("reproduce", "pcme-coco", "--data-root", data, "--out", tmp_path / "o"), "cannot run")
    _one_line_error(run_cli("reproduce", "no-such", "--smoke", "--out", tmp_path / "o"), "unknown recipe")
    _one_line_error(run_cli("reproduce", "pcmepp-table1-eval", "--smoke", "--variant", "RN50", "--out", tmp_path / "o"),
                    "variants")
    assert not (tmp_path / "o" / "reproduce.json").exists()


def _smoke(tmp_path, name, *extra):
    out = tmp_path / name
    r = run_cli("reproduce", name, "--smoke", *extra, "--out", out, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "reproduce.json").read_text())
    assert doc["smoke"] is True and "SMOKE RUN" in (out / "reproduce.md").read_text()
    return doc, r, out


@pytest.mark.slow(seconds=40)
def test_smoke_table1_eval_and_a_rerun_skips_its_step(tmp_path):
    doc, _, out = _smoke(tmp_path, "pcmepp-table1-eval")
    rows = {f["metric"]: f for f in doc["figures"]}
    assert [rows[k]["paper"] for k in rows] == [v[0] for v in TABLE1["ViT-B-32"]["Ours + SWA"].values()]
    assert rows["RSUM"]["measured"] is not None and rows["ECCV mAP@R"]["verdict"] == "not measured on this data"
    again = run_cli("reproduce", "pcmepp-table1-eval", "--smoke", "--out", out)
    assert again.returncode == 0 and "done already" in again.stdout


@pytest.mark.slow(seconds=40)
def test_smoke_clip_zero_shot_rows(tmp_path):
    doc, _, _ = _smoke(tmp_path, "pcmepp-table1-clip-zs", "--variant", "ViT-B-16")
    assert {f["row"] for f in doc["figures"]} == {"ViT-B-16 CLIP ZS"}
    assert doc["figures"][0]["paper"] == 29.3


@pytest.mark.slow(seconds=90)
def test_smoke_training_two_seeds(tmp_path):
    doc, _, out = _smoke(tmp_path, "pcmepp-table1-train", "--variant", "infonce", "--seeds", "2")
    rsum = {f["metric"]: f for f in doc["figures"]}["RSUM"]
    assert rsum["n_runs"] == 2 and rsum["paper"] == 532.6 and rsum["row"] == "ViT-B-32 InfoNCE"
    assert (out / "seed1" / "run" / "model" / "zsprob.json").is_file()


@pytest.mark.slow(seconds=90)
def test_smoke_table6_pretrains_then_compares(tmp_path):
    doc, _, _ = _smoke(tmp_path, "pcmepp-table6")
    by = {f["row"].split(":")[0]: f for f in doc["figures"]}
    assert by["oracle"]["paper"] == 14.75 and by["oracle"]["uses_eval_labels"] is True
    assert by["all"]["uses_eval_labels"] is False and by["auto"]["paper"] is None


@pytest.mark.slow(seconds=60)
def test_smoke_prolip_marks_the_eval_shots(tmp_path):
    doc, _, _ = _smoke(tmp_path, "prolip-zeroshot")
    by = {f["row"].split(":")[0]: f for f in doc["figures"]}
    assert by["all"]["paper"] == 74.6 and by["bprw-fewshot"]["uses_eval_labels"] is True
    assert by["bprw-fewshot"]["measured"] is not None
