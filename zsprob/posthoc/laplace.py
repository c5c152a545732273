"""``--method laplace``: a K-FAC Laplace posterior of each tower's projection, propagated to the normalised mean.

BayesVLM's idea: the projection ``z = W f + b`` gets a Gaussian posterior from the Kronecker factors of the
symmetric InfoNCE loss on the cached pairs; its covariance through ``z / ||z||`` gives sigma^2 (formulas:
docs/posthoc.md). The variance is epistemic, not how vague an input is. The exact log-variances are distilled
into the model's own heads, so the output is an ordinary zsprob checkpoint."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zsprob.posthoc.features import PARTS

#: the InfoNCE temperature of the curvature when the frozen model's own scale is unknown
DEFAULT_LOGIT_SCALE = 1.0 / 0.07
PRIOR_GRID = tuple(10.0 ** (k / 4) for k in range(-16, 25))


def with_bias_input(features: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """f~: the projection's input with a column of ones when the projection has a bias."""
    if bias is None:
        return features
    return torch.cat([features, torch.ones_like(features[:, :1])], dim=1)


def kfac_factors(inputs: torch.Tensor, loss_grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G): the mean outer products of the layer's inputs [N, w] and of its outputs' loss gradients [N, D]."""
    n = inputs.shape[0]
    return inputs.t() @ inputs / n, loss_grads.t() @ loss_grads / n


def infonce_output_grads(image_z: torch.Tensor, text_z: torch.Tensor, logit_scale: float,
                         batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair gradients g = dL/dz of the symmetric InfoNCE loss (sum over the rows of each batch of
    ``batch_size`` consecutive pairs) for both towers' unnormalised projections."""
    grads = []
    for start in range(0, image_z.shape[0], batch_size):
        zi = image_z[start:start + batch_size].detach().double().requires_grad_(True)
        zt = text_z[start:start + batch_size].detach().double().requires_grad_(True)
        logits = logit_scale * F.normalize(zi, dim=-1) @ F.normalize(zt, dim=-1).t()
        labels = torch.arange(zi.shape[0], device=zi.device)
        loss = 0.5 * (F.cross_entropy(logits, labels, reduction="sum")
                      + F.cross_entropy(logits.t(), labels, reduction="sum"))
        grads.append(torch.autograd.grad(loss, (zi, zt)))
    return torch.cat([g[0] for g in grads]).float(), torch.cat([g[1] for g in grads]).float()


def log_evidence(prior: float, eig_a: torch.Tensor, eig_g: torch.Tensor, n: int, weight_sq: float) -> float:
    """Laplace log evidence of the projection up to terms free of the prior precision ``prior``:
    -prior ||theta||^2 / 2 + p log(prior) / 2 - log det(N A kron G + prior I) / 2."""
    eig = n * eig_a.clamp(min=0)[:, None].double() * eig_g.clamp(min=0)[None, :].double() + prior
    p = eig.numel()
    return float(-0.5 * prior * weight_sq + 0.5 * p * math.log(prior) - 0.5 * torch.log(eig).sum())


