"""The ground truth of a retrieval test set and the bookkeeping of its evaluation.

A :class:`RetrievalTask` holds one test set's image and caption ids and one :class:`BenchmarkSet` of sparse
(scipy) positives per benchmark, optionally the COCO 1K folds; :class:`EvalResult` is what an evaluation
returns. :func:`sets_metrics` turns per-query metrics into every set's result, for score matrices and for
ranked lists alike (:mod:`zsprob.retrieval.evaluate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import scipy.sparse as sp

from zsprob.retrieval.metrics import positives_from_assignment

#: above this many positives per query a benchmark is ranked in chunks instead of sharing the top-L lists
SHARED_L_LIMIT = 256


@dataclass
class BenchmarkSet:
    """One benchmark's positives. ``kind``: "recall" (R@K for ``ks``) or "precision"
    (mAP@R, R-Precision and R@1) or "rprecision" (R-Precision only, e.g. PMRP)."""

    name: str
    i2t: sp.csr_matrix  # [n_img, n_cap]
    t2i: sp.csr_matrix  # [n_cap, n_img]
    kind: str = "recall"
    i2t_queries: np.ndarray | None = None  # default: rows with a positive
    t2i_queries: np.ndarray | None = None
    i2t_n_pos: np.ndarray | None = None  # R per query if it counts positives outside the gallery
    t2i_n_pos: np.ndarray | None = None

    def side(self, direction: str) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray | None]:
        """One direction's positives, query rows (int64) and R per query (None: the positives' count)."""
        pos, q, n_pos = ((self.i2t, self.i2t_queries, self.i2t_n_pos) if direction == "i2t"
                         else (self.t2i, self.t2i_queries, self.t2i_n_pos))
        if q is None:
            q = np.flatnonzero(np.diff(pos.indptr) > 0)
        return pos, np.asarray(q, dtype=np.int64), n_pos

    def ks(self, ks: Sequence[int]) -> tuple[int, ...]:
        """The R@K cut-offs this set reports: ``ks`` for a recall set, R@1 for the others."""
        return tuple(ks) if self.kind == "recall" else (1,)


@dataclass
class RetrievalTask:
    name: str
    image_ids: np.ndarray
    caption_ids: np.ndarray
    caption_image: np.ndarray
    sets: list[BenchmarkSet] = field(default_factory=list)
    folds: list[tuple[np.ndarray, np.ndarray]] | None = None  # COCO 1K
    notes: list[str] = field(default_factory=list)

    @property
    def n_images(self) -> int:
        return len(self.image_ids)

    @property
    def n_captions(self) -> int:
        return len(self.caption_ids)

    def caption_positives(self) -> sp.csr_matrix:
        return positives_from_assignment(self.caption_image, self.n_images)


@dataclass
class EvalResult:
    metrics: dict  # nested, percentages
    per_query: dict  # {"i2t": {"r@1": array over images}, "t2i": {...}} from the first recall set
    top: dict  # {"i2t": [n_img, T] caption indices, "t2i": [n_cap, T] image indices}
    selective: dict | None = None  # per direction: zsprob.retrieval.evaluate.selective_block


def percent(d: dict) -> dict:
    return {k: 100.0 * v for k, v in d.items()}


def needed_length(bs: BenchmarkSet, direction: str, ks: Sequence[int]) -> int:
    """The ranked-list length a set's metrics read: max(ks) for R@K, the largest R otherwise."""
    if bs.kind == "recall":
        return max(ks)
    pos, q, n_pos = bs.side(direction)
    counts = np.diff(pos.indptr)
    if n_pos is not None:  # R counts positives outside the gallery too: the list must reach position R
        counts = np.maximum(counts, np.asarray(n_pos))
    return max(1, int(counts[q].max()) if len(q) else 1)


def sets_metrics(task: RetrievalTask, ks: Sequence[int], direction_metrics) -> dict:
    """Every set's mean metrics per direction in percent (PMRP: R-Precision only), RSUM for the recall sets
    and the PMRP sets merged; ``direction_metrics(bs, direction)`` gives a direction's per-query metrics."""
    metrics = {}
    for bs in task.sets:
        out = {}
        for d in ("i2t", "t2i"):
            qm = direction_metrics(bs, d)
            vals = qm.mean()
            out[d] = percent({"rprecision": vals["rprecision"]} if bs.kind == "rprecision" else vals)
            out[d]["n_queries"] = len(qm.queries)
        if bs.kind == "recall":
            out["rsum"] = sum(out[d][f"r@{k}"] for d in ("i2t", "t2i") for k in ks)
        metrics[bs.name] = out
    merge_pmrp(metrics)
    return metrics


def merge_pmrp(metrics: dict) -> None:
    """Gather the per-zeta PMRP sets into metrics["pmrp"] with their mean."""
    pm = sorted(k for k in metrics if k.startswith("pmrp_zeta"))
    if pm:
        agg = {}
        for d in ("i2t", "t2i"):
            agg[d] = {k.replace("pmrp_", ""): metrics[k][d]["rprecision"] for k in pm}
            agg[d]["mean"] = float(np.mean(list(agg[d].values())))
        for k in pm:
            del metrics[k]
        metrics["pmrp"] = agg


def fold_summary(per: dict, task: RetrievalTask, ks: Sequence[int]) -> dict:
    """COCO 1K result: per direction the mean of the fold means, query counts, RSUM."""
    out = {d: percent({k: float(np.mean([m[k] for m in per[d]])) for k in per[d][0]}) for d in per}
    for d in out:
        out[d]["n_queries"] = int(sum(len(f[0] if d == "i2t" else f[1]) for f in task.folds))
    out["rsum"] = sum(out[d][f"r@{k}"] for d in ("i2t", "t2i") for k in ks)
    out["n_folds"] = len(task.folds)
    return out
