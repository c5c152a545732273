"""Prompt-selection strategies: from a prompt bank to one class embedding (mu, sigma^2) per class.

Tensor math on a :class:`~zsprob.zeroshot.prompts.PromptBank` (means L2-normalised per prompt, CLIP's
convention) and on precomputed image embeddings; nothing here encodes. docs/zeroshot.md describes every
strategy; BPRW / ZPE are in ``baselines``, CARPRT in ``carprt``. Ties: a stable sort on ``||sigma^2||_1`` keeps
template-file order, and of two equally good K the larger (closer to ``all``) wins."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from zsprob.zeroshot.options import as_request
from zsprob.zeroshot.prompts import SINGLE_TEMPLATE
from zsprob.zeroshot.selection_base import (Selection, as_feats, make_selection, require_sigma, topk_mask,
                                            uncertainty_order)
from zsprob.zeroshot.strategy_registry import StrategyInputs, get_strategy

TAU_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, math.inf)
BETA_GRID = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


# ----------------------------------------------------------------------------- label-free strategies

def _valid(bank) -> torch.Tensor:
    """[C, T] bool: the prompts that exist (all of them unless the bank holds per-class pools)."""
    mask = bank.mask
    return torch.ones(bank.num_classes, bank.num_templates, dtype=torch.bool) if mask is None else mask


def select_all(bank) -> Selection:
    """CLIP's classifier: every template, equally weighted."""
    W = _valid(bank).float()
    return make_selection(bank, "all", "all", W, k=W.sum(1).long().tolist(), info={"k_global": bank.num_templates})


def select_single(bank) -> Selection:
    """CLIP's one prompt ("a photo of a {}.") when the bank has it, else the first template."""
    template = SINGLE_TEMPLATE if SINGLE_TEMPLATE in bank.templates else bank.templates[0]
    t = bank.templates.index(template)
    W = torch.zeros(bank.num_classes, bank.num_templates)
    W[:, t] = 1
    return make_selection(bank, "single", "single", W, k=[1] * bank.num_classes, info={"template": template})


def select_topk(bank, k: int) -> Selection:
    unc = require_sigma(bank, "topk")
    k = int(k)
    M = topk_mask(unc, k)
    return make_selection(bank, "topk", f"topk-{k}", M.float(), k=M.sum(1).tolist(),
                          info={"k_global": k, "ties": "stable sort: equal uncertainty keeps template order"})


def select_threshold(bank, c: float = 1.0) -> Selection:
    """ProLIP's per-class rule: keep templates with u <= mean(u_c) + c * std(u_c) (at least one)."""
    unc = require_sigma(bank, "threshold")
    valid = _valid(bank)
    if bank.mask is None:
        thr = unc.mean(1, keepdim=True) + c * unc.std(1, keepdim=True)
    else:  # per-class pools: mean and unbiased std over each class's own prompts (one prompt: std 0)
        n = valid.sum(1, keepdim=True)
        finite = torch.where(valid, unc, torch.zeros_like(unc))
        mean = finite.sum(1, keepdim=True) / n
        std = (torch.where(valid, finite - mean, 0.0) ** 2).sum(1, keepdim=True).div((n - 1).clamp_min(1)).sqrt()
        thr = mean + c * std
    M = (unc <= thr) & valid
    empty = ~M.any(1)
    if empty.any():
        M[empty] = unc[empty] == unc[empty].min(1, keepdim=True).values
    ks = M.sum(1).tolist()
    return make_selection(bank, "threshold", "auto (label-free)", M.float(), k=ks,
                          info={"rule": "u <= mean_c(u) + c * std_c(u) per class (ProLIP by_std_values_per_class)",
                                "c": c, "data_used": "none (text uncertainties only)"})


