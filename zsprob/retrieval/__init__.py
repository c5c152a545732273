"""zsprob.retrieval: retrieval evaluation, uncertainty analyses and exact CSD search.

May import data, models, prob, report (plots), ``zsprob.errors`` and ``zsprob.utils``; never train,
zeroshot or cli.

- :mod:`~zsprob.retrieval.metrics`: R@K, R-Precision, mAP@R, COCO 1K folds, PMRP over rankings;
- :mod:`~zsprob.retrieval.scoring`: chunked scoring with ``zsprob.prob.score`` (:class:`PairScores`);
- :mod:`~zsprob.retrieval.benchmarks`: :class:`RetrievalTask`, :class:`BenchmarkSet`, :class:`EvalResult`;
- :mod:`~zsprob.retrieval.evaluate`: every benchmark's metrics from a score matrix or from rankings
  made elsewhere, the Table-1 style table;
- :mod:`~zsprob.retrieval.coco`: COCO 5K / 1K, CxC, ECCV Caption, PMRP; :func:`evaluate_coco`;
- :mod:`~zsprob.retrieval.synthetic`: SynthWorld, :func:`evaluate_synthetic`;
- :mod:`~zsprob.retrieval.analysis` / :mod:`~zsprob.retrieval.validity`: uncertainty analyses (analysis also
  names the files an evaluation writes);
- :mod:`~zsprob.retrieval.search`: CSD ranking as nearest-neighbour search (FAISS, torch);
  :mod:`~zsprob.retrieval.index_format` names its kinds and files;
- :mod:`~zsprob.retrieval.embeddings`: a split embedded, and the ``E.npz`` format.

Names are imported on first use, so the command line reads ``index_format`` and ``analysis`` without torch.
"""
from __future__ import annotations

_EXPORTS = {
    "benchmarks": ("BenchmarkSet", "EvalResult", "RetrievalTask"),
    "coco": ("coco_task", "evaluate_coco", "official_subset", "task_for_embeddings"),
    "embeddings": ("Embeddings", "load_embeddings"),
    "evaluate": ("evaluate_embeddings", "evaluate_rankings", "evaluate_scores", "format_table", "summary_row"),
    "scoring": ("PairScores", "chunked_topk", "score_matrix"),
    "search": ("CSDIndex", "MeanRerankIndex", "SearchResult", "augment_gallery", "augment_queries", "brute_force_csd",
               "build_index", "load_index"),
    "synthetic": ("evaluate_synthetic", "synthetic_task"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name):
    import importlib

    if name in _HOME:
        return getattr(importlib.import_module(f"zsprob.retrieval.{_HOME[name]}"), name)
    raise AttributeError(f"module 'zsprob.retrieval' has no attribute {name!r}")
