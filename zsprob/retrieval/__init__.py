"""zsprob.retrieval: retrieval evaluation, uncertainty analyses and exact CSD search.

Owns retrieval evaluation (benchmark sets, metrics, scoring), search indexes and the uncertainty
analyses. May import data, models, prob, report (plots), ``zsprob.errors`` and ``zsprob.utils``;
never train, zeroshot or cli.

- :mod:`~zsprob.retrieval.metrics`: R@K, R-Precision, mAP@R, COCO 1K folds, PMRP as tensor
  operations over rankings (definitions identical to eccv_caption's);
- :mod:`~zsprob.retrieval.scoring`: chunked scoring with ``zsprob.prob.score`` (:class:`PairScores`,
  :func:`chunked_topk`);
- :mod:`~zsprob.retrieval.benchmarks`: the benchmark-set types (:class:`RetrievalTask`,
  :class:`BenchmarkSet`, :class:`EvalResult`) and their bookkeeping;
- :mod:`~zsprob.retrieval.evaluate`: every benchmark's metrics from a score matrix
  (:func:`evaluate_embeddings`), from rankings made elsewhere (:func:`evaluate_rankings`), the
  Table-1 style table;
- :mod:`~zsprob.retrieval.coco`: COCO 5K / 1K, CxC, ECCV Caption (ground truth from eccv_caption), PMRP,
  :func:`evaluate_coco`;
- :mod:`~zsprob.retrieval.synthetic`: SynthWorld, :func:`evaluate_synthetic`;
- :mod:`~zsprob.retrieval.analysis`: uncertainty deciles, uncertain-queries page, corruption sweep;
- :mod:`~zsprob.retrieval.validity`: does sigma^2 mean ambiguity (SynthWorld's exact ground truth);
- :mod:`~zsprob.retrieval.search`: CSD ranking as nearest-neighbour search on augmented vectors
  (FAISS flat / HNSW / IVF, torch brute force), the mean-only + re-rank baseline;
  :mod:`~zsprob.retrieval.index_format` names its kinds and files without importing torch;
- :mod:`~zsprob.retrieval.embeddings`: the ``E.npz`` format.

Names are imported on first use (``from zsprob.retrieval import evaluate_coco`` works), so that
``zsprob.retrieval.index_format`` can be read by the command line without importing torch.
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
