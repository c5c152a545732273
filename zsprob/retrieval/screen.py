"""Exact retrieval metrics without a score matrix: a bfloat16 screen with a proven error bound.

CSD, mean-only and cosine rank a gallery by a *linear* key. For a query vector ``a`` and
gallery item ``j``::

    key(a, j) = w <a, b_j> - c_j

CSD: w = 2, b_j = mu_j, c_j = ||mu_j||^2 + ||sigma_j^2||_1 (the query's own terms are the same
for every item and drop out of its ranking); mean-only: c_j = ||mu_j||^2; cosine: the
float32-normalised means, w = 1, c = 0. Every benchmark metric is a function of where the
positives rank, and only up to a cap:

* R@K (COCO 5K, CxC): the rank of each query's best positive, clipped at K; COCO 1K the same
  within the fold's column range;
* R-Precision, mAP@R, R@1 (ECCV Caption): the ranks of all positives, clipped at R (a positive
  at rank r < R is a hit at position r).

So evaluation is a list of *rank requests* (query, item, cap, column range), answered by
:func:`screen_ranks`: rank = #items with a higher key + #items with an equal key and a lower
index, i.e. the position in the stable descending order of the float64 keys
(:func:`zsprob.retrieval.metrics.topk_ranking`'s rule).

:class:`Screen` computes every key approximately with one bfloat16 GEMM per block of queries
(AMX tiles on recent Xeons: ~5x the float32 GEMM here), each query offset by ``o_i`` so that its
thresholds lie just above zero (positive bfloat16 numbers order like their int16 bit patterns),
and reduces the block to int16 group maxima of 64 items. A rigorous rounding bound
(:meth:`Screen.error`: input rounding by Cauchy-Schwarz on the actual residual norms, float32
accumulation, output rounding) settles most requests from the group maxima alone (>= cap
groups hold an item certainly above); for the others the candidate groups' sub-groups of 8
that reach the lower threshold are inspected item by item, and only items inside the band are
rescored in float64. Each such request's own item must turn up inside its band, with a
rescored error within the bound: that check is free and catches a GEMM that rounds otherwise
(:class:`ScreenBoundError`; ``evaluate_embeddings`` then falls back to the score matrix).

Without AMX (``torch.cpu._is_amx_tile_supported()`` false) the same screen runs in float32
(u = 2^-24), slower but exact in the same sense. The two directions run in two threads
(:func:`parallel`). torch (oneDNN's AMX GEMM, reductions) and numpy (float64 exp) do the
arithmetic; the screen, the bound and the certification are zsprob's own.

:func:`evaluate_screened` runs every benchmark of a :class:`~zsprob.retrieval.evaluate.RetrievalTask`
this way and returns the :class:`~zsprob.retrieval.evaluate.EvalResult` of
:func:`~zsprob.retrieval.evaluate.evaluate_scores`. Benchmarks with very long positive lists
(PMRP, R > ``SHARED_L_LIMIT``) are ranked on float32 score blocks as before.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

LINEAR_SCORES = ("csd", "mean", "cosine")
#: items per group maximum (64 int16 lanes reduce fastest on AVX-512)
GROUP = 64
#: items per sub-group inside a candidate group
SUB = 8
#: rows per chunk of the float64 work (fits in L2 cache)
CHUNK = 2048
#: target size of one block of approximate keys (rows x padded gallery; measured best on 2 cores)
BLOCK_ELEMS = 6_500_000


def norm_slack(d: int) -> float:
    """Inflation covering the rounding of a float32 norm of d terms (squares, sum, scaling, sqrt:
    relative error below (d + 4) 2^-24), with a factor 4 to spare."""
    return 1.0 + 4 * (d + 4) * 2.0 ** -24


class ScreenBoundError(RuntimeError):
    """A rescored pair fell outside the certified rounding bound (a GEMM that does not accumulate
    in float32 as assumed); the caller must not trust the screen on this machine."""


def amx_available() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # pragma: no cover - older torch / other CPUs
        return False


# ----------------------------------------------------------------------------- keys
class Side:
    """One modality's vectors as the screen needs them: float32, exact squared norms
    (:meth:`exact`), and per precision the rounded vectors, their transpose and the norms of the
    vectors and of their rounding residuals (:meth:`lp`). Made once, shared by both directions and
    every fold; the parts can be prepared in different threads. Work goes through chunk buffers:
    large fresh temporaries cost page faults every time."""

    def __init__(self, mu: torch.Tensor):
        self.mu = torch.as_tensor(mu).detach().to("cpu", torch.float32).contiguous()
        self.sq = None
        self._lp: dict = {}

    def __len__(self) -> int:
        return self.mu.shape[0]

    def exact(self) -> "Side":
        """Squared norms in float64 (exact products of float32, float64 sums)."""
        if self.sq is None:
            sq = torch.empty(len(self), dtype=torch.float64)
            buf = torch.empty(min(CHUNK, len(self)), self.mu.shape[1], dtype=torch.float64)
            for s in range(0, len(self), CHUNK):
                b = buf[:min(CHUNK, len(self) - s)]
                b.copy_(self.mu[s:s + CHUNK])
                torch.bmm(b.unsqueeze(1), b.unsqueeze(2), out=sq[s:s + b.shape[0]].view(-1, 1, 1))
            self.sq = sq
        return self

    def lp(self, dtype: torch.dtype):
        """(rounded vectors [N, D], their transpose [D, N], float64 norms of the rounded vectors and
        of the rounding residuals, both inflated by :func:`norm_slack`). A residual x - rn(x) is
        exact in float32 (Sterbenz), so only the norm's own rounding needs the slack."""
        if dtype not in self._lp:
            v = self.mu.to(dtype)
            n = len(self)
            hat, res = torch.empty(n), torch.empty(n)
            buf = torch.empty(min(CHUNK, n), self.mu.shape[1])
            for s in range(0, n, CHUNK):
                b = buf[:min(CHUNK, n - s)]
                b.copy_(v[s:s + CHUNK])
                torch.linalg.vector_norm(b, dim=1, out=hat[s:s + b.shape[0]])
                b.sub_(self.mu[s:s + CHUNK]).neg_()
                torch.linalg.vector_norm(b, dim=1, out=res[s:s + b.shape[0]])
            slack = norm_slack(self.mu.shape[1])
            self._lp[dtype] = (v, v.T.contiguous(), hat.double() * slack, res.double() * slack)
        return self._lp[dtype]


