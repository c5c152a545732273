"""Every benchmark of a retrieval task for the linear scores, ranked by the screen without a score matrix.

Each metric is a function of where the positives rank, only up to a cap (R@K: the best
positive's rank clipped at K; R-Precision, mAP@R and R@1: the ranks of all positives clipped at
R; COCO 1K: the best positive's rank within its fold's column range). :func:`evaluate_screened`
turns a :class:`~zsprob.retrieval.benchmarks.RetrievalTask` into such rank requests per
direction, answers them with :func:`zsprob.retrieval.screen.screen_ranks` (the kernel) and reads
the metrics off the ranks with the helpers of :mod:`zsprob.retrieval.benchmarks` and
:mod:`zsprob.retrieval.metrics`. The float64 image-caption dot products of every positive pair
are computed once and shared by both directions. Benchmarks with very long positive lists
(PMRP, R > ``SHARED_L_LIMIT``) are ranked on float32 score blocks
(:func:`zsprob.retrieval.scoring.score_block`), computed on ``device`` when one is given (the
screen itself is a CPU kernel). torch and scipy do the arithmetic.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

from zsprob.retrieval import metrics as M
from zsprob.retrieval.benchmarks import (SHARED_L_LIMIT, EvalResult, direction_result, fold_summary, merge_pmrp,
                                         needed_length, set_queries, with_rsum)
from zsprob.retrieval.scoring import compute_device, on_device, score_block
from zsprob.retrieval.screen import GROUP, LinearKeys, Screen, Side, amx_available, pair_dots, parallel, prepare, \
    screen_ranks, screen_topk


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


def evaluate_screened(score: str, img_mu, img_logvar, cap_mu, cap_logvar, task, *, ks: Sequence[int] = (1, 5, 10),
                      keep_top: int = 0, dtype: torch.dtype | None = None, group: int = GROUP,
                      stats: dict | None = None, threads: int | None = None, device=None):
    """Every benchmark of ``task`` (a :class:`~zsprob.retrieval.benchmarks.RetrievalTask`) for the
    linear ``score`` ("csd", "mean", "cosine") of the given embeddings, screened.

    Each metric is a function of where the positives rank: R@K of the best positive's rank
    (clipped at K), R-Precision and mAP@R of the ranks of all positives (clipped at R), COCO 1K of
    the best positive's rank within its fold's column range, so each direction is one
    :func:`screen_ranks` call over (query, positive) pairs. The two directions run concurrently
    (:func:`parallel`; ``threads=1`` runs them in turn). Returns the
    :class:`~zsprob.retrieval.benchmarks.EvalResult` :func:`~zsprob.retrieval.evaluate.evaluate_scores`
    gives on the float64 score matrix. ``stats`` receives what the screen did, per direction.
    ``device``: where the float32 score blocks of very long positive lists are computed (default:
    where the embeddings live).
    """
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
            q = set_queries(bs, d)
            if bs.kind != "recall" and needed_length(bs, d, ks) > SHARED_L_LIMIT:
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
                                           stats[d], device=device, dtype=dt, group=group) for d in ("i2t", "t2i")],
                   threads)
    out = dict(zip(("i2t", "t2i"), res))
    metrics: dict = {}
    for bs in task.sets:
        per_dir = {d: direction_result(bs, *out[d]["means"][bs.name]) for d in ("i2t", "t2i")}
        metrics[bs.name] = with_rsum(bs, per_dir, ks)
    merge_pmrp(metrics)
    if task.folds:
        per = {d: out[d]["folds"] for d in ("i2t", "t2i")}
        if not all(per.values()):  # folds that are not contiguous ranges: each fold on its own
            per = _fold_separately(keys, dots, task, cap_pos, ks, stats.setdefault("folds", {}), dtype=dt,
                                   group=group)
        metrics["coco_1k"] = fold_summary(per, task, ks)
    per_query = {d: out[d]["per_query"] for d in ("i2t", "t2i") if out[d]["per_query"] is not None}
    top = {d: out[d]["top"] for d in ("i2t", "t2i") if out[d]["top"] is not None}
    return EvalResult(metrics=metrics, per_query=per_query, top=top)


def _direction(d: str, kd: LinearKeys, dots: "_PairDots", task, cap_pos, plan: dict, ks: tuple, keep_top: int,
               score: str, emb: tuple, st: dict, device=None, **kw) -> dict:
    """One direction of :func:`evaluate_screened`: its requests, one screened pass, its metrics."""
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
        qm = M.rank_metrics(_score_rows(score, emb, device), bs.i2t if d == "i2t" else bs.t2i, queries=q, ks=(1,),
                            r_metrics=True)
        out["means"][bs.name] = (qm.mean(), len(q))
    if keep_top:
        out["top"] = screen_topk(kd, keep_top, screen=scr, stats=st)
    return out


def _score_rows(score: str, emb: tuple, device=None):
    """``rows -> float32 CPU score rows`` of the queries ``emb[:2]`` against the gallery ``emb[2:]``,
    scored on ``device`` (default: where the gallery lives; the gallery is moved there once)."""
    mq, lq, mg, lg = emb
    dev = compute_device(device, mg)
    if dev.type == "cpu":
        return lambda rows: score_block(score, mq[rows], None if lq is None else lq[rows], mg, lg)
    mg, lg = on_device(mg, dev), on_device(lg, dev)
    return lambda rows: score_block(score, on_device(mq[rows], dev), None if lq is None else on_device(lq[rows], dev),
                                    mg, lg).cpu()


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
