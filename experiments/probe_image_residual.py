#!/usr/bin/env python
"""Diagnostic: how far an image's captions sit from its mean, and whether the image features predict it.

Backs: docs/findings.md, "The image side" (why the image likelihood term can make image
sigma^2 vary only a little on the demo's model).

The image likelihood term (``loss.pcmepp.image_nll_alpha``) fits an image's sigma^2 to the squared
residual of its captions around its mean. For a trained model and a SynthWorld retrieval split this
script computes, per image, that residual (the mean over its five captions of
||mu_v - mu_t||^2) and reports:

* the residual per rendering condition against "normal" (difference and Welch SE, as the
  evaluation's :func:`zsprob.retrieval.validity.condition_uncertainty` computes them), beside the
  model's own image ||sigma^2||_1 difference: which conditions the term can teach at all;
* how much of the residual the features the image log-variance head reads can predict: ridge
  regressions (several penalties) from those features, fitted on ``--fit-split`` and scored on
  ``--split`` (held-out R^2 and Spearman), next to the head's own Spearman with the residual;
* whether those features tell each condition from "normal" at all: a linear probe's held-out ROC
  AUC per condition, next to the AUC of the head's own ||sigma^2||_1 (a condition the features
  show but the head's sigma^2 does not follow lacks a training signal, not features).

The features are the input of ``model.image_sigma`` (a forward hook), so the script needs a model
with an image log-variance head beside the tower (``sigma_head: unc`` on a bag-of-words model, as
the demo's recipe; ``block`` heads work too). numpy does the regression, scipy the Spearman,
scikit-learn the linear probe and the AUCs.

    python experiments/probe_image_residual.py RUN/model --root sw --split val --fit-split test
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def residuals(model, root, split: str):
    """(features [N, F], per-image residual [N], image ||sigma^2||_1 [N], conditions) for a split."""
    import torch

    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.retrieval.synthetic import encode_split

    feats = []
    hook = model.image_sigma.register_forward_hook(lambda m, i, o: feats.append(i[0].detach().double()))
    data = load_retrieval_split(root, split)
    try:
        with torch.no_grad():
            emb = encode_split(model, data)
    finally:
        hook.remove()
    image_mu, caption_mu = emb.image_mu.double(), emb.caption_mu.double()
    owner = torch.as_tensor(emb.caption_image)
    n = len(image_mu)
    per_caption = (image_mu[owner] - caption_mu).square().sum(1)
    residual = torch.zeros(n, dtype=torch.float64).index_add_(0, owner, per_caption)
    residual /= torch.bincount(owner, minlength=n).double()
    features = torch.cat(feats)[:n].numpy()
    conditions = np.array([m.get("condition", "unknown") for m in data.image_meta])
    return features, residual.numpy(), emb.image_logvar.double().exp().sum(1).numpy(), conditions


def by_condition(residual, uncertainty, conditions) -> list[str]:
    """Markdown rows: per condition, residual and ||sigma^2||_1 minus normal's with Welch SEs
    (:func:`zsprob.retrieval.validity.condition_uncertainty` on each)."""
    from zsprob.retrieval.validity import condition_uncertainty

    res, unc = condition_uncertainty(residual, conditions), condition_uncertainty(uncertainty, conditions)
    lines = [f"normal: residual {res['reference']['mean']:.4f}, image ||sigma^2||_1 {unc['reference']['mean']:.4f} "
             f"(n = {res['reference']['n']})", "| condition | n | residual - normal (SE) | ||sigma^2||_1 - normal (SE) |",
             "|---|---|---|---|"]
    for name, r in res["by_condition"].items():
        cells = [f"{g['diff']:+.4f} ({g['diff'] / g['se']:+.1f} SE)" for g in (r, unc["by_condition"][name])]
        lines.append(f"| {name} | {r['n']} | {cells[0]} | {cells[1]} |")
    return lines


def ridge_scores(fit_x, fit_y, x, y, penalties) -> list[tuple[float, float, float]]:
    """(penalty, held-out R^2, held-out Spearman) of ridge regressions with an unpenalised intercept."""
    from scipy.stats import spearmanr

    mean_x, mean_y = fit_x.mean(0), fit_y.mean()
    a, b = fit_x - mean_x, fit_y - mean_y
    out = []
    for lam in penalties:
        w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ b)
        pred = (x - mean_x) @ w + mean_y
        r2 = 1.0 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        out.append((lam, float(r2), float(spearmanr(pred, y)[0])))
    return out


def separability(fit_x, fit_cond, x, cond, uncertainty, min_count: int = 5) -> list[str]:
    """Markdown rows: per condition (at least ``min_count`` images in both splits), the held-out ROC AUC
    of a linear probe telling it from "normal" (scikit-learn's logistic regression on standardised
    features, C = 0.1, balanced classes, fitted on the fit split) beside the AUC of the head's own
    ||sigma^2||_1: whether the features the head reads show the condition at all, and whether the
    head's output uses it."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    lines = ["| condition | n (fit / scored) | linear probe AUC | head ||sigma^2||_1 AUC |", "|---|---|---|---|"]
    for name in sorted(set(cond) - {"normal"}):
        fit_rows, rows = np.isin(fit_cond, ["normal", name]), np.isin(cond, ["normal", name])
        n_fit, n = int((fit_cond == name).sum()), int((cond == name).sum())
        if min(n_fit, n, (fit_cond == "normal").sum(), (cond == "normal").sum()) < min_count:
            continue
        mean, std = fit_x[fit_rows].mean(0), fit_x[fit_rows].std(0) + 1e-8
        probe = LogisticRegression(C=0.1, max_iter=2000, class_weight="balanced")
        probe.fit((fit_x[fit_rows] - mean) / std, fit_cond[fit_rows] == name)
        probe_auc = roc_auc_score(cond[rows] == name, probe.decision_function((x[rows] - mean) / std))
        head_auc = roc_auc_score(cond[rows] == name, uncertainty[rows])
        lines.append(f"| {name} | {n_fit} / {n} | {probe_auc:.3f} | {head_auc:.3f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a zsprob model directory (RUN/model)")
    parser.add_argument("--root", required=True, help="the SynthWorld root (zsprob data synthetic --out)")
    parser.add_argument("--split", default="val", help="split to report on (default val)")
    parser.add_argument("--fit-split", default="test", help="split the ridge regressions are fitted on (default test)")
    parser.add_argument("--penalties", default="1,10,100", help="ridge penalties, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args(argv)
    try:
        penalties = [float(p) for p in a.penalties.split(",")]
    except ValueError:
        print(f"probe_image_residual: --penalties must be numbers, got {a.penalties!r}", file=sys.stderr)
        return 2
    if a.split == a.fit_split:
        print("probe_image_residual: --split and --fit-split must differ (the regression is scored held out)",
              file=sys.stderr)
        return 2
    import torch

    from zsprob.errors import UserError
    from zsprob.models import load

    torch.set_num_threads(max(1, a.threads))
    try:
        model = load(a.checkpoint).eval()
        if getattr(model, "image_sigma", None) is None:
            raise UserError(f"{a.checkpoint}: the model has no image log-variance head beside the tower")
        x, y, u, cond = residuals(model, a.root, a.split)
        fx, fy, _, fit_cond = residuals(model, a.root, a.fit_split)
    except (UserError, FileNotFoundError) as err:
        print(f"probe_image_residual: {err}", file=sys.stderr)
        return 2
    from scipy.stats import spearmanr

    print(f"{a.split}: {len(y)} images; residual mean {y.mean():.3f} std {y.std():.3f}; "
          f"image ||sigma^2||_1 mean {u.mean():.3f} std {u.std():.4f}; "
          f"Spearman(head, residual) {spearmanr(u, y)[0]:+.3f}")
    print("\n".join(by_condition(y, u, cond)))
    print(f"ridge from the head's input features, fitted on {a.fit_split} ({len(fy)} images), scored on {a.split}:")
    for lam, r2, rho in ridge_scores(fx, fy, x, y, penalties):
        print(f"  penalty {lam:g}: R^2 {r2:+.3f}, Spearman {rho:+.3f}")
    print(f"each condition against normal, from the same features (probe fitted on {a.fit_split}, "
          f"scored on {a.split}):")
    print("\n".join(separability(fx, fit_cond, x, cond, u)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
