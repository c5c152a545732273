"""zsprob.prob: tensor math on diagonal Gaussian embeddings, and the training methods' registry.

No models, data or I/O: may import ``zsprob.errors``, ``zsprob.methods`` and ``zsprob.utils.host_sync`` only.
Modules: ``distances`` (pairwise [N, M], :func:`score`), ``losses``, ``prolip``, ``jwae``, ``msda``, ``pairs``
(rows / columns bookkeeping) and ``method_registry`` (torch-free). Names are imported on first use
(``from zsprob.prob import csd``), so the registry is read without importing torch."""
from __future__ import annotations

_EXPORTS = {
    "distances": ("bhattacharyya", "cosine", "csd", "elk", "inclusion_logit", "inclusion_test", "js", "kl",
                  "kl_reverse", "mc_avg_l2", "mc_match_prob", "min_kl", "sample_gaussian", "score", "sq_euclidean",
                  "uncertainty", "wasserstein2"),
    "losses": ("InfoNCELoss", "MuOnlyLoss", "PCMELoss", "PCMEPPLoss", "ProbTripletLoss", "TripletLoss",
               "pseudo_positive_targets", "vib_kl"),
    "prolip": ("ProLIPLoss",),
    "msda": ("mix_batch",),
    "jwae": ("JWAE_PRESETS", "JWAEObjective", "PriorDiscriminator", "discriminator_loss", "generator_loss",
             "max_margin_alignment", "mse_alignment", "reconstruction_loss", "sample_prior"),
    "method_registry": ("register_method", "get_method", "method_names", "create_loss", "needs_sigma", "SCORE_NAMES"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name):
    import importlib

    if name in _HOME:
        return getattr(importlib.import_module(f"zsprob.prob.{_HOME[name]}"), name)
    raise AttributeError(f"module 'zsprob.prob' has no attribute {name!r}")
