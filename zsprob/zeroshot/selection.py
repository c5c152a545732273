"""Prompt-selection strategies: from a prompt bank to one class embedding (mu, sigma^2) per class.

Everything here is tensor math on a :class:`~zsprob.zeroshot.prompts.PromptBank` (means are
L2-normalised per prompt first, the CLIP convention) and, for the strategies that look at
images, on precomputed image embeddings. Nothing here encodes text or images. zsprob writes
all of it itself; the reference for ``all`` is open_clip's ``build_zero_shot_classifier``
(tested equal), for ``bprw`` ProLIP's ``analysis/unc_zeroshot_prompts.py`` and for ``zpe``
the authors' notebook of Allingham et al. (2023); neither is copied.

Which data each strategy reads (``Selection.uses_eval_labels`` records the last column; the
registry, :mod:`zsprob.zeroshot.strategy_registry`, holds these facts and the ``--compare`` order,
and :func:`run_strategy` dispatches through it to the ``_run_*`` functions at the end of this module):

==================  ===========================================================  ===========
strategy            what it does                                                  eval labels
==================  ===========================================================  ===========
all                 mean of the normalised means of all T templates, renormalised  no
single              one template ("a photo of a {}." if present, else the first)   no
topk (K)            per class the K lowest-uncertainty templates, CLIP average     no
global              ``topk`` with the K that maximises the selection-split          no
                    log-likelihood (labelled selection split)
auto                per-class K on the labelled selection split, shrunk towards    no
                    the global K (Bayesian MAP, shrinkage chosen by CV); without
                    a selection split falls back to ``threshold``
threshold           label-free: keep templates with u <= mean_c + c * std_c          no
                    (ProLIP's ``by_std_values_per_class``; c = 1 by default)
fusion              precision weights w ∝ u^-beta (beta = 1: inverse ||sigma^2||_1)  no
fusion-select       the same with beta chosen on the selection split                no
poe                 per-dimension product of the prompt Gaussians                   no
bprw                ProLIP Bayesian prompt re-weighting: EM for prompt mixture     no (uses
                    weights on samples of the nearest unlabelled images            unlabelled
zpe                 ZPE (Allingham et al. 2023): prompt scores from normalised     images)
                    max-logits on unlabelled images, softmax weights
oracle              per-class best K searched on the evaluation labels (PCME++     YES
                    Table 6 protocol); ``oracle-global`` the eval-best global K
==================  ===========================================================  ===========

Ties: templates are ranked by ``||sigma^2||_1`` with a *stable* sort, so equal
uncertainties keep template-file order (the earlier template is kept first). When two K
are equally good, the larger K (closer to ``all``) wins.

The ``auto`` rule, exactly (``select_auto``):
1. ``S[n, c, k]`` = cosine between selection image ``n`` and class ``c``'s top-``k``
   classifier, for every ``k`` in ``k_values`` (default 1..T).
2. A softmax temperature ``s`` is fitted by maximum likelihood on the selection split for
   the ``all`` classifier (grid over 1..1000, log-spaced).
3. Global K: ``K_g = argmax_k sum_n log softmax(s * S[n, :, k])[y_n]``.
4. Per class, with every other class at ``K_g``: the selection log-likelihood ``J_c(k)``
   of ALL selection images when class ``c`` uses top-``k`` (class ``c`` is a candidate
   in every image's softmax), plus a log-normal prior centred at ``K_g``:
   ``K_c = argmax_k J_c(k) - (log k - log K_g)^2 / (2 tau^2)`` (one coordinate-ascent pass).
5. ``tau`` (the shrinkage) is chosen from {0, 0.25, 0.5, 1, 2, inf} by stratified
   ``F``-fold cross-validation on the selection split (``F = min(5, images per class)``),
   with the one-standard-error rule: the most-shrunk ``tau`` whose held-out log-likelihood is
   within one standard error (of the per-image differences) of the best. ``tau = 0`` is the
   global K; with one image per class no CV is possible and ``tau = 0.5``.
A handful of images thus moves a class away from ``K_g`` only when the held-out
likelihood says per-class choices generalise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from zsprob.errors import UserError
from zsprob.zeroshot.strategy_registry import StrategyInputs, get_strategy, strategies_without_runner, strategy_runner

SINGLE_TEMPLATE = "a photo of a {}."
TAU_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, math.inf)
BETA_GRID = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class NeedsSigma(UserError):
    """The strategy ranks or weights prompts by sigma^2, and the model has none."""


@dataclass
class Selection:
    """The outcome of a strategy: per class template weights and one class Gaussian.

    ``weights`` [C, T] (rows sum to 1; 0 = template not used), ``class_mu`` [C, D] (unit norm
    when ``normalized``), ``class_logvar`` [C, D] or ``None``, ``k`` per-class number of kept
    templates for hard selections (else ``None``), ``info``: how it was chosen.
    """

    strategy: str
    label: str
    classnames: list[str]
    templates: list[str]
    weights: torch.Tensor
    class_mu: torch.Tensor
    class_logvar: torch.Tensor | None
    uncertainty: torch.Tensor | None = None  # [C, T] prompt uncertainties of the bank
    k: list[int] | None = None
    uses_eval_labels: bool = False
    normalized: bool = True
    info: dict = field(default_factory=dict)

    @property
    def class_uncertainty(self) -> torch.Tensor | None:
        return None if self.class_logvar is None else self.class_logvar.exp().sum(-1)

    def to_dict(self, *, model: dict | None = None, data: dict | None = None) -> dict:
        """The selection.json document (readable by humans and by :meth:`from_dict`)."""
        from zsprob import __version__

        classes = []
        W = self.weights
        for c, name in enumerate(self.classnames):
            kept = []
            idx = torch.nonzero(W[c] > 0).flatten().tolist()
            idx.sort(key=lambda t: (-float(W[c, t]), t))
            for t in idx:
                kept.append({"template": self.templates[t], "index": t, "weight": float(W[c, t]),
                             "uncertainty": None if self.uncertainty is None else float(self.uncertainty[c, t])})
            classes.append({
                "name": name,
                "k": None if self.k is None else int(self.k[c]),
                "kept": kept,
                "mu": [float(v) for v in self.class_mu[c]],
                "sigma2": None if self.class_logvar is None else [float(v) for v in self.class_logvar[c].exp()],
            })
        return {
            "format": "zsprob-selection/1",
            "zsprob_version": __version__,
            "strategy": self.strategy,
            "label": self.label,
            "uses_eval_labels": bool(self.uses_eval_labels),
            "how": {"strategy": self.strategy, "k_global": self.info.get("k_global"), **self.info},
            "data": data or {},
            "model": model or {},
            "normalized": bool(self.normalized),
            "embed_dim": int(self.class_mu.shape[1]),
            "templates": list(self.templates),
            "classes": classes,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "selection") -> "Selection":
        from zsprob.zeroshot.prompts import check_selection_document

        check_selection_document(d, source)
        try:
            if d.get("format") != "zsprob-selection/1":
                raise KeyError("format")
            templates = list(d["templates"])
            classes = d["classes"]
            C, T = len(classes), len(templates)
            W = torch.zeros(C, T)
            U = torch.full((C, T), float("nan"))
            mus, sig = [], []
            for c, entry in enumerate(classes):
                for kept in entry["kept"]:
                    W[c, int(kept["index"])] = float(kept["weight"])
                    if kept.get("uncertainty") is not None:
                        U[c, int(kept["index"])] = float(kept["uncertainty"])
                mus.append(torch.tensor(entry["mu"], dtype=torch.float32))
                sig.append(None if entry.get("sigma2") is None else torch.tensor(entry["sigma2"]))
            mu = torch.stack(mus)
            logvar = None if any(s is None for s in sig) else torch.stack(sig).clamp_min(1e-30).log()
            ks = [e.get("k") for e in classes]
            return cls(strategy=d["strategy"], label=d.get("label", d["strategy"]),
                       classnames=[e["name"] for e in classes], templates=templates, weights=W,
                       class_mu=mu, class_logvar=logvar, uncertainty=None if torch.isnan(U).all() else U,
                       k=None if any(k is None for k in ks) else [int(k) for k in ks],
                       uses_eval_labels=bool(d.get("uses_eval_labels", False)),
                       normalized=bool(d.get("normalized", True)), info=dict(d.get("how", {})))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise UserError(f"{source} is not a zsprob selection file ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- helpers

def _require_sigma(bank, strategy: str) -> torch.Tensor:
    if bank.logvar is None:
        raise NeedsSigma(f"strategy '{strategy}' ranks or weights prompts by sigma^2, but the model is "
                         "deterministic (no sigma); use 'all', 'single' or 'zpe'")
    return bank.uncertainty


def uncertainty_order(unc: torch.Tensor) -> torch.Tensor:
    """[C, T] template indices per class, most certain first; ties keep template order."""
    return torch.sort(unc, dim=1, stable=True).indices


def topk_mask(unc: torch.Tensor, k) -> torch.Tensor:
    """Boolean [C, T]: per class exactly the ``k`` lowest-uncertainty templates (``k`` int or [C])."""
    C, T = unc.shape
    k = torch.as_tensor(k).long()
    if k.dim() == 0:
        k = k.expand(C)
    if (k < 1).any() or (k > T).any():
        raise UserError(f"top-K must be between 1 and {T}, got {k.min().item()}..{k.max().item()}")
    order = uncertainty_order(unc)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(T).expand(C, T).contiguous())
    return rank < k[:, None]


def combine(bank, weights: torch.Tensor, *, renormalize: bool = True, var_rule: str = "mean"):
    """Class Gaussians from per-class template weights (rows are normalised to sum to 1).

    mu_c = sum_t w_ct * mu_ct / ||mu_ct|| (then renormalised when ``renormalize``);
    sigma^2_c = sum_t w_ct sigma^2_ct (``mean``) or sum_t w_ct^2 sigma^2_ct (``avg`` -- the
    variance of the weighted average of independent Gaussians, ProLIP's BPRW rule).
    """
    W = weights.float()
    W = W / W.sum(1, keepdim=True).clamp_min(1e-30)
    mu = torch.einsum("ct,ctd->cd", W, bank.mu_normed)
    if renormalize:
        mu = F.normalize(mu, dim=-1)
    logvar = None
    if bank.logvar is not None:
        var = bank.var
        coef = W if var_rule == "mean" else W ** 2
        logvar = torch.einsum("ct,ctd->cd", coef, var).clamp_min(1e-30).log()
    return W, mu, logvar


def _make(bank, strategy, label, W, *, k=None, renormalize=True, var_rule="mean", info=None,
          uses_eval_labels=False, mu=None, logvar=None) -> Selection:
    Wn, cmu, clv = combine(bank, W, renormalize=renormalize, var_rule=var_rule)
    return Selection(strategy=strategy, label=label, classnames=list(bank.classnames),
                     templates=list(bank.templates), weights=Wn,
                     class_mu=cmu if mu is None else mu, class_logvar=clv if logvar is None else logvar,
                     uncertainty=bank.uncertainty, k=None if k is None else [int(v) for v in k],
                     uses_eval_labels=uses_eval_labels, normalized=renormalize, info=dict(info or {}))


def _as_feats(feats):
    """(mu, logvar) or a bare mu tensor -> (normalised mu, logvar or None)."""
    if isinstance(feats, (tuple, list)):
        mu, logvar = feats[0], (feats[1] if len(feats) > 1 else None)
    else:
        mu, logvar = feats, None
    return F.normalize(mu.float(), dim=-1), (None if logvar is None else logvar.float())


# ----------------------------------------------------------------------------- label-free strategies

def select_all(bank) -> Selection:
    C, T = bank.num_classes, bank.num_templates
    return _make(bank, "all", "all", torch.ones(C, T), k=[T] * C, info={"k_global": T})


def select_single(bank, template: str | None = None) -> Selection:
    if template is None:
        template = SINGLE_TEMPLATE if SINGLE_TEMPLATE in bank.templates else bank.templates[0]
    if template not in bank.templates:
        raise UserError(f"template {template!r} is not in the prompt bank")
    t = bank.templates.index(template)
    W = torch.zeros(bank.num_classes, bank.num_templates)
    W[:, t] = 1
    return _make(bank, "single", "single", W, k=[1] * bank.num_classes, info={"template": template})


def select_topk(bank, k: int) -> Selection:
    unc = _require_sigma(bank, "topk")
    k = int(k)
    M = topk_mask(unc, k)
    return _make(bank, "topk", f"topk-{k}", M.float(), k=[k] * bank.num_classes,
                 info={"k_global": k, "ties": "stable sort: equal uncertainty keeps template order"})


def select_threshold(bank, c: float = 1.0) -> Selection:
    """ProLIP's per-class rule: keep templates with u <= mean(u_c) + c * std(u_c) (at least one)."""
    unc = _require_sigma(bank, "threshold")
    thr = unc.mean(1, keepdim=True) + c * unc.std(1, keepdim=True)
    M = unc <= thr
    empty = ~M.any(1)
    if empty.any():
        M[empty] = unc[empty] == unc[empty].min(1, keepdim=True).values
    ks = M.sum(1).tolist()
    return _make(bank, "threshold", "auto (label-free)", M.float(), k=ks,
                 info={"rule": "u <= mean_c(u) + c * std_c(u) per class (ProLIP by_std_values_per_class)",
                       "c": c, "data_used": "none (text uncertainties only)"})


def select_fusion(bank, beta: float = 1.0, *, strategy: str = "fusion", label: str | None = None,
                  info: dict | None = None) -> Selection:
    """Uncertainty-weighted fusion: w_ct ∝ u_ct^-beta (beta = 1: precision weighting)."""
    unc = _require_sigma(bank, strategy)
    logw = -beta * unc.clamp_min(1e-30).log()
    W = torch.softmax(logw, dim=1)
    inf = {"rule": "w_ct proportional to ||sigma^2_ct||_1 ** -beta", "beta": beta}
    inf.update(info or {})
    return _make(bank, strategy, label or f"fusion (beta={beta:g})", W, info=inf)


def select_poe(bank) -> Selection:
    """Product of the prompt Gaussians per class (per dimension): precision-weighted mean."""
    _require_sigma(bank, "poe")
    prec = (-bank.logvar.float()).exp()                       # [C, T, D]
    tot = prec.sum(1)                                         # [C, D]
    mu = (prec * bank.mu_normed).sum(1) / tot
    logvar = (-tot.log())
    W = prec.mean(2)
    W = W / W.sum(1, keepdim=True)
    return _make(bank, "poe", "product of Gaussians", W, mu=F.normalize(mu, dim=-1), logvar=logvar,
                 info={"rule": "mu = sum_t mu_t / sigma^2_t / sum_t 1 / sigma^2_t (per dim), renormalised; "
                               "sigma^2 = 1 / sum_t 1 / sigma^2_t; weights shown = mean precision share"})


# ----------------------------------------------------------------------------- selection-split machinery

def default_k_values(T: int) -> list[int]:
    return list(range(1, T + 1))


def topk_score_tensor(bank, x_normed: torch.Tensor, k_values: Sequence[int]) -> torch.Tensor:
    """S[n, c, j]: cosine of image n with class c's top-``k_values[j]`` CLIP-average classifier."""
    unc = _require_sigma(bank, "topk")
    order = uncertainty_order(unc)                            # [C, T]
    mun = bank.mu_normed
    sorted_mu = torch.gather(mun, 1, order[:, :, None].expand_as(mun))
    cum = sorted_mu.cumsum(1)                                 # [C, T, D]
    kidx = torch.as_tensor(list(k_values)).long() - 1
    emb = F.normalize(cum[:, kidx], dim=-1)                   # [C, nK, D]
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
    """Per-class index into k_values: argmax_k J_c(k) + log prior(k | K_g, tau) (see module doc)."""
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
    N, C, _ = S.shape
    return S[:, torch.arange(C), kc]                          # [N, C]


def _check_labels(y, C, what):
    y = torch.as_tensor(y).long()
    if y.numel() == 0:
        raise UserError(f"{what}: no labelled images")
    if y.min() < 0 or y.max() >= C:
        raise UserError(f"{what}: labels out of range for {C} classes")
    return y


def select_global(bank, select_feats, select_labels, k_values=None, *, data: str = "selection split") -> Selection:
    """The paper's "same top-K for all classes", with K chosen on the labelled selection split."""
    x, _ = _as_feats(select_feats)
    y = _check_labels(select_labels, bank.num_classes, "selection split")
    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, x, k_values)
    scale, g, _, curve = _fit_auto(S, y, k_values, 0.0)
    K = k_values[g]
    sel = select_topk(bank, K)
    sel.strategy, sel.label = "global", f"global top-K (K={K}, selection split)"
    sel.info.update({"data_used": data, "n_select_images": int(len(y)), "scale": scale,
                     "criterion": "selection-split log-likelihood", "k_values": k_values,
                     "select_loglik_curve": [float(v) for v in curve]})
    return sel


