"""Evaluate a test set's image x caption scores on several benchmarks at once.

:func:`evaluate_scores` ranks each direction once (top-L, L = the longest list any metric needs; PMRP in
query chunks) and reads every benchmark off the same lists; :func:`evaluate_embeddings` scores embeddings
first; :func:`evaluate_rankings` takes ranked lists made elsewhere (eccv_caption's ``compute_all_metrics``
interface). Results are percentages, plus per-query arrays for the uncertainty analyses."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

from zsprob.retrieval import metrics as M
from zsprob.retrieval.benchmarks import (SHARED_L_LIMIT, BenchmarkSet, EvalResult, RetrievalTask, fold_summary,
                                         needed_length, sets_metrics)
from zsprob.retrieval.scoring import PairScores


def _direction_metrics(bs: BenchmarkSet, direction: str, ranked: torch.Tensor, ks: Sequence[int]):
    """One set's per-query metrics in one direction from every query's ranked list."""
    pos, queries, n_pos = bs.side(direction)
    return M.metrics_from_ranking(ranked, pos, queries=queries, ks=bs.ks(ks), r_metrics=bs.kind != "recall",
                                  n_pos=n_pos)


def evaluate_scores(scores: PairScores, task: RetrievalTask, *, ks: Sequence[int] = M.DEFAULT_KS,
                    keep_top: int = 0, chunk_size: int = 2048) -> EvalResult:
    """All benchmark metrics of ``task`` from the image x caption ``scores``."""
    mats = {"i2t": scores.i2t, "t2i": scores.t2i}
    shared = [bs for bs in task.sets if all(needed_length(bs, d, ks) <= SHARED_L_LIMIT for d in mats)]
    ranked, top, per_query = {}, {}, {}
    for d, mat in mats.items():
        L = min(max([max(ks), keep_top] + [needed_length(bs, d, ks) for bs in shared]), mat.shape[1])
        ranked[d] = M.rank_lists(mat, np.arange(mat.shape[0]), L, chunk_size=chunk_size)
        if keep_top:
            top[d] = ranked[d][:, :keep_top].numpy()

    def direction_metrics(bs: BenchmarkSet, d: str):
        if bs in shared:
            qm = _direction_metrics(bs, d, ranked[d], ks)
        else:
            pos, queries, _ = bs.side(d)
            qm = M.rank_metrics(mats[d], pos, queries=queries, ks=bs.ks(ks), r_metrics=bs.kind != "recall",
                                chunk_size=chunk_size)
        if bs.kind == "recall" and d not in per_query:
            per_query[d] = {"queries": qm.queries, **qm.values, "set": bs.name}
        return qm

    metrics = sets_metrics(task, ks, direction_metrics)
    if task.folds:
        metrics["coco_1k"] = fold_metrics(scores, task, ks=ks)
    return EvalResult(metrics=metrics, per_query=per_query, top=top)


def evaluate_rankings(ranked_i2t, ranked_t2i, task: RetrievalTask, *, ks: Sequence[int] = M.DEFAULT_KS) -> dict:
    """The metrics of :func:`evaluate_scores` from ranked index lists made elsewhere (eccv_caption's
    ``compute_all_metrics``): ``ranked_i2t`` [n_images, L] caption indices best first, ``ranked_t2i``
    [n_captions, L'] image indices. COCO 1K reads each list's items of the query's fold, in order, as
    eccv_caption does. A list too short for a metric or naming an item twice is a ValueError."""
    ranked = {"i2t": torch.as_tensor(np.asarray(ranked_i2t), dtype=torch.int64),
              "t2i": torch.as_tensor(np.asarray(ranked_t2i), dtype=torch.int64)}
    n_q = {"i2t": task.n_images, "t2i": task.n_captions}
    n_g = {"i2t": task.n_captions, "t2i": task.n_images}
    for d in ranked:
        if ranked[d].ndim != 2 or ranked[d].shape[0] != n_q[d]:
            raise ValueError(f"{d} rankings must be [{n_q[d]}, L], got {tuple(ranked[d].shape)}")
        if ranked[d].numel() and (int(ranked[d].min()) < 0 or int(ranked[d].max()) >= n_g[d]):
            raise ValueError(f"{d} rankings hold indices outside 0..{n_g[d] - 1}")
        _refuse_repeats(ranked[d], d)

    def direction_metrics(bs: BenchmarkSet, d: str):
        need = needed_length(bs, d, ks)
        if ranked[d].shape[1] < min(need, n_g[d]):
            raise ValueError(f"{bs.name} {d} needs ranked lists of at least {need} items, got {ranked[d].shape[1]}")
        return _direction_metrics(bs, d, ranked[d][:, :need], ks)

    metrics = sets_metrics(task, ks, direction_metrics)
    if task.folds:
        metrics["coco_1k"] = _fold_metrics_from_rankings(ranked, task, ks)
    return metrics


def _refuse_repeats(ranked: torch.Tensor, direction: str) -> None:
    """A ranked list naming an item twice would count a repeated positive as another hit."""
    if ranked.shape[1] < 2:
        return
    ordered = ranked.sort(dim=1).values
    repeat = ordered[:, 1:] == ordered[:, :-1]
    rows = repeat.any(1)
    if bool(rows.any()):
        q = int(rows.int().argmax())
        item = int(ordered[q, 1:][repeat[q]][0])
        raise ValueError(f"{direction} ranking of query {q} holds index {item} more than once "
                         f"({int(rows.sum())} lists repeat an item); a ranking names each item once")


def _first_in_fold(rows: torch.Tensor, lists: torch.Tensor, q_fold: torch.Tensor, item_fold: torch.Tensor, k: int):
    """Each list's first ``k`` items of its query's fold, in ranked order, and which lists hold ``k``."""
    in_fold = item_fold[lists] == q_fold[rows][:, None]
    cum = in_fold.cumsum(1, dtype=torch.int32)
    ok = cum[:, -1] >= k
    keep = in_fold & (cum <= k) & ok[:, None]
    return lists[keep].view(-1, k), ok  # boolean indexing keeps row-major order


def _fold_metrics_from_rankings(ranked: dict, task: RetrievalTask, ks: Sequence[int]) -> dict:
    """COCO 1K as eccv_caption reads it off global lists: each list's first max(ks) items of its fold."""
    pos = {"i2t": task.caption_positives()}
    pos["t2i"] = sp.csr_matrix(pos["i2t"].T)
    fold = {"i2t": np.zeros(task.n_images, dtype=np.int64), "t2i": np.zeros(task.n_captions, dtype=np.int64)}
    for f, (imgs, caps) in enumerate(task.folds):
        fold["i2t"][imgs], fold["t2i"][caps] = f, f
    K = max(ks)
    per = {"i2t": [], "t2i": []}
    for d, other in (("i2t", "t2i"), ("t2i", "i2t")):
        q_fold, item_fold = torch.from_numpy(fold[d]), torch.from_numpy(fold[other])
        # most lists hold K in-fold items early on: look at a prefix first, the whole list where needed
        head, ok = _first_in_fold(torch.arange(ranked[d].shape[0]), ranked[d][:, :8 * K], q_fold, item_fold, K)
        sub = torch.empty(ranked[d].shape[0], K, dtype=torch.int64)
        sub[ok] = head
        rest = torch.nonzero(~ok).flatten()
        if rest.numel():
            tail, ok_rest = _first_in_fold(rest, ranked[d][rest], q_fold, item_fold, K)
            if not bool(ok_rest.all()):
                short = rest[~ok_rest]
                raise ValueError(f"COCO 1K {d}: {short.numel()} ranked lists hold fewer than {K} items of their "
                                 f"query's fold (e.g. query {int(short[0])}); pass longer lists")
            sub[rest] = tail
        for f, (imgs, caps) in enumerate(task.folds):
            qs = np.asarray(imgs if d == "i2t" else caps, dtype=np.int64)
            qs = qs[np.diff(pos[d].indptr)[qs] > 0]
            m = M.metrics_from_ranking(sub[torch.from_numpy(qs)], pos[d], ranked_queries=qs, queries=qs, ks=ks,
                                       r_metrics=False)
            per[d].append(m.mean())
    return fold_summary(per, task, ks)


def fold_metrics(scores: PairScores, task: RetrievalTask, *, ks: Sequence[int] = M.DEFAULT_KS) -> dict:
    """COCO 1K: each fold's images x captions ranked on their own; mean of the fold means."""
    pos = task.caption_positives()
    per = {"i2t": [], "t2i": []}
    for imgs, caps in task.folds:
        sub_i = M.take(M.take(scores.i2t, imgs), caps, dim=1)
        sub_t = M.take(M.take(scores.t2i, caps), imgs, dim=1)
        p_i = pos[imgs][:, caps]
        for d, sub, p in (("i2t", sub_i, p_i), ("t2i", sub_t, sp.csr_matrix(p_i.T))):
            q = np.flatnonzero(np.diff(p.indptr) > 0)
            ranked = M.rank_lists(sub, q, max(ks))
            per[d].append(M.metrics_from_ranking(ranked, p, ranked_queries=q, queries=q, ks=ks, r_metrics=False).mean())
    return fold_summary(per, task, ks)


def pmrp_fold_metrics(emb, task: RetrievalTask, score: str, *, seed: int = 0, chunk_size: int = 1024,
                      device=None, **score_kw) -> dict | None:
    """PMRP on the COCO 1K folds (PCME's headline table): each fold's images x captions scored and
    ranked on their own, plausible positives restricted to the fold, R-Precision per query; per
    direction and zeta the mean of the fold means, and their mean over zeta. None without folds
    or PMRP sets."""
    pm_sets = [bs for bs in task.sets if bs.name.startswith("pmrp_zeta")]
    if not task.folds or not pm_sets:
        return None
    per: dict = {d: {bs.name.replace("pmrp_", ""): [] for bs in pm_sets} for d in ("i2t", "t2i")}
    for imgs, caps in task.folds:
        fold = emb.select(imgs, caps)
        ps = PairScores(score, fold.image_mu, fold.image_logvar, fold.caption_mu, fold.caption_logvar,
                        chunk_size=chunk_size, seed=seed, device=device, **score_kw)
        for bs in pm_sets:
            for d, mat, pos in (("i2t", ps.i2t, bs.i2t[imgs][:, caps]), ("t2i", ps.t2i, bs.t2i[caps][:, imgs])):
                qm = M.rank_metrics(mat, sp.csr_matrix(pos), ks=(1,), r_metrics=True)
                per[d][bs.name.replace("pmrp_", "")].append(float(qm.mean()["rprecision"]))
    out = {}
    for d, by_zeta in per.items():
        out[d] = {z: 100.0 * float(np.mean(v)) for z, v in by_zeta.items()}
        out[d]["mean"] = float(np.mean(list(out[d].values())))
    out["n_folds"] = len(task.folds)
    return out


# ----------------------------------------------------------------------------- tables
#: the summary row, in column order: (label, benchmark, metric), each the mean of i2t and t2i (RSUM as it is);
#: a benchmark the metrics lack gives no column, and "RSUM (5K)" stands only without the 1K folds' RSUM
SUMMARY_COLUMNS = (("ECCV mAP@R", "eccv", "map_at_r"), ("ECCV R-P", "eccv", "rprecision"), ("ECCV R@1", "eccv", "r@1"),
                   ("CxC R@1", "cxc", "r@1"), ("COCO 1K R@1", "coco_1k", "r@1"), ("COCO 5K R@1", "coco_5k", "r@1"),
                   ("R@1", "coco", "r@1"), ("RSUM", "coco", "rsum"), ("RSUM", "coco_1k", "rsum"),
                   ("RSUM (5K)", "coco_5k", "rsum"), ("PMRP", "pmrp", "mean"), ("PMRP 1K", "pmrp_1k", "mean"),
                   ("R@1", "caption", "r@1"), ("RSUM", "caption", "rsum"), ("PM mAP@R", "plausible", "map_at_r"),
                   ("PM R-P", "plausible", "rprecision"))


def summary_row(metrics: dict) -> dict[str, float]:
    """The PCME++ Table 1 style columns (:data:`SUMMARY_COLUMNS`) that ``metrics`` has."""
    row = {}
    for label, bench, key in SUMMARY_COLUMNS:
        m = metrics.get(bench)
        if m is None or (label == "RSUM (5K)" and "coco_1k" in metrics):
            continue
        if key == "rsum":
            row[label] = m["rsum"]
        elif key in m.get("i2t", {}):
            row[label] = 0.5 * (m["i2t"][key] + m["t2i"][key])
    return row


def format_table(metrics: dict, label: str = "model") -> str:
    """Markdown tables: the paper-style summary row and every benchmark per direction."""
    row = summary_row(metrics)
    lines = ["| " + " | ".join(["model"] + list(row)) + " |", "|" + "---|" * (len(row) + 1),
             "| " + " | ".join([label] + [f"{v:.1f}" for v in row.values()]) + " |", ""]
    lines += ["| benchmark | direction | metric | value |", "|---|---|---|---|"]
    for bench, m in metrics.items():
        if not isinstance(m, dict) or "i2t" not in m:
            continue
        for d in ("i2t", "t2i"):
            for k, v in m[d].items():
                if k == "n_queries":
                    continue
                lines.append(f"| {bench} | {d} | {k} | {v:.2f} |")
        if "rsum" in m:
            lines.append(f"| {bench} | both | RSUM | {m['rsum']:.2f} |")
    return "\n".join(lines) + "\n"


def evaluate_embeddings(emb, task: RetrievalTask, *, score: str = "csd", ks: Sequence[int] = M.DEFAULT_KS,
                        keep_top: int = 0, chunk_size: int = 1024, progress: bool = False, seed: int = 0,
                        device=None, logit_scale: float | None = None, **score_kw) -> EvalResult:
    """Score ``emb`` (:class:`~zsprob.retrieval.embeddings.Embeddings`) with ``score`` in float32 blocks on
    ``device`` (default: where the embeddings live) and evaluate ``task``; ``metrics["setup"]`` records the
    score, its numeric options (e.g. MC's a, b, J), how it was ranked and the sizes. With ``logit_scale`` (the
    model's, for its softmax baselines), ``selective``: :func:`selective_block`."""
    scores = PairScores(score, emb.image_mu, emb.image_logvar, emb.caption_mu, emb.caption_logvar,
                        chunk_size=chunk_size, progress=progress, seed=seed, device=device, **score_kw)
    res = evaluate_scores(scores, task, ks=ks, keep_top=keep_top)
    if logit_scale is not None:
        res.selective = selective_block(scores, res.per_query, emb, logit_scale)
    pm_1k = pmrp_fold_metrics(emb, task, score, seed=seed, chunk_size=chunk_size, device=device, **score_kw)
    if pm_1k is not None:
        res.metrics["pmrp_1k"] = pm_1k
    res.metrics = {"setup": {"score": score, "method": "matrix (float32 score blocks)", "n_images": task.n_images,
                             **{f"score_{k}": float(v) for k, v in score_kw.items() if isinstance(v, (int, float))},
                             "n_captions": task.n_captions, "unit": "percent", "notes": list(task.notes)},
                   **res.metrics}
    return res


def selective_block(scores: PairScores, per_query: dict, emb, logit_scale: float, n_boot: int = 300) -> dict:
    """Per direction of the recall benchmark: which confidence flags a query whose top-1 item is not a positive
    (:mod:`zsprob.utils.selective`): the softmax baselines over the query's row at ``logit_scale``, its
    top-1 score (a monotone function of PCME++'s match probability) and, with sigma^2, the query's."""
    from zsprob.utils.selective import selective_report, sigma_confidence, softmax_confidences

    out = {}
    for d, pq in per_query.items():
        queries = torch.as_tensor(np.asarray(pq["queries"]), dtype=torch.long)
        rows = (scores.i2t if d == "i2t" else scores.t2i)[queries].double()
        logvar = emb.image_logvar if d == "i2t" else emb.caption_logvar
        conf = {**softmax_confidences(rows, logit_scale), "top1_score": rows.max(1).values.numpy()}
        if logvar is not None:
            conf["query_sigma2"] = sigma_confidence(logvar[queries])
        out[d] = selective_report(np.asarray(pq["r@1"]) > 0, conf, n_boot=n_boot)
    return out
