"""The label-using baselines (zsprob.zeroshot.probe): the linear probe against a hand-written multinomial
logistic regression, the k-shot draws, Tip-Adapter's cache and search, the ``--compare`` rows, and
`zsprob probe` end to end in a subprocess on a folder dataset and a tiny checkpoint."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from test_zeroshot_cli import _folder  # three drawn shapes, a folder per class
from zsprob.errors import UserError
from zsprob.zeroshot import probe as P


def _blobs(n_per=12, n_classes=3, dim=4, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_classes, dim)) * 2.0
    x = np.concatenate([c + spread * rng.normal(size=(n_per, dim)) for c in centres])
    y = np.repeat(np.arange(n_classes), n_per)
    return x, y


def _hand_logreg(x, y, C, n_classes):
    """argmin_W,b C * sum_i -log softmax(W x_i + b)[y_i] + ||W||^2 / 2 (bias not penalised), float64 L-BFGS."""
    from scipy.optimize import minimize

    D = x.shape[1]
    onehot = np.eye(n_classes)[y]

    def loss(theta):
        W, b = theta[:n_classes * D].reshape(n_classes, D), theta[n_classes * D:]
        z = x @ W.T + b
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        p = np.exp(logp)
        value = -C * (onehot * logp).sum() + 0.5 * (W * W).sum()
        gz = C * (p - onehot)
        return value, np.concatenate([(gz.T @ x + W).ravel(), gz.sum(0)])

    res = minimize(loss, np.zeros(n_classes * (D + 1)), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 10000})
    W, b = res.x[:n_classes * D].reshape(n_classes, D), res.x[n_classes * D:]
    z = x @ W.T + b
    return z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)


@pytest.mark.parametrize("C", [0.05, 1.0, 20.0])
def test_probe_is_the_regularised_multinomial_logistic_regression(C):
    x, y = _blobs(spread=2.0)
    model = P._fit(x, y, C, tol=1e-10)
    ours = P.probe_scores(model, x, 3)
    np.testing.assert_allclose(ours, _hand_logreg(x, y, C, 3), atol=2e-5)


def test_probe_scores_put_minus_infinity_on_unseen_classes():
    x, y = _blobs(n_classes=2)
    scores = P.probe_scores(P._fit(x, y, 1.0), x, 4)
    assert scores.shape == (len(x), 4) and np.isneginf(scores[:, 2:]).all()
    np.testing.assert_allclose(np.exp(scores).sum(1), 1.0, atol=1e-9)


def test_fit_probe_sweeps_C_on_validation_then_refits_on_all():
    x, y = _blobs(n_per=20, spread=2.5, seed=3)
    tr, va = P.hold_out(y, ["a", "b", "c"], seed=0)
    assert not set(tr) & set(va) and len(tr) + len(va) == len(y) and np.bincount(y[va]).tolist() == [4, 4, 4]
    grid = (0.01, 1.0, 100.0)
    model, info = P.fit_probe(x[tr], y[tr], 3, val=(x[va], y[va]), c_grid=grid)
    sweep = info["c_sweep"]["val_accuracy"]
    logps = [P.probe_scores(P._fit(x[tr], y[tr], C), x[va], 3) for C in grid]
    expected = [float((lp.argmax(1) == y[va]).mean()) for lp in logps]
    nll = [float(-lp[np.arange(len(va)), y[va]].mean()) for lp in logps]
    best = max(range(3), key=lambda i: (expected[i], -nll[i]))  # accuracy, then the lower log-loss
    assert sweep == expected and info["c_sweep"]["val_log_loss"] == pytest.approx(nll)
    assert info["C"] == grid[best] and info["n_train"] == len(y)
    refit = P._fit(x, y, info["C"])
    np.testing.assert_allclose(P.probe_scores(model, x, 3), P.probe_scores(refit, x, 3))
    _, alone = P.fit_probe(x, y, 3)
    assert alone["C"] == 1.0 and alone["c_sweep"] is None and "default" in alone["C_chosen_by"]


def test_draw_shots_per_class_seeded_and_disjoint():
    y = np.repeat(np.arange(3), [5, 9, 6])
    names = ["a", "b", "c"]
    tr, va = P.draw_shots(y, 2, seed=0, classnames=names)
    assert np.bincount(y[tr]).tolist() == [2, 2, 2] and np.bincount(y[va]).tolist() == [2, 2, 2]
    assert not set(tr) & set(va)
    again, _ = P.draw_shots(y, 2, seed=0, classnames=names)
    other = [P.draw_shots(y, 2, seed=s, classnames=names)[0] for s in range(1, 6)]
    assert (again == tr).all() and any(set(o) != set(tr) for o in other)
    tr5, va5 = P.draw_shots(y, 5, seed=0, classnames=names)
    assert np.bincount(y[va5], minlength=3).tolist() == [0, 4, 1]   # min(k, 4) when the class holds them
    with pytest.raises(UserError, match=r"6 shots per class, but class 'a' .* has 5 images"):
        P.draw_shots(y, 6, seed=0, classnames=names)
    with pytest.raises(UserError, match="no image of class 'c'"):
        P.draw_shots(np.array([0, 0, 1, 1]), 1, seed=0, classnames=names)


def test_shots_for_default_drops_what_the_smallest_class_cannot_hold():
    assert P.shots_for([10, 7, 12]) == ([1, 2, 4], [8, 16])
    assert P.shots_for([10, 7], shots=[3, 1, 3]) == ([1, 3], [])


def test_seed_summary_is_the_student_t_interval():
    from scipy.stats import t

    s = P.seed_summary([10.0, 12.0, 17.0])
    se = np.std([10.0, 12.0, 17.0], ddof=1) / np.sqrt(3)
    assert s["mean"] == pytest.approx(13.0) and s["se"] == pytest.approx(se)
    assert s["ci95"] == pytest.approx([13.0 - t.ppf(0.975, 2) * se, 13.0 + t.ppf(0.975, 2) * se])
    assert P.seed_summary([4.0])["ci95"] is None


def test_tip_adapter_cache_and_leave_one_out_search():
    rng = np.random.default_rng(0)
    shots_x, shots_y = rng.normal(size=(6, 3)), np.array([0, 0, 1, 1, 2, 2])
    x, zs = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    assert np.allclose(P.tip_adapter_scores(zs, x, shots_x, shots_y, 3, 0.0, 5.0), zs)
    f, u = P.unit_rows(shots_x), P.unit_rows(x)
    hand = zs + 2.0 * np.stack([np.exp(-3.0 * (1 - u @ f[shots_y == c].T)).sum(1) for c in range(3)], 1)
    np.testing.assert_allclose(P.tip_adapter_scores(zs, x, shots_x, shots_y, 3, 2.0, 3.0), hand)
    # shots that are copies in pairs: leave-one-out finds each shot's twin, so a large alpha reaches 100%
    twins = np.repeat(np.eye(3) + 0.1, 2, axis=0)
    flat = np.zeros((6, 3))
    found = P.tip_adapter_search(flat, twins, shots_y, 3, alphas=(1.0,), betas=(5.0,))
    assert found["loo_accuracy"] == 1.0
    wrong_zs = np.eye(3)[(shots_y + 1) % 3] * 10.0   # zero-shot wrong everywhere, by a wide margin
    found = P.tip_adapter_search(wrong_zs, twins, shots_y, 3, alphas=(0.25, 100.0), betas=(1.0,))
    assert found["alpha"] == 100.0 and found["loo_accuracy"] == 1.0


def _features(x, y, names, logvar=None):
    from zsprob.zeroshot.features import ImageFeatures

    return ImageFeatures(torch.tensor(x, dtype=torch.float32), logvar, torch.tensor(y), list(names))


def test_compare_rows_train_on_the_selection_split_only():
    """The rows read the selection split's labels; changing the evaluation labels changes their scores' accuracy
    but not the fitted probe or the chosen alpha / beta."""
    from zsprob.zeroshot.selection_base import Selection

    names = ["a", "b", "c"]
    x, y = _blobs(n_per=10, dim=8, seed=1)
    xe, ye = _blobs(n_per=6, dim=8, seed=1)
    sel = Selection(strategy="all", label="all", classnames=names, templates=["{}"],
                    weights=torch.ones(3, 1), class_mu=torch.randn(3, 8), class_logvar=None)
    rows = P.label_baseline_rows(sel, _features(xe, ye, names), _features(x, y, names), logit_scale=50.0)
    shuffled = P.label_baseline_rows(sel, _features(xe, ye[::-1].copy(), names), _features(x, y, names),
                                     logit_scale=50.0)
    for (row, hits), (row2, _) in zip(rows, shuffled):
        assert row["reads_eval_labels"] is False and row["transductive"] is False
        assert row["label_split"] == "selection split" and "30 images" in row["data_used"]
        assert hits.dtype == torch.bool and len(hits) == len(ye)
        assert row["metrics"]["top1"] == pytest.approx(100 * float(hits.double().mean()))
        assert {k: v for k, v in row["info"].items() if k != "c_sweep"} == \
            {k: v for k, v in row2["info"].items() if k != "c_sweep"}
    assert [r["name"] for r, _ in rows] == ["linear-probe", "tip-adapter"]
    assert rows[0][0]["metrics"]["top1"] > 90  # separable blobs


# ----------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from zsprob.models import create_model, save

    base = tmp_path_factory.mktemp("probe")
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny"), base / "ckpt")
    return {"ckpt": str(ckpt), "eval": _folder(base / "eval", 4), "train": _folder(base / "train", 5)}


def _one_line_error(r, words):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    assert words in r.stderr, r.stderr


@pytest.mark.slow(seconds=30)
def test_probe_command_end_to_end(folders, tmp_path):
    out = tmp_path / "r" / "results.json"
    r = run_cli("probe", "folder", "--checkpoint", folders["ckpt"], "--root", folders["eval"], "--train-root",
                folders["train"], "--seeds", "2", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["kshot"]) == {"1", "2", "4"} and res["shots_dropped"] == [8, 16]
    assert all(len(v["runs"]) == 2 and v["top1"]["ci95"] is not None for v in res["kshot"].values())
    assert res["metrics"]["n_images"] == 12 and res["dataset"]["n_train"] == 15
    assert res["protocol"]["reads_eval_labels"] is False and res["probe"]["c_sweep"] is not None
    assert (out.parent / "probe.png").stat().st_size > 1000 and "1-shot" in r.stdout
    again = run_cli("probe", "folder", "--checkpoint", folders["ckpt"], "--root", folders["eval"], "--train-root",
                    folders["train"], "--seeds", "2", "--out", out)
    assert again.returncode == 0 and json.loads(out.read_text())["images_from_cache"] is True

    common = ("probe", "folder", "--checkpoint", folders["ckpt"], "--root", folders["eval"])
    _one_line_error(run_cli(*common, "--train-root", folders["train"], "--shots", "2,9", "--out", tmp_path / "x.json"),
                    "9 shots per class")
    _one_line_error(run_cli(*common, "--train-root", folders["train"], "--shots", "two", "--out", tmp_path / "x.json"),
                    "--shots")
    _one_line_error(run_cli(*common, "--out", tmp_path / "x.json"), "--train-root")
    assert not (tmp_path / "x.json").exists()


def test_compare_skips_the_rows_whose_labels_miss_a_class():
    """A selection split without an image of some class: the few-shot strategy and both baselines are listed as
    skipped with the reason, every other row is scored (before, the whole --compare stopped)."""
    from test_zeroshot_selection import make_world

    from zsprob.zeroshot.classify import compare_on_features
    from zsprob.zeroshot.features import ImageFeatures

    bank, sel_f, ev = make_world(seed=2)
    keep = sel_f.labels != 0
    partial = ImageFeatures(sel_f.mu[keep], sel_f.logvar[keep], sel_f.labels[keep], sel_f.classnames)
    res = compare_on_features(bank, ev, partial, strategies=["all", "auto", "bprw-fewshot"])
    rows = {r["name"]: r for r in res["rows"]}
    for name in ("bprw-fewshot", "linear-probe", "tip-adapter"):
        assert "no image of class 'class0'" in rows[name]["skipped"], name
    assert not rows["all"].get("skipped") and not rows["auto"].get("skipped")
