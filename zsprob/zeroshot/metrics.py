"""Zero-shot scores, metrics and label-free diagnostics, in plain torch.

:func:`class_scores` gives [N, C] similarities of images to a selection's classes; :func:`evaluate_scores`
accuracies and image-uncertainty bins; :func:`class_separation` says, without reading an image, whether the
class text embeddings have collapsed.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from zsprob.errors import UserError
from zsprob.zeroshot.features import ImageFeatures


def class_scores(img_mu: torch.Tensor, img_logvar: torch.Tensor | None, selection, score: str = "cosine",
                 unc_weight: float = 0.5) -> torch.Tensor:
    """[N, C] similarities (higher = better) of images and the selection's classes, by ``score``: ``cosine``
    (normalised image mean . class vector, the CLIP convention), ``csd`` (negative closed-form sampled
    distance between the image and class Gaussians on unit means) or ``unc`` (cosine - unc_weight *
    ||sigma^2_class||_1, ProLIP's uncertainty-adjusted logits; at 0.5 it ranks classes as CSD does)."""
    x = F.normalize(img_mu.float(), dim=-1)
    if score == "cosine":
        return x @ selection.class_mu.float().T
    if selection.class_logvar is None:
        raise UserError(f"score '{score}' needs class sigma^2; this selection has none (deterministic model)")
    cm = F.normalize(selection.class_mu.float(), dim=-1)
    if score == "unc":
        return x @ cm.T - unc_weight * selection.class_logvar.exp().sum(-1)[None]
    if img_logvar is None:
        raise UserError("score 'csd' needs image sigma^2; the model is deterministic")
    from zsprob.prob import score as prob_score

    return prob_score("csd", x, img_logvar.float(), cm, selection.class_logvar.float())


def evaluate_scores(scores: torch.Tensor, labels: torch.Tensor, classnames: Sequence[str],
                    img_uncertainty: torch.Tensor | None = None, n_bins: int = 10) -> dict:
    """Top-1/top-5 (%), per-class accuracy, and accuracy per image-uncertainty bin (equal counts)."""
    labels = torch.as_tensor(labels).long()
    C = scores.shape[1]
    k5 = min(5, C)
    top = scores.topk(k5, dim=1).indices
    hit1 = top[:, 0] == labels
    hit5 = (top == labels[:, None]).any(1)
    counts = torch.bincount(labels, minlength=C)
    per = torch.zeros(C, dtype=torch.float64).index_add_(0, labels, hit1.double())
    per_class = {name: (100.0 * float(per[c] / counts[c]) if counts[c] > 0 else None)
                 for c, name in enumerate(classnames)}
    present = [v for v in per_class.values() if v is not None]
    out = {"n_images": int(len(labels)), "top1": 100.0 * float(hit1.double().mean()),
           "top5": 100.0 * float(hit5.double().mean()), "top5_k": k5,
           "mean_per_class": float(sum(present) / max(1, len(present))), "per_class": per_class}
    if img_uncertainty is not None and len(labels) >= n_bins:
        order = torch.argsort(img_uncertainty, stable=True)
        bins = []
        for b, idx in enumerate(torch.tensor_split(order, n_bins)):
            u = img_uncertainty[idx]
            bins.append({"bin": b, "n": int(len(idx)), "uncertainty_min": float(u.min()),
                         "uncertainty_max": float(u.max()), "uncertainty_mean": float(u.mean()),
                         "top1": 100.0 * float(hit1[idx].double().mean())})
        out["uncertainty_bins"] = bins
    return out


def evaluate_selection(selection, feats: ImageFeatures, score: str = "cosine", unc_weight: float = 0.5) -> dict:
    """:func:`evaluate_scores` of a selection on image features whose labels index its classes."""
    s = class_scores(feats.mu, feats.logvar, selection, score=score, unc_weight=unc_weight)
    return evaluate_scores(s, feats.labels, feats.classnames, feats.uncertainty)


def top1_hits(selection, feats: ImageFeatures, score: str = "cosine", unc_weight: float = 0.5) -> torch.Tensor:
    """[N] bool: whether each image's top-1 class is its label (the per-image record paired tests read)."""
    s = class_scores(feats.mu, feats.logvar, selection, score=score, unc_weight=unc_weight)
    return s.argmax(1) == torch.as_tensor(feats.labels).long()


def topk_curve(bank, feats: ImageFeatures, k_values=None) -> dict:
    """Accuracy (%) of the same top-K for every class, for each K (PCME++ Fig. C.1a)."""
    from zsprob.zeroshot.selection import default_k_values, topk_score_tensor

    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, F.normalize(feats.mu.float(), dim=-1), k_values)
    acc = (S.argmax(1) == feats.labels[:, None]).double().mean(0) * 100
    return {"k": k_values, "top1": [float(v) for v in acc]}


