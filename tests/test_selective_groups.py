"""Selective prediction by group (SynthWorld's rendering conditions): the AUROC against the reference group
by scikit-learn and by the exact rank count, the flagged share by hand, and the condition of each
classification image read from the world's seed against the rendered sample."""
from __future__ import annotations

import numpy as np
import pytest

from zsprob.errors import UserError
from zsprob.utils.selective import low_confidence_auroc, selective_by_group, selective_groups_table


def test_group_auroc_and_flagged_share_by_hand():
    groups = ["normal"] * 6 + ["dark"] * 5 + ["tiny"] * 2
    conf = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.1, 0.2, 0.3, 0.55, 0.95, 0.0, 1.0])
    correct = np.array([1, 1, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0], dtype=bool)
    out = selective_by_group(correct, {"s": conf, "indicator": -(np.array(groups) == "dark").astype(float)}, groups,
                             flag_share=0.2, n_boot=50)
    g = out["groups"]
    assert list(g) == ["normal", "dark", "tiny"] and g["normal"] == {"n": 6, "accuracy": pytest.approx(4 / 6)}
    assert g["tiny"] == {"n": 2, "accuracy": 0.5}  # fewer than 5 items: n and accuracy only
    # dark vs normal: pairs (dark less confident than normal) of 5 x 6: 0.1, 0.2, 0.3 beat all 6; 0.55 beats
    # 0.9, 0.8, 0.7, 0.6 (4); 0.95 none -> (18 + 4) / 30
    s = g["dark"]["scores"]["s"]
    assert s["auroc_vs_reference"]["value"] == pytest.approx(22 / 30)
    # the 20% least confident of 13 items = the 3 lowest (0.0, 0.1, 0.2): two of the five dark images
    assert s["flagged_share"]["value"] == pytest.approx(2 / 5) and s["mean_confidence"] == pytest.approx(0.42)
    lo, hi = s["auroc_vs_reference"]["ci95"]
    assert lo <= 22 / 30 <= hi
    assert g["dark"]["scores"]["indicator"]["auroc_vs_reference"]["value"] == 1.0
    table = selective_groups_table(out, scores=("s",))
    assert "| dark | 5 | 40.0 | 0.73 [" in table and "| tiny | 2 | 50.0 | - | - |" in table
    with pytest.raises(UserError, match="3 group labels for 13 predictions"):
        selective_by_group(correct, {"s": conf}, groups[:3])


def test_rank_auroc_equals_scikit_learn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 6, 40).astype(float), rng.integers(1, 8, 70).astype(float)
    want = roc_auc_score(np.r_[np.ones(40), np.zeros(70)], -np.r_[a, b])
    assert low_confidence_auroc(a, b) == pytest.approx(want, abs=1e-12)


def test_classify_conditions_match_the_rendered_samples(tmp_path):
    from zsprob.data.classification import build_classification_dataset
    from zsprob.data.synthetic import SynthWorld, generate
    from zsprob.data.synthworld.readers import classify_conditions

    generate(tmp_path / "sw", image_size=32, num_pretrain=0, num_classify_select=1, num_classify_eval=3,
             num_retrieval=0, num_retrieval_val=0, seed=7, progress=False)
    ds = build_classification_dataset("synthetic", tmp_path / "sw", split="eval")
    paths = [p for p, _ in ds.samples]
    got = classify_conditions(tmp_path / "sw", "eval", paths)
    world = SynthWorld(7, 32)
    for path, label, condition in zip(paths, ds.targets, got):
        j = int(str(path).rsplit("_", 1)[1].split(".")[0])
        assert world.sample("classify-eval", j * 20 + label).meta["condition"] == condition
    assert len(set(got)) > 1
    with pytest.raises(UserError, match="not a SynthWorld classification image"):
        classify_conditions(tmp_path / "sw", "eval", [tmp_path / "circle" / "square_00001.jpg"])
    with pytest.raises(UserError, match="no readable SynthWorld manifest"):
        classify_conditions(tmp_path, "eval", paths)


@pytest.mark.slow(seconds=25)
def test_compare_on_synthworld_writes_the_breakdown_the_plot_and_the_baseline_rows(tmp_path):
    import json

    from conftest import TINY_TOWERS, run_cli, small_world

    w = small_world(tmp_path, seed=3, model={**TINY_TOWERS, "embed_dim": 16},
                    num_pretrain=0, num_classify_select=2, num_classify_eval=4, num_retrieval=0, num_retrieval_val=0)
    out = tmp_path / "zs" / "compare.json"
    r = run_cli("zeroshot", "synthetic", "--checkpoint", w["ckpt"], "--root", w["root"], "--compare",
                "--device", "cpu", "--workers", "0", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    groups = res["selective_by_condition"]["all"]["groups"]
    assert sum(g["n"] for g in groups.values()) == 80 and "normal" in groups
    assert set(res["selective"]["all"]["scores"]) >= {"msp", "entropy", "margin", "image_sigma2", "class_sigma2"}
    rows = {row["name"]: row for row in res["rows"]}
    for name in ("linear-probe", "tip-adapter"):
        assert rows[name]["label_split"] == "selection split" and rows[name]["reads_eval_labels"] is False
        assert rows[name]["paired_vs_all"]["n"] == 80
    assert (out.parent / "risk_coverage.png").stat().st_size > 1000
    assert "By rendering condition, all" in (out.parent / "compare.md").read_text()


def test_flagged_share_breaks_ties_by_expectation():
    from zsprob.utils.selective import flagged_probability

    # a constant score flags every item with probability n_flag / n
    assert np.allclose(flagged_probability(np.ones(10), 2), 0.2)
    # 0.1 < (0.5 x 3) < 0.9 x 2 with 2 places: the lowest is in, the tie of three shares the one left
    p = flagged_probability([0.5, 0.9, 0.1, 0.5, 0.9, 0.5], 2)
    assert np.allclose(p, [1 / 3, 0, 1, 1 / 3, 0, 1 / 3]) and p.sum() == pytest.approx(2)
    groups = ["normal"] * 5 + ["g"] * 5
    out = selective_by_group(np.ones(10, dtype=bool), {"c": np.ones(10)}, groups, n_boot=20)
    assert out["groups"]["g"]["scores"]["c"]["flagged_share"]["value"] == pytest.approx(0.2)
    assert out["groups"]["g"]["scores"]["c"]["auroc_vs_reference"]["value"] == pytest.approx(0.5)
