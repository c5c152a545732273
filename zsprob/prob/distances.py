"""Pairwise distances and similarities between diagonal Gaussians, and uncertainty scalars.

A Gaussian is ``(mu, logvar)``, tensors [N, D] with ``logvar = log sigma^2``; a pairwise function takes
rows ``a`` [N, D] and columns ``b`` [M, D] and returns [N, M]. Closed forms that separate over (a, b) are
matrix products (no [N, M, D] tensor); the rest run in bounded blocks. float64 in, float64 out; else float32.
Every formula and the paper it follows: docs/prob.md."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zsprob.errors import UserError
from zsprob.prob.method_registry import SCORE_NAMES

#: default size (number of elements) of one temporary block in the chunked functions (16 MiB in float32)
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (half / bfloat16 are promoted)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _cast(*tensors: torch.Tensor | None):
    dt = compute_dtype(*tensors)
    return tuple(None if t is None else t.to(dt) for t in tensors)


def _sq_dist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x_i - y_j||^2 [N, M] through one matmul; clamped at 0 against round-off."""
    x2 = (x * x).sum(-1, keepdim=True)
    y2 = (y * y).sum(-1).unsqueeze(0)
    d = torch.addmm(y2, x, y.t(), alpha=-2.0)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return (d + x2).clamp(min=0.0)
    return d.add_(x2).clamp_(min=0.0)  # in place: no second [N, M] temporary