def prepare(score: str, img_mu, img_logvar, cap_mu, cap_logvar, dtype: torch.dtype | None = None,
            threads: int | None = None) -> tuple[Side, torch.Tensor, Side, torch.Tensor, float]:
    """(image side, image bias, caption side, caption bias, w) of a linear score, the pieces
    prepared concurrently (:func:`parallel`). A modality's bias as a gallery is ||mu||^2 +
    ||sigma^2||_1 (CSD), ||mu||^2 (mean) or 0 (cosine), shifted by its median."""
    if score not in LINEAR_SCORES:
        raise ValueError(f"score {score!r} is not linear (screened scores: {', '.join(LINEAR_SCORES)})")
    dtype = dtype or (torch.bfloat16 if amx_available() else torch.float32)
    mi = torch.as_tensor(img_mu).detach().to("cpu", torch.float32)
    mc = torch.as_tensor(cap_mu).detach().to("cpu", torch.float32)
    if mi.ndim != 2 or mc.ndim != 2 or mi.shape[1] != mc.shape[1]:
        raise ValueError(f"image {tuple(mi.shape)} and caption {tuple(mc.shape)} means must be [N, D] with the same D")
    for name, x in (("image_mu", mi), ("caption_mu", mc), ("image_logvar", img_logvar), ("caption_logvar", cap_logvar)):
        if x is not None and not bool(torch.isfinite(torch.as_tensor(x)).all()):
            raise ValueError(f"{name} contains NaN or inf")
    if score == "cosine":  # the normalised means, as zsprob.prob.score and linear_form compute them
        mi = torch.nn.functional.normalize(mi, dim=-1, eps=1e-8)
        mc = torch.nn.functional.normalize(mc, dim=-1, eps=1e-8)
    elif score == "csd" and (img_logvar is None or cap_logvar is None):
        raise ValueError("score 'csd' needs logvar for both modalities")
    si, sc = Side(mi), Side(mc)

    def spread(logvar):
        """||sigma^2||_1 in float64 (numpy's float64 exp is 2x torch's), in chunks."""
        if score != "csd":
            return None
        lv = torch.as_tensor(logvar).detach().to("cpu", torch.float32).numpy()
        out = np.empty(len(lv))
        buf = np.empty((min(CHUNK, len(lv)), lv.shape[1]))
        for s in range(0, len(lv), CHUNK):
            b = buf[:len(lv[s:s + CHUNK])]
            np.exp(lv[s:s + CHUNK], out=b, dtype=np.float64)
            b.sum(1, out=out[s:s + len(b)])
        return torch.from_numpy(out)

    # the caption side is 5x the image side: its three parts go to different threads
    work = parallel([lambda: (si.exact(), si.lp(dtype), spread(img_logvar))[2], lambda: spread(cap_logvar),
                     lambda: sc.lp(dtype), sc.exact], threads)
    bias = []
    for side, s in ((si, work[0]), (sc, work[1])):
        if score == "cosine":
            c = torch.zeros(len(side), dtype=torch.float64)
        else:
            c = side.sq.clone() if s is None else side.sq + s
            if c.numel():
                c -= c.median()  # a constant shift: same ranking, smaller numbers for the screen
        bias.append(c)
    return si, bias[0], sc, bias[1], (1.0 if score == "cosine" else 2.0)


