"""zsprob.retrieval: retrieval evaluation, uncertainty analyses and exact CSD search.

May import data, models, prob, report (plots), ``zsprob.errors`` and ``zsprob.utils``; never train,
zeroshot or cli. Names are imported on first use, so the command line reads ``index_format`` and ``analysis``
(which names the output files) without torch."""
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
