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

__all__ = ["risk_coverage", "aurc", "selective_metrics", "selective_report", "selective_by_group",
           "flagged_probability", "selective_groups_table", "selective_table", "softmax_confidences",
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


def low_confidence_auroc(group_conf, reference_conf) -> float:
    """P(a group item is less confident than a reference item), ties counted half: the AUROC of low
    confidence for "in the group" (Mann-Whitney, exact with ties)."""
    ref = np.sort(np.asarray(reference_conf, dtype=np.float64))
    g = np.asarray(group_conf, dtype=np.float64)
    above = len(ref) - np.searchsorted(ref, g, "right")
    ties = np.searchsorted(ref, g, "right") - np.searchsorted(ref, g, "left")
    return float((above + 0.5 * ties).sum() / (len(g) * len(ref)))


def flagged_probability(confidence, n_flag: int) -> np.ndarray:
    """Per item, the probability of being among the ``n_flag`` least confident, ties broken by expectation (a
    tie straddling the cut shares its remaining places evenly), so a constant score flags every item with
    probability n_flag / n."""
    conf = np.asarray(confidence, dtype=np.float64)
    values, group, size = np.unique(conf, return_inverse=True, return_counts=True)
    start = np.concatenate([[0], np.cumsum(size)[:-1]])  # items strictly less confident than each tie group
    return np.clip((n_flag - start[group]) / size[group], 0.0, 1.0)


def selective_by_group(correct, confidences: dict, groups, *, reference: str = "normal", flag_share: float = 0.2,
                       n_boot: int = 300, seed: int = 0, min_items: int = 5) -> dict:
    """Does each score flag a group of items (a SynthWorld rendering condition: blurry, dark, cropped, ...)?
    Per group: n, accuracy, and per score the mean confidence, the share of the group among the ``flag_share``
    least confident of all items (ties by expectation: :func:`flagged_probability`), and the AUROC of low
    confidence for "in this group rather than in ``reference``" (scikit-learn), each with a bootstrap 95%
    interval over the group's (and the reference's) items. Groups of fewer than ``min_items`` items get n and
    accuracy only."""
    from sklearn.metrics import roc_auc_score

    correct, groups = np.asarray(correct, dtype=bool), np.asarray(groups).astype(str)
    if len(groups) != len(correct):
        raise UserError(f"{len(groups)} group labels for {len(correct)} predictions")
    n_flag = max(1, int(np.ceil(flag_share * len(correct))))
    flagged = {s: flagged_probability(c, n_flag) for s, c in confidences.items()}
    rng = np.random.default_rng(seed)
    ref = np.flatnonzero(groups == reference)
    out = {}
    for g in sorted(set(groups.tolist()), key=lambda name: (name != reference, name)):
        idx = np.flatnonzero(groups == g)
        entry = {"n": int(len(idx)), "accuracy": float(correct[idx].mean())}
        if g != reference and len(idx) >= min_items and len(ref) >= min_items:
            draws = [(rng.choice(idx, len(idx)), rng.choice(ref, len(ref))) for _ in range(int(n_boot))]
            entry["scores"] = {}
            for s, conf in confidences.items():
                conf = np.asarray(conf, dtype=np.float64)
                both = np.concatenate([idx, ref])
                auroc = roc_auc_score(np.isin(both, idx), -conf[both])
                entry["scores"][s] = {
                    "mean_confidence": float(conf[idx].mean()),
                    "flagged_share": {"value": float(flagged[s][idx].mean()),
                                      "ci95": _ci(np.array([flagged[s][a].mean() for a, _ in draws]))},
                    "auroc_vs_reference": {"value": float(auroc), "ci95": _ci(np.array(
                        [low_confidence_auroc(conf[a], conf[b]) for a, b in draws]))}}
        out[g] = entry
    return {"reference": reference, "flag_share": flag_share, "n_boot": int(n_boot), "groups": out}


def selective_groups_table(by_group: dict, scores=("msp", "image_sigma2")) -> str:
    """Markdown: per group, n, accuracy, and per score the AUROC of low confidence against the reference group
    and the share of the group among the least confident items."""
    share = int(round(100 * by_group["flag_share"]))
    head = ["condition", "n", "accuracy"] + [f"{s}: AUROC vs {by_group['reference']}" for s in scores] + \
        [f"{s}: in lowest {share}%" for s in scores]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, e in by_group["groups"].items():
        cells = [g, str(e["n"]), f"{100 * e['accuracy']:.1f}"]
        got = e.get("scores", {})
        for key in ("auroc_vs_reference", "flagged_share"):
            for s in scores:
                v = got.get(s, {}).get(key)
                cells.append("-" if v is None else f"{v['value']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def selective_table(selective: dict, items: str = "images", right: str = "accuracy") -> str:
    """Markdown: per report (a ``--compare`` row, a retrieval direction) and score, AURC and AUROC (wrong
    prediction) with 95% intervals and the paired AUROC difference against maximum softmax probability."""
    lines = []
    for name, rep in selective.items():
        lines += [f"\n\nSelective prediction, {name} ({rep['n']} {items}, {right} {100 * rep['accuracy']:.1f}%):",
                  "| score | AURC | AUROC (wrong) | AUROC - msp | acc@80% | acc@50% |", "|---|---|---|---|---|---|"]
        for s, e in rep["scores"].items():
            d = e.get("minus_msp", {}).get("auroc")
            diff = "-" if d is None else f"{d['value']:+.3f} [{_cell(d['ci95'][0])}, {_cell(d['ci95'][1])}]"
            lines.append(f"| {s} | {e['aurc']['value']:.3f} | {e['auroc']['value']:.3f} "
                         f"[{_cell(e['auroc']['ci95'][0])}, {_cell(e['auroc']['ci95'][1])}] | {diff} | "
                         f"{100 * e['acc_at_80']['value']:.1f} | {100 * e['acc_at_50']['value']:.1f} |")
    return "\n".join(lines)