def sq_euclidean(mu_a: torch.Tensor, mu_b: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distance of the means, [N, M] (the "mean-only" distance)."""
    mu_a, mu_b = _cast(mu_a, mu_b)
    return _sq_dist(mu_a, mu_b)


def cosine(mu_a: torch.Tensor, mu_b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Cosine similarity of the means, [N, M] (a similarity: higher = closer)."""
    mu_a, mu_b = _cast(mu_a, mu_b)
    return F.normalize(mu_a, dim=-1, eps=eps) @ F.normalize(mu_b, dim=-1, eps=eps).t()


def csd(mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
    """PCME++'s closed-form sampled distance E||Z_a - Z_b||^2 (Eq. 1), [N, M], through one matmul."""
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    s_a = logvar_a.exp().sum(-1, keepdim=True)
    s_b = logvar_b.exp().sum(-1).unsqueeze(0)
    return _sq_dist(mu_a, mu_b) + s_a + s_b


def wasserstein2(mu_a, logvar_a, mu_b, logvar_b, *, form: str = "std", squared: bool = True,
                 eps: float = 1e-12) -> torch.Tensor:
    """Squared 2-Wasserstein distance, [N, M] (``form="var"``: variances in place of sigma);
    ``squared=False``: sqrt(W2^2 + eps), finite gradient at 0."""
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    power = {"std": 0.5, "var": 1.0}[form]  # sigma = exp(logvar / 2), sigma^2 = exp(logvar)
    s_a, s_b = (power * logvar_a).exp(), (power * logvar_b).exp()
    # one matmul on concatenated features: ||[mu, s]_a - [mu, s]_b||^2
    d = _sq_dist(torch.cat([mu_a, s_a], dim=1), torch.cat([mu_b, s_b], dim=1))
    return d if squared else (d + eps).sqrt()


def kl(mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
    """KL(N_a || N_b) for every pair, [N, M].

    0.5 [sum logvar_b - sum logvar_a - D + (v_a + mu_a^2) . (1/v_b) - 2 mu_a . (mu_b / v_b)
    + sum(mu_b^2 / v_b)]: the two dot products are one matmul on concatenated features.
    """
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    inv_b = (-logvar_b).exp()
    left = torch.cat([logvar_a.exp() + mu_a * mu_a, mu_a], dim=1)
    right = torch.cat([inv_b, -2.0 * mu_b * inv_b], dim=1)
    cross = left @ right.t()
    row = (-logvar_a.sum(-1)).unsqueeze(1) - mu_a.shape[1]
    col = (logvar_b.sum(-1) + (mu_b * mu_b * inv_b).sum(-1)).unsqueeze(0)
    return 0.5 * (cross + row + col)


def kl_reverse(mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
    """KL(N_b || N_a) for every pair (rows a, columns b), [N, M]."""
    return kl(mu_b, logvar_b, mu_a, logvar_a).t()


def min_kl(mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
    """min(KL(a||b), KL(b||a)), [N, M] (Pishdad et al.)."""
    return torch.minimum(kl(mu_a, logvar_a, mu_b, logvar_b), kl_reverse(mu_a, logvar_a, mu_b, logvar_b))


def js(mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
    """PCME's "JS" divergence: 0.5 (KL(a||b) + KL(b||a)), [N, M] (symmetric)."""
    return 0.5 * (kl(mu_a, logvar_a, mu_b, logvar_b) + kl_reverse(mu_a, logvar_a, mu_b, logvar_b))


def _row_chunks(n_rows: int, per_row: int, chunk_elements: int):
    step = max(1, int(chunk_elements) // max(1, per_row))
    for s in range(0, n_rows, step):
        yield s, min(n_rows, s + step)


def _pairwise_blocks(fn: Callable, mu_a, logvar_a, mu_b, logvar_b, chunk_elements: int) -> torch.Tensor:
    """Evaluate fn on [rows, 1, D] x [1, M, D] blocks with rows * M * D <= chunk_elements."""
    n, d = mu_a.shape
    m = mu_b.shape[0]
    v_a, v_b = logvar_a.exp(), logvar_b.exp()
    out = []
    for s, e in _row_chunks(n, m * d, chunk_elements):
        out.append(fn(mu_a[s:e, None], logvar_a[s:e, None], v_a[s:e, None],
                      mu_b[None], logvar_b[None], v_b[None]))
    return torch.cat(out, dim=0) if out else mu_a.new_zeros(0, m)


def _elk_block(mu_a, lv_a, v_a, mu_b, lv_b, v_b):
    vs = v_a + v_b
    return 0.5 * ((mu_a - mu_b).pow(2) / vs + vs.log()).sum(-1)


def _bhat_block(mu_a, lv_a, v_a, mu_b, lv_b, v_b):
    vs = v_a + v_b
    return (0.25 * (mu_a - mu_b).pow(2) / vs + 0.5 * (vs.log() - math.log(2.0) - 0.5 * (lv_a + lv_b))).sum(-1)


def elk(mu_a, logvar_a, mu_b, logvar_b, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Negative log expected likelihood kernel (no 2 pi constant), [N, M]; row-blocked."""
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    return _pairwise_blocks(_elk_block, mu_a, logvar_a, mu_b, logvar_b, chunk_elements)


def bhattacharyya(mu_a, logvar_a, mu_b, logvar_b, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Bhattacharyya distance between diagonal Gaussians, [N, M]; row-blocked."""
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    return _pairwise_blocks(_bhat_block, mu_a, logvar_a, mu_b, logvar_b, chunk_elements)


# ----------------------------------------------------------------------------- Monte Carlo

def sample_gaussian(mu: torch.Tensor, logvar: torch.Tensor | None, n_samples: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Reparameterised samples mu + sigma * eps, [N, J, D] (J = 0 or logvar None: the means, J = 1)."""
    if logvar is None or n_samples == 0:
        return mu.unsqueeze(1)
    gen_device = generator.device if generator is not None else mu.device
    eps = torch.randn((mu.shape[0], n_samples, mu.shape[1]), generator=generator,
                      device=gen_device, dtype=mu.dtype).to(mu.device)
    return mu.unsqueeze(1) + (0.5 * logvar).exp().unsqueeze(1) * eps


def sample_blocks(z_a: torch.Tensor, z_b: torch.Tensor, block: Callable, chunk_elements: int,
                  checkpointed: bool = False, *args) -> torch.Tensor:
    """``block(fa, fb, *args) -> [rows, cols, ...]`` over the samples z_a [n, J, D] x z_b [m, J', D] in blocks
    of at most ``chunk_elements`` sample pairs (fa [rows * J, D], fb [cols * J', D]; each block recomputed
    in the backward pass when ``checkpointed``), joined into [n, m, ...]."""
    n, ja, d = z_a.shape
    m, jb, _ = z_b.shape
    fb_all = z_b.reshape(m * jb, d)
    col_step = max(1, min(m, int(chunk_elements) // max(1, ja * jb)))
    cols = []
    for cs in range(0, m, col_step):
        ce = min(m, cs + col_step)
        fb = fb_all[cs * jb:ce * jb]
        rows = []
        for rs, re in _row_chunks(n, ja * (ce - cs) * jb, chunk_elements):
            fa = z_a[rs:re].reshape(-1, d)
            rows.append(checkpoint(block, fa, fb, *args, use_reentrant=False) if checkpointed else block(fa, fb, *args))
        cols.append(torch.cat(rows, dim=0))
    return torch.cat(cols, dim=1)


def sample_sq_dist(fa: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
    """||fa_i - fb_j||^2 of flattened samples, [rows, cols], through one matmul (not clamped)."""
    return torch.addmm((fb * fb).sum(-1).unsqueeze(0), fa, fb.t(), alpha=-2.0) + (fa * fa).sum(-1, keepdim=True)


def _reduced_dist_block(fa, fb, reduce: Callable, ja: int, jb: int) -> torch.Tensor:
    """``reduce(d [rows, J, cols, J'])`` of the sample L2 distances of one block."""
    dist = (sample_sq_dist(fa, fb).clamp(min=0.0) + 1e-12).sqrt()
    return reduce(dist.view(fa.shape[0] // ja, ja, fb.shape[0] // jb, jb))


def _mc_inputs(mu_a, logvar_a, mu_b, logvar_b, n_samples, generator):
    mu_a, logvar_a, mu_b, logvar_b = _cast(mu_a, logvar_a, mu_b, logvar_b)
    z_a = sample_gaussian(mu_a, logvar_a, n_samples, generator)
    z_b = sample_gaussian(mu_b, logvar_b, n_samples, generator)
    return z_a, z_b


def mc_match_prob(mu_a, logvar_a, mu_b, logvar_b, a=5.0, b=5.0, n_samples: int = 7,
                  generator: torch.Generator | None = None,
                  chunk_size: int = DEFAULT_CHUNK_ELEMENTS, slope: float = 1.0) -> torch.Tensor:
    """PCME's Monte Carlo match probability (Eq. 2-3), [N, M]: the mean over J x J sample pairs of
    sigmoid(slope * (-a ||z_a - z_b||_2 + b)) (slope 2: the official code); ``chunk_size`` bounds the
    sample-pair distances held at once; ``a``, ``b`` may be tensors (learnable)."""
    z_a, z_b = _mc_inputs(mu_a, logvar_a, mu_b, logvar_b, n_samples, generator)
    return sample_blocks(z_a, z_b, _reduced_dist_block, chunk_size, False,
                         lambda d: torch.sigmoid(slope * (-a * d + b)).mean(dim=(1, 3)), z_a.shape[1], z_b.shape[1])


def mc_avg_l2(mu_a, logvar_a, mu_b, logvar_b, n_samples: int = 7,
              generator: torch.Generator | None = None,
              chunk_size: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Average sampled L2 distance E||z_a - z_b||_2 over J x J sample pairs (PCME), [N, M]."""
    z_a, z_b = _mc_inputs(mu_a, logvar_a, mu_b, logvar_b, n_samples, generator)
    return sample_blocks(z_a, z_b, _reduced_dist_block, chunk_size, False,
                         lambda d: d.mean(dim=(1, 3)), z_a.shape[1], z_b.shape[1])


# ----------------------------------------------------------------------------- inclusion, uncertainty

def inclusion_test(mu_1: torch.Tensor, logvar_1: torch.Tensor, mu_2: torch.Tensor, logvar_2: torch.Tensor,
                   eps: float = -10.0) -> torch.Tensor:
    """ProLIP's inclusion score of row i of (mu_1, logvar_1) in row i of (mu_2, logvar_2): [N], larger when
    1 is inside 2 (rows [N, D] or [D]). Per dimension, with w_k = exp(eps - logvar_k), A = w_1 + w_2 / 2,
    B = 2 mu_1 w_1 + mu_2 w_2, C = mu_1^2 w_1 + mu_2^2 w_2 / 2: -2 logvar_1 - logvar_2 - log(A) / 2
    + B^2 / (4 A) - C, averaged over D (``eps``: ProLIP's ``inclusion_loss_eps``)."""
    mu_1, logvar_1, mu_2, logvar_2 = _cast(mu_1, logvar_1, mu_2, logvar_2)
    if mu_1.shape != mu_2.shape or logvar_1.shape != mu_1.shape or logvar_2.shape != mu_2.shape:
        raise ValueError(f"inclusion_test needs equal shapes, got {tuple(mu_1.shape)}, {tuple(logvar_1.shape)}, "
                         f"{tuple(mu_2.shape)}, {tuple(logvar_2.shape)}")
    prec_1 = torch.exp(eps - logvar_1)
    prec_2 = torch.exp(eps - logvar_2)
    quad_a = prec_1 + 0.5 * prec_2
    lin_b = 2.0 * mu_1 * prec_1 + mu_2 * prec_2
    const_c = mu_1.square() * prec_1 + 0.5 * mu_2.square() * prec_2
    value = -2.0 * logvar_1 - logvar_2 - 0.5 * torch.log(quad_a) + lin_b.square() / (4.0 * quad_a) - const_c
    return value.mean(dim=-1)


def inclusion_logit(mu_1, logvar_1, mu_2, logvar_2, eps: float = -10.0) -> torch.Tensor:
    """test(1 in 2) - test(2 in 1), [N]: positive when row i of 1 is the included (more specific) one."""
    return inclusion_test(mu_1, logvar_1, mu_2, logvar_2, eps) - inclusion_test(mu_2, logvar_2, mu_1, logvar_1, eps)


def uncertainty(logvar: torch.Tensor, kind: str = "l1") -> torch.Tensor:
    """Per-input uncertainty [N]: ``"l1"`` ||sigma^2||_1 (PCME++), ``"logdet"`` sum logvar
    (Pishdad et al.), ``"geomean"`` geometric mean of sigma = exp(mean(logvar) / 2) (PCME)."""
    (logvar,) = _cast(logvar)
    if kind == "l1":
        return logvar.exp().sum(-1)
    if kind == "logdet":
        return logvar.sum(-1)
    if kind == "geomean":
        return (0.5 * logvar.mean(-1)).exp()
    raise UserError(f"unknown uncertainty kind {kind!r} (choose from l1, logdet, geomean)")


# ----------------------------------------------------------------------------- scores


def score(name: str, mu_a, logvar_a=None, mu_b=None, logvar_b=None, **kw) -> torch.Tensor:
    """Similarity matrix [N, M] for retrieval / classification, higher = better: distances negated, "cosine"
    of the means, "mc" the match probability. ``kw`` go to the underlying function; ``logvar_a`` /
    ``logvar_b`` may be None for "mean" and "cosine"."""
    if name == "mean":
        return -sq_euclidean(mu_a, mu_b)
    if name == "cosine":
        return cosine(mu_a, mu_b, **kw)
    if name not in SCORE_NAMES:
        raise UserError(f"unknown score {name!r} (choose from {', '.join(SCORE_NAMES)})")
    if logvar_a is None or logvar_b is None:
        raise UserError(f"score {name!r} needs sigma, but the model is deterministic (use 'mean' or 'cosine')")
    if name == "mc":
        return mc_match_prob(mu_a, logvar_a, mu_b, logvar_b, **kw)
    fns = {"csd": csd, "w2": wasserstein2, "kl": kl, "minkl": min_kl, "js": js, "elk": elk,
           "bhattacharyya": bhattacharyya}
    return -fns[name](mu_a, logvar_a, mu_b, logvar_b, **kw)
