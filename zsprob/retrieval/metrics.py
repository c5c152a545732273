"""Retrieval metrics as tensor operations over rankings.

The ranking (:func:`topk_ranking`: descending score, ties broken by the lower gallery index) and every
metric (R@K, R-Precision, mAP@R, COCO 1K folds, PMRP) as a reduction over a ``hits`` matrix (``hits[q, r]``:
the item ranked ``r`` for query ``q`` is a positive), a query chunk at a time, with no per-query Python loop.
Positives are ``scipy.sparse`` CSR matrices (query x gallery). The definitions are eccv_caption 0.1.0's
(docs/retrieval.md states them); queries with no positive are not evaluated."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

DEFAULT_KS = (1, 5, 10)


# ----------------------------------------------------------------------------- positives
def positives_from_lists(lists: Sequence[Sequence[int]], n_gallery: int) -> sp.csr_matrix:
    """CSR [n_query, n_gallery] bool from a list of positive gallery indices per query."""
    indptr = np.zeros(len(lists) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(x) for x in lists])
    indices = np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(indptr[-1]))
    m = sp.csr_matrix((np.ones(len(indices), dtype=bool), indices, indptr), shape=(len(lists), n_gallery))
    m.sum_duplicates()
    m.sort_indices()
    return m


def positives_from_assignment(caption_image: np.ndarray, n_images: int) -> sp.csr_matrix:
    """Image x caption positives where caption ``c`` belongs to image ``caption_image[c]``."""
    caption_image = np.asarray(caption_image, dtype=np.int64)
    n_cap = len(caption_image)
    m = sp.csr_matrix((np.ones(n_cap, dtype=bool), (caption_image, np.arange(n_cap))), shape=(n_images, n_cap))
    m.sort_indices()
    return m


def plausible_positives(image_labels: np.ndarray, caption_labels: np.ndarray, zeta: int) -> sp.csr_matrix:
    """PCME plausible matches, CSR [n_img, n_cap]: binary label vectors ([n, C]; a caption takes its
    image's instance labels) differing in at most ``zeta`` positions. Items without any label are
    never positives (PCME drops the unlabeled COCO test images)."""
    a = torch.as_tensor(np.asarray(image_labels, dtype=np.float32))
    b = torch.as_tensor(np.asarray(caption_labels, dtype=np.float32))
    # hamming = |a| + |b| - 2 a.b
    ham = a.sum(1, keepdim=True) + b.sum(1)[None, :] - 2.0 * (a @ b.T)
    pos = (ham <= zeta + 0.5) & (a.sum(1, keepdim=True) > 0) & (b.sum(1)[None, :] > 0)
    return sp.csr_matrix(pos.numpy())


# ----------------------------------------------------------------------------- ranking
def topk_ranking(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64 [Q, min(k, G)]) of the ``k`` best items of each row of ``scores`` [Q, G]: exactly the first
    k of a stable descending sort (ties to the lower index), also when ties straddle the k-th place."""
    g = scores.shape[1]
    k = min(int(k), g)
    k1 = min(k + 1, g)
    vals, idx = scores.topk(k1, dim=1, largest=True, sorted=True)
    if k1 > k:
        # a tie across the cut: torch.topk may have picked any of the tied items; redo those rows exactly
        cut = torch.nonzero(vals[:, k - 1] == vals[:, k]).flatten()
        vals, idx = vals[:, :k].contiguous(), idx[:, :k].contiguous()
        if cut.numel():
            full = scores[cut].argsort(dim=1, descending=True, stable=True)[:, :k]
            idx[cut] = full
            vals[cut] = scores[cut].gather(1, full)
    if k > 1:
        tied = torch.nonzero((vals[:, 1:] == vals[:, :-1]).any(dim=1)).flatten()
        if tied.numel():
            # stable tie-break on the tied rows: sort by index, then stable-sort by descending value
            v, i = vals[tied], idx[tied]
            order = i.argsort(dim=1)
            i, v = i.gather(1, order), v.gather(1, order)
            order = v.argsort(dim=1, descending=True, stable=True)
            idx[tied] = i.gather(1, order)
    return idx


def hits_matrix(ranked: torch.Tensor, positives: sp.csr_matrix) -> torch.Tensor:
    """``hits[q, r]``: item ``ranked[q, r]`` is a positive of query ``q`` (a negative entry pads and never hits)."""
    q, L = ranked.shape
    g = positives.shape[1]
    block = positives[:q]
    block.sort_indices()
    rows = np.repeat(np.arange(q, dtype=np.int64), np.diff(block.indptr))
    pos_keys = torch.from_numpy(rows * g + block.indices.astype(np.int64))  # sorted ascending
    ranked = ranked.to(torch.int64)
    keys = torch.arange(q, dtype=torch.int64)[:, None] * g + ranked
    if pos_keys.numel() == 0:
        return torch.zeros(q, L, dtype=torch.bool)
    loc = torch.searchsorted(pos_keys, keys.reshape(-1)).clamp_max(pos_keys.numel() - 1)
    return (pos_keys[loc] == keys.reshape(-1)).reshape(q, L) & (ranked >= 0)


def metrics_from_hits(hits: torch.Tensor, n_pos: torch.Tensor, ks: Sequence[int] = DEFAULT_KS,
                      r_metrics: bool = True) -> dict[str, torch.Tensor]:
    """Per-query float64 [Q] ``r@K`` for each K and, with ``r_metrics``, ``rprecision`` and ``map_at_r`` (L >=
    max(n_pos)) from a hits matrix [Q, L] and the number of positives per query [Q]."""
    out: dict[str, torch.Tensor] = {}
    L = hits.shape[1]
    for k in ks:
        out[f"r@{k}"] = hits[:, : min(k, L)].any(dim=1).to(torch.float64)
    if r_metrics:
        n_pos = n_pos.to(torch.int64)
        if n_pos.numel() and L < int(n_pos.max()):
            raise ValueError(f"ranking of length {L} is shorter than the largest positive set ({int(n_pos.max())})")
        R = n_pos.clamp_min(1).to(torch.float64)
        pos_r = torch.arange(1, L + 1, dtype=torch.int64)[None, :]
        within = pos_r <= n_pos[:, None]
        h = hits & within
        out["rprecision"] = h.sum(1).to(torch.float64) / R
        prec = hits.cumsum(1).to(torch.float64) / pos_r.to(torch.float64)
        out["map_at_r"] = (prec * h).sum(1) / R
    return out


@dataclass
class QueryMetrics:
    """Per-query metric values (float64 numpy arrays over ``queries``, indices into the query set)."""

    queries: np.ndarray
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def mean(self) -> dict[str, float]:
        return {k: float(np.mean(v)) if len(v) else float("nan") for k, v in self.values.items()}


def take(x: torch.Tensor, index, dim: int = 0) -> torch.Tensor:
    """``x.index_select(dim, index)``, as a view when ``index`` is a contiguous ascending range (COCO 1K folds)."""
    index = torch.as_tensor(index, dtype=torch.int64)
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) == n - 1 and bool((index[1:] > index[:-1]).all()):
        return x.narrow(dim, int(index[0]), n)
    return x.index_select(dim, index)