def select_auto(bank, select_feats=None, select_labels=None, k_values=None, *, taus=TAU_GRID,
                threshold_c: float = 1.0, data: str = "selection split") -> Selection:
    """``--topk auto``: per-class K with shrinkage to the global K (see the module docstring).

    Without a labelled selection split: the label-free :func:`select_threshold` rule.
    """
    unc = _require_sigma(bank, "auto")
    if select_feats is None or select_labels is None:
        sel = select_threshold(bank, threshold_c)
        sel.strategy = "auto"
        sel.label = "auto (label-free)"
        sel.info["variant"] = "label-free (no selection split)"
        return sel
    x, _ = _as_feats(select_feats)
    y = _check_labels(select_labels, bank.num_classes, "selection split")
    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, x, k_values)
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
        # one-standard-error rule: the most-shrunk tau whose held-out log-likelihood is within one
        # standard error (of the per-image differences) of the best
        tau = best_tau
        for t in sorted(taus):
            d = per_image[best_tau] - per_image[t]
            if d.sum().item() <= math.sqrt(len(d)) * d.std().item() + 1e-9:
                tau = t
                break
    else:
        tau = 0.5 if len(taus) > 1 else taus[0]
    scale, g, kc, curve = _fit_auto(S, y, k_values, tau)
    ks = [k_values[j] for j in kc.tolist()]
    M = topk_mask(unc, torch.as_tensor(ks))
    info = {"variant": "selection split", "data_used": data, "n_select_images": int(len(y)),
            "images_per_class_min": int(counts.min().item()), "scale": scale,
            "k_global": k_values[g], "tau": (None if math.isinf(tau) else tau),
            "tau_is_inf": math.isinf(tau), "cv_folds": n_folds,
            "cv_heldout_loglik": {("inf" if math.isinf(t) else str(t)): v for t, v in cv.items()},
            "k_values": k_values, "select_loglik_curve": [float(v) for v in curve],
            "rule": "K_c = argmax_k J_c(k) - (log k - log K_g)^2 / (2 tau^2); tau by CV"}
    return _make(bank, "auto", "auto (selection split)", M.float(), k=ks, info=info)


