"""Paired statistics of --compare: exact McNemar against scipy and a hand count, the bootstrap
interval against a direct image resampling, the minimum detectable effect formula, and the rows."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from zsprob.zeroshot.paired import (Z_80, Z_975, bootstrap_ci, mcnemar_exact, min_detectable_effect,
                                    paired_stats)


@pytest.mark.parametrize("n10,n01", [(0, 0), (1, 0), (0, 5), (3, 9), (7, 7), (12, 30), (150, 181), (2000, 2100)])
def test_mcnemar_exact_equals_scipy_binomtest(n10, n01):
    want = 1.0 if n10 + n01 == 0 else binomtest(n10, n10 + n01, 0.5, alternative="two-sided").pvalue
    assert mcnemar_exact(n10, n01) == pytest.approx(want, rel=1e-10, abs=1e-300)


def _mcnemar_log_gamma(n10, n01):
    """The hand-written tail sum zsprob used before it called scipy: 2 P[Binom(n, 1/2) <= min(n10, n01)]."""
    n, low = n10 + n01, min(n10, n01)
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) - n * math.log(2.0)
            for j in range(low + 1)]
    top = max(logs)
    return min(1.0, 2.0 * math.exp(top) * sum(math.exp(t - top) for t in logs))


@pytest.mark.parametrize("n10,n01", [(1, 0), (0, 5), (3, 9), (7, 7), (12, 30), (150, 181), (2000, 2100)])
def test_mcnemar_equals_the_hand_sum_it_replaces(n10, n01):
    assert mcnemar_exact(n10, n01) == pytest.approx(_mcnemar_log_gamma(n10, n01), rel=1e-9, abs=1e-300)


def test_mcnemar_by_hand():
    # 1 vs 5 discordant: P[Binom(6, 1/2) <= 1] = (1 + 6) / 64; two-sided doubles it: 14 / 64
    assert mcnemar_exact(1, 5) == pytest.approx(14 / 64, rel=1e-12)
    assert mcnemar_exact(5, 1) == pytest.approx(14 / 64, rel=1e-12)
    # 0 vs 3: 2 * 1/8
    assert mcnemar_exact(0, 3) == pytest.approx(0.25, rel=1e-12)
    assert mcnemar_exact(4, 4) == 1.0


def test_paired_stats_counts_and_diff_by_hand():
    a = [1, 1, 0, 0, 1, 1, 0, 1, 1, 1]
    r = [1, 0, 1, 0, 0, 0, 0, 1, 1, 1]
    out = paired_stats(a, r, samples=2000, seed=3)
    # a right where r wrong: images 1, 4, 5 (n10 = 3); r right where a wrong: image 2 (n01 = 1)
    assert (out["n10"], out["n01"], out["n"]) == (3, 1, 10)
    assert out["diff"] == pytest.approx(20.0)                      # 100 * (3 - 1) / 10
    assert out["mcnemar_p"] == pytest.approx(binomtest(3, 4, 0.5).pvalue)
    assert out["discordance"] == pytest.approx(0.4)
    assert out["mde"] == pytest.approx(100 * (Z_975 + Z_80) * math.sqrt(0.4 / 10))
    low, high = out["ci95"]
    assert low <= out["diff"] <= high
    assert paired_stats(a, r, samples=2000, seed=3)["ci95"] == out["ci95"]   # seeded


def test_bootstrap_matches_resampling_the_images():
    rng = np.random.default_rng(0)
    n = 400
    a = rng.random(n) < 0.6
    r = np.where(rng.random(n) < 0.7, a, ~a)
    out = paired_stats(a, r, samples=20000, seed=1)
    # the direct paired bootstrap: resample image indices, take the mean difference
    idx = np.random.default_rng(2).integers(0, n, size=(20000, n))
    d = 100.0 * (a.astype(float) - r.astype(float))
    direct = np.percentile(d[idx].mean(1), [2.5, 97.5])
    assert out["ci95"][0] == pytest.approx(direct[0], abs=0.35)
    assert out["ci95"][1] == pytest.approx(direct[1], abs=0.35)
    # and the normal interval (SE of the paired difference) agrees to the bootstrap's noise
    se = d.std(ddof=0) / math.sqrt(n)
    assert out["ci95"][0] == pytest.approx(d.mean() - 1.96 * se, abs=0.5)
    with pytest.raises(ValueError):
        bootstrap_ci(0, 0, 0)


def test_min_detectable_effect_formula():
    # the normal approximation: 2.80 * sqrt(d / N); 1000 images, 10% discordance -> 2.80 points
    assert min_detectable_effect(0.1, 1000) == pytest.approx(100 * 2.8016 * math.sqrt(1e-4), rel=1e-3)
    assert min_detectable_effect(0.0, 100) == min_detectable_effect(0.01, 100)    # floor: one image


def test_compare_rows_carry_paired_vs_all():
    from test_zeroshot_selection import make_world
    from zsprob.zeroshot.classify import compare_on_features
    from zsprob.zeroshot.metrics import top1_hits

    bank, sel, ev = make_world()
    res = compare_on_features(bank, ev, sel, strategies=["all", "single", "fusion", "oracle"])
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["all"]["paired_vs_all"]["diff"] == 0.0 and rows["all"]["paired_vs_all"]["mcnemar_p"] == 1.0
    single = rows["single"]
    want = top1_hits(res["selections"]["single"], ev).numpy().astype(int) - \
        top1_hits(res["selections"]["all"], ev).numpy().astype(int)
    assert single["paired_vs_all"]["diff"] == pytest.approx(100.0 * want.mean())
    assert single["paired_vs_all"]["diff"] == pytest.approx(single["metrics"]["top1"] - rows["all"]["metrics"]["top1"])
    assert single["paired_vs_all"]["n10"] == int((want == 1).sum())
    mde = res["min_detectable_effect"]
    assert mde["n_images"] == len(ev) and mde["mde_top1_points"] > 0
    assert "vs all [95% CI]" in res["table"] and "McNemar p" in res["table"]


def test_demo_report_shows_the_paired_columns_and_the_detectable_effect(tmp_path):
    from test_zeroshot_selection import make_world
    from zsprob.report.demo_report import build_report
    from zsprob.zeroshot.classify import compare_on_features

    bank, sel, ev = make_world()
    out = tmp_path / "demo"
    (out / "runs" / "pcmepp").mkdir(parents=True)
    res = compare_on_features(bank, ev, sel, strategies=["all", "single", "fusion"],
                              out_dir=out / "zeroshot" / "pcmepp", write_selections=False)
    report = build_report(out)
    zs = report["zeroshot"]["pcmepp"]
    rows = {r["name"]: r for r in zs["rows"]}
    assert rows["single"]["paired_vs_all"] == res["rows"][1]["paired_vs_all"]
    mde = res["min_detectable_effect"]
    text = (out / "report.md").read_text()
    assert "vs all [95% CI]" in text and "McNemar p" in text
    assert f"is {mde['mde_top1_points']:.2f} top-1 points" in text and f"With {len(ev)} evaluation images" in text
