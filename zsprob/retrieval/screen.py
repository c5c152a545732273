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
(AMX tiles on recent Xeons; see docs/benchmarks.md), each query offset by ``o_i`` so that its
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

This module is the kernel: it imports nothing from :mod:`zsprob.retrieval`.
:mod:`zsprob.retrieval.screened` runs every benchmark of a retrieval task through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

LINEAR_SCORES = ("csd", "mean", "cosine")
#: items per group maximum (64 int16 lanes reduce fastest on AVX-512)
GROUP = 64
#: items per sub-group inside a candidate group
SUB = 8
#: rows per chunk of the float64 work (fits in L2 cache)
CHUNK = 2048
#: target size of one block of approximate keys (rows x padded gallery; tuned with scripts/bench_eval.py)
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
    screener = screen or Screen(keys, dtype=dtype, group=group)
    stats = stats if stats is not None else {}
    for counter in ("requests", "rescored", "fallback_rows", "rows"):
        stats.setdefault(counter, 0)
    rows, cols, caps, range_lo, range_hi = _as_requests(keys, rows, cols, caps, col_lo, col_hi)
    n_requests = rows.numel()
    stats["requests"] += n_requests
    if n_requests == 0:
        return np.zeros(0, dtype=np.int64)
    outside = (cols < range_lo) | (cols >= range_hi) | (range_lo < 0) | (range_hi > keys.m)
    if bool((outside | (rows < 0) | (rows >= keys.n)).any()):
        raise ValueError("each request needs 0 <= row < n and 0 <= col_lo <= col < col_hi <= m")
    theta = keys.exact_pairs(rows, cols) if theta is None else torch.as_tensor(theta, dtype=torch.float64)
    order = torch.argsort(rows, stable=True)
    req = _thresholds(screener, keys.m, *(x[order] for x in (rows, cols, caps, theta, range_lo, range_hi)))
    rank = torch.zeros(n_requests, dtype=torch.int64)
    unsettled, candidates = _scan_blocks(screener, req, stats)
    settled = req.valid & ~unsettled
    rank[settled] = req.caps[settled]  # at least cap groups hold an item certainly ranked before
    if candidates[0]:
        count = _count_candidates(keys, screener, req, unsettled, candidates, stats)
        rank[unsettled] = torch.minimum(count[unsettled], req.caps[unsettled])
    fallback = torch.nonzero(~req.valid).flatten()
    if fallback.numel():  # thresholds too close to zero for the integer comparison: whole rows in float64
        stats["fallback_rows"] += torch.unique(req.rows[fallback]).numel()
        rank[fallback] = exact_ranks(keys, req.rows[fallback], req.cols[fallback], req.caps[fallback],
                                     req.theta[fallback], req.range_lo[fallback], req.range_hi[fallback])
    out = torch.empty_like(rank)
    out[order] = rank
    return out.numpy()


def _as_requests(keys: LinearKeys, rows, cols, caps, col_lo, col_hi) -> tuple[torch.Tensor, ...]:
    """screen_ranks' arguments as int64 tensors: rows, cols, caps and each request's column range
    (the whole gallery where ``col_lo`` / ``col_hi`` are not given)."""
    n_items = keys.m
    rows = torch.as_tensor(np.asarray(rows, dtype=np.int64))
    cols = torch.as_tensor(np.asarray(cols, dtype=np.int64))
    caps = torch.as_tensor(np.asarray(caps, dtype=np.int64))
    n_requests = rows.numel()
    range_lo = (torch.zeros(n_requests, dtype=torch.int64) if col_lo is None
                else torch.as_tensor(np.asarray(col_lo, dtype=np.int64)))
    range_hi = (torch.full((n_requests,), n_items, dtype=torch.int64) if col_hi is None
                else torch.as_tensor(np.asarray(col_hi, dtype=np.int64)))
    return rows, cols, caps, range_lo, range_hi


@dataclass
class _Requests:
    """screen_ranks' requests sorted by query row, with what the screen decides them by: each
    query's offset (``offset_parts`` as the GEMM takes it), each request's error bound ``e`` and
    its two thresholds as bit patterns (``high_bits``: above it an item is certainly ranked
    before; ``low_bits``: below it certainly not); ``valid``: the thresholds are positive."""

    rows: torch.Tensor
    cols: torch.Tensor
    caps: torch.Tensor
    theta: torch.Tensor
    range_lo: torch.Tensor
    range_hi: torch.Tensor
    query_rows: torch.Tensor
    query_of: torch.Tensor
    query_counts: torch.Tensor
    offset_parts: torch.Tensor
    offset: torch.Tensor
    e: torch.Tensor
    rel_error: float
    high_bits: torch.Tensor
    low_bits: torch.Tensor
    valid: torch.Tensor
    ranged: torch.Tensor