def prompt_quality_diagnostic(bank, feats: ImageFeatures, k_values=None) -> dict:
    """Does text uncertainty track prompt quality? Spearman correlations of the templates' uncertainties with
    the accuracy of each single-template classifier (overall and per class), and the per-class recall of the
    same-top-K classifier for every K, on labelled images (an analysis; it selects nothing)."""
    from scipy.stats import spearmanr

    from zsprob.zeroshot.selection import default_k_values, topk_score_tensor

    if bank.deterministic or bank.mask is not None:  # per-template analysis: shared templates
        return {}
    x = F.normalize(feats.mu.float(), dim=-1)
    y = feats.labels
    C, T = bank.num_classes, bank.num_templates
    unc = bank.uncertainty
    scores = torch.einsum("nd,ctd->ntc", x, bank.mu_normed)            # [N, T, C]
    hit = (scores.argmax(2) == y[:, None]).double()                     # [N, T]
    acc_t = hit.mean(0) * 100
    counts = torch.bincount(y, minlength=C).double().clamp_min(1)
    recall = torch.zeros(C, T, dtype=torch.float64).index_add_(0, y, hit) / counts[:, None]
    rho_t = spearmanr(unc.mean(0).numpy(), acc_t.numpy()).statistic
    per_class = []
    for c in range(C):
        if recall[c].std() > 0 and unc[c].std() > 0:
            per_class.append(float(spearmanr(unc[c].numpy(), recall[c].numpy()).statistic))
    k_values = list(k_values or default_k_values(T))
    S = topk_score_tensor(bank, x, k_values)
    hitk = (S.argmax(1) == y[:, None]).double()                         # [N, nK]
    rk = torch.zeros(C, len(k_values), dtype=torch.float64).index_add_(0, y, hitk) / counts[:, None]
    order = torch.argsort(unc.mean(0), stable=True)
    return {"uses_eval_labels": True,
            "template_accuracy": {bank.templates[t]: float(acc_t[t]) for t in range(T)},
            "template_mean_uncertainty": {bank.templates[t]: float(unc[:, t].mean()) for t in range(T)},
            "spearman_template_uncertainty_vs_accuracy": float(rho_t),
            "spearman_per_class_uncertainty_vs_recall_mean": (sum(per_class) / len(per_class)) if per_class else None,
            "n_classes_with_negative_rho": sum(1 for r in per_class if r < 0), "n_classes_rho": len(per_class),
            "most_certain_templates": [bank.templates[t] for t in order[:5].tolist()],
            "least_certain_templates": [bank.templates[t] for t in order[-5:].tolist()],
            "uncertainty_relative_spread": float((unc.std(1) / unc.mean(1)).mean()),
            "per_class_recall_vs_k": {"k": k_values,
                                      "recall": {bank.classnames[c]: [float(v) for v in rk[c]] for c in range(C)}}}


COLLAPSE_COSINE = 0.95


def class_separation(class_vectors: torch.Tensor, classnames: Sequence[str],
                     collapse_cosine: float = COLLAPSE_COSINE) -> dict:
    """Mean and largest pairwise cosine of the class text embeddings, the closest pair, and ``collapsed``
    (mean above ``collapse_cosine``: the text tower cannot tell the class names apart)."""
    v = F.normalize(class_vectors.float(), dim=-1)
    C = v.shape[0]
    if C < 2:
        return {"n_classes": C, "mean_pairwise_cosine": None, "max_pairwise_cosine": None,
                "closest_pair": None, "collapsed": False}
    sim = v @ v.t()
    off = ~torch.eye(C, dtype=torch.bool)
    vals = sim[off]
    masked = sim.masked_fill(~off, -2.0)
    i, j = divmod(int(masked.argmax()), C)
    mean = float(vals.mean())
    return {"n_classes": C, "mean_pairwise_cosine": mean, "max_pairwise_cosine": float(vals.max()),
            "closest_pair": [classnames[i], classnames[j]], "collapsed": mean > collapse_cosine,
            "collapse_threshold": float(collapse_cosine)}


def separation_warning(sep: dict) -> str | None:
    """One line for the user when the class embeddings have collapsed, else None."""
    if not sep.get("collapsed"):
        return None
    return (f"warning: the class text embeddings are nearly identical (mean pairwise cosine "
            f"{sep['mean_pairwise_cosine']:.3f} > {sep['collapse_threshold']}): this model's text tower does not "
            f"tell these class names apart, so zero-shot accuracy will be near chance for every prompt strategy")
