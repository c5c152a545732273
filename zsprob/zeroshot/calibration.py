"""Calibration of zero-shot class probabilities: ECE, NLL and a temperature fitted on the selection split.

Probabilities are ``softmax(logit_scale * scores / T)``, ``logit_scale`` the model's own factor
(:func:`model_logit_scale`); ``T`` is fitted on the labelled selection split only and is a report-only figure
(bins and details: docs/zeroshot.md, "Calibration"). scipy does the 1-D minimisation; the rest is float64 numpy.
"""
from __future__ import annotations

import math

import numpy as np

from zsprob.errors import UserError
from zsprob.models.logit_scale import CLIP_ZEROSHOT_SCALE, logit_scale_of, model_logit_scale

ECE_BINS = 15
T_BOUNDS = (1e-3, 1e3)
#: CLIP's zero-shot convention (open_clip ``zero_shot_classifier`` evaluation: 100 * cosine)


def _as_logits_labels(logits, labels) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits.detach().cpu() if hasattr(logits, "detach") else logits, dtype=np.float64)
    y = np.asarray(labels.detach().cpu() if hasattr(labels, "detach") else labels).astype(np.int64)
    if z.ndim != 2 or y.ndim != 1 or z.shape[0] != y.shape[0]:
        raise UserError(f"calibration needs logits [N, C] and labels [N]; got {z.shape} and {y.shape}")
    if z.shape[0] == 0:
        raise UserError("calibration needs at least one labelled image")
    if y.min() < 0 or y.max() >= z.shape[1]:
        raise UserError(f"labels must lie in [0, {z.shape[1]}); got {y.min()}..{y.max()}")
    return z, y


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def softmax_nll(logits, labels, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood (nats) of the true class under ``softmax(logits / T)``."""
    z, y = _as_logits_labels(logits, labels)
    logp = _log_softmax(z / float(temperature))
    return float(-logp[np.arange(len(y)), y].mean())


def expected_calibration_error(logits, labels, temperature: float = 1.0, n_bins: int = ECE_BINS) -> dict:
    """``{"ece", "bins"}``: ECE over ``n_bins`` equal-width confidence bins; ``bins`` lists the non-empty
    ones as ``{"lo", "hi", "n", "accuracy", "confidence"}``."""
    z, y = _as_logits_labels(logits, labels)
    prob = np.exp(_log_softmax(z / float(temperature)))
    conf = prob.max(axis=1)
    correct = (prob.argmax(axis=1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    # bin b holds (edges[b], edges[b + 1]]: searchsorted(side="left") - 1, 1.0 -> last bin
    idx = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
    ece, bins = 0.0, []
    for b in range(n_bins):
        members = idx == b
        n = int(members.sum())
        if n == 0:
            continue
        acc, mean_conf = float(correct[members].mean()), float(conf[members].mean())
        ece += n / len(y) * abs(acc - mean_conf)
        bins.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": n, "accuracy": acc,
                     "confidence": mean_conf})
    return {"ece": float(ece), "bins": bins}


def fit_temperature(logits, labels, bounds: tuple[float, float] = T_BOUNDS) -> float:
    """The ``T`` in ``bounds`` minimising :func:`softmax_nll` of these (selection-split) logits."""
    from scipy.optimize import minimize_scalar

    z, y = _as_logits_labels(logits, labels)
    z_true = z[np.arange(len(y)), y]

    def nll(log_t: float) -> float:
        s = z / math.exp(log_t)
        m = s.max(axis=1)
        return float((m + np.log(np.exp(s - m[:, None]).sum(axis=1)) - z_true / math.exp(log_t)).mean())

    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    res = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-7})
    best = min((res.x, lo, hi), key=nll)   # the NLL may keep falling towards a bracket end
    return float(math.exp(best))


def calibration_report(eval_logits, eval_labels, select_logits=None, select_labels=None,
                       n_bins: int = ECE_BINS) -> dict:
    """ECE / NLL on the evaluation split at ``T = 1`` and at ``T`` fitted on the selection split alone
    (``temperature``, ``ece_at_t``, ``nll_at_t``, ``reliability_at_t``; None without one)."""
    out = {"ece": expected_calibration_error(eval_logits, eval_labels, 1.0, n_bins)["ece"],
           "nll": softmax_nll(eval_logits, eval_labels), "n_bins": n_bins,
           "temperature": None, "ece_at_t": None, "nll_at_t": None}
    if select_logits is None:
        return out
    t = fit_temperature(select_logits, select_labels)
    at_t = expected_calibration_error(eval_logits, eval_labels, t, n_bins)
    out.update(temperature=t, ece_at_t=at_t["ece"], nll_at_t=softmax_nll(eval_logits, eval_labels, t),
               reliability_at_t=at_t["bins"])
    return out


ROW_FIELDS = ("ece", "nll", "temperature", "ece_at_t", "nll_at_t")


def row_calibration(selection, eval_feats, select_feats=None, *, score: str = "cosine",
                    logit_scales: dict | None = None, unc_weight: float = 0.5) -> dict:
    """The calibration fields of one ``--compare`` row: :data:`ROW_FIELDS` of :func:`calibration_report` on
    logits = scale x class scores, plus ``calibration`` (the whole report, the scale and its source).
    ``logit_scales``: ``{score: (scale, source)}`` (:func:`model_logit_scales`; missing: CLIP's 100). A
    selection without class sigma^2 is scored by cosine, as ``--compare`` scores its accuracy."""
    from zsprob.zeroshot.metrics import class_scores

    if selection.class_logvar is None:
        score = "cosine"
    scale, source = (logit_scales or {}).get(score, (CLIP_ZEROSHOT_SCALE, "CLIP zero-shot convention (100)"))

    def logits(feats):
        return scale * class_scores(feats.mu, feats.logvar, selection, score=score, unc_weight=unc_weight).double()

    sel = (None, None) if select_feats is None else (logits(select_feats), select_feats.labels)
    report = calibration_report(logits(eval_feats), eval_feats.labels, *sel)
    report["logit_scale"] = float(scale)
    report["logit_scale_source"] = source
    report["temperature_role"] = ("report only: fitted on the selection split after the prompts were chosen"
                                  if report["temperature"] is not None else "no labelled selection split")
    return {**{k: report[k] for k in ROW_FIELDS}, "calibration": report}


def model_logit_scales(model) -> dict:
    """``{score: (scale, source)}`` of :func:`model_logit_scale` for every score name."""
    from zsprob.zeroshot.options import SCORES

    found = logit_scale_of(model)
    return {s: model_logit_scale(model, s, found) for s in SCORES}


def _fmt(v, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def calibration_table(rows: list[dict]) -> str:
    """Markdown table of the calibration fields (:data:`ROW_FIELDS`) of each ``--compare`` row."""
    lines = ["Calibration (evaluation split; T fitted on the selection split):", "",
             "| strategy | ECE | NLL | T (selection split) | ECE at T | NLL at T |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "ece" in r:
            lines.append(f"| {r['label']} | " + " | ".join(_fmt(r[k]) for k in ROW_FIELDS) + " |")
    return "\n".join(lines)
