"""K-FAC Laplace of a projection (zsprob.posthoc.laplace) against float64 references on a tiny linear layer.

The factors against their definitions computed in float64 by autograd, the Kronecker order against
the layer's real per-sample gradient, and the propagated variance of the normalised output against
the dense posterior (P = N A kron G + lambda I inverted in float64, then the delta method).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zsprob.posthoc.laplace import (KFACPosterior, infonce_output_grads, kfac_factors, log_evidence,
                                    with_bias_input)

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(seed=0, n=12, w=5, d=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d, w, generator=g), torch.randn(d, generator=g) * 0.1,
            torch.randn(n, w, generator=g), torch.randn(n, w, generator=g))


def _reference_grads(weight, bias, f_img, f_txt, scale):
    """dL/dz of the symmetric InfoNCE sum, float64 autograd through the layer itself."""
    w64, b64 = weight.double(), bias.double()
    z_img = (f_img.double() @ w64.t() + b64).requires_grad_(True)
    z_txt = (f_txt.double() @ w64.t() + b64).requires_grad_(True)
    logits = scale * F.normalize(z_img, dim=-1) @ F.normalize(z_txt, dim=-1).t()
    labels = torch.arange(f_img.shape[0])
    loss = 0.5 * (F.cross_entropy(logits, labels, reduction="sum") + F.cross_entropy(logits.t(), labels,
                                                                                       reduction="sum"))
    return torch.autograd.grad(loss, (z_img, z_txt))


def test_factors_equal_their_float64_definitions():
    weight, bias, f_img, f_txt = _layer()
    z_img, z_txt = f_img @ weight.t() + bias, f_txt @ weight.t() + bias
    g_img, g_txt = infonce_output_grads(z_img, z_txt, logit_scale=7.0)
    ref_img, ref_txt = _reference_grads(weight, bias, f_img, f_txt, 7.0)
    torch.testing.assert_close(g_img.double(), ref_img, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_txt.double(), ref_txt, rtol=1e-5, atol=1e-6)
    a, g = kfac_factors(with_bias_input(f_img, bias), g_img)
    f64 = torch.cat([f_img.double(), torch.ones(f_img.shape[0], 1, dtype=torch.float64)], 1)
    a_ref = sum(torch.outer(row, row) for row in f64) / f_img.shape[0]
    g_ref = sum(torch.outer(row, row) for row in ref_img) / f_img.shape[0]
    torch.testing.assert_close(a.double(), a_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_one_sample_factors_are_the_outer_product_of_the_layers_real_gradient():
    """A kron G of one sample = vec(dL/d[W, b]) vec(...)^T, with the parameters ordered input-major."""
    weight, bias, f_img, _ = _layer(seed=1, n=1)
    w = torch.cat([weight, bias[:, None]], 1).double().requires_grad_(True)
    f64 = torch.cat([f_img.double(), torch.ones(1, 1, dtype=torch.float64)], 1)
    target = torch.randn(1, weight.shape[0], dtype=torch.float64)
    loss = ((f64 @ w.t()).tanh() - target).square().sum()
    grad_w, = torch.autograd.grad(loss, w)
    z = (f64 @ w.detach().t()).requires_grad_(True)
    grad_z, = torch.autograd.grad(((z.tanh() - target).square().sum()), z)
    a, g = kfac_factors(f64, grad_z)
    vec = grad_w.t().reshape(-1)  # (input k, output d) -> k * D + d
    torch.testing.assert_close(torch.kron(a, g), torch.outer(vec, vec), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("use_bias", [True, False])
def test_propagated_variance_equals_the_dense_float64_posterior(use_bias):
    weight, bias, f_img, f_txt = _layer(seed=2)
    bias = bias if use_bias else None
    z_img = f_img @ weight.t() + (0 if bias is None else bias)
    z_txt = f_txt @ weight.t() + (0 if bias is None else bias)
    g_img, _ = infonce_output_grads(z_img, z_txt, logit_scale=5.0)
    a, g = kfac_factors(with_bias_input(f_img, bias), g_img)
    n, prior = 40, 0.3
    post = KFACPosterior(weight, bias, a, g, n=n, prior=prior)
    got = post.mean_logvar(f_txt[:3])
    d = weight.shape[0]
    precision = n * torch.kron(a.double(), g.double()) + prior * torch.eye(a.shape[0] * d, dtype=torch.float64)
    sigma = torch.linalg.inv(precision)
    for row, f in enumerate(with_bias_input(f_txt[:3].double(), None if bias is None else bias.double())):
        jac = torch.kron(f[None, :], torch.eye(d, dtype=torch.float64))  # dz / dtheta, theta input-major
        cov_z = jac @ sigma @ jac.t()
        z = f @ torch.cat([weight, bias[:, None]], 1).double().t() if bias is not None else f @ weight.double().t()
        m = z / z.norm()
        j_norm = (torch.eye(d, dtype=torch.float64) - torch.outer(m, m)) / z.norm()
        var = torch.diagonal(j_norm @ cov_z @ j_norm.t())
        torch.testing.assert_close(got[row].double(), var.log(), rtol=1e-4, atol=1e-4)


def test_the_evidence_prefers_a_prior_near_the_weights_scale_and_the_grid_finds_its_maximum():
    weight, bias, f_img, f_txt = _layer(seed=3)
    z_img, z_txt = f_img @ weight.t() + bias, f_txt @ weight.t() + bias
    g_img, _ = infonce_output_grads(z_img, z_txt, logit_scale=5.0)
    a, g = kfac_factors(with_bias_input(f_img, bias), g_img)
    post = KFACPosterior(weight, bias, a, g, n=12)
    weight_sq = float(weight.square().sum() + bias.square().sum())
    best = log_evidence(post.prior, post.eig_a, post.eig_g, 12, weight_sq)
    for other in (post.prior * 3, post.prior / 3):
        assert log_evidence(other, post.eig_a, post.eig_g, 12, weight_sq) <= best
