"""Uncertainty-validity evidence: probe generators against the grammar's predicate, the analyses on
hand-built embeddings whose answers are known, and `zsprob eval synthetic` end to end."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import run_cli
from scipy.stats import rankdata, spearmanr

from zsprob.data.synthworld.captions import ambiguity, caption_key, caption_matches
from zsprob.data.synthworld.probes import crop_scenes, inclusion_pairs
from zsprob.data.synthworld.scene import VOCAB
from zsprob.data.synthetic import SynthWorld, make_scene
from zsprob.retrieval import validity as V


TINY = {  # a one-layer random Gaussian model, as in tests/test_retrieval_synthetic.py
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def pairs():
    return inclusion_pairs(300, seed=3)


def _refuting_scene(general: dict, specific: dict) -> dict:
    """A scene true of ``general`` but not of ``specific`` (the strictness witness)."""
    if len(specific["objects"]) > len(general["objects"]):  # conjunction: drop the second object
        return make_scene([dict(general["objects"][0], shape=specific["objects"][0]["shape"])])
    obj = dict(specific["objects"][0])
    for attr in set(obj) - set(general["objects"][0]):
        obj[attr] = next(v for v in VOCAB[attr] if v != obj[attr])
    return make_scene([obj])


def test_inclusion_pairs_are_exact_strict_refinements(pairs):
    assert len(pairs) == 300 and len({(p["general"]["text"], p["specific"]["text"]) for p in pairs}) == 300
    assert {p["kind"] for p in pairs} == {"attribute", "conjunction"}
    world = SynthWorld(seed=0, image_size=32)
    prior_scenes = [world.scene("probe", i)[0] for i in range(300)]
    for p in pairs:
        general, specific = p["general"], p["specific"]
        assert general["ambiguity"] == ambiguity(general, caption_key(general)) > specific["ambiguity"]
        witness = make_scene([dict(o) for o in specific["objects"]])
        assert caption_matches(specific, witness) and caption_matches(general, witness)
        refuting = _refuting_scene(general, specific)
        assert caption_matches(general, refuting) and not caption_matches(specific, refuting)
        for scene in prior_scenes:  # every scene true of the specific caption is true of the general one
            assert not caption_matches(specific, scene) or caption_matches(general, scene)
        assert p["same_word_count"] == (len(general["text"].split()) == len(specific["text"].split()))
    assert inclusion_pairs(50, seed=3) == pairs[:50]  # deterministic per seed


def test_crop_scenes_have_a_in_both_and_b_only_in_the_second():
    trials = crop_scenes(40, seed=1)
    world = SynthWorld(seed=1, image_size=48)
    for t in trials:
        a, ab = t["scene_a"], t["scene_ab"]
        assert a["objects"] == ab["objects"][:1] and len(ab["objects"]) == 2
        assert ab["objects"][1]["shape"] != a["objects"][0]["shape"]
        assert a["render"]["objects"] == ab["render"]["objects"][:1] and a["background"] == ab["background"]
        assert a["condition"] == ab["condition"] == "normal"
        assert caption_matches(t["caption_a"], a) and caption_matches(t["caption_a"], ab)
        assert caption_matches(t["caption_ab"], ab) and not caption_matches(t["caption_ab"], a)
        assert t["caption_ab"]["text"].startswith(t["caption_a"]["text"] + " and ")
    image_a, image_ab = (np.asarray(world.render(trials[0][k]), dtype=int) for k in ("scene_a", "scene_ab"))
    changed = (image_a != image_ab).any(-1).mean()
    assert 0 < changed < 0.5  # B's pixels differ, the rest (A and the background) is identical


def test_bootstrap_spearman_matches_scipy_and_its_interval_contains_it():
    rng = np.random.default_rng(0)
    x = rng.normal(size=400)
    y = 0.5 * x + rng.normal(size=400)
    y[::7] = np.round(y[::7])  # some ties
    stats = V.bootstrap_spearman(x, y, seed=1)
    assert stats["rho"] == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    # the resamples' vectorised rank correlation is the value scipy gives (and the point value it replaced)
    hand = V._rowwise_spearman(rankdata(x)[None], rankdata(y)[None])[0]
    assert hand == pytest.approx(stats["rho"], abs=1e-12)
    assert stats["lo"] < stats["rho"] < stats["hi"] and stats["n"] == 400
    assert 0.05 < stats["hi"] - stats["lo"] < 0.4  # about 4 standard errors of rho at n = 400
    assert V.bootstrap_spearman(x, y, seed=1) == stats  # seeded
    assert V.bootstrap_spearman(x, -x)["rho"] == pytest.approx(-1.0)
    assert math.isnan(V.bootstrap_spearman(x, np.ones(400))["rho"])


def _logvar_from(values, dim: int = 8) -> torch.Tensor:
    """logvar whose ||sigma^2||_1 = dim * exp(value): monotone in ``value``."""
    return torch.tensor(np.asarray(values, dtype=np.float64), dtype=torch.float32)[:, None].repeat(1, dim)


def test_ambiguity_spearman_is_one_when_sigma_follows_ambiguity_and_minus_one_reversed():
    rng = np.random.default_rng(2)
    captions = [" ".join(["w"] * int(k)) for k in rng.integers(2, 5, size=600)]
    amb = -rng.random(600) * 10
    u = np.exp(_logvar_from(amb)).sum(1).numpy()
    res = V.ambiguity_spearman(u, amb, captions)
    assert res["overall"]["rho"] == pytest.approx(1.0) and res["positive_in_counted_bins"]
    assert set(res["by_word_count"]) == {"2", "3", "4"}
    for words, stats in res["by_word_count"].items():
        assert stats["rho"] == pytest.approx(1.0)
        assert stats["n"] == sum(len(c.split()) == int(words) for c in captions)
        assert stats["counts"] == (stats["n"] >= V.MIN_BIN)
    reversed_ = V.ambiguity_spearman(-u, amb, captions)
    assert reversed_["overall"]["rho"] == pytest.approx(-1.0) and not reversed_["positive_in_counted_bins"]


def test_inclusion_accuracy_is_one_when_sigma_follows_ambiguity_and_zero_reversed(pairs):
    general_amb = [p["general"]["ambiguity"] for p in pairs]
    specific_amb = [p["specific"]["ambiguity"] for p in pairs]
    same = [p["same_word_count"] for p in pairs]
    mu = torch.randn(len(pairs), 8, generator=torch.Generator().manual_seed(0)) * 0.1
    for sign, expected in ((1.0, 1.0), (-1.0, 0.0)):
        res = V.inclusion_accuracy(mu, _logvar_from(np.multiply(sign, general_amb)), mu,
                                   _logvar_from(np.multiply(sign, specific_amb)), same)
        for name in ("inclusion", "sigma"):
            assert res[name]["accuracy"] == expected and res[name]["se"] == 0.0 and res[name]["n"] == len(pairs)
        assert res["by_word_count"]["same"]["sigma"]["n"] == sum(same)
    # half right: the binomial standard error sqrt(p (1 - p) / n)
    flip = np.arange(len(pairs)) % 2 == 0
    lv_g = _logvar_from(np.where(flip, general_amb, specific_amb))
    lv_s = _logvar_from(np.where(flip, specific_amb, general_amb))
    res = V.inclusion_accuracy(mu, lv_g, mu, lv_s)
    assert res["sigma"]["accuracy"] == pytest.approx(0.5)
    assert res["sigma"]["se"] == pytest.approx(math.sqrt(0.25 / len(pairs)))


def test_condition_uncertainty_differences_and_welch_errors():
    rng = np.random.default_rng(4)
    conds = np.array(["normal"] * 200 + ["blurry"] * 50 + ["dark"] * 40 + ["bright"] * 30)
    u = np.concatenate([rng.normal(1, 0.1, 200), rng.normal(1.5, 0.2, 50), rng.normal(0.7, 0.1, 40),
                        rng.normal(2, 0.1, 30)])
    res = V.condition_uncertainty(u, conds)
    blurry = res["by_condition"]["blurry"]
    assert blurry["diff"] == pytest.approx(u[200:250].mean() - u[:200].mean())
    assert blurry["se"] == pytest.approx(math.sqrt(u[200:250].var(ddof=1) / 50 + u[:200].var(ddof=1) / 200))
    assert blurry["n"] == 50 and res["reference"]["n"] == 200
    assert res["more_uncertain"] == 1 and res["of"] == 8  # bright is not one of the 8 listed conditions


def test_crop_test_selection_and_uncertainty_on_known_gaussians():
    n, dim = 30, 6
    eye = 3.0 * torch.eye(dim)  # means far apart against the variances: every similarity picks the same mean
    a_mu, b_mu = eye[0].repeat(n, 1), eye[1].repeat(n, 1)
    small, large = torch.full((n, dim), -1.2), torch.full((n, dim), -1.0)
    res = V.crop_test((a_mu, small), (b_mu, large), (a_mu, large), (b_mu, small))
    for name in V.CROP_SIMILARITIES:
        for query in ("caption_a", "caption_ab", "image_a", "image_ab"):
            assert res["selection"][name][query]["accuracy"] == 1.0 and res["selection"][name][query]["n"] == n
    assert res["uncertainty"]["image_ab"]["mean"] == pytest.approx(dim * math.exp(-1.0))
    assert res["uncertainty"]["caption_ab"]["mean"] == pytest.approx(dim * math.exp(-1.2))
    assert res["image_ab_more_uncertain"]["accuracy"] == 1.0 and res["caption_ab_less_uncertain"]["accuracy"] == 1.0
    swapped = V.crop_test((b_mu, small), (a_mu, large), (a_mu, large), (b_mu, small))
    assert all(swapped["selection"][name][q]["accuracy"] == 0.0 for name in V.CROP_SIMILARITIES
               for q in ("caption_a", "caption_ab", "image_a", "image_ab"))


@pytest.mark.slow
def test_eval_synthetic_writes_the_validity_section(tmp_path):
    from zsprob.data.synthetic import generate
    from zsprob.models import create_model, save

    torch.manual_seed(0)
    checkpoint = save(create_model("zsprob-tiny", open_clip_cfg=TINY, seed=0), tmp_path / "ckpt")
    root = tmp_path / "sw"
    generate(root, image_size=32, num_pretrain=4, num_classify_select=1, num_classify_eval=1, num_retrieval=40,
             num_retrieval_val=4, shard_size=4, progress=False, seed=1)
    out = tmp_path / "eval" / "metrics.json"
    r = run_cli("eval", "synthetic", "--checkpoint", checkpoint, "--root", root, "--no-corruption", "--out", out,
                "--batch-size", "32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "uncertainty validity" in r.stdout and "inclusion accuracy, inclusion test" in r.stdout
    validity = json.loads(out.read_text())["uncertainty_validity"]
    assert validity["text_ambiguity"]["overall"]["n"] == 200
    assert validity["inclusion"]["inclusion"]["n"] == validity["setup"]["n_pairs"] == 1000
    assert validity["crop_test"]["uncertainty"]["image_a"]["n"] == validity["setup"]["n_crops"]
    assert set(validity["crop_test"]["selection"]) == set(V.CROP_SIMILARITIES)
    assert len(validity["deciles"]) == 2
    assert all(len(trend["r1"]) == 10 and "falling" in trend for trend in validity["deciles"].values())
    assert sum(c["n"] for c in validity["image_conditions"]["by_condition"].values()) + \
        validity["image_conditions"]["reference"]["n"] == 40
    # --seed draws other inclusion pairs and crop scenes (pairs a recipe was not chosen on); retrieval is unchanged
    out3 = tmp_path / "eval3" / "metrics.json"
    r = run_cli("eval", "synthetic", "--checkpoint", checkpoint, "--root", root, "--no-corruption", "--out", out3,
                "--batch-size", "32", "--seed", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    res3 = json.loads(out3.read_text())
    assert res3["uncertainty_validity"]["setup"]["seed"] == 3 and validity["setup"]["seed"] == 0
    assert res3["uncertainty_validity"]["inclusion"]["examples"] != validity["inclusion"]["examples"]
    assert res3["uncertainty_validity"]["crop_test"]["examples"] != validity["crop_test"]["examples"]
    assert res3["metrics"]["caption"] == json.loads(out.read_text())["metrics"]["caption"]


def test_validity_table_shows_every_analysis_and_the_demo_report_prints_it(tmp_path):
    rng = np.random.default_rng(5)
    n, dim = 200, 4
    gauss = [(torch.randn(n, dim), torch.randn(n, dim) * 0.1) for _ in range(4)]
    captions = [" ".join(["w"] * int(k)) for k in rng.integers(2, 4, size=n)]
    deciles = {"image queries": {"bins": [{"r1": float(10 - b)} for b in range(10)],
                                 "spearman_bins": {"rho": -1.0}, "spearman_queries": {"rho": -0.2}}}
    validity = {"text_ambiguity": V.ambiguity_spearman(rng.random(n), rng.random(n), captions),
                "inclusion": V.inclusion_accuracy(*gauss[0], *gauss[1], rng.random(n) < 0.5),
                "image_conditions": V.condition_uncertainty(rng.random(n), np.where(np.arange(n) < 100, "normal", "dark")),
                "crop_test": V.crop_test(*gauss), "deciles": V.decile_trend(deciles)}
    assert validity["deciles"]["image queries"]["falling"]
    table = V.validity_table(validity, "pcmepp")
    for row in ("Spearman(text u, ambiguity), all", "... 2 words", "inclusion accuracy, sigma comparison",
                "... same word count", "conditions more uncertain than normal", "1 of 8", "dark",
                "selection -kl", "selection -minkl", "selection -w2", "R@1 per u decile, image queries"):
        assert row in table, row
    # the demo report reads it from the eval step's metrics.json into report.json and report.md
    from zsprob.report.demo_report import build_report

    recall = {"r@1": 2.0, "r@5": 4.0, "r@10": 12.0}
    (tmp_path / "runs" / "pcmepp").mkdir(parents=True)
    (tmp_path / "retrieval" / "pcmepp").mkdir(parents=True)
    (tmp_path / "retrieval" / "pcmepp" / "metrics.json").write_text(
        json.dumps({"metrics": {"caption": {"i2t": recall, "t2i": recall, "rsum": 36.0}}, "uncertainty_validity": validity,
                    "validity_table": table}))
    report = build_report(tmp_path)
    assert report["retrieval"]["pcmepp"]["uncertainty_validity"]["inclusion"]["sigma"]["n"] == n
    markdown = (tmp_path / "report.md").read_text()
    assert "## Uncertainty validity" in markdown and "| uncertainty validity (pcmepp) |" in markdown


def test_undefined_figures_print_as_na_and_are_written_as_json_null(tmp_path):
    """A condition seen once has no standard error and a two-caption bin no interval: the table says
    "n/a" (never "+-nan") and the JSON holds null (NaN is not JSON)."""
    from zsprob.utils.io import append_jsonl, atomic_write_json

    rng = np.random.default_rng(1)
    n = 60
    conditions = np.array(["normal"] * (n - 1) + ["blurry"])
    cond = V.condition_uncertainty(rng.random(n), conditions)
    assert math.isnan(cond["by_condition"]["blurry"]["se"])
    captions = ["w w"] * (n - 2) + ["w w w", "w w w"]  # a bin of two captions: no Spearman interval
    amb = V.ambiguity_spearman(rng.random(n), rng.random(n), captions)
    gauss = [(torch.randn(n, 4), torch.randn(n, 4) * 0.1) for _ in range(4)]
    validity = {"text_ambiguity": amb, "inclusion": V.inclusion_accuracy(*gauss[0], *gauss[1], rng.random(n) < 0.5),
                "image_conditions": cond, "crop_test": V.crop_test(*gauss),
                "deciles": V.decile_trend({"image queries": {"bins": [{"r1": 1.0}] * 10,
                                                             "spearman_bins": {"rho": 0.0},
                                                             "spearman_queries": {"rho": 0.0}}})}
    table = V.validity_table(validity, "m")
    assert "nan" not in table.lower() and "blurry" in table and "+-n/a" in table
    atomic_write_json(tmp_path / "v.json", {"v": validity, "inf": float("inf"), "arr": np.array([1.0, np.nan])})
    append_jsonl(tmp_path / "m.jsonl", {"loss": float("nan"), "t": torch.tensor(float("-inf"))})

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")
    back = json.loads((tmp_path / "v.json").read_text(), parse_constant=refuse)
    assert back["v"]["image_conditions"]["by_condition"]["blurry"]["se"] is None
    assert back["inf"] is None and back["arr"] == [1.0, None]
    assert json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=refuse) == {"loss": None, "t": None}
    # a table made again from the JSON (None where NaN was) reads the same
    assert V.validity_table(back["v"], "m") == table
