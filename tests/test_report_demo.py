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
    with pytest.raises(UserError, match="step 'bad' failed with exit code 2"):
        run_steps(tmp_path, [bad], echo=lambda s: None, stream=False)
    assert not is_done(tmp_path, bad)


def test_demo_rejects_bad_options():
    r = run_cli("demo", "--steps", "0")
    assert r.returncode == 2 and r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1


@pytest.mark.slow(seconds=250)
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
    # the report's claims are checked, each with its evidence (yes / no from the figures above)
    assert c["uncertainty_pcmepp_tracks_ambiguity"], rep["check_evidence"]
    assert set(CLAIMS + VERSUS) <= set(c) and set(rep["check_evidence"]) == set(c)
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


# ----------------------------------------------------------------------------- the report's checks
# The checks are computed from the figures `zsprob eval synthetic` writes. Here those figures come from
# the real evaluation (zsprob.retrieval: CSD ranking, uncertainty deciles, zsprob.retrieval.validity) of
# embeddings built on a real SynthWorld split so that the claims hold: a caption's sigma^2 grows with its
# exact ambiguity, and vaguer captions sit further from their image. Shuffling the caption
# log-variances (the same values, dealt to the wrong captions) must turn the uncertainty claims to "no".

@pytest.fixture(scope="module")
def retrieval_split(tmp_path_factory):
    from zsprob.data.synthetic import generate, load_retrieval_split

    root = tmp_path_factory.mktemp("sw_checks")
    generate(root, image_size=32, num_pretrain=4, num_classify_select=1, num_classify_eval=1, num_retrieval=300,
             num_retrieval_val=4, shard_size=4, progress=False, seed=2)
    return load_retrieval_split(root, "test")


def _sigma_of(ambiguity, dim: int):
    """The constructed model's caption log sigma^2: monotone in the exact ambiguity (ln fraction true)."""
    import numpy as np
    import torch

    return torch.tensor(-6.0 + 0.5 * np.asarray(ambiguity, dtype=np.float64), dtype=torch.float32)[:, None].repeat(1, dim)


def _evaluation(split, *, shuffle_sigma: bool = False, deterministic: bool = False, noise: float = 1.0,
                dim: int = 16) -> dict:
    """metrics.json as `zsprob eval synthetic` lays it out, from the real evaluation of constructed embeddings."""
    import numpy as np
    import torch
    from scipy.stats import rankdata

    from zsprob.data.synthworld.probes import inclusion_pairs
    from zsprob.retrieval import analysis as A
    from zsprob.retrieval import validity as V
    from zsprob.retrieval.embeddings import Embeddings
    from zsprob.retrieval.evaluate import evaluate_embeddings, summary_row
    from zsprob.retrieval.synthetic import ground_truth_uncertainty, synthetic_task

    gen = torch.Generator().manual_seed(0)
    n_img, cap_img = len(split.image_paths), np.asarray(split.caption_image)
    vague = torch.tensor(rankdata(split.caption_ambiguity) / len(cap_img), dtype=torch.float32)[:, None]
    image_mu = torch.nn.functional.normalize(torch.randn(n_img, dim, generator=gen), dim=1)
    caption_mu = torch.nn.functional.normalize(
        image_mu[torch.from_numpy(cap_img)] + noise * (0.2 + vague) * torch.randn(len(cap_img), dim, generator=gen), dim=1)
    pairs = inclusion_pairs(300, seed=0)
    probe_lv = _sigma_of([p[k]["ambiguity"] for k in ("general", "specific") for p in pairs], dim)
    caption_lv = _sigma_of(split.caption_ambiguity, dim)
    if shuffle_sigma:  # the same log-variances, dealt to the wrong captions
        caption_lv = caption_lv[torch.randperm(len(caption_lv), generator=gen)]
        probe_lv = probe_lv[torch.randperm(len(probe_lv), generator=gen)]
    image_lv = torch.full((n_img, dim), -6.0) + 0.1 * torch.randn(n_img, dim, generator=gen)
    emb = Embeddings(image_ids=np.asarray(split.image_ids), caption_ids=np.asarray(split.caption_ids),
                     image_mu=image_mu, caption_mu=caption_mu, caption_image=cap_img,
                     image_logvar=None if deterministic else image_lv, caption_logvar=None if deterministic else caption_lv)
    task = synthetic_task(split)
    res = evaluate_embeddings(emb, task, score="cosine" if deterministic else "csd")
    out = {"metrics": res.metrics, "summary": summary_row(res.metrics), "uncertainty": None,
           "uncertainty_validity": None, "files": {}}
    if deterministic:
        return out
    deciles = A.report_uncertainty(emb, res, task)["deciles"]
    probe_mu = torch.zeros(len(probe_lv), dim)
    half = len(pairs)
    out["uncertainty"] = {"deciles": deciles, "ground_truth": ground_truth_uncertainty(emb, split)}
    out["uncertainty_validity"] = {
        "text_ambiguity": V.ambiguity_spearman(caption_lv.exp().sum(1).numpy(), split.caption_ambiguity,
                                               split.captions),
        "inclusion": V.inclusion_accuracy(probe_mu[:half], probe_lv[:half], probe_mu[half:], probe_lv[half:]),
        "image_conditions": V.condition_uncertainty(image_lv.exp().sum(1).numpy(),
                                                    [m.get("condition") for m in split.image_meta]),
        "deciles": V.decile_trend(deciles)}
    return out