def select_fusion_tuned(bank, select_feats, select_labels, betas=BETA_GRID, *,
                        data: str = "selection split") -> Selection:
    """Precision-weighted fusion with beta chosen by selection-split log-likelihood."""
    _require_sigma(bank, "fusion-select")
    x, _ = _as_feats(select_feats)
    y = _check_labels(select_labels, bank.num_classes, "selection split")
    base = select_all(bank)
    scale = fit_scale(x @ base.class_mu.T, y)
    lls = {}
    for b in betas:
        sel = select_fusion(bank, b)
        lls[b] = _ll(scale * (x @ sel.class_mu.T), y).sum().item()
    best = max(lls.values())
    beta = min(b for b, v in lls.items() if v >= best - 1e-9)
    return select_fusion(bank, beta, strategy="fusion-select", label=f"fusion (beta={beta:g}, selection split)",
                         info={"data_used": data, "scale": scale, "beta_grid": list(betas),
                               "select_loglik": {str(b): v for b, v in lls.items()}})


# ----------------------------------------------------------------------------- evaluation-label oracle

def select_oracle(bank, eval_feats, eval_labels, k_values=None) -> Selection:
    """PCME++ Table 6 "best top-K per class": per class the K with the best class accuracy
    when every class uses that K, searched ON THE EVALUATION LABELS (marked as such)."""
    unc = _require_sigma(bank, "oracle")
    x, _ = _as_feats(eval_feats)
    y = _check_labels(eval_labels, bank.num_classes, "evaluation split")
    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, x, k_values)
    C = bank.num_classes
    pred = S.argmax(1)                                        # [N, nK]
    correct = (pred == y[:, None]).double()
    counts = torch.bincount(y, minlength=C).double().clamp_min(1)
    recall = torch.zeros(C, len(k_values), dtype=torch.float64)
    recall.index_add_(0, y, correct)
    recall = recall / counts[:, None]
    kc = _argmax_prefer_last(recall, dim=1)
    ks = [k_values[j] for j in kc.tolist()]
    M = topk_mask(unc, torch.as_tensor(ks))
    acc_curve = correct.mean(0)
    return _make(bank, "oracle", "oracle per-class K (EVAL LABELS)", M.float(), k=ks, uses_eval_labels=True,
                 info={"data_used": "evaluation split labels", "k_values": k_values,
                       "eval_acc_curve": [float(v) for v in acc_curve],
                       "rule": "K_c = argmax_k recall_c(all classes at top-k); ties -> larger k"})


