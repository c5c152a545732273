"""What every prompt-selection strategy returns and the shared steps from template weights to class Gaussians.

:class:`Selection` (per-class template weights, the class Gaussians, how they were chosen, the
selection.json document), :func:`combine` / :func:`make_selection` (weights -> class mean and sigma^2),
the uncertainty ranking (:func:`uncertainty_order`, :func:`topk_mask`) and the steps every strategy
module shares (:func:`require_sigma`, :func:`as_feats`, :func:`slot_logits`). Plain torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zsprob.errors import UserError
from zsprob.zeroshot.prompts import SELECTION_FORMAT, check_selection_document


class NeedsSigma(UserError):
    """The strategy ranks or weights prompts by sigma^2, and the model has none."""


@dataclass
class Selection:
    """The outcome of a strategy: ``weights`` [C, T] (rows sum to 1; 0 = template not used), one class
    Gaussian (``class_mu`` [C, D], unit norm when ``normalized``; ``class_logvar`` [C, D] or None), ``k`` the
    number of kept templates per class for hard selections, ``info`` how it was chosen."""

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
    class_prompts: list | None = None  # per-class prompt pools: class c's prompt in slot t (else None)

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
                if self.class_prompts is not None:
                    kept[-1]["prompt"] = self.class_prompts[c][t]
            classes.append({
                "name": name,
                "k": None if self.k is None else int(self.k[c]),
                "kept": kept,
                "mu": [float(v) for v in self.class_mu[c]],
                "sigma2": None if self.class_logvar is None else [float(v) for v in self.class_logvar[c].exp()],
            })
        return {
            "format": SELECTION_FORMAT,
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
            **({} if self.class_prompts is None else {"class_prompts": [list(p) for p in self.class_prompts]}),
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "selection") -> "Selection":
        """The selection of a selection.json document, refused in one line when it has another shape."""
        check_selection_document(d, source)
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
                   normalized=bool(d.get("normalized", True)), info=dict(d.get("how") or {}),
                   class_prompts=d.get("class_prompts"))


# ----------------------------------------------------------------------------- shared steps

def require_sigma(bank, strategy: str) -> torch.Tensor:
    if bank.logvar is None:
        raise NeedsSigma(f"strategy '{strategy}' ranks or weights prompts by sigma^2, but the model is "
                         "deterministic (no sigma); use 'all', 'single' or 'zpe'")
    return bank.uncertainty


def slot_logits(bank, x: torch.Tensor, t: int, logit_scale: float = 1.0) -> torch.Tensor:
    """[N, C] float64 logits ``logit_scale * cos(x_n, mu_ct)`` of template ``t``'s classifier (``x``: unit
    rows); in a bank of per-class pools a class whose pool is shorter competes with its pool average."""
    mun = bank.mu_normed.double()
    vectors = mun[:, t]                                         # [C, D]
    mask = bank.mask
    if mask is not None and not bool(mask[:, t].all()):
        mean = (mun * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        vectors = torch.where(mask[:, t, None], vectors, mean)
    return logit_scale * (x.double() @ vectors.T)


def uncertainty_order(unc: torch.Tensor) -> torch.Tensor:
    """[C, T] template indices per class, most certain first; ties keep template order."""
    return torch.sort(unc, dim=1, stable=True).indices


def topk_mask(unc: torch.Tensor, k) -> torch.Tensor:
    """Boolean [C, T]: per class the ``k`` lowest-uncertainty templates (``k`` int or [C]); infinite
    uncertainty marks an absent prompt (per-class pools), so a class keeps at most its finite ones."""
    C, T = unc.shape
    k = torch.as_tensor(k).long()
    if k.dim() == 0:
        k = k.expand(C)
    if (k < 1).any() or (k > T).any():
        raise UserError(f"top-K must be between 1 and {T}, got {k.min().item()}..{k.max().item()}")
    order = uncertainty_order(unc)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(T).expand(C, T).contiguous())
    valid = torch.isfinite(unc)
    return (rank < torch.minimum(k, valid.sum(1))[:, None]) & valid


def combine(bank, weights: torch.Tensor, *, renormalize: bool = True, var_rule: str = "mean"):
    """Class Gaussians from per-class template weights (rows normalised to sum to 1): mu_c = sum_t w_ct
    mu_ct / ||mu_ct|| (renormalised when ``renormalize``); sigma^2_c = sum_t w_ct sigma^2_ct (``mean``) or
    sum_t w_ct^2 sigma^2_ct (``avg``: the variance of a weighted average, ProLIP's BPRW rule)."""
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


def make_selection(bank, strategy, label, W, *, k=None, renormalize=True, var_rule="mean", info=None,
                   uses_eval_labels=False, mu=None, logvar=None) -> Selection:
    """The :class:`Selection` of template weights ``W`` [C, T] on ``bank`` (through :func:`combine`)."""
    Wn, cmu, clv = combine(bank, W, renormalize=renormalize, var_rule=var_rule)
    return Selection(strategy=strategy, label=label, classnames=list(bank.classnames),
                     templates=list(bank.templates), weights=Wn,
                     class_mu=cmu if mu is None else mu, class_logvar=clv if logvar is None else logvar,
                     uncertainty=bank.uncertainty, k=None if k is None else [int(v) for v in k],
                     uses_eval_labels=uses_eval_labels, normalized=renormalize, info=dict(info or {}),
                     class_prompts=bank.pools)


def as_feats(feats):
    """(mu, logvar) or a bare mu tensor -> (normalised mu, logvar or None)."""
    if isinstance(feats, (tuple, list)):
        mu, logvar = feats[0], (feats[1] if len(feats) > 1 else None)
    else:
        mu, logvar = feats, None
    return F.normalize(mu.float(), dim=-1), (None if logvar is None else logvar.float())