def _demo_out(tmp_path: Path, pcmepp: dict, infonce: dict, zeroshot_all: tuple[float, float] | None = None) -> Path:
    """A demo OUT folder holding the two evaluations (and zero-shot all-80 top-1 of both, n = 1,000)."""
    for name, metrics in (("pcmepp", pcmepp), ("infonce", infonce)):
        (tmp_path / "runs" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "retrieval" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "retrieval" / name / "metrics.json").write_text(json.dumps(metrics))
    for name, top1 in zip(("pcmepp", "infonce"), zeroshot_all or ()):
        compare = tmp_path / "zeroshot" / name / "compare.json"
        compare.parent.mkdir(parents=True, exist_ok=True)
        compare.write_text(json.dumps({"n_eval": 1000, "classes": [f"c{i}" for i in range(20)], "rows": [
            {"name": "all", "metrics": {"top1": top1}, "uses_eval_labels": False}]}))
    return tmp_path


CLAIMS = ("uncertainty_pcmepp_tracks_ambiguity", "uncertainty_pcmepp_inclusion_above_chance",
          "uncertainty_pcmepp_r1_falls_with_caption_uncertainty")
VERSUS = tuple(f"baseline_pcmepp_not_below_infonce_{x}" for x in ("i2t_r1", "t2i_r1", "zeroshot"))


def test_claim_checks_say_yes_when_sigma_tracks_ambiguity_and_no_when_it_is_shuffled(retrieval_split, tmp_path):
    from zsprob.report.demo_checks import binomial_se, decile_sizes
    from zsprob.report.demo_report import build_report

    real = _evaluation(retrieval_split)
    baseline = _evaluation(retrieval_split, deterministic=True)
    report = build_report(_demo_out(tmp_path / "real", real, baseline, (28.2, 24.2)))
    checks, evidence = report["checks"], report["check_evidence"]
    assert all(checks[k] for k in CLAIMS + VERSUS), {k: evidence[k] for k in CLAIMS + VERSUS}
    # each decided on the report's own figures
    overall = real["uncertainty_validity"]["text_ambiguity"]["overall"]
    assert overall["rho"] > 0.3 and overall["lo"] > 0 and f"{overall['rho']:+.3f}" in evidence[CLAIMS[0]]
    bins = real["uncertainty"]["deciles"]["caption queries"]["bins"]
    n_queries = report["retrieval"]["pcmepp"]["t2i"]["n_queries"]
    assert decile_sizes(n_queries, len(bins)) == [b["n"] for b in bins]  # the evaluation's own bins
    first, last = bins[0], bins[-1]
    se = (binomial_se(first["r1"], first["n"]) ** 2 + binomial_se(last["r1"], last["n"]) ** 2) ** 0.5
    assert first["r1"] - last["r1"] > 2 * se and f"{first['r1'] - last['r1']:+.1f} +- {se:.1f}" in evidence[CLAIMS[2]]

    shuffled = _evaluation(retrieval_split, shuffle_sigma=True)
    report = build_report(_demo_out(tmp_path / "shuffled", shuffled, baseline, (28.2, 24.2)))
    assert not any(report["checks"][k] for k in CLAIMS), {k: report["check_evidence"][k] for k in CLAIMS}
    assert abs(shuffled["uncertainty_validity"]["text_ambiguity"]["overall"]["rho"]) < 0.1
    md = (tmp_path / "shuffled" / "report.md").read_text().split("## Checks")[1]
    assert "- uncertainty_pcmepp_tracks_ambiguity: NO (Spearman" in md
    assert "- uncertainty_pcmepp_inclusion_above_chance: NO (general caption more uncertain in" in md