def _thresholds(screener: Screen, n_items: int, rows, cols, caps, theta, range_lo, range_hi) -> _Requests:
    """The offsets and thresholds of requests sorted by row (see :class:`_Requests`)."""
    n_requests = rows.numel()
    query_rows, query_of, query_counts = torch.unique_consecutive(rows, return_inverse=True, return_counts=True)
    # offsets: each query's lowest threshold sits 4 E above zero, so every threshold is positive
    lowest_theta = torch.full((query_rows.numel(),), math.inf, dtype=torch.float64).scatter_reduce(
        0, query_of, theta, reduce="amin", include_self=True)
    lowest_error = screener.error(query_rows, lowest_theta)
    o = lowest_theta - 4 * lowest_error - 1e-9 * lowest_theta.abs()
    offset_parts, offset = screener.fold(o)
    offset_error = screener.error(query_rows, offset)
    rel_error = screener.rel
    shifted_theta = theta - offset[query_of]
    e = offset_error[query_of]
    hi = (shifted_theta + e) / (1 - rel_error)  # out > hi  =>  key > theta
    lo = (shifted_theta - e) / (1 + rel_error)  # out < lo  =>  key < theta
    valid = lo > 0
    high_bits = torch.zeros(n_requests, dtype=screener.int_dtype)
    low_bits = torch.zeros(n_requests, dtype=screener.int_dtype)
    if bool(valid.any()):
        high_bits[valid] = _bits(hi[valid], screener.dtype, up=True)
        low_bits[valid] = _bits(lo[valid], screener.dtype, up=False)
    ranged = (range_lo > 0) | (range_hi < n_items)
    return _Requests(rows, cols, caps, theta, range_lo, range_hi, query_rows, query_of, query_counts, offset_parts,
                     offset, e, rel_error, high_bits, low_bits, valid, ranged)


