"""Chunked image-caption scoring for retrieval.

The similarity itself comes from :func:`zsprob.prob.score` (CSD, mean-only, W2, KL, min-KL,
JS, ELK, Bhattacharyya, cosine, PCME's Monte Carlo match probability); zsprob.prob computes
each block through matrix products (closed forms) or bounded sample blocks (MC), so no
[N, M, D] tensor is formed here. What this module adds:

* :class:`PairScores`: the image x caption similarity of a whole test set, scored in row
  blocks, and its contiguous transpose for text->image rows. Both directions therefore rank by
  the very same numbers. A transposed copy is also cheaper than scoring the caption blocks
  again. CSD, mean-only and cosine scores are one inner product of augmented vectors
  (:func:`linear_form`), so their blocks are single GEMMs written into the output, with no
  [N, M] temporaries (timings: docs/benchmarks.md).
  ``direct_t2i=True`` still scores the t2i direction separately, for symmetric scores.
* :func:`chunked_topk`: the best ``k`` gallery items for every query, merging per-block top-k,
  so a query set can be ranked against a gallery of any size with bounded memory.

Both compute where the gallery tensors live, or on ``device=`` (the gallery is moved there once,
query blocks as they are scored); results come back as float32 / int64 CPU tensors, so the
metrics downstream are the same code on every device. CPU tensors without ``device`` take
exactly the CPU path.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from zsprob.errors import UserError

#: scores with score(a, b) == score(b, a).T (MC is symmetric in expectation but sampled)
SYMMETRIC_SCORES = ("csd", "mean", "cosine", "w2", "minkl", "js", "elk", "bhattacharyya")
NEEDS_SIGMA = ("csd", "w2", "kl", "minkl", "js", "elk", "bhattacharyya", "mc")


def _prob_score() -> Callable:
    try:
        from zsprob.prob import score  # type: ignore[attr-defined]
    except ImportError:  # package __init__ not re-exporting yet
        from zsprob.prob.distances import score
    return score


def score_names() -> tuple[str, ...]:
    try:
        from zsprob.prob import SCORE_NAMES  # type: ignore[attr-defined]
    except ImportError:
        from zsprob.prob.distances import SCORE_NAMES
    return tuple(SCORE_NAMES)


def check_score(name: str, has_sigma: bool) -> None:
    names = score_names()
    if name not in names:
        raise UserError(f"unknown score {name!r} (choose from {', '.join(names)})")
    if name in NEEDS_SIGMA and not has_sigma:
        raise UserError(f"score {name!r} needs sigma (logvar), but the embeddings have none; use 'mean' or 'cosine'")


def mc_score_options(model) -> dict:
    """Options of the "mc" score for a model trained by ``--method pcme``: its learned a (scale) and
    b (shift), J (``loss.pcme.n_samples``) and the match probability of its loss form (slope 2 =
    sigmoid(2 l) for the official form). Read from the checkpoint's metadata (``loss_params``,
    ``train_config``); {} (a = b = 5, J = 7, sigmoid(l)) for any other model."""
    meta = getattr(model, "checkpoint_meta", None) or {}
    extra = meta.get("extra") or {}
    if extra.get("method") != "pcme":
        return {}
    params = extra.get("loss_params") or {}
    pcme = ((extra.get("train_config") or {}).get("loss") or {}).get("pcme") or {}
    opts = {"n_samples": int(pcme.get("n_samples", 7)), "slope": 2.0 if pcme.get("form", "official") == "official" else 1.0}
    if "scale" in params and "shift" in params:
        opts.update(a=float(params["scale"]), b=float(params["shift"]))
    return opts


def score_block(name: str, mu_a, logvar_a, mu_b, logvar_b, **kw) -> torch.Tensor:
    """``zsprob.prob.score`` on one block, as float32 on the inputs' device."""
    return _prob_score()(name, mu_a, logvar_a, mu_b, logvar_b, **kw).float()


def compute_device(device, gallery) -> torch.device:
    """Where scores are computed: ``device`` if given, else where the ``gallery`` tensor lives (CPU
    for numpy arrays)."""
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
    """Full similarity matrix [N, M] (float32, on the CPU), scored in blocks of ``chunk_size`` rows
    on ``device`` (default: where ``mu_b``, the gallery, lives).

    For "mc" a seeded generator (on the compute device) is passed to every block (``seed``) so
    results are reproducible.
    """
    check_score(name, logvar_a is not None and logvar_b is not None)
    dev = compute_device(device, mu_b)
    if dev.type != "cpu":
        return _score_matrix_on(dev, name, mu_a, logvar_a, mu_b, logvar_b, chunk_size=chunk_size,
                                progress=progress, seed=seed, **kw)
    n, m = mu_a.shape[0], mu_b.shape[0]
    out = torch.empty(n, m, dtype=torch.float32)
    it = range(0, n, chunk_size)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"score {name}", unit="block")
    form = linear_form(name, mu_a, logvar_a, mu_b, logvar_b)
    if form is not None:  # one GEMM per row block, written straight into the output
        a_aug, b_aug = form
        for a in it:
            torch.mm(a_aug[a:a + chunk_size], b_aug.t(), out=out[a:a + chunk_size])
        return out
    if name == "mc" and "generator" not in kw:
        kw["generator"] = torch.Generator().manual_seed(seed)
    for a in it:
        b = min(n, a + chunk_size)
        out[a:b] = score_block(name, mu_a[a:b], None if logvar_a is None else logvar_a[a:b], mu_b, logvar_b, **kw)
    return out