def select_fusion(bank, beta: float = 1.0, *, strategy: str = "fusion", label: str | None = None,
                  info: dict | None = None) -> Selection:
    """Uncertainty-weighted fusion: w_ct ∝ u_ct^-beta (beta = 1: precision weighting)."""
    unc = require_sigma(bank, strategy)
    logw = (-beta * unc.clamp_min(1e-30).log()).masked_fill(~_valid(bank), float("-inf"))
    W = torch.softmax(logw, dim=1)
    inf = {"rule": "w_ct proportional to ||sigma^2_ct||_1 ** -beta", "beta": beta}
    inf.update(info or {})
    return make_selection(bank, strategy, label or f"fusion (beta={beta:g})", W, info=inf)


def select_poe(bank) -> Selection:
    """Product of the prompt Gaussians per class (per dimension): precision-weighted mean."""
    require_sigma(bank, "poe")
    prec = (-bank.logvar.float()).exp() * _valid(bank)[..., None]   # [C, T, D]; absent prompts: 0
    tot = prec.sum(1)                                         # [C, D]
    mu = (prec * bank.mu_normed).sum(1) / tot
    logvar = (-tot.log())
    W = prec.mean(2)
    W = W / W.sum(1, keepdim=True)
    return make_selection(bank, "poe", "product of Gaussians", W, mu=F.normalize(mu, dim=-1), logvar=logvar,
                          info={"rule": "mu = sum_t mu_t / sigma^2_t / sum_t 1 / sigma^2_t (per dim), renormalised; "
                               "sigma^2 = 1 / sum_t 1 / sigma^2_t; weights shown = mean precision share"})


# ----------------------------------------------------------------------------- selection-split machinery

def default_k_values(T: int) -> list[int]:
    return list(range(1, T + 1))


def _score_grid(bank, feats, labels, k_values):
    """``(S, y, k_values)``: :func:`topk_score_tensor` of labelled images over the K grid (default every K)."""
    x, _ = as_feats(feats)
    k_values = list(k_values or default_k_values(bank.num_templates))
    return topk_score_tensor(bank, x, k_values), torch.as_tensor(labels).long(), k_values


def topk_score_tensor(bank, x_normed: torch.Tensor, k_values: Sequence[int]) -> torch.Tensor:
    """S[n, c, j]: cosine of image n with class c's top-``k_values[j]`` CLIP-average classifier."""
    unc = require_sigma(bank, "topk")
    order = uncertainty_order(unc)                            # [C, T]
    mun = bank.mu_normed
    sorted_mu = torch.gather(mun, 1, order[:, :, None].expand_as(mun))
    cum = sorted_mu.cumsum(1)                                 # [C, T, D]
    kidx = torch.as_tensor(list(k_values)).long()[None] - 1   # [1, nK]
    kidx = torch.minimum(kidx, _valid(bank).sum(1, keepdim=True) - 1)   # a K beyond a class's pool: all of it
    emb = F.normalize(torch.gather(cum, 1, kidx[..., None].expand(-1, -1, cum.shape[2])), dim=-1)   # [C, nK, D]
    return torch.einsum("nd,ckd->nck", x_normed, emb)


def _ll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=1).gather(1, y[:, None]).squeeze(1)


def fit_scale(scores: torch.Tensor, y: torch.Tensor) -> float:
    """Softmax temperature (logit scale) maximising the log-likelihood of ``y``, grid 1..1000."""
    grid = torch.logspace(0, 3, 61, dtype=torch.float64)
    lp = torch.log_softmax(grid[:, None, None] * scores.double()[None], dim=2)     # [G, N, C]
    ll = lp.gather(2, y[None, :, None].expand(len(grid), -1, 1)).sum((1, 2))
    return float(grid[int(torch.argmax(ll))])