def _scan_blocks(screener: Screen, req: _Requests, stats: dict) -> tuple[torch.Tensor, tuple[list, list, list]]:
    """Per block of queries: the GEMM, group maxima, the requests they settle, and the candidate
    groups' values. Returns (unsettled requests, candidates: request, sub-group and SUB values
    per sub-group reaching the lower threshold, one list entry per block)."""
    group_size, n_groups = screener.group, screener.ng
    if group_size % SUB:
        raise ValueError(f"group size {group_size} must be a multiple of {SUB}")
    high_bits, low_bits, ranged, caps, valid = req.high_bits, req.low_bits, req.ranged, req.caps, req.valid
    range_lo, range_hi = req.range_lo, req.range_hi
    inner_first, inner_end = -(-range_lo // group_size), range_hi // group_size  # groups wholly inside [range_lo, range_hi)
    touch_first, touch_end = range_lo // group_size, -(-range_hi // group_size)  # groups touching it
    group_index = torch.arange(n_groups)
    block_rows = screener.block_rows()
    ends = torch.cumsum(req.query_counts, 0)
    starts = ends - req.query_counts
    unsettled = torch.zeros(req.rows.numel(), dtype=torch.bool)
    cand_req, cand_group, cand_vals = [], [], []
    for block_start in range(0, req.query_rows.numel(), block_rows):
        block = slice(block_start, min(block_start + block_rows, req.query_rows.numel()))
        out = screener.gemm(req.query_rows[block], req.offset_parts[block])
        n_rows = out.shape[0]
        stats["rows"] += n_rows
        out_bits = out.view(screener.int_dtype).view(n_rows, n_groups, group_size)
        group_max = out_bits.amax(-1)
        req_start, req_end = int(starts[block][0]), int(ends[block][-1])
        block_reqs = slice(req_start, req_end)
        local_row = req.query_of[block_reqs] - block_start  # local row of each request
        req_group_max = group_max[local_row]
        above = req_group_max > high_bits[block_reqs][:, None]
        ranged_reqs = torch.nonzero(ranged[block_reqs]).flatten()
        if ranged_reqs.numel():
            above[ranged_reqs] &= ((group_index >= inner_first[block_reqs][ranged_reqs, None])
                                   & (group_index < inner_end[block_reqs][ranged_reqs, None]))
        open_reqs = valid[block_reqs] & (_count(above) < caps[block_reqs])
        unsettled[block_reqs] = open_reqs
        open_idx = torch.nonzero(open_reqs).flatten()
        if not open_idx.numel():
            continue
        candidate = req_group_max[open_idx] >= low_bits[block_reqs][open_idx][:, None]
        ranged_open = torch.nonzero(ranged[block_reqs][open_idx]).flatten()
        if ranged_open.numel():
            ranged_req = open_idx[ranged_open] + req_start
            candidate[ranged_open] &= (group_index >= touch_first[ranged_req, None]) & (group_index < touch_end[ranged_req, None])
        cand_row, cand_group_idx = candidate.nonzero(as_tuple=True)
        cand_req_idx = open_idx[cand_row]
        # within the candidate groups, sub-groups of SUB items: only those reaching lo are kept
        sub_groups = out_bits.view(n_rows, n_groups, group_size // SUB, SUB)
        sub_max = sub_groups[local_row[cand_req_idx], cand_group_idx].amax(-1)  # [G, group_size / SUB]
        sub_row, sub_col = (sub_max >= low_bits[block_reqs][cand_req_idx][:, None]).nonzero(as_tuple=True)
        sub_req = cand_req_idx[sub_row]
        sub_id = cand_group_idx[sub_row] * (group_size // SUB) + sub_col
        cand_req.append(sub_req + req_start)
        cand_group.append(sub_id)
        cand_vals.append(out_bits.view(n_rows, n_groups * (group_size // SUB), SUB)[local_row[sub_req], sub_id])  # [S, SUB]
    return unsettled, (cand_req, cand_group, cand_vals)


def _count_candidates(keys: LinearKeys, screener: Screen, req: _Requests, unsettled: torch.Tensor,
                      candidates: tuple[list, list, list], stats: dict) -> torch.Tensor:
    """For every request: how many candidate items are ranked before its own, all blocks at once
    (items certainly above counted, items inside the band rescored in float64; both the own items
    and the rescored ones certified against the bound)."""
    n_requests = req.rows.numel()
    high_bits, low_bits, ranged, cols, theta = req.high_bits, req.low_bits, req.ranged, req.cols, req.theta
    offset, query_of, e, rel_error = req.offset, req.query_of, req.e, req.rel_error
    cand_req_idx, sub_id, values = (torch.cat(parts) for parts in candidates)
    certain = values > high_bits[cand_req_idx][:, None]
    maybe = values >= low_bits[cand_req_idx][:, None]
    item = sub_id[:, None] * SUB + torch.arange(SUB)[None, :]
    ranged_cand = torch.nonzero(ranged[cand_req_idx]).flatten()
    if ranged_cand.numel():  # items outside a request's column range do not count
        ranged_req = cand_req_idx[ranged_cand]
        inside = (item[ranged_cand] >= req.range_lo[ranged_req, None]) & (item[ranged_cand] < req.range_hi[ranged_req, None])
        certain[ranged_cand] &= inside
        maybe[ranged_cand] &= inside
    maybe &= ~certain
    count = torch.zeros(n_requests, dtype=torch.int64).index_add_(0, cand_req_idx, _count(certain).to(torch.int64))
    maybe_row, maybe_lane = maybe.nonzero(as_tuple=True)
    maybe_req = cand_req_idx[maybe_row]
    maybe_item = item[maybe_row, maybe_lane]
    own = maybe_item == cols[maybe_req]
    # free certification: each request's own item (key theta, known) must lie within the band
    seen = torch.zeros(n_requests, dtype=torch.int64).index_add_(0, maybe_req[own], torch.ones_like(maybe_req[own]))
    if bool((seen[unsettled] != 1).any()):
        raise ScreenBoundError("a query's own item fell outside its certified band; this GEMM does not "
                               "round as the screen assumes")
    own_req = maybe_req[own]
    _certify(values[maybe_row[own], maybe_lane[own]].view(screener.dtype).double(),
             theta[own_req] - offset[query_of[own_req]], e[own_req], rel_error)
    keep = ~own  # the item itself is never ranked before itself
    maybe_row, maybe_lane, maybe_req, maybe_item = maybe_row[keep], maybe_lane[keep], maybe_req[keep], maybe_item[keep]
    if maybe_req.numel():
        exact = keys.exact_pairs(req.rows[maybe_req], maybe_item)
        stats["rescored"] += int(maybe_req.numel())
        _certify(values[maybe_row, maybe_lane].view(screener.dtype).double(), exact - offset[query_of[maybe_req]],
                 e[maybe_req], rel_error)
        req_theta = theta[maybe_req]
        before = (exact > req_theta) | ((exact == req_theta) & (maybe_item < cols[maybe_req]))
        count.index_add_(0, maybe_req, before.to(torch.int64))
    return count


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