def _score_matrix_on(dev: torch.device, name: str, mu_a, logvar_a, mu_b, logvar_b, *, chunk_size: int,
                     progress: bool, seed: int, **kw) -> torch.Tensor:
    """:func:`score_matrix` computed on a device other than the CPU: the gallery moved there once,
    each block of rows scored there and copied into the CPU result."""
    mu_b, logvar_b = on_device(mu_b, dev), on_device(logvar_b, dev)
    n, m = mu_a.shape[0], mu_b.shape[0]
    out = torch.empty(n, m, dtype=torch.float32)
    it = range(0, n, chunk_size)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"score {name} ({dev})", unit="block")
    form = linear_form(name, on_device(mu_a, dev), on_device(logvar_a, dev), mu_b, logvar_b)
    if name == "mc" and "generator" not in kw:
        kw["generator"] = torch.Generator(device=dev).manual_seed(seed)
    for a in it:
        b = min(n, a + chunk_size)
        if form is not None:
            block = form[0][a:b] @ form[1].t()
        else:
            block = score_block(name, on_device(mu_a[a:b], dev),
                                None if logvar_a is None else on_device(logvar_a[a:b], dev), mu_b, logvar_b, **kw)
        out[a:b].copy_(block)
    return out


class PairScores:
    """Image x caption similarities of a test set, with fast row access in both directions.

    ``i2t`` is the [n_img, n_cap] matrix (computed in blocks). ``t2i`` is [n_cap, n_img]: its
    contiguous transpose (default), or, with ``direct_t2i=True`` and a symmetric score, scored
    again from the embeddings (equal up to float rounding).
    """

    def __init__(self, name: str, img_mu, img_logvar, cap_mu, cap_logvar, *, chunk_size: int = 1024,
                 direct_t2i: bool = False, progress: bool = False, seed: int = 0, device=None, **kw):
        self.name = name
        self.i2t = score_matrix(name, img_mu, img_logvar, cap_mu, cap_logvar, chunk_size=chunk_size,
                                progress=progress, seed=seed, device=device, **kw)
        if direct_t2i and name not in SYMMETRIC_SCORES:
            raise UserError(f"direct_t2i needs a symmetric score ({', '.join(SYMMETRIC_SCORES)}), got {name!r}")
        if direct_t2i:
            self.t2i = score_matrix(name, cap_mu, cap_logvar, img_mu, img_logvar, chunk_size=chunk_size * 4,
                                    progress=progress, seed=seed, device=device, **kw)
        else:
            self.t2i = transposed(self.i2t)

    @classmethod
    def from_matrix(cls, i2t: torch.Tensor, t2i: torch.Tensor | None = None, name: str = "given") -> "PairScores":
        self = cls.__new__(cls)
        self.name = name
        self.i2t = i2t
        self.t2i = transposed(i2t) if t2i is None else t2i
        return self


def linear_form(name: str, mu_a, logvar_a, mu_b, logvar_b) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For scores that are one inner product of augmented vectors, float32 (A, B) with
    ``A @ B.T == score(name, ...)`` up to float32 rounding; None for every other score.

    -CSD = 2 mu_a.mu_b - (||mu_a||^2 + s_a) - (||mu_b||^2 + s_b) with s = ||sigma^2||_1, so
    A = [2 mu_a, -(||mu_a||^2 + s_a), 1] and B = [mu_b, 1, -(||mu_b||^2 + s_b)]; "mean" is the same
    with s = 0 and "cosine" uses the normalised means. The row and column terms are summed in
    float64. Unlike :func:`zsprob.prob.score`, a squared distance is not clamped at 0 (rounding
    can make -CSD of two identical points a tiny positive number; the ranking is unaffected).
    """
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
    """Top-``k`` similarities and gallery indices [Q, k] of every query, best first (CPU tensors).

    Memory is bounded by ``query_chunk x gallery_chunk`` scores at a time: per gallery block
    the block's top-k are merged with the running top-k. Computed on ``device`` (default: where
    ``g_mu``, the gallery, lives).
    """
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
        best_v = None
        best_i = None
        for g0 in range(0, ng, gallery_chunk):
            g1 = min(ng, g0 + gallery_chunk)
            q_lv = None if q_logvar is None else on_device(q_logvar[a:b], dev)
            s = score_block(name, on_device(q_mu[a:b], dev), q_lv, g_mu[g0:g1],
                            None if g_logvar is None else g_logvar[g0:g1], **kw)
            v, i = s.topk(min(k, g1 - g0), dim=1)
            i = i + g0
            if best_v is None:
                best_v, best_i = v, i
            else:
                cv = torch.cat([best_v, v], 1)
                ci = torch.cat([best_i, i], 1)
                best_v, j = cv.topk(k, dim=1)
                best_i = ci.gather(1, j)
        vals_out[a:b] = best_v.cpu()
        idx_out[a:b] = best_i.cpu()
    return vals_out, idx_out


def as_tensor(x, dtype=torch.float32) -> torch.Tensor | None:
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to(dtype)