class KFACPosterior:
    """The Laplace posterior of one projection (weight [D, w], bias [D] or None) from its factors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, factor_a: torch.Tensor,
                 factor_g: torch.Tensor, n: int, prior: float | None = None):
        self.weight = weight.detach().double()
        self.bias = None if bias is None else bias.detach().double()
        self.n = int(n)
        self.eig_a, self.q_a = torch.linalg.eigh(factor_a.double())
        self.eig_g, self.q_g = torch.linalg.eigh(factor_g.double())
        if prior is None:
            weight_sq = float(self.weight.square().sum() + (0 if self.bias is None else self.bias.square().sum()))
            prior = max(PRIOR_GRID, key=lambda lam: log_evidence(lam, self.eig_a, self.eig_g, self.n, weight_sq))
        self.prior = float(prior)

    def z_covariance_diagonal(self, features: torch.Tensor) -> torch.Tensor:
        """c [N, D]: Cov(z) = Qg diag(c) Qg^T for each row of ``features`` (docs/posthoc.md)."""
        proj = (with_bias_input(features.double(), self.bias) @ self.q_a).square()
        denominator = self.n * self.eig_a.clamp(min=0)[:, None] * self.eig_g.clamp(min=0)[None, :] + self.prior
        return proj @ (1.0 / denominator)

    def mean_logvar(self, features: torch.Tensor) -> torch.Tensor:
        """log sigma^2 [N, D] of the normalised mean m = z / ||z|| by the delta method (float32)."""
        f = features.double()
        z = f @ self.weight.t() + (0 if self.bias is None else self.bias)
        norm = z.norm(dim=1, keepdim=True).clamp(min=1e-12)
        m = z / norm
        c = self.z_covariance_diagonal(f)
        u = m @ self.q_g
        diag_c = c @ self.q_g.square().t()
        c_m = (c * u) @ self.q_g.t()
        m_c_m = (c * u.square()).sum(1, keepdim=True)
        var = (diag_c - 2 * m * c_m + m.square() * m_c_m) / norm.square()
        return torch.log(var.clamp(min=1e-30)).float()


def _posteriors(adapters: dict, features: dict, settings) -> dict:
    inputs, z = {}, {}
    for side in ("image", "text"):
        weight, bias = adapters[side].projection()
        inputs[side] = adapters[side].projection_input(features[f"{side}_features"])
        z[side] = inputs[side] @ weight.detach().t().float() + (0 if bias is None else bias.detach().float())
    grads = dict(zip(("image", "text"), infonce_output_grads(z["image"], z["text"], DEFAULT_LOGIT_SCALE)))
    posteriors = {}
    for side in ("image", "text"):
        weight, bias = adapters[side].projection()
        factor_a, factor_g = kfac_factors(with_bias_input(inputs[side], bias), grads[side])
        posteriors[side] = KFACPosterior(weight, bias, factor_a, factor_g, n=inputs[side].shape[0],
                                         prior=settings.prior_precision)
    return posteriors


def distill_terms(adapters: dict, batch: dict, settings) -> dict:
    """Least squares of the heads' log sigma^2 against the exact Laplace log sigma^2 (``PART_laplace``)."""
    out = {}
    for part in PARTS:
        head = adapters[part.split("_")[0]].logvar(batch[f"{part}_features"])
        out[f"mse_{part}"] = (head - batch[f"{part}_laplace"]).square().mean()
    out["loss"] = sum(out.values())
    return out


def fit_laplace(adapters: dict, features: dict, settings, device, progress: bool = True) -> dict:
    """The K-FAC posteriors of both projections, their log-variances on every cached row, and the heads
    distilled to them; returns the priors and how closely the heads follow (Spearman of summed sigma^2)."""
    from scipy.stats import spearmanr

    from zsprob.posthoc.adapter import train_heads

    features = {k: v.to(device) for k, v in features.items()}  # the cached rows meet the weights on the device
    posteriors = _posteriors(adapters, features, settings)
    targets = dict(features)
    for part in PARTS:
        side = part.split("_")[0]
        inputs = adapters[side].projection_input(features[f"{part}_features"])
        targets[f"{part}_laplace"] = posteriors[side].mean_logvar(inputs)
    fitted = train_heads(adapters, targets, settings, device, terms=distill_terms, progress=progress)
    agreement = {}
    with torch.no_grad():
        for side in ("image", "text"):
            head = adapters[side].logvar(features[f"{side}_features"]).exp().sum(1).cpu()
            exact = targets[f"{side}_laplace"].exp().sum(1).cpu()
            agreement[side] = float(spearmanr(head.numpy(), exact.numpy()).statistic)
    return {**fitted, "prior_precision": {s: p.prior for s, p in posteriors.items()},
            "distillation_spearman": agreement}


__all__ = ["kfac_factors", "infonce_output_grads", "log_evidence", "KFACPosterior", "fit_laplace",
           "with_bias_input", "DEFAULT_LOGIT_SCALE"]
