"""zsprob.retrieval: retrieval evaluation, uncertainty analyses and exact CSD search.

Owns retrieval evaluation (benchmark sets, metrics, the screen kernel, scoring), search indexes and
the uncertainty analyses. May import data, models, prob, report (plots), ``zsprob.errors`` and
``zsprob.utils``; never train, zeroshot or cli.

- :mod:`~zsprob.retrieval.metrics`: R@K, R-Precision, mAP@R, COCO 1K folds, PMRP as tensor
  operations over rankings (definitions identical to eccv_caption's);
- :mod:`~zsprob.retrieval.scoring`: chunked scoring with ``zsprob.prob.score`` (:class:`PairScores`,
  :func:`chunked_topk`);
- :mod:`~zsprob.retrieval.benchmarks`: the benchmark-set types (:class:`RetrievalTask`,
  :class:`BenchmarkSet`, :class:`EvalResult`) and the helpers both evaluation routes share;
- :mod:`~zsprob.retrieval.evaluate`: the score-matrix route, the route choice in
  :func:`evaluate_embeddings`, :func:`evaluate_rankings` (metrics of rankings made elsewhere), the
  Table-1 style table;
- :mod:`~zsprob.retrieval.screen`: the kernel: clipped ranks and top lists of linear keys from a
  certified bfloat16 screen with float64 rescoring (imports nothing from this package);
- :mod:`~zsprob.retrieval.screened`: every benchmark of a task for CSD / mean / cosine through
  the kernel, without a score matrix;
- :mod:`~zsprob.retrieval.coco`: COCO 5K / 1K, CxC, ECCV Caption (ground truth from eccv_caption), PMRP,
  :func:`evaluate_coco`;
- :mod:`~zsprob.retrieval.synthetic`: SynthWorld, :func:`evaluate_synthetic`;
- :mod:`~zsprob.retrieval.analysis`: uncertainty deciles, uncertain-queries page, corruption sweep;
- :mod:`~zsprob.retrieval.search`: CSD ranking as nearest-neighbour search on augmented vectors
  (FAISS flat / HNSW / IVF, torch brute force), the mean-only + re-rank baseline;
- :mod:`~zsprob.retrieval.embeddings`: the ``E.npz`` format.
"""
from zsprob.retrieval.coco import coco_task, evaluate_coco, official_subset, task_for_embeddings
from zsprob.retrieval.embeddings import Embeddings, load_embeddings
from zsprob.retrieval.evaluate import (
    BenchmarkSet, EvalResult, RetrievalTask, evaluate_embeddings, evaluate_rankings, evaluate_scores, format_table,
    summary_row,
)
from zsprob.retrieval.scoring import PairScores, chunked_topk, score_matrix
from zsprob.retrieval.search import (
    CSDIndex, MeanRerankIndex, SearchResult, augment_gallery, augment_queries, brute_force_csd, build_index,
    load_index,
)
from zsprob.retrieval.synthetic import evaluate_synthetic, synthetic_task

__all__ = [
    "coco_task", "evaluate_coco", "official_subset", "task_for_embeddings", "Embeddings", "load_embeddings",
    "BenchmarkSet", "EvalResult", "RetrievalTask", "evaluate_embeddings", "evaluate_rankings", "evaluate_scores",
    "format_table", "summary_row", "PairScores", "chunked_topk", "score_matrix", "CSDIndex", "MeanRerankIndex", "SearchResult",
    "augment_gallery", "augment_queries", "brute_force_csd", "build_index", "load_index", "evaluate_synthetic",
    "synthetic_task",
]