def select_oracle_global(bank, eval_feats, eval_labels, k_values=None) -> Selection:
    x, _ = _as_feats(eval_feats)
    y = _check_labels(eval_labels, bank.num_classes, "evaluation split")
    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, x, k_values)
    acc = (S.argmax(1) == y[:, None]).double().mean(0)
    K = k_values[int(_argmax_prefer_last(acc))]
    sel = select_topk(bank, K)
    sel.strategy, sel.label, sel.uses_eval_labels = "oracle-global", f"oracle global K={K} (EVAL LABELS)", True
    sel.info.update({"data_used": "evaluation split labels", "eval_acc_curve": [float(v) for v in acc]})
    return sel


# ----------------------------------------------------------------------------- published baselines

def _em_mixture_weights(obs, means, var, *, alpha=5.0, prior="inverse", tol=1e-12, max_iter=1000):
    """MAP mixing proportions (Dirichlet(alpha) prior) of fixed diagonal Gaussians, batched over classes.

    obs [B, M, D], means / var [B, T, D] -> pi [B, T], iterations run.
    """
    B, M, D = obs.shape
    T = means.shape[1]
    if prior == "inverse":
        pi = 1.0 / var.mean(2)
    else:
        pi = torch.ones(B, T, dtype=obs.dtype)
    pi = pi / pi.sum(1, keepdim=True)
    inv = 1.0 / var                                           # [B, T, D]
    # log N(x | m, v) = -0.5 [sum x^2/v - 2 x.(m/v) + sum m^2/v] - 0.5 sum log v - D/2 log 2pi
    logp = -0.5 * (torch.bmm(obs ** 2, inv.transpose(1, 2)) - 2 * torch.bmm(obs, (means * inv).transpose(1, 2))
                   + (means ** 2 * inv).sum(2)[:, None])
    logp = logp - 0.5 * var.log().sum(2)[:, None] - 0.5 * D * math.log(2 * math.pi)   # [B, M, T]
    it = 0
    for it in range(max_iter):
        r = torch.softmax(logp + pi.log()[:, None], dim=2)
        nk = r.sum(1)
        new = (nk + alpha - 1).clamp_min(0) / (M + T * (alpha - 1))
        new = new / new.sum(1, keepdim=True)
        done = bool((torch.linalg.vector_norm(new - pi, dim=1) < tol).all())
        pi = new
        if done:
            break
    return pi, it + 1


