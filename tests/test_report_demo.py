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


def test_all_methods_only_adds_steps_after_the_main_ones(tmp_path):
    from zsprob.report.demo import DEMO_EXTRA_RUNS, DemoSettings, plan
    from zsprob.utils.paths import configs_dir

    base = plan(tmp_path, DemoSettings.make(False))
    full = plan(tmp_path, DemoSettings.make(False, all_methods=True))
    # same names and arguments for the main steps: --all-methods on an existing OUT re-runs none of them
    assert [(st.name, st.args) for st in full[:len(base)]] == [(st.name, st.args) for st in base]
    extra = full[len(base):]
    assert [st.name for st in extra] == [f"{kind}-{name}" for name in DEMO_EXTRA_RUNS
                                         for kind in ("pretrain", "eval", "zeroshot-compare")]
    args = {st.name: st.args for st in full}

    def value(name, flag):
        return args[name][args[name].index(flag) + 1]

    assert Path(value("pretrain-pcmepp", "--config")).name == "synthetic_tiny_sigma.yaml"
    for name, (recipe, method, _) in DEMO_EXTRA_RUNS.items():
        assert value(f"pretrain-{name}", "--config") == str(configs_dir() / recipe) and Path(configs_dir() / recipe).is_file()
        assert value(f"pretrain-{name}", "--method") == method
        for flag in ("--steps", "--batch-size", "--seed", "--shards"):  # the main models' budget and data
            assert value(f"pretrain-{name}", flag) == value("pretrain-infonce", flag)
        model = str(tmp_path / "methods" / name / "run" / "model")
        assert value(f"eval-{name}", "--checkpoint") == model == value(f"zeroshot-compare-{name}", "--checkpoint")
        assert value(f"eval-{name}", "--score") == "csd" and "--no-corruption" in args[f"eval-{name}"]
    assert [value("pretrain-pcmepp-official", "--method"), value("pretrain-prolip", "--method")] == ["pcmepp", "prolip"]
    assert "model.overrides.sigma_head=unc" in args["pretrain-prolip"]


def test_the_method_table_reads_every_objectives_eval_and_compare_files(tmp_path):
    import numpy as np
    import torch

    from zsprob.report.demo_report import build_report
    from zsprob.retrieval import validity as V

    rng = np.random.default_rng(0)
    n = 300
    captions = [" ".join(["w"] * int(k)) for k in rng.integers(2, 4, size=n)]
    ambiguity = rng.random(n)
    gauss = [(torch.randn(n, 4), torch.randn(n, 4) * 0.1) for _ in range(2)]
    deciles = {"caption queries": {"bins": [{"r1": float(20 - 2 * b)} for b in range(10)],
                                   "spearman_bins": {"rho": -1.0}, "spearman_queries": {"rho": -0.3}}}

    def write(folder: Path, compare: Path, i2t: float, sigma_follows: bool | None, all80: float, single: float):
        caption = {"i2t": {"r@1": i2t, "r@5": 2 * i2t, "r@10": 3 * i2t},
                   "t2i": {"r@1": i2t / 3, "r@5": i2t, "r@10": 1.5 * i2t}, "rsum": 8 * i2t}
        metrics = {"metrics": {"setup": {"score": "csd" if sigma_follows is not None else "cosine"},
                               "caption": caption}}
        if sigma_follows is not None:
            u = ambiguity + (0.0 if sigma_follows else -2 * ambiguity)
            metrics["uncertainty_validity"] = {
                "text_ambiguity": V.ambiguity_spearman(u, ambiguity, captions),
                "inclusion": V.inclusion_accuracy(*gauss[0], *gauss[1], rng.random(n) < 0.5),
                "image_conditions": V.condition_uncertainty(rng.random(n), np.where(np.arange(n) < 150, "normal", "dark")),
                "deciles": V.decile_trend(deciles)}
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps(metrics))
        compare.parent.mkdir(parents=True, exist_ok=True)
        compare.write_text(json.dumps({"rows": [
            {"name": "all", "metrics": {"top1": all80}, "uses_eval_labels": False},
            {"name": "single", "metrics": {"top1": single}, "uses_eval_labels": False},
            {"name": "auto", "uses_eval_labels": False},  # skipped (no metrics): a deterministic model
            {"name": "oracle", "metrics": {"top1": 99.0}, "uses_eval_labels": True}]}))

    write(tmp_path / "retrieval" / "infonce", tmp_path / "zeroshot" / "infonce" / "compare.json", 26.0, None, 25.0, 25.5)
    write(tmp_path / "retrieval" / "pcmepp", tmp_path / "zeroshot" / "pcmepp" / "compare.json", 24.0, True, 28.0, 27.0)
    write(tmp_path / "methods" / "prolip" / "retrieval", tmp_path / "methods" / "prolip" / "compare.json", 17.0, False,
          20.0, 20.3)
    for m in ("pcmepp", "infonce"):
        (tmp_path / "runs" / m).mkdir(parents=True)
    report = build_report(tmp_path)
    rows = report["methods"]
    assert list(rows) == ["infonce", "pcmepp", "prolip"]
    assert rows["pcmepp"]["spearman"] == pytest.approx(1.0) and rows["prolip"]["spearman"] == pytest.approx(-1.0)
    assert (rows["pcmepp"]["bins_positive"], rows["prolip"]["bins_positive"], rows["pcmepp"]["bins_counted"]) == (2, 0, 2)
    assert rows["pcmepp"]["caption_decile_r1"] == [20.0, 2.0] and "spearman" not in rows["infonce"]
    # the best strategy that reads no evaluation labels, against all 80 (the oracle's 99% is not it)
    assert rows["pcmepp"]["best_label_free"] == {"name": "single", "gain": -1.0}
    assert rows["prolip"]["best_label_free"] == {"name": "single", "gain": 0.3}
    md = (tmp_path / "report.md").read_text()
    assert "## 5. Every objective on the same budget" in md
    section = md.split("## 5. Every objective on the same budget")[1].split("\n## ")[0].splitlines()
    line = next(x for x in section if x.startswith("| ProLIP |"))
    assert "--method prolip --set model.overrides.sigma_head=unc" in line and "-1.00 [" in line and "| 0/2 |" in line
    assert "| 17.0 / 5.67 | 20.0 | +0.3 (single) |" in line
    assert next(x for x in section if x.startswith("| InfoNCE |")).count("(no sigma)") == 1
    # without OUT/methods the section is left out
    import shutil

    shutil.rmtree(tmp_path / "methods")
    assert "methods" not in build_report(tmp_path)
