"""The demo: its resumable step runner, the report builder, and (slow) `zsprob demo --quick` end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from zsprob import UserError
from zsprob.report.pipeline import Step, is_done, run_steps


def _steps(out: Path, n: int) -> list[Step]:
    data = out / "sw"
    return [Step("data", "tiny world",
                 ["data", "synthetic", "--out", str(data), "--preset", "quick", "--num-pretrain", str(n),
                  "--num-classify-select", "1", "--num-classify-eval", "1", "--num-retrieval", "5",
                  "--num-retrieval-val", "5", "--no-progress", "--overwrite"],
                 outputs=[data / "manifest.json"])]


def test_steps_skip_when_done_and_rerun_when_arguments_change(tmp_path):
    log: list[str] = []
    t1 = run_steps(tmp_path, _steps(tmp_path, 8), echo=log.append, stream=False)
    assert not t1["data"]["skipped"] and is_done(tmp_path, _steps(tmp_path, 8)[0])
    assert json.loads((tmp_path / "sw" / "manifest.json").read_text())["counts"]["pretrain"] == 8
    t2 = run_steps(tmp_path, _steps(tmp_path, 8), echo=log.append, stream=False)
    assert t2["data"]["skipped"] and any("skipping" in line for line in log)
    t3 = run_steps(tmp_path, _steps(tmp_path, 12), echo=log.append, stream=False)
    assert not t3["data"]["skipped"]
    assert json.loads((tmp_path / "sw" / "manifest.json").read_text())["counts"]["pretrain"] == 12
    # deleting an output makes the step run again
    (tmp_path / "sw" / "manifest.json").unlink()
    assert not is_done(tmp_path, _steps(tmp_path, 12)[0])


def test_failing_step_is_one_clear_user_error(tmp_path):
    bad = Step("bad", "bad step", ["data", "synthetic", "--out", str(tmp_path / "x"), "--image-size", "16"],
               outputs=[tmp_path / "x" / "manifest.json"])
    with pytest.raises(UserError, match="demo step 'bad' failed with exit code 2"):
        run_steps(tmp_path, [bad], echo=lambda s: None, stream=False)
    assert not is_done(tmp_path, bad)


def test_demo_rejects_bad_options():
    r = run_cli("demo", "--steps", "0")
    assert r.returncode == 2 and r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = run_cli("demo", "--quick", "--out", out, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    # Both pretrainings ran, their losses went down, PCME++ left its base-rate loss, and the models
    # are far above chance on retrieval. Measured on this budget (300 x 128 per model, seed 0, the
    # sigma recipe configs/synthetic_tiny_sigma.yaml for PCME++): i2t R@1 12.0% / 17.5% (PCME++ /
    # InfoNCE; chance 0.5%); best zero-shot top-1 11.5% / 9.5% on 200 images (chance 5%), so
    # zero-shot is asserted with a margin below that; Spearman(caption sigma^2, ambiguity) +0.67
    # [+0.63, +0.70] (the official-form recipe gives about -0.8), asserted with a margin.
    c = rep["checks"]
    assert c["training_pcmepp_loss_decreased"] and c["training_infonce_loss_decreased"]
    assert c["training_pcmepp_beats_base_rate"]
    assert c["retrieval_pcmepp_above_chance"] and c["retrieval_infonce_above_chance"], c
    assert c["zeroshot_pcmepp_class_names_separated"] and c["zeroshot_infonce_class_names_separated"]
    best = max(row["top1"] for row in rep["zeroshot"]["pcmepp"]["rows"]
               if row.get("top1") is not None and not row["uses_eval_labels"])
    assert best > 1.6 * rep["zeroshot"]["pcmepp"]["chance_top1"], best
    assert rep["training"]["pcmepp"]["steps"] == 300 and "img_sigma2_end" in rep["training"]["pcmepp"]
    zs = rep["zeroshot"]["pcmepp"]
    assert zs["n_classes"] >= 20 and any(row["name"] == "auto" for row in zs["rows"])
    assert not next(row for row in zs["rows"] if row["name"] == "auto")["uses_eval_labels"]
    sep = zs["class_separation"]
    assert rep["checks"]["zeroshot_pcmepp_class_names_separated"] == (not sep["collapsed"])
    unc = rep["retrieval"]["pcmepp"]["uncertainty"]
    assert 0.3 < unc["spearman_text_uncertainty_vs_ambiguity"] <= 1.0, unc
    assert rep["settings"]["recipes"]["pcmepp"] == "synthetic_tiny_sigma.yaml"
    md = (out / "report.md").read_text()
    assert ("the class prompts embed almost identically" in md) == any(
        (z or {}).get("class_separation", {}).get("collapsed") for z in rep["zeroshot"].values())
    for img in ["figures/training_curves.png", "accuracy_vs_topk.png", "uncertainty_deciles.png"]:
        assert img in md, img
    for line in md.splitlines():  # every embedded figure exists
        if line.startswith("!["):
            assert (out / line.split("](")[1].rstrip(")")).is_file(), line
    # a second run resumes: every step is skipped and the report is rebuilt
    r2 = run_cli("demo", "--quick", "--out", out, timeout=600)
    assert r2.returncode == 0 and r2.stdout.count("skipping") >= 8, r2.stdout
    rep2 = json.loads((out / "report.json").read_text())
    # the resumed report still counts the time the steps took in the first invocation
    assert rep2["steps_seconds_total"] == pytest.approx(rep["steps_seconds_total"], abs=1.0)
    assert rep2["steps_seconds_total"] > 10 and len(rep2["resumed_steps"]) >= 8
    assert "finished by an earlier invocation" in (out / "report.md").read_text()