class LinearKeys:
    """key(i, j) = w <a_i, b_j> - c_j for queries ``q.mu[rows]`` and gallery ``g.mu[cols]``
    (:class:`Side`; ``rows`` / ``cols`` None for all), gallery bias ``c`` [m] (float64).
    :meth:`exact_pairs` / :meth:`exact_rows` are the float64 reference every screened decision is
    certified against. Indices passed to the methods are local (0..n-1, 0..m-1)."""

    def __init__(self, q: Side, g: Side, c: torch.Tensor, w: float, rows: torch.Tensor | None = None,
                 cols: torch.Tensor | None = None):
        self.q, self.g, self.c, self.w = q.exact(), g.exact(), c, float(w)
        self.rows = torch.arange(len(q)) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
        self.cols = torch.arange(len(g)) if cols is None else torch.as_tensor(cols, dtype=torch.int64)
        self.full_cols = cols is None

    @classmethod
    def from_score(cls, name: str, mu_q, logvar_q, mu_g, logvar_g, **kw) -> "LinearKeys":
        """Ranking keys of ``zsprob.prob.score(name, ...)`` for queries ``mu_q`` against gallery ``mu_g``."""
        sq, _, sg, cg, w = prepare(name, mu_q, logvar_q, mu_g, logvar_g, **kw)
        return cls(sq, sg, cg, w)

    @property
    def n(self) -> int:
        return self.rows.numel()

    @property
    def m(self) -> int:
        return self.cols.numel()

    def subset(self, rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> "LinearKeys":
        r = self.rows if rows is None else self.rows[torch.as_tensor(np.asarray(rows, dtype=np.int64))]
        if cols is None:
            return LinearKeys(self.q, self.g, self.c, self.w, r, None if self.full_cols else self.cols)
        ct = torch.as_tensor(np.asarray(cols, dtype=np.int64))
        return LinearKeys(self.q, self.g, self.c[ct], self.w, r, self.cols[ct])

    def exact_pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float64 keys of the pairs (rows[p], cols[p])."""
        return self.w * pair_dots(self.q.mu, self.g.mu, self.rows[rows], self.cols[cols]) - self.c[cols]

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float64 keys [len(rows), m] of whole rows (the fallback for rows the screen cannot settle)."""
        return self.w * (self.q.mu[self.rows[rows]].double() @ self.g.mu[self.cols].double().T) - self.c[None, :]


def pair_dots(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float64 <a[rows[p]], b[cols[p]]> of float32 vectors (products exact, float64 sums),
    gathered chunk by chunk into reused buffers."""
    n = rows.numel()
    out = torch.empty(n, dtype=torch.float64)
    if n == 0:
        return out
    k = min(CHUNK, n)
    a32, b32 = torch.empty(k, a.shape[1]), torch.empty(k, b.shape[1])
    a64, b64 = torch.empty(k, a.shape[1], dtype=torch.float64), torch.empty(k, b.shape[1], dtype=torch.float64)
    for s in range(0, n, k):
        m = min(k, n - s)
        torch.index_select(a, 0, rows[s:s + m], out=a32[:m])
        torch.index_select(b, 0, cols[s:s + m], out=b32[:m])
        a64[:m].copy_(a32[:m])
        b64[:m].copy_(b32[:m])
        torch.bmm(a64[:m].unsqueeze(1), b64[:m].unsqueeze(2), out=out[s:s + m].view(m, 1, 1))
    return out


def _split3(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64) as the sum of three ``dtype`` numbers: parts [3, n] and their exact float64 sum."""
    parts, rest = [], x.clone()
    for _ in range(3):
        p = rest.to(dtype)
        parts.append(p)
        rest = rest - p.double()
    stacked = torch.stack(parts)
    return stacked, stacked.double().sum(0)


def _bits(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Integer bit patterns of the ``dtype`` number just >= x (``up``) or just <= x, for x > 0.
    Positive floats order like their bit patterns, so comparisons can run on the integers."""
    idt = torch.int16 if dtype == torch.bfloat16 else torch.int32
    bits = x.to(torch.float32).to(dtype).view(idt).to(torch.int64)
    for _ in range(3):  # float64 -> float32 -> dtype may round twice; step to the right side
        back = bits.clamp(torch.iinfo(idt).min, torch.iinfo(idt).max).to(idt).view(dtype).double()
        bits = torch.where(back < x, bits + 1, bits) if up else torch.where(back > x, bits - 1, bits)
    return bits.clamp(torch.iinfo(idt).min, torch.iinfo(idt).max).to(idt)


def _round_down_f32(x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.float32)
    return torch.where(y.double() > x, torch.nextafter(y, torch.tensor(-math.inf)), y)


class Screen:
    """Approximate keys ``out[i, j] ~ key(i, j) - o_i`` of a :class:`LinearKeys` problem, one
    low-precision GEMM per block of query rows, with the certified error bound :meth:`error`.

    The gallery side is one [K, m_pad] matrix: b^T, the three-part split of -c (rows D..D+2) and
    three rows of ones that carry the per-query offset o_i; padding columns score about -1e30.
    """

    def __init__(self, keys: LinearKeys, *, dtype: torch.dtype | None = None, group: int = GROUP):
        if dtype is None:
            dtype = torch.bfloat16 if amx_available() else torch.float32
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("the screen runs in bfloat16 or float32")
        self.keys, self.dtype, self.group = keys, dtype, int(group)
        self.int_dtype = torch.int16 if dtype == torch.bfloat16 else torch.int32
        self.u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
        #: relative bound of the output rounding (round-to-nearest gives u; 2u also covers truncation)
        self.rel = 2 * self.u
        d, m = keys.q.mu.shape[1], keys.m
        self.d, self.ng = d, max(1, -(-m // self.group))
        self.m_pad = self.ng * self.group
        self.k = -(-(d + 6) // 32) * 32  # AMX tiles like K in multiples of 32
        b_lp, b_lpT, b_hat_norm, rb = keys.g.lp(dtype)
        a_lp, _, a_hat_norm, ra = keys.q.lp(dtype)
        cols = keys.cols
        bt = torch.empty(self.k, self.m_pad, dtype=dtype)
        if keys.full_cols:
            bt[:d, :m] = b_lpT
        elif m and int(cols[-1]) - int(cols[0]) == m - 1 and bool((cols[1:] > cols[:-1]).all()):
            bt[:d, :m] = b_lpT[:, int(cols[0]):int(cols[0]) + m]  # a contiguous fold
        else:
            bt[:d, :m] = b_lpT.index_select(1, cols)
        bt[:d, m:] = 0
        bt[d:, :] = 0
        c_parts, c_fold = _split3(keys.c, dtype)
        bt[d:d + 3, :m] = -c_parts
        bt[d, m:] = -1e30
        bt[d + 3:d + 6] = 1
        self.bt = bt
        self.a_lp = a_lp
        self.qrows = keys.rows
        # the bound's ingredients: norms of the GEMM inputs and of their rounding residuals
        self.bmax = float(keys.g.sq[cols].max().sqrt()) * (1 + 1e-12) if m else 0.0
        self.bhat_max = float(b_hat_norm[cols].max()) if m else 0.0
        self.rb_max = float(rb[cols].max()) if m else 0.0
        self.ahat = a_hat_norm * keys.w
        self.ra = ra * keys.w
        self.c_resid = float((keys.c - c_fold).abs().max()) if m else 0.0
        self.cmax = float(c_fold.abs().max()) if m else 0.0
        #: float32 accumulation of K terms, doubled for safety
        self.gamma = 2.0 * self.k * 2.0 ** -24 / (1.0 - self.k * 2.0 ** -24)

    def fold(self, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The offsets as the GEMM sees them: (three parts [n, 3], their exact float64 sum)."""
        parts, o_fold = _split3(o, self.dtype)
        return parts.T.contiguous(), o_fold

    def error(self, rows: torch.Tensor, o_fold: torch.Tensor) -> torch.Tensor:
        """Absolute part E_i of the bound |out_ij - (key_ij - o_i)| <= E_i + rel |out_ij|, for the
        queries ``rows`` with folded offsets ``o_fold``.

        With alpha_i = w a_i, beta_j = b_j and hats for the rounded GEMM inputs,
        |alpha.beta - alpha^.beta^| <= ||alpha - alpha^|| ||beta|| + ||alpha^|| ||beta - beta^|| (Cauchy-Schwarz);
        the K float32 additions of exact bfloat16 products add at most gamma times the sum of |terms|;
        the three-part bias split leaves ``c_resid`` (and 2^-50 |c| + 2^-50 |o| for float64 sums of
        the parts); denormals flushed to zero are covered by 1e-30; the output rounding is the
        ``rel |out|`` part.
        """
        rows = self.qrows[rows]
        prod = self.ra[rows] * self.bmax + self.ahat[rows] * self.rb_max
        bias = (self.cmax + o_fold.abs()) * (1 + 2 * self.u)
        acc = self.gamma * (self.ahat[rows] * self.bhat_max + bias)
        return (prod + acc) * (1 + 1e-12) + self.c_resid + 2.0 ** -50 * bias + 1e-30

    def gemm(self, rows: torch.Tensor, o_parts: torch.Tensor) -> torch.Tensor:
        """Approximate keys minus offsets of the queries ``rows`` (at most :meth:`block_rows`), written
        into a buffer reused by the next call (fresh 13 MB outputs cost page faults every block)."""
        r = rows.numel()
        if getattr(self, "_abuf", None) is None or self._abuf.shape[0] < r:
            self._abuf = torch.zeros(max(r, self.block_rows()), self.k, dtype=self.dtype)
            self._abuf[:, self.d:self.d + 3] = 1
            self._obuf = torch.empty(self._abuf.shape[0], self.m_pad, dtype=self.dtype)
        a = self._abuf[:r]
        a[:, :self.d] = self.a_lp[self.qrows[rows]]
        if self.keys.w != 1:
            a[:, :self.d] *= self.keys.w  # w is 1 or 2: an exact scaling
        a[:, self.d + 3:self.d + 6] = -o_parts
        return torch.mm(a, self.bt, out=self._obuf[:r])

    def block_rows(self) -> int:
        return int(max(64, min(2048, BLOCK_ELEMS // self.m_pad)) // 64 * 64)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """Row sums of a bool matrix (summed as bytes: torch's bool reduction is ~10x slower)."""
    return mask.view(torch.uint8).sum(1, dtype=torch.int32)


def _certify(approx: torch.Tensor, target: torch.Tensor, e: torch.Tensor, rel: float) -> None:
    """Raise :class:`ScreenBoundError` unless every |approx - target| is within the bound."""
    viol = (approx - target).abs() > (e + rel * approx.abs()) * (1 + 1e-9)
    if bool(viol.any()):
        i = int(torch.nonzero(viol)[0])
        raise ScreenBoundError(
            f"screened key {float(approx[i]):.9g} vs exact {float(target[i]):.9g}: error above the bound "
            f"{float(e[i] + rel * approx[i].abs()):.3g}; this GEMM does not accumulate as the screen assumes")


# ----------------------------------------------------------------------------- ranks
def screen_ranks(keys: LinearKeys, rows, cols, caps, *, theta: torch.Tensor | None = None, col_lo=None, col_hi=None,
                 screen: Screen | None = None, dtype: torch.dtype | None = None, group: int = GROUP,
                 stats: dict | None = None) -> np.ndarray:
    """Rank of gallery item ``cols[p]`` in the ranking of query ``rows[p]``, clipped at ``caps[p]``.

    rank = #{j : key(row, j) > key(row, col)} + #{j < col : key(row, j) == key(row, col)}, the
    0-based position of ``col`` in the stable descending order of the float64 keys, counting only
    items ``col_lo[p] <= j < col_hi[p]`` when given (COCO 1K ranks within a fold's contiguous
    range, which must hold ``cols[p]``). ``theta``: the float64 keys of the pairs if already known
    (``keys.exact_pairs(rows, cols)``). Returns int64 [P].
    """
    scr = screen or Screen(keys, dtype=dtype, group=group)
    st = stats if stats is not None else {}
    for k in ("requests", "rescored", "fallback_rows", "rows"):
        st.setdefault(k, 0)
    m = keys.m
    rows = torch.as_tensor(np.asarray(rows, dtype=np.int64))
    cols = torch.as_tensor(np.asarray(cols, dtype=np.int64))
    caps = torch.as_tensor(np.asarray(caps, dtype=np.int64))
    P = rows.numel()
    c_lo = torch.zeros(P, dtype=torch.int64) if col_lo is None else torch.as_tensor(np.asarray(col_lo, dtype=np.int64))
    c_hi = torch.full((P,), m, dtype=torch.int64) if col_hi is None else torch.as_tensor(np.asarray(col_hi, dtype=np.int64))
    st["requests"] += P
    if P == 0:
        return np.zeros(0, dtype=np.int64)
    if bool(((cols < c_lo) | (cols >= c_hi) | (c_lo < 0) | (c_hi > m) | (rows < 0) | (rows >= keys.n)).any()):
        raise ValueError("each request needs 0 <= row < n and 0 <= col_lo <= col < col_hi <= m")
    theta = keys.exact_pairs(rows, cols) if theta is None else torch.as_tensor(theta, dtype=torch.float64)
    order = torch.argsort(rows, stable=True)
    rows, cols, caps, theta, c_lo, c_hi = (x[order] for x in (rows, cols, caps, theta, c_lo, c_hi))
    rank = torch.zeros(P, dtype=torch.int64)
    urows, first, counts = torch.unique_consecutive(rows, return_inverse=True, return_counts=True)
    # offsets: each query's lowest threshold sits 4 E above zero, so every threshold is positive
    tmin = torch.full((urows.numel(),), math.inf, dtype=torch.float64).scatter_reduce(
        0, first, theta, reduce="amin", include_self=True)
    e0 = scr.error(urows, tmin)
    o = tmin - 4 * e0 - 1e-9 * tmin.abs()
    o_parts, o_fold = scr.fold(o)
    err = scr.error(urows, o_fold)
    rel = scr.rel
    th = theta - o_fold[first]
    e = err[first]
    hi = (th + e) / (1 - rel)  # out > hi  =>  key > theta
    lo = (th - e) / (1 + rel)  # out < lo  =>  key < theta
    valid = lo > 0
    hb = torch.zeros(P, dtype=scr.int_dtype)
    lb = torch.zeros(P, dtype=scr.int_dtype)
    if bool(valid.any()):
        hb[valid] = _bits(hi[valid], scr.dtype, up=True)
        lb[valid] = _bits(lo[valid], scr.dtype, up=False)
    g, ng = scr.group, scr.ng
    if g % SUB:
        raise ValueError(f"group size {g} must be a multiple of {SUB}")
    ranged = (c_lo > 0) | (c_hi < m)
    gfull0, gfull1 = -(-c_lo // g), c_hi // g  # groups wholly inside [c_lo, c_hi)
    gpart0, gpart1 = c_lo // g, -(-c_hi // g)  # groups touching it
    garange = torch.arange(ng)
    br = scr.block_rows()
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    need = torch.zeros(P, dtype=torch.bool)
    cand_req, cand_group, cand_vals = [], [], []
    # per block: the GEMM, group maxima, the requests they settle, and the candidate groups' values
    for s in range(0, urows.numel(), br):
        ub = slice(s, min(s + br, urows.numel()))
        out = scr.gemm(urows[ub], o_parts[ub])
        r = out.shape[0]
        st["rows"] += r
        iv = out.view(scr.int_dtype).view(r, ng, g)
        gmax = iv.amax(-1)
        p0, p1 = int(starts[ub][0]), int(ends[ub][-1])
        pr = slice(p0, p1)
        lr = first[pr] - s  # local row of each request
        gm = gmax[lr]
        above = gm > hb[pr][:, None]
        rg = torch.nonzero(ranged[pr]).flatten()
        if rg.numel():
            above[rg] &= (garange >= gfull0[pr][rg, None]) & (garange < gfull1[pr][rg, None])
        nb = valid[pr] & (_count(above) < caps[pr])
        need[pr] = nb
        ni = torch.nonzero(nb).flatten()
        if not ni.numel():
            continue
        sel = gm[ni] >= lb[pr][ni][:, None]
        rgn = torch.nonzero(ranged[pr][ni]).flatten()
        if rgn.numel():
            k = ni[rgn] + p0
            sel[rgn] &= (garange >= gpart0[k, None]) & (garange < gpart1[k, None])
        qi, gg = sel.nonzero(as_tuple=True)
        pi = ni[qi]
        # within the candidate groups, sub-groups of SUB items: only those reaching lo are kept
        sub = iv.view(r, ng, g // SUB, SUB)[lr[pi], gg].amax(-1)  # [G, g / SUB]
        gi, sj = (sub >= lb[pr][pi][:, None]).nonzero(as_tuple=True)
        pk = pi[gi]
        sid = gg[gi] * (g // SUB) + sj
        cand_req.append(pk + p0)
        cand_group.append(sid)
        cand_vals.append(iv.view(r, ng * (g // SUB), SUB)[lr[pk], sid])  # [S, SUB]
    settled = valid & ~need
    rank[settled] = caps[settled]  # at least cap groups hold an item certainly ranked before
    if cand_req:
        # all blocks at once: certain items, items to rescore, counts
        pi, sid, vals = torch.cat(cand_req), torch.cat(cand_group), torch.cat(cand_vals)
        cert = vals > hb[pi][:, None]
        maybe = vals >= lb[pi][:, None]
        item = sid[:, None] * SUB + torch.arange(SUB)[None, :]
        rgi = torch.nonzero(ranged[pi]).flatten()
        if rgi.numel():  # items outside a request's column range do not count
            inside = (item[rgi] >= c_lo[pi[rgi], None]) & (item[rgi] < c_hi[pi[rgi], None])
            cert[rgi] &= inside
            maybe[rgi] &= inside
        maybe &= ~cert
        count = torch.zeros(P, dtype=torch.int64).index_add_(0, pi, _count(cert).to(torch.int64))
        mi, mk = maybe.nonzero(as_tuple=True)
        mp = pi[mi]
        mc = item[mi, mk]
        own = mc == cols[mp]
        # free certification: each request's own item (key theta, known) must lie within the band
        seen = torch.zeros(P, dtype=torch.int64).index_add_(0, mp[own], torch.ones_like(mp[own]))
        if bool((seen[need] != 1).any()):
            raise ScreenBoundError("a query's own item fell outside its certified band; this GEMM does not "
                                   "round as the screen assumes")
        _certify(vals[mi[own], mk[own]].view(scr.dtype).double(), theta[mp[own]] - o_fold[first[mp[own]]],
                 e[mp[own]], rel)
        keep = ~own  # the item itself is never ranked before itself
        mi, mk, mp, mc = mi[keep], mk[keep], mp[keep], mc[keep]
        if mp.numel():
            exact = keys.exact_pairs(rows[mp], mc)
            st["rescored"] += int(mp.numel())
            _certify(vals[mi, mk].view(scr.dtype).double(), exact - o_fold[first[mp]], e[mp], rel)
            t = theta[mp]
            before = (exact > t) | ((exact == t) & (mc < cols[mp]))
            count.index_add_(0, mp, before.to(torch.int64))
        rank[need] = torch.minimum(count[need], caps[need])
    fb = torch.nonzero(~valid).flatten()
    if fb.numel():  # thresholds too close to zero for the integer comparison: whole rows in float64
        st["fallback_rows"] += torch.unique(rows[fb]).numel()
        rank[fb] = exact_ranks(keys, rows[fb], cols[fb], caps[fb], theta[fb], c_lo[fb], c_hi[fb])
    out = torch.empty_like(rank)
    out[order] = rank
    return out.numpy()


def exact_ranks(keys: LinearKeys, rows: torch.Tensor, cols: torch.Tensor, caps: torch.Tensor, theta: torch.Tensor,
                c_lo: torch.Tensor, c_hi: torch.Tensor) -> torch.Tensor:
    """:func:`screen_ranks` the slow way, from whole float64 rows (its fallback)."""
    rank = torch.zeros(rows.numel(), dtype=torch.int64)
    urows = torch.unique(rows)
    j = torch.arange(keys.m)[None, :]
    for a in range(0, urows.numel(), 256):
        rr = urows[a:a + 256]
        kk = keys.exact_rows(rr)
        pos = torch.searchsorted(rr, rows)
        f = torch.nonzero((pos < rr.numel()) & (rr[pos.clamp_max(rr.numel() - 1)] == rows)).flatten()
        row_keys, t = kk[pos[f]], theta[f][:, None]
        before = (row_keys > t) | ((row_keys == t) & (j < cols[f][:, None]))
        before &= (j >= c_lo[f][:, None]) & (j < c_hi[f][:, None])
        rank[f] = torch.minimum(before.sum(1), caps[f])
    return rank


# ----------------------------------------------------------------------------- top lists
def screen_topk(keys: LinearKeys, k: int, rows: np.ndarray | None = None, *, screen: Screen | None = None,
                dtype: torch.dtype | None = None, group: int = GROUP, stats: dict | None = None) -> np.ndarray:
    """The ``k`` best gallery indices of each query in ``rows`` (default: all), best first, in
    the stable descending order of the float64 keys. Returns int64 [len(rows), min(k, m)]."""
    scr = screen or Screen(keys, dtype=dtype, group=group)
    st = stats if stats is not None else {}
    for key in ("rescored", "fallback_rows", "rows"):
        st.setdefault(key, 0)
    rows = torch.arange(keys.n) if rows is None else torch.as_tensor(np.asarray(rows, dtype=np.int64))
    k = min(int(k), keys.m)
    tops = np.full((rows.numel(), k), -1, dtype=np.int64)
    if k == 0 or rows.numel() == 0:
        return tops
    g, ng = scr.group, scr.ng
    if k > ng:  # more items than groups: whole rows
        st["fallback_rows"] += rows.numel()
        for a in range(0, rows.numel(), 256):
            kk = keys.exact_rows(rows[a:a + 256])
            tops[a:a + 256] = kk.argsort(dim=1, descending=True, stable=True)[:, :k].numpy()
        return tops
    o_parts, o_fold = scr.fold(torch.zeros(rows.numel(), dtype=torch.float64))
    err = scr.error(rows, o_fold)
    rel = scr.rel
    pr, pc, pk = [], [], []
    br = scr.block_rows()
    for s in range(0, rows.numel(), br):
        rb = rows[s:s + br]
        out = scr.gemm(rb, o_parts[s:s + br]).float()
        st["rows"] += rb.numel()
        sub = out.view(rb.numel(), ng, g)
        gm = sub.amax(-1)
        mth = gm.topk(k, dim=1).values[:, -1].double()
        e = err[s:s + br]
        # k items have out >= mth, so the k-th best exact key is >= xl; an item can only reach it
        # if out >= lo (the bound read both ways, for either sign)
        xl = mth - e - rel * mth.abs()
        t = xl - e
        lo = torch.where(t >= 0, t / (1 + rel), t / (1 - rel))
        lo32 = _round_down_f32(lo)
        qi, gg = (gm >= lo32[:, None]).nonzero(as_tuple=True)
        vals = sub[qi, gg]
        mi, mk = (vals >= lo32[qi][:, None]).nonzero(as_tuple=True)
        prow = qi[mi] + s
        pcol = gg[mi] * g + mk
        exact = keys.exact_pairs(rows[prow], pcol)
        st["rescored"] += int(prow.numel())
        _certify(vals[mi, mk].double(), exact - o_fold[prow], err[prow], rel)
        pr.append(prow)
        pc.append(pcol)
        pk.append(exact)
    r, c, kv = torch.cat(pr).numpy(), torch.cat(pc).numpy(), torch.cat(pk).numpy()
    order = np.lexsort((c, -kv, r))  # by query, then key descending, then index
    r, c = r[order], c[order]
    pos = np.arange(len(r)) - np.searchsorted(r, r, side="left")
    keep = pos < k
    tops[r[keep], pos[keep]] = c[keep]
    return tops


# ----------------------------------------------------------------------------- benchmarks
class _PairDots:
    """float64 <mu_image, mu_caption> of a set of (image, caption) pairs, computed once and read by
    both directions (their keys differ only in the bias term)."""

    def __init__(self, img_side: Side, cap_side: Side, img: np.ndarray, cap: np.ndarray, threads: int | None = None):
        self.n_cap = len(cap_side)
        code = np.asarray(img, dtype=np.int64) * self.n_cap + np.asarray(cap, dtype=np.int64)
        self.code = np.unique(code, return_inverse=True)[0]  # (the inverse path sorts; plain unique hashes, 7x slower)
        r, c = torch.from_numpy(self.code // self.n_cap), torch.from_numpy(self.code % self.n_cap)
        h = len(self.code) // 2
        parts = parallel([lambda: pair_dots(img_side.mu, cap_side.mu, r[:h], c[:h]),
                          lambda: pair_dots(img_side.mu, cap_side.mu, r[h:], c[h:])], threads)
        self.dot = torch.cat(parts)

    def get(self, img: np.ndarray, cap: np.ndarray) -> torch.Tensor:
        code = np.asarray(img, dtype=np.int64) * self.n_cap + np.asarray(cap, dtype=np.int64)
        return self.dot[torch.from_numpy(np.searchsorted(self.code, code))]


def _positive_pairs(pos: sp.csr_matrix, queries: np.ndarray):
    sub = pos[queries]
    q = np.repeat(np.asarray(queries, dtype=np.int64), np.diff(sub.indptr))
    return q, sub.indices.astype(np.int64)


def _keys_of(dots: _PairDots, keys: LinearKeys, d: str, q: np.ndarray, g: np.ndarray) -> torch.Tensor:
    """float64 keys of (query, gallery item) pairs of direction ``d`` from the shared dot products."""
    img, cap = (q, g) if d == "i2t" else (g, q)
    return keys.w * dots.get(img, cap) - keys.c[torch.from_numpy(g)]


def _best(q: np.ndarray, g: np.ndarray, k: torch.Tensor, queries: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Each query's best positive (lowest index among equal keys) and its key."""
    local = torch.from_numpy(np.searchsorted(queries, q))
    best = torch.full((len(queries),), -math.inf, dtype=torch.float64).scatter_reduce(
        0, local, k, reduce="amax", include_self=True)
    tie = k == best[local]
    idx = torch.full((len(queries),), np.iinfo(np.int64).max, dtype=torch.int64).scatter_reduce(
        0, local[tie], torch.from_numpy(g)[tie], reduce="amin", include_self=True)
    return idx.numpy(), best


def parallel(fns: Sequence, threads: int | None = None) -> list:
    """Run the callables concurrently in Python threads, torch ops single-threaded in each (the
    screen's many small ops then overlap instead of waiting on one another); in order, without
    threads, when torch has one thread or there is one callable. torch's thread count is a
    process-wide setting: other threads using torch meanwhile also get one thread."""
    n = torch.get_num_threads() if threads is None else threads
    if n < 2 or len(fns) < 2:
        return [f() for f in fns]
    from concurrent.futures import ThreadPoolExecutor

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(n, len(fns))) as ex:
            futures = [ex.submit(f) for f in fns]
            return [f.result() for f in futures]
    finally:
        torch.set_num_threads(before)


def evaluate_screened(score: str, img_mu, img_logvar, cap_mu, cap_logvar, task, *, ks: Sequence[int] = (1, 5, 10),
                      keep_top: int = 0, dtype: torch.dtype | None = None, group: int = GROUP,
                      stats: dict | None = None, threads: int | None = None):
    """Every benchmark of ``task`` (a :class:`~zsprob.retrieval.evaluate.RetrievalTask`) for the
    linear ``score`` ("csd", "mean", "cosine") of the given embeddings, screened.

    Each metric is a function of where the positives rank: R@K of the best positive's rank
    (clipped at K), R-Precision and mAP@R of the ranks of all positives (clipped at R), COCO 1K of
    the best positive's rank within its fold's column range, so each direction is one
    :func:`screen_ranks` call over (query, positive) pairs. The two directions run concurrently
    (:func:`parallel`; ``threads=1`` runs them in turn). Returns the
    :class:`~zsprob.retrieval.evaluate.EvalResult` :func:`~zsprob.retrieval.evaluate.evaluate_scores`
    gives on the float64 score matrix. ``stats`` receives what the screen did, per direction.
    """
    from zsprob.retrieval import evaluate as E

    ks = tuple(ks)
    dt = dtype or (torch.bfloat16 if amx_available() else torch.float32)
    si, ci, sc, cc, w = prepare(score, img_mu, img_logvar, cap_mu, cap_logvar, dt, threads)
    keys = {"i2t": LinearKeys(si, sc, cc, w), "t2i": LinearKeys(sc, si, ci, w)}
    stats = stats if stats is not None else {}
    # per direction and benchmark: (set, queries, positive pairs); "long" sets keep the queries only
    plan = {d: {"recall": [], "list": [], "long": []} for d in ("i2t", "t2i")}
    img_all, cap_all = [], []
    for d in ("i2t", "t2i"):
        for bs in task.sets:
            q = E._queries(bs, d)
            if bs.kind != "recall" and E._needed_len(bs, d, ks) > E.SHARED_L_LIMIT:
                plan[d]["long"].append((bs, q))
                continue
            pq, pg = _positive_pairs(bs.i2t if d == "i2t" else bs.t2i, q)
            plan[d]["recall" if bs.kind == "recall" else "list"].append((bs, q, pq, pg))
            img_all.append(pq if d == "i2t" else pg)
            cap_all.append(pg if d == "i2t" else pq)
    cap_pos = task.caption_positives() if task.folds else None
    if task.folds:
        cp = cap_pos.tocoo()
        img_all.append(cp.row.astype(np.int64))
        cap_all.append(cp.col.astype(np.int64))
    cat = lambda x: np.concatenate(x) if x else np.zeros(0, dtype=np.int64)  # noqa: E731
    dots = _PairDots(si, sc, cat(img_all), cat(cap_all), threads)
    emb = {"i2t": (img_mu, img_logvar, cap_mu, cap_logvar), "t2i": (cap_mu, cap_logvar, img_mu, img_logvar)}
    for d in ("i2t", "t2i"):
        stats.setdefault(d, {})
    res = parallel([lambda d=d: _direction(d, keys[d], dots, task, cap_pos, plan[d], ks, keep_top, score, emb[d],
                                           stats[d], dtype=dt, group=group) for d in ("i2t", "t2i")], threads)
    out = dict(zip(("i2t", "t2i"), res))
    metrics: dict = {}
    for bs in task.sets:
        per_dir = {d: E._direction_result(bs, *out[d]["means"][bs.name]) for d in ("i2t", "t2i")}
        metrics[bs.name] = E._with_rsum(bs, per_dir, ks)
    E._merge_pmrp(metrics)
    if task.folds:
        per = {d: out[d]["folds"] for d in ("i2t", "t2i")}
        if not all(per.values()):  # folds that are not contiguous ranges: each fold on its own
            per = _fold_separately(keys, dots, task, cap_pos, ks, stats.setdefault("folds", {}), dtype=dt,
                                   group=group)
        metrics["coco_1k"] = E._fold_summary(per, task, ks)
    per_query = {d: out[d]["per_query"] for d in ("i2t", "t2i") if out[d]["per_query"] is not None}
    top = {d: out[d]["top"] for d in ("i2t", "t2i") if out[d]["top"] is not None}
    return E.EvalResult(metrics=metrics, per_query=per_query, top=top)


def _direction(d: str, kd: LinearKeys, dots: "_PairDots", task, cap_pos, plan: dict, ks: tuple, keep_top: int,
               score: str, emb: tuple, st: dict, **kw) -> dict:
    """One direction of :func:`evaluate_screened`: its requests, one screened pass, its metrics."""
    from zsprob.retrieval import metrics as M
    from zsprob.retrieval.scoring import score_block

    kmax = max(ks)
    scr = Screen(kd, **kw)
    req_rows, req_cols, req_caps, req_lo, req_hi, jobs = [], [], [], [], [], []

    def add(kind, bs, arg, rows, cols, caps, lo=None, hi=None):
        jobs.append((bs, kind, arg, len(req_rows)))
        req_rows.append(rows)
        req_cols.append(cols)
        req_caps.append(caps)
        req_lo.append(np.zeros(len(rows), dtype=np.int64) if lo is None else lo)
        req_hi.append(np.full(len(rows), kd.m, dtype=np.int64) if hi is None else hi)

    for bs, q, pq, pg in plan["recall"]:
        best, _ = _best(pq, pg, _keys_of(dots, kd, d, pq, pg), q)
        add("recall", bs, q, q, best, np.full(len(q), kmax, dtype=np.int64))
    for bs, q, pq, pg in plan["list"]:
        npos = bs.i2t_n_pos if d == "i2t" else bs.t2i_n_pos
        R = np.diff((bs.i2t if d == "i2t" else bs.t2i).indptr) if npos is None else np.asarray(npos, dtype=np.int64)
        add("list", bs, (q, pq, pg, R), pq, pg, np.maximum(R[pq], 1))
    fold = _fold_requests(kd, dots, task, cap_pos, d) if task.folds else None
    if fold is not None:
        fq, fcol, flo, fhi, fjob = fold
        add("folds", None, fjob, fq, fcol, np.full(len(fq), kmax, dtype=np.int64), flo, fhi)
    ranks = []
    if req_rows:
        rr, rc, rcap = np.concatenate(req_rows), np.concatenate(req_cols), np.concatenate(req_caps)
        rlo, rhi = np.concatenate(req_lo), np.concatenate(req_hi)
        # one request per (query, item, column range), with the largest cap any benchmark asks of it
        ranges, rid = np.unique(rlo * (kd.m + 1) + rhi, return_inverse=True)
        nr = len(ranges)
        code, inv = np.unique((rr * kd.m + rc) * nr + rid.reshape(-1), return_inverse=True)
        inv = inv.reshape(-1)
        ucap = np.zeros(len(code), dtype=np.int64)
        np.maximum.at(ucap, inv, rcap)
        urow, ucol, urange = (code // nr) // kd.m, (code // nr) % kd.m, ranges[code % nr]
        urank = screen_ranks(kd, urow, ucol, ucap, theta=_keys_of(dots, kd, d, urow, ucol),
                             col_lo=urange // (kd.m + 1), col_hi=urange % (kd.m + 1), screen=scr, stats=st)
        off = np.cumsum([0] + [len(x) for x in req_rows])
        ranks = [urank[inv[off[i]:off[i + 1]]] for i in range(len(req_rows))]
    out = {"means": {}, "per_query": None, "top": None, "folds": []}
    for bs, kind, arg, i in jobs:
        rk = ranks[i]
        if kind == "folds":
            out["folds"] = [{f"r@{k}": float((rk[a:b] < k).mean()) for k in ks} for a, b, _ in arg]
        elif kind == "recall":
            q = arg
            vals = {f"r@{k}": (rk < k).astype(np.float64) for k in ks}
            out["means"][bs.name] = ({k: float(v.mean()) if len(v) else float("nan") for k, v in vals.items()}, len(q))
            if out["per_query"] is None:
                out["per_query"] = {"queries": q, **vals, "set": bs.name}
        else:
            # positives ranked r < R are hits at position r: R-Precision, mAP@R and R@1 from the hits
            q, pq, pg, R = arg
            Rq = np.maximum(R[q], 1)
            hits = torch.zeros(len(q), int(Rq.max(initial=1)), dtype=torch.bool)
            local = np.searchsorted(q, pq)
            inside = rk < Rq[local]
            hits[torch.from_numpy(local[inside]), torch.from_numpy(rk[inside])] = True
            vals = M.metrics_from_hits(hits, torch.from_numpy(R[q]), (1,), r_metrics=True)
            out["means"][bs.name] = ({k: float(v.mean()) if v.numel() else float("nan") for k, v in vals.items()},
                                     len(q))
    for bs, q in plan["long"]:  # very long positive lists (PMRP): ranked on float32 score blocks
        mq, lq, mg, lg = emb

        def rows_fn(rows, mq=mq, lq=lq, mg=mg, lg=lg):
            return score_block(score, mq[rows], None if lq is None else lq[rows], mg, lg)

        qm = M.rank_metrics(rows_fn, bs.i2t if d == "i2t" else bs.t2i, queries=q, ks=(1,), r_metrics=True)
        out["means"][bs.name] = (qm.mean(), len(q))
    if keep_top:
        out["top"] = screen_topk(kd, keep_top, screen=scr, stats=st)
    return out


def _contiguous(idx: np.ndarray) -> bool:
    return len(idx) > 0 and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and bool((np.diff(idx) == 1).all())


def _fold_problem(dots: _PairDots, keys: LinearKeys, d: str, rows: np.ndarray, cols: np.ndarray, p: sp.csr_matrix):
    """A fold's queries (local), their best in-fold positive (local) and its key."""
    q = np.flatnonzero(np.diff(p.indptr) > 0)
    pq, pg = _positive_pairs(p, q)
    k = _keys_of(dots, keys, d, rows[pq], cols[pg])
    best, theta = _best(pq, pg, k, q)
    return q, best, theta


def _fold_requests(keys: LinearKeys, dots: _PairDots, task, pos: sp.csr_matrix, d: str):
    """COCO 1K as requests of the full pass: each query's best in-fold positive (``pos``: the
    task's caption positives), ranked among the fold's items only (a column range). None unless
    every fold's gallery is a contiguous range."""
    fq, fcol, flo, fhi, jobs = [], [], [], [], []
    n = 0
    for imgs, caps in task.folds:
        rows, cols = (imgs, caps) if d == "i2t" else (caps, imgs)
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        if not _contiguous(cols):
            return None
        p = pos[imgs][:, caps]
        if d == "t2i":
            p = sp.csr_matrix(p.T)
        q, best, _ = _fold_problem(dots, keys, d, rows, cols, p)
        fq.append(rows[q])
        fcol.append(cols[best])
        flo.append(np.full(len(q), cols[0]))
        fhi.append(np.full(len(q), cols[-1] + 1))
        jobs.append((n, n + len(q), q))
        n += len(q)
    cat = lambda x: np.concatenate(x) if x else np.zeros(0, dtype=np.int64)  # noqa: E731
    return cat(fq), cat(fcol), cat(flo), cat(fhi), jobs


def _fold_separately(keys: dict, dots: _PairDots, task, pos: sp.csr_matrix, ks: Sequence[int], stats: dict,
                     **kw) -> dict:
    """COCO 1K for folds of any shape: each fold's images x captions screened on their own."""
    per: dict = {"i2t": [], "t2i": []}
    for imgs, caps in task.folds:
        p_i = pos[imgs][:, caps]
        for d, rows, cols, p in (("i2t", imgs, caps, p_i), ("t2i", caps, imgs, sp.csr_matrix(p_i.T))):
            rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
            q, best, theta = _fold_problem(dots, keys[d], d, rows, cols, p)
            rk = screen_ranks(keys[d].subset(rows, cols), q, best, np.full(len(q), max(ks)), theta=theta,
                              stats=stats, **kw)
            per[d].append({f"r@{k}": float((rk < k).mean()) for k in ks})
    return per