def rank_lists(scores: torch.Tensor, queries: np.ndarray, k: int, *, chunk_size: int = 2048) -> torch.Tensor:
    """Top-``k`` gallery indices [len(queries), k] (order of :func:`topk_ranking`) of the rows
    ``queries`` of ``scores`` [Q, G], in query chunks."""
    q = torch.as_tensor(np.asarray(queries, dtype=np.int64))
    out = [topk_ranking(take(scores, q[a:a + chunk_size]), k) for a in range(0, q.numel(), chunk_size)]
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.int64)


def metrics_from_ranking(ranked: torch.Tensor, positives: sp.csr_matrix, *, ranked_queries: np.ndarray | None = None,
                         queries: np.ndarray | None = None, ks: Sequence[int] = DEFAULT_KS,
                         r_metrics: bool = True, n_pos: np.ndarray | None = None) -> QueryMetrics:
    """Per-query metrics from ``ranked`` [n, L], the ranked gallery indices of ``ranked_queries`` (default:
    every row of ``positives``), for ``queries`` among them (default: those with a positive). L must be
    >= max(ks) and, with ``r_metrics``, >= the largest R. ``n_pos``: R per query where it counts
    ground-truth items outside the gallery (as eccv_caption does)."""
    positives = sp.csr_matrix(positives, dtype=bool)
    positives.sort_indices()
    n_q = positives.shape[0]
    if ranked_queries is None:
        ranked_queries = np.arange(n_q)
    ranked_queries = np.asarray(ranked_queries, dtype=np.int64)
    n_pos_all = np.diff(positives.indptr).astype(np.int64)
    if queries is None:
        queries = ranked_queries[n_pos_all[ranked_queries] > 0]
    queries = np.asarray(queries, dtype=np.int64)
    where = np.full(n_q, -1, dtype=np.int64)
    where[ranked_queries] = np.arange(len(ranked_queries))
    if len(queries) == 0:
        return QueryMetrics(queries=queries, values={})
    L = ranked.shape[1]
    sub_ranked = ranked[torch.from_numpy(where[queries])]
    sub = positives[queries]
    hits = hits_matrix(sub_ranked, sub)
    R = np.diff(sub.indptr) if n_pos is None else np.asarray(n_pos, dtype=np.int64)[queries]
    if r_metrics and len(R) and L < int(R.max()) and L < positives.shape[1]:
        hits = torch.cat([hits, torch.zeros(hits.shape[0], int(R.max()) - L, dtype=torch.bool)], 1)
    vals = metrics_from_hits(hits, torch.from_numpy(np.ascontiguousarray(R)), ks, r_metrics)
    return QueryMetrics(queries=queries, values={k: v.numpy() for k, v in vals.items()})