def select_bprw(bank, pool_feats, *, n_neighbors: int = 10, n_samples: int = 10, alpha: float = 5.0,
                var_mult: float = 1.0, stable_eps: float = 0.02, prior: str = "inverse", seed: int = 0,
                data: str = "unlabelled images") -> Selection:
    """ProLIP's Bayesian prompt re-weighting (BPRW), defaults = its "use NN" setting (5-1-10-10-0.02-inverse).

    Per class: the ``n_neighbors`` unlabelled images nearest to the class's average prompt mean,
    ``n_samples`` draws from each image Gaussian, then EM for the mixing proportions of the
    class's prompt Gaussians N(mu_t, var_mult * sigma^2_t + stable_eps) under a Dirichlet(alpha)
    prior. Class mean = sum_t pi_t mu_t (not renormalised, as in ProLIP), sigma^2 = sum_t pi_t^2 sigma^2_t.
    """
    _require_sigma(bank, "bprw")
    x, xlv = _as_feats(pool_feats)
    if x.shape[0] == 0:
        raise UserError("bprw needs unlabelled images")
    gen = torch.Generator().manual_seed(seed)
    mun = bank.mu_normed.double()
    var = bank.var.double() * var_mult + stable_eps
    C, T, D = mun.shape
    nn_k = min(n_neighbors, x.shape[0])
    sims = x.double() @ mun.mean(1).T                        # [N, C]
    idx = torch.topk(sims, nn_k, dim=0).indices.T             # [C, nn_k]
    m = x.double()[idx]                                       # [C, nn_k, D]
    if xlv is not None:
        std = (0.5 * xlv.double()[idx]).exp()
        eps = torch.randn(C, nn_k, n_samples, D, generator=gen, dtype=torch.float64)
        obs = (m[:, :, None] + eps * std[:, :, None]).reshape(C, nn_k * n_samples, D)
    else:
        obs = m
    W = torch.zeros(C, T, dtype=torch.float64)
    iters = []
    step = max(1, int(4e6 // max(1, obs.shape[1] * T * 4)))
    for c0 in range(0, C, step):
        pi, n_it = _em_mixture_weights(obs[c0:c0 + step], mun[c0:c0 + step], var[c0:c0 + step], alpha=alpha,
                                       prior=prior)
        W[c0:c0 + step] = pi
        iters.append(n_it)
    W = W.float()
    return _make(bank, "bprw", "ProLIP BPRW", W, renormalize=False, var_rule="avg",
                 info={"data_used": data, "n_pool_images": int(x.shape[0]), "n_neighbors": nn_k,
                       "n_samples": n_samples, "alpha": alpha, "var_mult": var_mult, "stable_eps": stable_eps,
                       "prior": prior, "seed": seed, "em_iterations_max": max(iters),
                       "reference": "ProLIP (Chun et al., ICLR 2025) analysis/unc_zeroshot_prompts.py bprw"})


def select_zpe(bank, pool_feats, *, logit_scale: float = 100.0, reference_feats=None,
               data: str = "unlabelled images") -> Selection:
    """ZPE (Allingham et al., ICML 2023): one weight per template, shared by all classes.

    logits l[n, t, c] = logit_scale * cos(x_n, mu_tc); normalised by subtracting the mean over
    images per (t, c) -- the unlabelled pool's mean, averaged with a reference (pre-training-
    like) set's mean when ``reference_feats`` is given (the authors' "both" mode); score
    s_t = mean_n max_c normalised l[n, t, c]; weights = softmax_t(s_t); class vector =
    sum_t w_t mu_tc (the weighted average of logits, not renormalised). Works without sigma.
    """
    x, _ = _as_feats(pool_feats)
    if x.shape[0] == 0:
        raise UserError("zpe needs unlabelled images")
    mun = bank.mu_normed                                      # [C, T, D]
    C, T, D = mun.shape
    scores = torch.zeros(T, dtype=torch.float64)
    ref_mean = None
    if reference_feats is not None:
        r, _ = _as_feats(reference_feats)
        ref_mean = logit_scale * torch.einsum("nd,ctd->tc", r, mun) / r.shape[0]
    for t in range(T):
        lt = logit_scale * (x @ mun[:, t].T)                  # [N, C]
        mean = lt.mean(0, keepdim=True)
        if ref_mean is not None:
            mean = 0.5 * (mean + ref_mean[t][None])
        scores[t] = (lt - mean).max(1).values.double().mean()
    w = torch.softmax(scores, 0).float()
    W = w[None].expand(C, T).contiguous()
    return _make(bank, "zpe", "ZPE", W, renormalize=False, var_rule="mean",
                 info={"data_used": data, "n_pool_images": int(x.shape[0]), "logit_scale": logit_scale,
                       "debias": "test+reference" if ref_mean is not None else "test (unlabelled pool mean)",
                       "template_scores": [float(v) for v in scores],
                       "reference": "Allingham et al., ICML 2023, Algorithm 2 / authors' notebook"})


# ----------------------------------------------------------------------------- the registry's functions
# each built-in strategy of zsprob.zeroshot.strategy_registry: fn(bank, StrategyInputs) -> Selection

@strategy_runner("all")
def _run_all(bank, given: StrategyInputs) -> Selection:
    return select_all(bank)


@strategy_runner("single")
def _run_single(bank, given: StrategyInputs) -> Selection:
    return select_single(bank, given.template)


@strategy_runner("topk")
def _run_topk(bank, given: StrategyInputs) -> Selection:
    return select_topk(bank, given.k)


@strategy_runner("threshold")
def _run_threshold(bank, given: StrategyInputs) -> Selection:
    return select_threshold(bank, given.threshold_c)


@strategy_runner("fusion")
def _run_fusion(bank, given: StrategyInputs) -> Selection:
    return select_fusion(bank, given.beta)


@strategy_runner("poe")
def _run_poe(bank, given: StrategyInputs) -> Selection:
    return select_poe(bank)


@strategy_runner("auto")
def _run_auto(bank, given: StrategyInputs) -> Selection:
    if given.select is None:  # the label-free rule
        return select_auto(bank, threshold_c=given.threshold_c)
    return select_auto(bank, given.select[0], given.select[1], given.k_values, threshold_c=given.threshold_c,
                       data=given.select_data)


@strategy_runner("global")
def _run_global(bank, given: StrategyInputs) -> Selection:
    return select_global(bank, given.select[0], given.select[1], given.k_values, data=given.select_data)


@strategy_runner("fusion-select")
def _run_fusion_select(bank, given: StrategyInputs) -> Selection:
    return select_fusion_tuned(bank, given.select[0], given.select[1], data=given.select_data)


@strategy_runner("bprw")
def _run_bprw(bank, given: StrategyInputs) -> Selection:
    return select_bprw(bank, given.pool, data=given.pool_data)


@strategy_runner("zpe")
def _run_zpe(bank, given: StrategyInputs) -> Selection:
    return select_zpe(bank, given.pool, data=given.pool_data)


@strategy_runner("oracle")
def _run_oracle(bank, given: StrategyInputs) -> Selection:
    return select_oracle(bank, given.eval_[0], given.eval_[1], given.k_values)


@strategy_runner("oracle-global")
def _run_oracle_global(bank, given: StrategyInputs) -> Selection:
    return select_oracle_global(bank, given.eval_[0], given.eval_[1], given.k_values)


if strategies_without_runner():  # every registered strategy runs (the registry declares, this module runs)
    raise ImportError(f"strategies without a function: {strategies_without_runner()}")


# ----------------------------------------------------------------------------- dispatcher

def run_strategy(name: str, bank, *, k: int | None = None, select=None, pool=None, eval_=None,
                 k_values=None, threshold_c: float = 1.0, beta: float = 1.0, template: str | None = None,
                 select_data: str = "selection split", pool_data: str = "unlabelled images") -> Selection:
    """One strategy by name, through its registry entry. ``select``/``eval_`` are ``(feats, labels)``;
    ``pool`` unlabelled feats. The strategy receives only the data its entry declares.

    Refused, in this order: an unknown name, a missing K, a missing needed input, a model without
    sigma^2 for a strategy that reads it (:class:`NeedsSigma`).
    """
    entry = get_strategy(name)
    if entry.run is None:
        raise RuntimeError(f"strategy {name!r} is registered without a function (register_strategy(run=...))")
    entry.check_k(k)
    entry.check_data(select=select, pool=pool, eval_=eval_)
    if entry.sigma:
        _require_sigma(bank, name)
    given = entry.inputs(k=k, select=select, pool=pool, eval_=eval_, k_values=k_values, threshold_c=threshold_c,
                         beta=beta, template=template, select_data=select_data, pool_data=pool_data)
    return entry.run(bank, given)
