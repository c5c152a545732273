"""Selective prediction: how well a confidence score tells a user which predictions to trust.

Given whether each prediction was right and a confidence per prediction (higher = more trusted), the
risk-coverage curve keeps the most confident predictions first. AURC is its mean risk, E-AURC its excess over
the oracle that keeps every right prediction first; AUROC and AUPR (scikit-learn's ``roc_auc_score`` /
``average_precision_score``) say how well low confidence flags a wrong prediction; accuracy at a coverage is
that of the most confident share. Ties in confidence are broken by expectation (every order of a tie equally
likely), so a constant score has the AURC of a random order. Intervals are seeded bootstrap percentiles over
items; differences against the baseline score use the same resamples (paired).
"""
from __future__ import annotations

import numpy as np
import torch

from zsprob.errors import UserError

__all__ = ["risk_coverage", "aurc", "selective_metrics", "selective_report", "softmax_confidences",
           "sigma_confidence"]

COVERAGES = (0.8, 0.5)


def risk_coverage(correct, confidence) -> tuple[np.ndarray, np.ndarray]:
    """(coverage k / n, expected risk among the k most confident) for k = 1..n, ties broken by expectation."""
    correct, confidence = np.asarray(correct, dtype=bool), np.asarray(confidence, dtype=np.float64)
    n = len(correct)
    if n == 0:
        raise UserError("selective prediction needs at least one prediction")
    values, group = np.unique(-confidence, return_inverse=True)  # most confident first
    size = np.bincount(group, minlength=len(values))
    wrong = np.bincount(group, weights=~correct, minlength=len(values))
    before = np.concatenate([[0.0], np.cumsum(wrong)[:-1]])
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    k = np.arange(1, n + 1)
    g = np.repeat(np.arange(len(values)), size)  # the tie group of the k-th kept prediction
    errors = before[g] + wrong[g] * (k - start[g]) / size[g]
    return k / n, errors / k


def aurc(correct, confidence) -> float:
    return float(risk_coverage(correct, confidence)[1].mean())


def selective_metrics(correct, confidence) -> dict:
    """AURC, E-AURC, AUROC / AUPR of low confidence for a wrong prediction, accuracy at :data:`COVERAGES`."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    correct, confidence = np.asarray(correct, dtype=bool), np.asarray(confidence, dtype=np.float64)
    coverage, risk = risk_coverage(correct, confidence)
    out = {"aurc": float(risk.mean()), "eaurc": float(risk.mean() - aurc(correct, correct.astype(float)))}
    both = 0 < correct.sum() < len(correct)
    out["auroc"] = float(roc_auc_score(~correct, -confidence)) if both else float("nan")
    out["aupr"] = float(average_precision_score(~correct, -confidence)) if both else float("nan")
    for c in COVERAGES:
        k = max(1, int(np.ceil(c * len(correct))))
        out[f"acc_at_{int(round(100 * c))}"] = float(1.0 - risk[k - 1])
    return out


def selective_report(correct, confidences: dict, *, baseline: str = "msp", n_boot: int = 1000, seed: int = 0,
                     curve_points: int = 50) -> dict:
    """Per score: :func:`selective_metrics`, a bootstrap 95% interval of each, the paired difference against
    ``baseline`` with its interval, and the risk-coverage curve at ``curve_points`` coverages."""
    correct = np.asarray(correct, dtype=bool)
    names = list(confidences)
    point = {s: selective_metrics(correct, confidences[s]) for s in names}
    rng = np.random.default_rng(seed)
    boots = {s: [] for s in names}
    for _ in range(int(n_boot)):
        idx = rng.integers(0, len(correct), len(correct))
        for s in names:
            boots[s].append(selective_metrics(correct[idx], np.asarray(confidences[s])[idx]))
    out = {}
    for s in names:
        rows = {m: np.array([b[m] for b in boots[s]]) for m in point[s]}
        entry = {m: {"value": v, "ci95": _ci(rows[m])} for m, v in point[s].items()}
        if baseline in boots and s != baseline:
            base = {m: np.array([b[m] for b in boots[baseline]]) for m in point[s]}
            entry["minus_" + baseline] = {m: {"value": point[s][m] - point[baseline][m], "ci95": _ci(rows[m] - base[m])}
                                          for m in point[s]}
        cov, risk = risk_coverage(correct, confidences[s])
        at = np.linspace(0, len(cov) - 1, min(curve_points, len(cov))).round().astype(int)
        entry["curve"] = {"coverage": cov[at].tolist(), "risk": risk[at].tolist()}
        out[s] = entry
    return {"n": int(len(correct)), "accuracy": float(correct.mean()), "baseline": baseline, "n_boot": int(n_boot),
            "scores": out}


def _ci(values: np.ndarray) -> list:
    values = values[np.isfinite(values)]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if len(values) else [None, None]


def softmax_confidences(scores: torch.Tensor, logit_scale: float) -> dict:
    """The deterministic baselines per row of [N, C] scores: maximum softmax probability at ``logit_scale``,
    negative entropy, top-1 minus top-2 probability."""
    p = torch.softmax(logit_scale * scores.double(), dim=1)
    top = p.topk(min(2, p.shape[1]), dim=1).values
    out = {"msp": top[:, 0], "entropy": (p * p.clamp_min(1e-300).log()).sum(1),
           "margin": top[:, 0] - (top[:, 1] if top.shape[1] > 1 else 0.0)}
    return {k: v.numpy() for k, v in out.items()}


def sigma_confidence(logvar: torch.Tensor):
    """Minus ||sigma^2||_1 per row: the more certain embedding is the more trusted."""
    return (-logvar.double().exp().sum(1)).numpy()