def rank_metrics(scores: torch.Tensor, positives: sp.csr_matrix, *, ks: Sequence[int] = DEFAULT_KS,
                 r_metrics: bool = True, queries: np.ndarray | None = None, chunk_size: int = 2048) -> QueryMetrics:
    """Per-query metrics of the rows ``queries`` (default: those with a positive) of ``scores`` [Q, G] against
    ``positives`` (CSR [Q, G]), ranked a query chunk at a time so a large R (PMRP) stays bounded in memory."""
    positives = sp.csr_matrix(positives, dtype=bool)
    positives.sort_indices()
    n_pos_all = np.diff(positives.indptr).astype(np.int64)
    if queries is None:
        queries = np.flatnonzero(n_pos_all > 0)
    queries = np.asarray(queries, dtype=np.int64)
    L = max(max(ks), int(n_pos_all[queries].max()) if (r_metrics and len(queries)) else 0)
    L = min(L, positives.shape[1])
    acc: dict[str, list[np.ndarray]] = {}
    for a in range(0, len(queries), chunk_size):
        qs = queries[a:a + chunk_size]
        ranked = rank_lists(scores, qs, L, chunk_size=chunk_size)
        m = metrics_from_ranking(ranked, positives, ranked_queries=qs, queries=qs, ks=ks, r_metrics=r_metrics)
        for k, v in m.values.items():
            acc.setdefault(k, []).append(v)
    return QueryMetrics(queries=queries, values={k: np.concatenate(v) for k, v in acc.items()})


# ----------------------------------------------------------------------------- benchmarks
def coco_folds(caption_order: np.ndarray, caption_image: np.ndarray,
               n_folds: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """eccv_caption's COCO 1K folds: contiguous chunks of ``caption_order`` (caption indices)
    and the images of those captions. Returns ``[(image_indices, caption_indices), ...]``."""
    caption_order = np.asarray(caption_order, dtype=np.int64)
    n = len(caption_order) // n_folds
    folds = []
    for f in range(n_folds):
        caps = np.sort(caption_order[f * n:(f + 1) * n])
        imgs = np.unique(np.asarray(caption_image)[caps])
        folds.append((imgs, caps))
    return folds
