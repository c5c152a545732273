"""ProbVLM's -SR^2 of the uncertainty deciles, against hand computations."""
from __future__ import annotations

import math

import numpy as np
import pytest

from zsprob.retrieval.analysis import deciles_table, neg_sr2, uncertainty_deciles


def test_neg_sr2_by_hand():
    # R@1 per bin 1..4: 40, 30, 30, 10. Least squares: xbar 2.5, ybar 27.5,
    # Sxy = (-1.5)(12.5) + (-0.5)(2.5) + (0.5)(2.5) + (1.5)(-17.5) = -45, Sxx = 5 -> slope -9;
    # fitted 41, 32, 23, 14; SS_res = 1 + 4 + 49 + 16 = 70, SS_tot = 156.25 + 6.25 + 6.25 + 306.25 = 475
    # R^2 = 1 - 70 / 475; Spearman: ranks of y (4, 2.5, 2.5, 1) vs (1, 2, 3, 4) -> Pearson of the ranks
    r = neg_sr2([40, 30, 30, 10])
    r2 = 1 - 70 / 475
    ry = np.array([4, 2.5, 2.5, 1]) - 2.5
    rx = np.array([1, 2, 3, 4]) - 2.5
    s = (rx * ry).sum() / math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    assert r["r2"] == pytest.approx(r2, abs=1e-12)
    assert r["s"] == pytest.approx(s, abs=1e-12) and s == pytest.approx(-4.5 / math.sqrt(5 * 4.5))
    assert r["neg_sr2"] == pytest.approx(-s * r2, abs=1e-12) and r["neg_sr2"] > 0


def test_neg_sr2_extremes_and_undefined():
    assert neg_sr2([50, 40, 30, 20, 10])["neg_sr2"] == pytest.approx(1.0)     # linear fall: best
    assert neg_sr2([10, 20, 30, 40, 50])["neg_sr2"] == pytest.approx(-1.0)    # linear rise: worst
    # monotone but not linear: S = -1, R^2 < 1
    r = neg_sr2([100, 10, 9, 8, 7])
    assert r["s"] == pytest.approx(-1.0) and 0 < r["r2"] < 1 and r["neg_sr2"] == pytest.approx(r["r2"])
    assert math.isnan(neg_sr2([20, 20, 20])["neg_sr2"]) and math.isnan(neg_sr2([1, 2])["neg_sr2"])


def test_deciles_carry_sr2_of_their_bins_and_table_shows_it():
    gen = np.random.default_rng(0)
    u = gen.random(1000)
    correct = (gen.random(1000) > u).astype(float)          # more uncertain -> less often right
    d = uncertainty_deciles(u, correct)
    assert d["sr2"] == neg_sr2([b["r1"] for b in d["bins"]])
    assert d["sr2"]["neg_sr2"] > 0.5
    table = deciles_table({"image queries": d, "caption queries": uncertainty_deciles(u, 1 - correct)})
    line = [x for x in table.splitlines() if x.startswith("| -SR^2")][0]
    cells = line.split("|")[2:4]
    assert cells[0].strip().startswith(f"{d['sr2']['neg_sr2']:.3f}") and cells[1].strip().startswith("-")


def test_demo_report_carries_neg_sr2(tmp_path):
    import json

    from zsprob.report.demo_report import _retrieval

    d = uncertainty_deciles(np.arange(100.0), (np.arange(100) < 60).astype(float))
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"metrics": {"setup": {}}, "uncertainty": {"deciles": {"image queries": d}}}))
    got = _retrieval(tmp_path / "metrics.json")["uncertainty"]["deciles"]["image queries"]
    assert got["neg_sr2"] == pytest.approx(d["sr2"]["neg_sr2"]) and got["neg_sr2"] > 0
