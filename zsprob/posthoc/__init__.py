"""Post-hoc uncertainty: log-variance heads for a frozen model whose means stay bit-identical.

Owns ``zsprob posthoc``: any model zsprob can load (a zsprob checkpoint, an open_clip model or
directory, a published ProLIP / PCME++ file) becomes a probabilistic zsprob checkpoint that every
command loads, its means untouched. :mod:`~zsprob.posthoc.heads` builds the copy and runs one
tower's head on cached features, :mod:`~zsprob.posthoc.features` computes those features once
(originals and the sigma recipe's degraded / word-deleted copies), :mod:`~zsprob.posthoc.adapter`
trains the heads with the recipe's terms, :mod:`~zsprob.posthoc.laplace` fits BayesVLM-style
K-FAC Laplace variances of the projections, :mod:`~zsprob.posthoc.run` chains them (``METHODS``).

May import: data (readers, copies), models (loading, heads, checkpoints), prob (the loss terms),
errors, utils and the root package. torch, safetensors and tqdm do the rest.
"""
from __future__ import annotations

from zsprob.posthoc.run import METHODS, load_source, posthoc

__all__ = ["METHODS", "posthoc", "load_source"]
