"""The published transductive and few-shot baselines: ProLIP's Bayesian prompt re-weighting, ZPE.

``bprw`` (ProLIP's "use NN" mode: the unlabelled evaluation images nearest each class), ``bprw-fewshot``
(its ``--use_gt`` mode: labelled shots per class, from the split the user names) and ``zpe`` (Allingham
et al., ICML 2023: one weight per template from unlabelled images). References, read and not copied:
ProLIP's ``src/analysis/unc_zeroshot_prompts.py`` and the ZPE authors' notebook. Plain torch.
"""
from __future__ import annotations

import math

import torch

from zsprob.errors import UserError
from zsprob.zeroshot.selection_base import Selection, as_feats, make_selection, require_sigma, slot_logits
from zsprob.zeroshot.strategy_registry import StrategyInputs


def _em_mixture_weights(obs, means, var, *, alpha=5.0, prior="inverse", tol=1e-12, max_iter=1000, mask=None):
    """MAP mixing proportions (Dirichlet(alpha) prior) of fixed diagonal Gaussians, batched over classes:
    obs [B, M, D], means / var [B, T, D] -> (pi [B, T], iterations run); ``mask`` [B, T]: the components
    that exist (per-class pools)."""
    B, M, D = obs.shape
    T = means.shape[1]
    if prior == "inverse":
        pi = 1.0 / var.mean(2)
    else:
        pi = torch.ones(B, T, dtype=obs.dtype)
    if mask is not None:
        pi = pi * mask
    pi = pi / pi.sum(1, keepdim=True)
    inv = 1.0 / var                                           # [B, T, D]
    # log N(x | m, v) = -0.5 [sum x^2/v - 2 x.(m/v) + sum m^2/v] - 0.5 sum log v - D/2 log 2pi
    logp = -0.5 * (torch.bmm(obs ** 2, inv.transpose(1, 2)) - 2 * torch.bmm(obs, (means * inv).transpose(1, 2))
                   + (means ** 2 * inv).sum(2)[:, None])
    logp = logp - 0.5 * var.log().sum(2)[:, None] - 0.5 * D * math.log(2 * math.pi)   # [B, M, T]
    if mask is not None:
        logp = logp.masked_fill(~mask[:, None], float("-inf"))
    it = 0
    for it in range(max_iter):
        r = torch.softmax(logp + pi.log()[:, None], dim=2)
        nk = r.sum(1)
        new = (nk + alpha - 1).clamp_min(0) / (M + T * (alpha - 1))
        if mask is not None:
            new = new * mask
        new = new / new.sum(1, keepdim=True)
        done = bool((torch.linalg.vector_norm(new - pi, dim=1) < tol).all())
        pi = new
        if done:
            break
    return pi, it + 1


