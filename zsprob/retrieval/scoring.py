"""Chunked image-caption scoring for retrieval; the similarity itself is :func:`zsprob.prob.score`.

:class:`PairScores` is a test set's image x caption similarity, scored in row blocks (CSD, mean-only and
cosine as one GEMM of augmented vectors per block, :func:`linear_form`), with its contiguous transpose so
both directions rank the same numbers; :func:`chunked_topk` gives the best ``k`` items of every query for a
gallery of any size. Both compute where the gallery lives (or on ``device=``) and return float32 / int64 CPU
tensors, so the metrics downstream are the same code on every device."""
from __future__ import annotations

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.prob.distances import SCORE_NAMES, score


def check_score(name: str, has_sigma: bool) -> None:
    """One line, before any block is scored, for an unknown score or one that needs sigma without it."""
    if name not in SCORE_NAMES:
        raise UserError(f"unknown score {name!r} (choose from {', '.join(SCORE_NAMES)})")
    if name not in ("mean", "cosine") and not has_sigma:
        raise UserError(f"score {name!r} needs sigma (logvar), but the embeddings have none; use 'mean' or 'cosine'")


def mc_score_options(model) -> dict:
    """The "mc" score's options for a ``--method pcme`` model, from its checkpoint metadata: learned a
    (scale) and b (shift), J (``loss.pcme.n_samples``) and the slope of its loss form's match probability
    (2 for the official form); {} (a = b = 5, J = 7, slope 1) for any other model."""
    meta = getattr(model, "checkpoint_meta", None) or {}
    extra = meta.get("extra") or {}
    if extra.get("method") != "pcme":
        return {}
    params = extra.get("loss_params") or {}
    pcme = ((extra.get("train_config") or {}).get("loss") or {}).get("pcme") or {}
    opts = {"n_samples": int(pcme.get("n_samples", 7)),
            "slope": 2.0 if pcme.get("form", "official") == "official" else 1.0}
    if "scale" in params and "shift" in params:
        opts.update(a=float(params["scale"]), b=float(params["shift"]))
    return opts


def compute_device(device, gallery) -> torch.device:
    """``device`` if given, else where the ``gallery`` tensor lives (the CPU for numpy arrays)."""
    if device is not None:
        return torch.device(device)
    return gallery.device if isinstance(gallery, torch.Tensor) else torch.device("cpu")


def on_device(x, device: torch.device):
    """``x`` (a tensor, numpy array or None) on ``device``; the same object when it is already there."""
    if x is None:
        return None
    x = as_tensor(x, x.dtype if isinstance(x, torch.Tensor) else torch.float32)
    return x if x.device == device else x.to(device, non_blocking=True)


def score_matrix(name: str, mu_a: torch.Tensor, logvar_a: torch.Tensor | None, mu_b: torch.Tensor,
                 logvar_b: torch.Tensor | None, *, chunk_size: int = 1024, progress: bool = False,
                 seed: int = 0, device=None, **kw) -> torch.Tensor:
    """Similarity matrix [N, M] (float32, on the CPU), scored in blocks of ``chunk_size`` rows on ``device``
    (default: where ``mu_b``, the gallery, lives); "mc" draws its samples from a generator seeded with ``seed``."""
    check_score(name, logvar_a is not None and logvar_b is not None)
    dev = compute_device(device, mu_b)
    on_cpu = dev.type == "cpu"
    if not on_cpu:
        mu_b, logvar_b = on_device(mu_b, dev), on_device(logvar_b, dev)
    n, m = mu_a.shape[0], mu_b.shape[0]
    out = torch.empty(n, m, dtype=torch.float32)
    blocks = range(0, n, chunk_size)
    if progress:
        from tqdm import tqdm
        blocks = tqdm(blocks, desc=f"score {name}" + ("" if on_cpu else f" ({dev})"), unit="block")
    form = linear_form(name, mu_a if on_cpu else on_device(mu_a, dev), logvar_a if on_cpu else on_device(logvar_a, dev),
                       mu_b, logvar_b)
    if name == "mc" and "generator" not in kw:
        kw["generator"] = torch.Generator(device=dev).manual_seed(seed)
    for a in blocks:
        b = min(n, a + chunk_size)
        if form is not None and on_cpu:  # one GEMM per row block, written straight into the output
            torch.mm(form[0][a:b], form[1].t(), out=out[a:b])
        elif form is not None:
            out[a:b].copy_(form[0][a:b] @ form[1].t())
        else:
            lv_a = None if logvar_a is None else on_device(logvar_a[a:b], dev)
            out[a:b].copy_(score(name, on_device(mu_a[a:b], dev), lv_a, mu_b, logvar_b, **kw).float())
    return out


