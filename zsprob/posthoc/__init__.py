"""Post-hoc uncertainty: log-variance heads for a frozen model whose means stay bit-identical.

Owns ``zsprob posthoc``: any model zsprob can load becomes a probabilistic zsprob checkpoint. ``heads`` builds
the copy, ``features`` caches what the heads read, ``adapter`` / ``laplace`` fit them (:data:`METHODS`) and
``run.posthoc`` chains them. Imports no torch, so the command line reads its lists for free. May import data,
models, prob, errors, utils and the root package; torch, safetensors and tqdm do the rest."""
from __future__ import annotations

from typing import NamedTuple

from zsprob.errors import UserError


class Method(NamedTuple):
    """One post-hoc method: its fit function (``"module:name"``, imported on use) and what its sigma^2 means."""

    fit: str
    sigma: str


METHODS = {
    "adapter": Method("zsprob.posthoc.adapter:train_heads",
                      "aleatoric: trained to say how vague an input is (the sigma recipe's terms on the frozen means)"),
    "laplace": Method("zsprob.posthoc.laplace:fit_laplace",
                      "epistemic: K-FAC Laplace posterior of the projections, propagated to the normalised mean "
                      "(how unfamiliar the features are), distilled into the heads"),
}
#: where post-hoc training reads image-caption pairs (``--data``)
DATA_KINDS = ("synthetic", "webdataset", "coco")


def get_method(name: str) -> Method:
    """The entry of ``name``; an unknown name is one :class:`UserError` line with the choices."""
    if name not in METHODS:
        raise UserError(f"unknown post-hoc method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "DATA_KINDS", "Method", "get_method"]
