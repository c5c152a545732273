"""Direct broadcast reference implementations, for tests and benchmarks only.

:func:`pcmepp_pseudocode_loss` is the PyTorch pseudo-code of PCME++ App. A.4 (Figure A.1) as
printed, with two changes that the paper's text and official code make: the pseudo-positive
comparison is row-wise (``gt_vals.unsqueeze(1)``, as in the official ``_recompute_matched``;
the printed line broadcasts along the wrong axis), and both directions are counted
(image-to-text on ``logits``, text-to-image on ``logits.T`` with ``matched.T``), which is what
the official code's ``2 * i2t + alpha * (pp_i2t + pp_t2i)`` computes. It materialises [N, M, D]
tensors: O(N * M * D) memory. :class:`zsprob.prob.PCMEPPLoss` must agree with it.
"""
from __future__ import annotations

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