class PairScores:
    """Image x caption similarities of a test set: ``i2t`` [n_img, n_cap] (:func:`score_matrix`) and
    ``t2i`` [n_cap, n_img], its contiguous transpose."""

    def __init__(self, name: str, img_mu, img_logvar, cap_mu, cap_logvar, *, chunk_size: int = 1024,
                 progress: bool = False, seed: int = 0, device=None, **kw):
        self.name = name
        self.i2t = score_matrix(name, img_mu, img_logvar, cap_mu, cap_logvar, chunk_size=chunk_size,
                                progress=progress, seed=seed, device=device, **kw)
        self.t2i = transposed(self.i2t)


def linear_form(name: str, mu_a, logvar_a, mu_b, logvar_b) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float32 (A, B) with ``A @ B.T == score(name, ...)`` up to rounding for "csd", "mean" and "cosine"
    (None for the others): -CSD = 2 mu_a.mu_b - (||mu_a||^2 + s_a) - (||mu_b||^2 + s_b), s = ||sigma^2||_1
    (row terms summed in float64), so A = [2 mu_a, -(||mu_a||^2 + s_a), 1], B = [mu_b, 1, -(||mu_b||^2 + s_b)];
    "mean" has s = 0, "cosine" normalised means. Not clamped at 0 as score is (the ranking is the same)."""
    if name not in ("csd", "mean", "cosine") or torch.is_grad_enabled() and (
            getattr(mu_a, "requires_grad", False) or getattr(mu_b, "requires_grad", False)):
        return None
    mu_a, mu_b = as_tensor(mu_a), as_tensor(mu_b)
    if mu_a.device != mu_b.device or mu_a.ndim != 2 or mu_b.ndim != 2 or mu_a.shape[1] != mu_b.shape[1]:
        return None  # let zsprob.prob.score raise its own error / run on the device
    if name == "cosine":
        return (torch.nn.functional.normalize(mu_a, dim=-1, eps=1e-8),
                torch.nn.functional.normalize(mu_b, dim=-1, eps=1e-8))

    def row_term(mu, logvar):
        t = mu.double().pow(2).sum(-1)
        if name == "csd":
            t = t + as_tensor(logvar, torch.float64).exp().sum(-1)
        return t.float()

    ones_a, ones_b = torch.ones(mu_a.shape[0], 1, device=mu_a.device), torch.ones(mu_b.shape[0], 1, device=mu_b.device)
    a_aug = torch.cat([2.0 * mu_a, -row_term(mu_a, logvar_a)[:, None], ones_a], 1)
    b_aug = torch.cat([mu_b, ones_b, -row_term(mu_b, logvar_b)[:, None]], 1)
    return a_aug, b_aug


def transposed(x: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """A contiguous transposed copy, written in bands of ``rows`` source rows (the band's columns
    stay in cache; faster than ``x.t().contiguous()`` on large float32 matrices)."""
    if x.ndim != 2:
        return x.t().contiguous()
    out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=x.device)
    for r in range(0, x.shape[0], rows):
        out[:, r:r + rows].copy_(x[r:r + rows].t())
    return out


def chunked_topk(name: str, q_mu: torch.Tensor, q_logvar: torch.Tensor | None, g_mu: torch.Tensor,
                 g_logvar: torch.Tensor | None, k: int, *, query_chunk: int = 1024, gallery_chunk: int = 65536,
                 progress: bool = False, device=None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` similarities and gallery indices [Q, k] of every query, best first (CPU tensors), with at
    most ``query_chunk x gallery_chunk`` scores in memory: each gallery block's top-k merged into the running
    top-k. Computed on ``device`` (default: where ``g_mu``, the gallery, lives)."""
    check_score(name, q_logvar is not None and g_logvar is not None)
    dev = compute_device(device, g_mu)
    if dev.type != "cpu":
        g_mu, g_logvar = on_device(g_mu, dev), on_device(g_logvar, dev)
    nq, ng = q_mu.shape[0], g_mu.shape[0]
    k = min(k, ng)
    vals_out = torch.empty(nq, k)
    idx_out = torch.empty(nq, k, dtype=torch.int64)
    it = range(0, nq, query_chunk)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"search {name}", unit="block")
    for a in it:
        b = min(nq, a + query_chunk)
        best_v = best_i = None
        for g0 in range(0, ng, gallery_chunk):
            g1 = min(ng, g0 + gallery_chunk)
            q_lv = None if q_logvar is None else on_device(q_logvar[a:b], dev)
            s = score(name, on_device(q_mu[a:b], dev), q_lv, g_mu[g0:g1],
                      None if g_logvar is None else g_logvar[g0:g1], **kw).float()
            v, i = s.topk(min(k, g1 - g0), dim=1)
            i = i + g0
            if best_v is not None:
                v, j = torch.cat([best_v, v], 1).topk(k, dim=1)
                i = torch.cat([best_i, i], 1).gather(1, j)
            best_v, best_i = v, i
        vals_out[a:b] = best_v.cpu()
        idx_out[a:b] = best_i.cpu()
    return vals_out, idx_out


def as_tensor(x, dtype=torch.float32) -> torch.Tensor | None:
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to(dtype)