def test_baseline_checks_say_no_when_the_sigma_model_is_more_than_two_se_below(retrieval_split, tmp_path):
    from zsprob.report.demo_checks import binomial_se
    from zsprob.report.demo_report import build_report

    worse = _evaluation(retrieval_split, noise=3.0)  # the same sigma, means further from their images
    better = _evaluation(retrieval_split, deterministic=True, noise=0.5)
    report = build_report(_demo_out(tmp_path, worse, better, (20.0, 28.0)))
    checks = report["checks"]
    assert checks["uncertainty_pcmepp_tracks_ambiguity"] and not any(checks[k] for k in VERSUS), report["check_evidence"]
    i2t = [report["retrieval"][m]["i2t"] for m in ("pcmepp", "infonce")]
    se = (binomial_se(i2t[0]["r@1"], i2t[0]["n_queries"]) ** 2 + binomial_se(i2t[1]["r@1"], i2t[1]["n_queries"]) ** 2) ** 0.5
    assert i2t[0]["r@1"] - i2t[1]["r@1"] < -2 * se
    # zero-shot: 20.0 vs 28.0 on 1,000 images, SE of the difference sqrt((.2 .8 + .28 .72) / 1000) = 1.90 points
    assert "-8.00 +- 1.90" in report["check_evidence"]["baseline_pcmepp_not_below_infonce_zeroshot"]


def test_a_claim_the_report_cannot_compute_is_no(tmp_path):
    from zsprob.report.demo_checks import claim_checks, r1_falls_with_uncertainty

    assert not r1_falls_with_uncertainty([10.0] * 10, 1000)[0]  # flat: Spearman undefined, difference 0
    report = {"retrieval": {"pcmepp": {"uncertainty": {"deciles": {}}, "i2t": {"r@1": 10.0}, "t2i": {"r@1": 4.0}},
                            "infonce": {"i2t": {"r@1": 9.0}, "t2i": {"r@1": 4.0}}}, "zeroshot": {}}
    checks = claim_checks(report)
    assert set(checks) == set(CLAIMS) | set(VERSUS[:2])  # no zero-shot figures: that comparison is not made
    assert all(not ok and why.startswith("not measured") for ok, why in checks.values())


@pytest.mark.parametrize("losses, start, end", [
    ([5.2, 5.1, 5.0, 4.9], 5.15, 4.95),                      # 4 records: the first 2 against the last 2
    ([5.2, 4.9], 5.2, 4.9),                                  # 2 records: one against the other
    ([6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5], 5.0, 1.1666666666666667),  # 7 records: the first 3 and last 3
    ([5.0], None, None),                                      # 1 record: nothing to compare
])
def test_training_summary_of_a_short_run_never_compares_a_record_with_itself(tmp_path, losses, start, end):
    from zsprob.report.demo_report import _training

    run = tmp_path / "runs" / "infonce"
    run.mkdir(parents=True)
    recs = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)] + [{"step": 99, "loss": None}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = _training(tmp_path, "infonce")
    assert t["loss_start"] == pytest.approx(start) if start is not None else t["loss_start"] is None
    assert t["loss_end"] == pytest.approx(end) if end is not None else t["loss_end"] is None
