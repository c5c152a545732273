"""Zero-shot calibration: ECE / NLL against hand computations and a float64 reference, the
temperature fit against a grid search, and the rule that the fit never reads evaluation labels."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zsprob.errors import UserError
from zsprob.zeroshot.calibration import (calibration_report, calibration_table, expected_calibration_error,
                                         fit_temperature, model_logit_scale, row_calibration, softmax_nll)


def _reference_ece(logits, labels, n_bins=15):
    """Guo et al.'s loop: bins (lo, hi], |acc - conf| weighted by the bin's share (float64)."""
    z = np.asarray(logits, dtype=np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    conf, pred = p.max(1), p.argmax(1)
    acc = (pred == np.asarray(labels)).astype(float)
    edges = np.linspace(0, 1, n_bins + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            total += m.mean() * abs(acc[m].mean() - conf[m].mean())
    return total


def test_nll_and_ece_by_hand():
    # two classes; image 0: p = (0.8, 0.2), label 0 (right); image 1: p = (0.6, 0.4), label 1 (wrong)
    logits = np.log([[0.8, 0.2], [0.6, 0.4]])
    labels = [0, 1]
    assert softmax_nll(logits, labels) == pytest.approx(-(math.log(0.8) + math.log(0.4)) / 2, abs=1e-12)
    # conf 0.8 -> bin (11/15, 12/15], acc 1; conf 0.6 -> bin (8/15, 9/15], acc 0
    ece = expected_calibration_error(logits, labels)
    assert ece["ece"] == pytest.approx(0.5 * abs(1 - 0.8) + 0.5 * abs(0 - 0.6), abs=1e-12)
    assert [b["n"] for b in ece["bins"]] == [1, 1]            # 13 of the 15 bins are empty
    assert ece["bins"][0]["lo"] == pytest.approx(8 / 15) and ece["bins"][1]["hi"] == pytest.approx(12 / 15)


def test_ece_confidence_one_goes_to_last_bin_and_edges_go_down():
    # confidence exactly 1.0 (one-hot after the softmax underflows) and exactly 0.6 = 9/15 (a bin edge)
    logits = np.array([[0.0, -1e4, -1e4], [math.log(0.6), math.log(0.4), -1e4]])
    ece = expected_calibration_error(logits, [0, 1])
    conf = [1.0, 0.6]
    assert [b["n"] for b in ece["bins"]] == [1, 1]
    assert ece["bins"][0]["hi"] == pytest.approx(9 / 15)       # 0.6 lies in (8/15, 9/15]
    assert ece["bins"][1]["hi"] == 1.0 and ece["bins"][1]["confidence"] == conf[0]
    assert ece["ece"] == pytest.approx(0.5 * 0.0 + 0.5 * 0.6, abs=1e-12)


def test_ece_and_nll_match_float64_reference_on_random_logits():
    gen = np.random.default_rng(0)
    z = gen.normal(size=(500, 7)) * 3
    y = gen.integers(0, 7, size=500)
    for t in (1.0, 0.5, 2.5):
        assert expected_calibration_error(torch.tensor(z, dtype=torch.float32), torch.tensor(y), t)["ece"] == \
            pytest.approx(_reference_ece(np.float32(z).astype(np.float64) / t, y), abs=1e-12)
        logp = z / t - np.log(np.exp(z / t).sum(1, keepdims=True))
        assert softmax_nll(z, y, t) == pytest.approx(-logp[np.arange(500), y].mean(), rel=1e-12)


def test_fit_temperature_minimises_nll():
    gen = np.random.default_rng(1)
    y = gen.integers(0, 5, size=400)
    z = gen.normal(size=(400, 5))
    z[np.arange(400), y] += 1.5
    z *= 10                                                    # overconfident: the best T is well above 1
    t = fit_temperature(z, y)
    grid = np.exp(np.linspace(math.log(0.1), math.log(100), 4001))
    best = grid[np.argmin([softmax_nll(z, y, g) for g in grid])]
    assert t == pytest.approx(best, rel=2e-3) and t > 2
    # stationary: d NLL / d(1/T) = mean(E_p[z] - z_y) = 0 at the optimum
    p = np.exp(z / t - z.max(1, keepdims=True) / t)
    p /= p.sum(1, keepdims=True)
    assert abs(((p * z).sum(1) - z[np.arange(400), y]).mean()) < 1e-3 * np.abs(z).mean()
    assert softmax_nll(z, y, t) < softmax_nll(z, y, 1.0)


def test_fit_temperature_separable_data_hits_the_bracket():
    # perfectly separated: the NLL falls to 0 (float64) as T -> 0, so T lands near the lower end
    z = np.array([[2.0, 0.0], [0.0, 2.0]])
    t = fit_temperature(z, [0, 1])
    assert 1e-3 <= t < 0.05 and softmax_nll(z, [0, 1], t) < 1e-12


def test_temperature_never_reads_evaluation_labels():
    gen = np.random.default_rng(2)
    ys = gen.integers(0, 4, size=200)
    zs = gen.normal(size=(200, 4)) * 5
    zs[np.arange(200), ys] += 4
    ze = gen.normal(size=(150, 4)) * 5
    reports = [calibration_report(ze, gen.integers(0, 4, size=150), zs, ys) for _ in range(3)]
    reports.append(calibration_report(ze, np.zeros(150, dtype=int), zs, ys))
    temps = {r["temperature"] for r in reports}
    assert len(temps) == 1                                     # identical, whatever the evaluation labels
    assert len({r["nll_at_t"] for r in reports}) > 1           # while the evaluation figures do change
    t = temps.pop()
    assert t == fit_temperature(zs, ys)
    # and changing the selection labels does change T
    assert calibration_report(ze, np.zeros(150, dtype=int), zs, gen.permutation(ys))["temperature"] != t


def test_report_without_selection_split():
    r = calibration_report(np.log([[0.7, 0.3]]), [0])
    assert r["temperature"] is None and r["ece_at_t"] is None and r["nll_at_t"] is None
    assert r["ece"] == pytest.approx(0.3) and r["nll"] == pytest.approx(-math.log(0.7))


def test_bad_input_is_a_user_error():
    with pytest.raises(UserError, match="labels must lie"):
        softmax_nll(np.zeros((2, 3)), [0, 3])
    with pytest.raises(UserError, match="logits"):
        expected_calibration_error(np.zeros(3), [0, 1, 2])


def test_model_logit_scale_sources():
    class Bare:
        pass

    pcmepp, infonce = Bare(), Bare()
    pcmepp.checkpoint_meta = {"extra": {"method": "pcmepp", "loss_params": {"scale": 7.0, "shift": 5.0}}}
    infonce.checkpoint_meta = {"extra": {"method": "infonce", "loss_params": {"logit_scale": math.log(50.0)}}}
    assert model_logit_scale(pcmepp, "csd")[0] == 7.0 and model_logit_scale(pcmepp, "cosine")[0] == 14.0
    assert model_logit_scale(infonce, "cosine")[0] == pytest.approx(50.0)
    assert model_logit_scale(Bare(), "cosine") == (100.0, "CLIP zero-shot convention (100)")


def test_row_calibration_uses_scores_of_the_selection(tmp_path):
    from types import SimpleNamespace

    from zsprob.zeroshot.metrics import class_scores

    gen = torch.Generator().manual_seed(3)
    sel = SimpleNamespace(class_mu=torch.nn.functional.normalize(torch.randn(4, 8, generator=gen), dim=-1),
                          class_logvar=None)

    def feats(n):
        y = torch.randint(0, 4, (n,), generator=gen)
        mu = sel.class_mu[y] + 0.8 * torch.randn(n, 8, generator=gen)
        return SimpleNamespace(mu=mu, logvar=None, labels=y)

    ev, se = feats(60), feats(40)
    fields = row_calibration(sel, ev, se, logit_scales={"cosine": (30.0, "test")})
    ref_ev = 30.0 * class_scores(ev.mu, None, sel).double()
    ref_se = 30.0 * class_scores(se.mu, None, sel).double()
    assert fields["nll"] == pytest.approx(softmax_nll(ref_ev, ev.labels), rel=1e-12)
    assert fields["temperature"] == pytest.approx(fit_temperature(ref_se, se.labels), rel=1e-9)
    assert fields["ece_at_t"] == pytest.approx(
        expected_calibration_error(ref_ev, ev.labels, fields["temperature"])["ece"], rel=1e-12)
    assert fields["calibration"]["logit_scale"] == 30.0
    table = calibration_table([{"label": "all", **fields}, {"label": "x", "skipped": "why"}])
    assert table.count("\n") == 4 and f"{fields['temperature']:.3f}" in table


def test_compare_rows_carry_calibration_and_t_ignores_eval_labels():
    """On the real --compare path: every scored row has the five fields; permuting the evaluation
    labels changes the evaluation figures but no temperature (the selection split alone fits T)."""
    from test_zeroshot_selection import make_world

    from zsprob.zeroshot.classify import ImageFeatures, compare_on_features

    bank, sel_f, ev = make_world(seed=4)
    perm = torch.randperm(len(ev.labels), generator=torch.Generator().manual_seed(0))
    ev_perm = ImageFeatures(ev.mu, ev.logvar, ev.labels[perm], ev.classnames)
    a = compare_on_features(bank, ev, sel_f)
    b = compare_on_features(bank, ev_perm, sel_f)
    rows_a = {r["name"]: r for r in a["rows"] if not r.get("skipped")}
    rows_b = {r["name"]: r for r in b["rows"] if not r.get("skipped")}
    for name, row in rows_a.items():
        if name in ("linear-probe", "tip-adapter"):  # trained on the selection split: T is not fitted there
            assert row["ece"] is not None and row["nll"] is not None and row["temperature"] is None, name
            assert rows_b[name]["info"]["C" if name == "linear-probe" else "alpha"] == \
                row["info"]["C" if name == "linear-probe" else "alpha"]
            continue
        assert all(row[k] is not None for k in ("ece", "nll", "temperature", "ece_at_t", "nll_at_t")), name
        assert row["calibration"]["logit_scale"] == 100.0
        if not row["uses_eval_labels"]:
            assert rows_b[name]["temperature"] == row["temperature"], name
    assert any(rows_b[n]["nll"] != r["nll"] for n, r in rows_a.items())
    assert "Calibration (evaluation split" in a["table"] and "| T (selection split) |" in a["table"]
    no_split = compare_on_features(bank, ev, None)
    assert all(r["temperature"] is None for r in no_split["rows"] if not r.get("skipped"))


def test_demo_report_reads_the_calibration_fields(tmp_path):
    from test_zeroshot_selection import make_world

    from zsprob.report.demo_report import _zeroshot
    from zsprob.zeroshot.classify import compare_on_features

    bank, sel_f, ev = make_world(seed=5)
    res = compare_on_features(bank, ev, sel_f, out_dir=tmp_path, write_selections=False)
    z = _zeroshot(tmp_path / "compare.json")
    by_name = {r["name"]: r for r in res["rows"] if not r.get("skipped")}
    for row in z["rows"]:
        if row["name"] in by_name:
            for k in ("ece", "nll", "temperature", "ece_at_t", "nll_at_t"):
                assert row[k] == pytest.approx(by_name[row["name"]][k]), (row["name"], k)
    assert "| T (selection split) |" in z["table"]


def test_compare_scores_every_unc_row_with_the_weight_it_is_given():
    """``--compare --score unc --unc-weight w``: each row's accuracy and calibration are those of its selection
    scored with w (zeroshot's single-strategy path uses the same class_scores)."""
    from test_zeroshot_selection import make_world

    from zsprob.zeroshot.classify import compare_on_features
    from zsprob.zeroshot.metrics import evaluate_selection

    bank, sel_f, ev = make_world(seed=4)
    out = {}
    for w in (0.5, 4.0):
        res = compare_on_features(bank, ev, sel_f, score="unc", unc_weight=w, strategies=["all", "fusion"],
                                  write_selections=False)
        assert res["unc_weight"] == w
        out[w] = {r["name"]: r for r in res["rows"]}
        for name in ("all", "fusion"):
            from zsprob.zeroshot.selection import run_strategy
            sel = run_strategy(name, bank)
            assert out[w][name]["metrics"] == evaluate_selection(sel, ev, score="unc", unc_weight=w)
    assert out[0.5]["fusion"]["nll"] != out[4.0]["fusion"]["nll"]
    assert "unc_weight" not in compare_on_features(bank, ev, sel_f, strategies=["all"], write_selections=False)
