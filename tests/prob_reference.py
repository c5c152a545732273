"""Direct references of the loss math, for tests and scripts/bench_losses.py.

:func:`pcmepp_pseudocode_loss` is the PyTorch pseudo-code of PCME++ App. A.4 (Figure A.1) with the two
changes the paper's text and official code make: the pseudo-positive comparison is row-wise
(``gt_vals.unsqueeze(1)``, as the official ``_recompute_matched``) and both directions are counted (the
official ``2 * i2t + alpha * (pp_i2t + pp_t2i)``). It materialises [N, M, D] tensors: O(N M D) memory.
:func:`inclusion_logit_per_dim` is ProLIP's inclusion logit per dimension in closed form (the formula of
``zsprob.prob.prolip``'s docstring), written out plainly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _direction(x_mu, x_sig, y_mu, y_sig, matched, a, b):
    mu_dist = ((x_mu.unsqueeze(1) - y_mu.unsqueeze(0)) ** 2).sum(-1)
    sigma_dist = (x_sig.unsqueeze(1) + y_sig.unsqueeze(0)).sum(-1)
    logits = -a * (mu_dist + sigma_dist) + b
    match_loss = F.binary_cross_entropy_with_logits(logits, matched)
    gt_labels, gt_indices = torch.max(matched, dim=1)
    gt_vals = logits[:, gt_indices].diag()
    pseudo_gt = logits >= gt_vals.unsqueeze(1)
    pp_matched = gt_labels.unsqueeze(1) * pseudo_gt
    matched = matched.clone()
    matched[pseudo_gt] = pp_matched[pseudo_gt]
    pp_loss = F.binary_cross_entropy_with_logits(logits, matched)
    return match_loss, pp_loss


def pcmepp_pseudocode_loss(v_mu, v_logvar, t_mu, t_logvar, matched=None, a=5.0, b=5.0,
                           alpha=0.1, beta=1e-4):
    """PCME++ loss by the App. A.4 pseudo-code, both directions counted (broadcast, O(NMD) memory)."""
    if matched is None:
        matched = torch.eye(v_mu.shape[0], dtype=v_mu.dtype, device=v_mu.device)
    v_sig, t_sig = v_logvar.exp(), t_logvar.exp()
    m1, p1 = _direction(v_mu, v_sig, t_mu, t_sig, matched, a, b)
    m2, p2 = _direction(t_mu, t_sig, v_mu, v_sig, matched.t(), a, b)
    v_vib = -0.5 * (1 + torch.log(v_sig) - v_mu ** 2 - v_sig).mean()
    t_vib = -0.5 * (1 + torch.log(t_sig) - t_mu ** 2 - t_sig).mean()
    return m1 + m2 + alpha * (p1 + p2) + beta * (v_vib + t_vib)


def inclusion_logit_per_dim(mu_1, logvar_1, mu_2, logvar_2, eps: float) -> torch.Tensor:
    """test(1 in 2) - test(2 in 1) per dimension, [N, D]: with s = sigma^2, W_2 = s_1 + 2 s_2 and
    W_1 = 2 s_1 + s_2, (logvar_2 - logvar_1) - log(W_2 / W_1) / 2 - e^eps (mu_1 - mu_2)^2 (1 / W_2 - 1 / W_1)."""
    var_1, var_2 = logvar_1.exp(), logvar_2.exp()
    wide_2 = var_1 + 2.0 * var_2
    wide_1 = 2.0 * var_1 + var_2
    mean_term = math.exp(eps) * (mu_1 - mu_2).square() * (wide_2.reciprocal() - wide_1.reciprocal())
    return (logvar_2 - logvar_1) - 0.5 * (wide_2 / wide_1).log() - mean_term