def _bprw_weights(bank, feats, idx, classes, *, n_samples: int, gen, alpha: float, var_mult: float,
                  stable_eps: float, prior: str):
    """EM mixture weights [c, T] of ``classes``' prompt Gaussians N(mu_t, var_mult sigma^2_t + eps) on
    ``n_samples`` draws from each image Gaussian ``feats[idx]`` ([c, M] indices); and the iterations run."""
    x, xlv = feats
    obs = x.double()[idx]                                      # [c, M, D]; the means without sigma
    if xlv is not None:
        c, M, D = obs.shape
        eps = torch.randn(c, M, n_samples, D, generator=gen, dtype=torch.float64)
        obs = (obs[:, :, None] + eps * (0.5 * xlv.double()[idx]).exp()[:, :, None]).reshape(c, M * n_samples, D)
    mun = bank.mu_normed.double()[classes]
    var = bank.var.double()[classes] * var_mult + stable_eps
    mask = bank.mask
    mask = None if mask is None else mask[classes]
    T = mun.shape[1]
    W = torch.zeros(len(classes), T, dtype=torch.float64)
    iters = []
    step = max(1, int(4e6 // max(1, obs.shape[1] * T * 4)))
    for c0 in range(0, len(classes), step):
        pi, n_it = _em_mixture_weights(obs[c0:c0 + step], mun[c0:c0 + step], var[c0:c0 + step], alpha=alpha,
                                       prior=prior, mask=None if mask is None else mask[c0:c0 + step])
        W[c0:c0 + step] = pi
        iters.append(n_it)
    return W, max(iters)


def _bprw_selection(bank, strategy: str, label: str, W, info: dict, **kw) -> Selection:
    """The selection of BPRW weights: class mean sum_t pi_t mu_t (not renormalised, as in ProLIP), sigma^2
    sum_t pi_t^2 sigma^2_t."""
    return make_selection(bank, strategy, label, W.float(), renormalize=False, var_rule="avg", info=info, **kw)


def select_bprw(bank, pool_feats, *, n_neighbors: int = 10, n_samples: int = 10, alpha: float = 5.0,
                var_mult: float = 1.0, stable_eps: float = 0.02, prior: str = "inverse", seed: int = 0,
                data: str = "unlabelled images") -> Selection:
    """ProLIP's Bayesian prompt re-weighting (BPRW), defaults = its "use NN" setting (5-1-10-10-0.02-inverse):
    per class, EM for the Dirichlet(alpha)-MAP mixing proportions of its prompt Gaussians on ``n_samples``
    draws from each of the ``n_neighbors`` unlabelled images nearest its average prompt."""
    require_sigma(bank, "bprw")
    feats = as_feats(pool_feats)
    x = feats[0]
    nn_k = min(n_neighbors, x.shape[0])
    sims = x.double() @ bank.mu_normed.double().mean(1).T     # [N, C]
    idx = torch.topk(sims, nn_k, dim=0).indices.T             # [C, nn_k]
    em = {"n_samples": n_samples, "alpha": alpha, "var_mult": var_mult, "stable_eps": stable_eps, "prior": prior}
    W, n_iter = _bprw_weights(bank, feats, idx, torch.arange(bank.num_classes),
                              gen=torch.Generator().manual_seed(seed), **em)
    return _bprw_selection(bank, "bprw", "ProLIP BPRW (NN)", W, {
        "data_used": data, "n_pool_images": int(x.shape[0]), "n_neighbors": nn_k, **em, "seed": seed,
        "mode": "NN (transductive)", "em_iterations_max": n_iter,
        "reference": "ProLIP (Chun et al., ICLR 2025) analysis/unc_zeroshot_prompts.py bprw"})


def select_bprw_fewshot(bank, shot_feats, shot_labels, *, shots: int | None = None, n_samples: int = 10,
                        alpha: float = 5.0, var_mult: float = 1.0, stable_eps: float = 0.02,
                        prior: str = "inverse", seed: int = 0, data: str = "selection split",
                        from_eval: bool = False) -> Selection:
    """ProLIP's BPRW with labelled shots (its ``--use_gt`` mode): per class the first ``shots`` images of that
    class (index order; None: all) replace the nearest neighbours. ``from_eval`` (the shots are evaluation
    images, ProLIP's published protocol) marks the selection as reading evaluation labels."""
    require_sigma(bank, "bprw-fewshot")
    feats = as_feats(shot_feats)
    y = torch.as_tensor(shot_labels).long()
    per_class = [torch.nonzero(y == c).flatten()[:shots] for c in range(bank.num_classes)]
    empty = [bank.classnames[c] for c, idx in enumerate(per_class) if len(idx) == 0]
    if empty:
        raise UserError(f"few-shot split has no image of class {empty[0]!r} ({len(empty)} classes without shots)")
    gen = torch.Generator().manual_seed(seed)
    em = {"n_samples": n_samples, "alpha": alpha, "var_mult": var_mult, "stable_eps": stable_eps, "prior": prior}
    W = torch.zeros(bank.num_classes, bank.num_templates, dtype=torch.float64)
    n_iter = 0
    for count in sorted({len(idx) for idx in per_class}):  # the EM is batched over classes with equal shots
        classes = torch.tensor([c for c, idx in enumerate(per_class) if len(idx) == count])
        idx = torch.stack([per_class[c] for c in classes.tolist()])
        W[classes], it = _bprw_weights(bank, feats, idx, classes, gen=gen, **em)
        n_iter = max(n_iter, it)
    label = "ProLIP BPRW (few-shot, EVAL SHOTS)" if from_eval else "ProLIP BPRW (few-shot)"
    return _bprw_selection(bank, "bprw-fewshot", label, W, {
        "data_used": data, "shots_per_class": [len(idx) for idx in per_class],
        "shots_from": "evaluation split" if from_eval else "selection split", **em, "seed": seed,
        "mode": "few-shot (labels)", "em_iterations_max": n_iter,
        "reference": "ProLIP analysis/unc_zeroshot_prompts.py --use_gt"}, uses_eval_labels=from_eval)


def select_zpe(bank, pool_feats, *, logit_scale: float = 100.0, data: str = "unlabelled images") -> Selection:
    """ZPE (Allingham et al., ICML 2023): one weight per template, shared by all classes: softmax_t of
    s_t = mean_n max_c of the logits l[n, t, c] = logit_scale * cos(x_n, mu_tc) centred over the unlabelled
    images; class vector sum_t w_t mu_tc (not renormalised). Works without sigma."""
    x, _ = as_feats(pool_feats)
    mun = bank.mu_normed                                      # [C, T, D]
    C, T, D = mun.shape
    scores = torch.zeros(T, dtype=torch.float64)
    mask = bank.mask
    for t in range(T):
        if mask is None:
            lt = logit_scale * (x @ mun[:, t].T)              # [N, C]
        else:  # per-class pools: slot t = each class's t-th prompt (docs/zeroshot.md)
            lt = slot_logits(bank, x, t, logit_scale).float()
        scores[t] = (lt - lt.mean(0, keepdim=True)).max(1).values.double().mean()
    w = torch.softmax(scores, 0).float()
    W = w[None].expand(C, T).contiguous()
    if mask is not None:
        W = W * mask                                          # renormalised per class over its own prompts
    return make_selection(bank, "zpe", "ZPE", W, renormalize=False, var_rule="mean",
                          info={"data_used": data, "n_pool_images": int(x.shape[0]), "logit_scale": logit_scale,
                                "debias": "test (unlabelled pool mean)",
                                "template_scores": [float(v) for v in scores],
                                "reference": "Allingham et al., ICML 2023, Algorithm 2 / authors' notebook"})


# ----------------------------------------------------------------------------- the registry's runners

def run_bprw(bank, given: StrategyInputs) -> Selection:
    return select_bprw(bank, given.pool, data=given.pool_data)


def run_bprw_fewshot(bank, given: StrategyInputs) -> Selection:
    from_eval = given.request.shots_split == "eval"
    data = "evaluation split labels (EVAL SHOTS)" if from_eval else given.select_data
    return select_bprw_fewshot(bank, given.select[0], given.select[1], shots=given.request.shots, data=data,
                               from_eval=from_eval)


def run_zpe(bank, given: StrategyInputs) -> Selection:
    return select_zpe(bank, given.pool, data=given.pool_data)