def _argmax_prefer_last(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """argmax that returns the LAST maximal index (larger K wins ties)."""
    n = v.shape[dim]
    return n - 1 - torch.argmax(v.flip(dim), dim=dim)


def choose_global_k(S: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[int, torch.Tensor]:
    """Index into k_values maximising the summed selection log-likelihood; also the curve."""
    lp = torch.log_softmax(scale * S.double(), dim=1)                                # [N, C, nK]
    ll = lp.gather(1, y[:, None, None].expand(-1, 1, S.shape[2])).squeeze(1).sum(0)  # [nK]
    return int(_argmax_prefer_last(ll)), ll


def per_class_map_k(S: torch.Tensor, y: torch.Tensor, scale: float, g: int, k_values: Sequence[int],
                    tau: float) -> torch.Tensor:
    """Per-class index into k_values: argmax_k J_c(k) + log prior(k | K_g, tau) (:func:`select_auto`)."""
    N, C, nK = S.shape
    if tau == 0:
        return torch.full((C,), g, dtype=torch.long)
    Z = scale * S.double()                                    # [N, C, nK]
    L0 = Z[:, :, g]                                           # [N, C]
    lse = torch.logsumexp(L0, 1, keepdim=True)
    rest = (-torch.expm1(L0 - lse)).clamp_min(1e-300).log() + lse   # logsumexp_{j != c}
    tgt_other = L0.gather(1, y[:, None])                      # [N, 1]
    is_c = (y[:, None] == torch.arange(C)[None, :])           # [N, C]
    J = torch.zeros(C, nK, dtype=torch.float64)
    step = max(1, int(2e7 // max(1, N * nK)))
    for c0 in range(0, C, step):
        c1 = min(C, c0 + step)
        Zc = Z[:, c0:c1]                                      # [N, cc, nK]
        new_lse = torch.logaddexp(rest[:, c0:c1, None], Zc)
        tgt = torch.where(is_c[:, c0:c1, None], Zc, tgt_other[:, :, None].expand_as(Zc))
        J[c0:c1] = (tgt - new_lse).sum(0)
    logk = torch.log(torch.as_tensor(list(k_values), dtype=torch.float64))
    if math.isinf(tau):
        prior = torch.zeros(nK, dtype=torch.float64)
    else:
        prior = -(logk - logk[g]) ** 2 / (2 * tau ** 2)
    return _argmax_prefer_last(J + prior[None, :], dim=1)


def _folds(y: torch.Tensor, n_folds: int) -> torch.Tensor:
    """Stratified deterministic folds: the i-th image of each class (in index order) goes to i % F."""
    fold = torch.empty_like(y)
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        fold[idx] = torch.arange(len(idx)) % n_folds
    return fold


def _fit_auto(S, y, k_values, tau):
    all_j = len(k_values) - 1
    scale = fit_scale(S[:, :, all_j], y)
    g, curve = choose_global_k(S, y, scale)
    kc = per_class_map_k(S, y, scale, g, k_values, tau)
    return scale, g, kc, curve


def _gather_classes(S, kc):
    return S[:, torch.arange(S.shape[1]), kc]                 # [N, C]


def run_global(bank, given: StrategyInputs) -> Selection:
    """The paper's "same top-K for all classes", with K chosen on the labelled selection split."""
    S, y, k_values = _score_grid(bank, *given.select, given.request.k_values)
    scale, g, _, curve = _fit_auto(S, y, k_values, 0.0)
    K = k_values[g]
    sel = select_topk(bank, K)
    sel.strategy, sel.label = "global", f"global top-K (K={K}, selection split)"
    sel.info.update({"data_used": given.select_data, "n_select_images": int(len(y)), "scale": scale,
                     "criterion": "selection-split log-likelihood", "k_values": k_values,
                     "select_loglik_curve": [float(v) for v in curve]})
    return sel


def select_auto(bank, select_feats=None, select_labels=None, k_values=None, *, taus=TAU_GRID,
                threshold_c: float = 1.0, data: str = "selection split") -> Selection:
    """``--topk auto``: per-class K with shrinkage to the global K, on the labelled selection split.

    With a softmax temperature fitted for ``all`` and K_g maximising the selection log-likelihood, per class
    (the others at K_g) ``K_c = argmax_k J_c(k) - (log k - log K_g)^2 / (2 tau^2)``; ``tau`` from ``taus``
    by stratified cross-validation (F = min(5, images per class) folds) with the one-standard-error rule, 0.5
    without CV. Without a selection split: :func:`select_threshold`.
    """
    unc = require_sigma(bank, "auto")
    if select_feats is None or select_labels is None:
        sel = select_threshold(bank, threshold_c)
        sel.strategy = "auto"
        sel.label = "auto (label-free)"
        sel.info["variant"] = "label-free (no selection split)"
        return sel
    S, y, k_values = _score_grid(bank, select_feats, select_labels, k_values)
    counts = torch.bincount(y, minlength=bank.num_classes)
    n_folds = int(min(5, counts[counts > 0].min().item())) if (counts > 0).any() else 0
    cv = {}
    if n_folds >= 2 and len(taus) > 1:
        fold = _folds(y, n_folds)
        per_image = {}
        for tau in taus:
            ll = torch.zeros(len(y), dtype=torch.float64)
            for f in range(n_folds):
                tr, te = fold != f, fold == f
                scale, g, kc, _ = _fit_auto(S[tr], y[tr], k_values, tau)
                ll[te] = _ll(scale * _gather_classes(S[te], kc), y[te])
            per_image[tau] = ll
            cv[tau] = ll.sum().item()
        best_tau = max(cv, key=lambda t: cv[t])
        tau = best_tau   # the most-shrunk tau within one standard error (of per-image differences) of the best
        for t in sorted(taus):
            d = per_image[best_tau] - per_image[t]
            if d.sum().item() <= math.sqrt(len(d)) * d.std().item() + 1e-9:
                tau = t
                break
    else:
        tau = 0.5 if len(taus) > 1 else taus[0]
    scale, g, kc, curve = _fit_auto(S, y, k_values, tau)
    M = topk_mask(unc, torch.as_tensor([k_values[j] for j in kc.tolist()]))
    ks = M.sum(1).tolist()   # the K searched, capped at each class's pool size
    info = {"variant": "selection split", "data_used": data, "n_select_images": int(len(y)),
            "images_per_class_min": int(counts.min().item()), "scale": scale,
            "k_global": k_values[g], "tau": (None if math.isinf(tau) else tau),
            "tau_is_inf": math.isinf(tau), "cv_folds": n_folds,
            "cv_heldout_loglik": {("inf" if math.isinf(t) else str(t)): v for t, v in cv.items()},
            "k_values": k_values, "select_loglik_curve": [float(v) for v in curve],
            "rule": "K_c = argmax_k J_c(k) - (log k - log K_g)^2 / (2 tau^2); tau by CV"}
    return make_selection(bank, "auto", "auto (selection split)", M.float(), k=ks, info=info)


def run_fusion_select(bank, given: StrategyInputs) -> Selection:
    """Precision-weighted fusion with beta (of :data:`BETA_GRID`) chosen by selection-split log-likelihood."""
    x, _ = as_feats(given.select[0])
    y = torch.as_tensor(given.select[1]).long()
    base = select_all(bank)
    scale = fit_scale(x @ base.class_mu.T, y)
    lls = {}
    for b in BETA_GRID:
        sel = select_fusion(bank, b)
        lls[b] = _ll(scale * (x @ sel.class_mu.T), y).sum().item()
    best = max(lls.values())
    beta = min(b for b, v in lls.items() if v >= best - 1e-9)
    return select_fusion(bank, beta, strategy="fusion-select", label=f"fusion (beta={beta:g}, selection split)",
                         info={"data_used": given.select_data, "scale": scale, "beta_grid": list(BETA_GRID),
                               "select_loglik": {str(b): v for b, v in lls.items()}})


# ----------------------------------------------------------------------------- evaluation-label oracle

def select_oracle(bank, eval_feats, eval_labels, k_values=None) -> Selection:
    """PCME++ Table 6 "best top-K per class": per class the K with the best class accuracy when every class
    uses that K, searched ON THE EVALUATION LABELS (marked as such)."""
    unc = require_sigma(bank, "oracle")
    S, y, k_values = _score_grid(bank, eval_feats, eval_labels, k_values)
    C = bank.num_classes
    pred = S.argmax(1)                                        # [N, nK]
    correct = (pred == y[:, None]).double()
    counts = torch.bincount(y, minlength=C).double().clamp_min(1)
    recall = torch.zeros(C, len(k_values), dtype=torch.float64)
    recall.index_add_(0, y, correct)
    recall = recall / counts[:, None]
    kc = _argmax_prefer_last(recall, dim=1)
    M = topk_mask(unc, torch.as_tensor([k_values[j] for j in kc.tolist()]))
    ks = M.sum(1).tolist()   # the K searched, capped at each class's pool size
    acc_curve = correct.mean(0)
    return make_selection(bank, "oracle", "oracle per-class K (EVAL LABELS)", M.float(), k=ks, uses_eval_labels=True,
                          info={"data_used": "evaluation split labels", "k_values": k_values,
                                "eval_acc_curve": [float(v) for v in acc_curve],
                                "rule": "K_c = argmax_k recall_c(all classes at top-k); ties -> larger k"})


def run_oracle_global(bank, given: StrategyInputs) -> Selection:
    """The one K for every class with the best accuracy ON THE EVALUATION LABELS."""
    S, y, k_values = _score_grid(bank, *given.eval_, given.request.k_values)
    acc = (S.argmax(1) == y[:, None]).double().mean(0)
    K = k_values[int(_argmax_prefer_last(acc))]
    sel = select_topk(bank, K)
    sel.strategy, sel.label, sel.uses_eval_labels = "oracle-global", f"oracle global K={K} (EVAL LABELS)", True
    sel.info.update({"data_used": "evaluation split labels", "eval_acc_curve": [float(v) for v in acc]})
    return sel


# ----------------------------------------------------------------------------- the registry's runners

def run_all(bank, given: StrategyInputs) -> Selection:
    return select_all(bank)


def run_single(bank, given: StrategyInputs) -> Selection:
    return select_single(bank)


def run_topk(bank, given: StrategyInputs) -> Selection:
    return select_topk(bank, given.request.k)


def run_threshold(bank, given: StrategyInputs) -> Selection:
    return select_threshold(bank, given.request.threshold_c)


def run_fusion(bank, given: StrategyInputs) -> Selection:
    return select_fusion(bank, given.request.beta)


def run_poe(bank, given: StrategyInputs) -> Selection:
    return select_poe(bank)


def run_auto(bank, given: StrategyInputs) -> Selection:
    if given.select is None:  # the label-free rule
        return select_auto(bank, threshold_c=given.request.threshold_c)
    return select_auto(bank, given.select[0], given.select[1], given.request.k_values,
                       threshold_c=given.request.threshold_c, data=given.select_data)


def run_oracle(bank, given: StrategyInputs) -> Selection:
    return select_oracle(bank, given.eval_[0], given.eval_[1], given.request.k_values)


# ----------------------------------------------------------------------------- dispatcher

def run_strategy(name: str, bank, request=None, *, select=None, pool=None, eval_=None,
                 select_data: str = "selection split", pool_data: str = "unlabelled images", **fields) -> Selection:
    """One strategy by name, with the options of ``request`` (or its fields as keywords); ``select`` /
    ``eval_``: ``(feats, labels)``, ``pool``: unlabelled feats, of which it receives only what its entry
    declares. Refused in one line: an unknown name, a missing K or needed input, a model without sigma^2
    for a strategy that reads it (:class:`~zsprob.zeroshot.selection_base.NeedsSigma`)."""
    entry = get_strategy(name)
    request = as_request(request, **fields)
    entry.check_k(request.k)
    select = entry.shots_source(request.shots_split, select, eval_)
    entry.check_data(select=select, pool=pool, eval_=eval_)
    if entry.sigma:
        require_sigma(bank, name)
    return entry.run(bank, entry.inputs(request, select=select, pool=pool, eval_=eval_, select_data=select_data,
                                        pool_data=pool_data))
