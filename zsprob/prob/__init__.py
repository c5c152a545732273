"""zsprob.prob: tensor math on diagonal Gaussian embeddings (no I/O, no models).

Owns the tensor math on Gaussians: distances, losses, MSDA, jWAE terms. May import ``zsprob.errors``,
``zsprob.methods`` and ``zsprob.utils.host_sync`` (whether a host read is free on a device) only: no
models, data or I/O.

- :mod:`zsprob.prob.distances`: pairwise distances [N, M] (CSD, 2-Wasserstein, KL, min-KL, JS,
  ELK, Bhattacharyya, mean-only, cosine, Monte Carlo match probability / average L2),
  ProLIP's inclusion test, uncertainty scalars, and :func:`score` (similarities, higher = better) by name;
- :mod:`zsprob.prob.losses`: PCMEPPLoss, PCMELoss, InfoNCELoss, TripletLoss, ProbTripletLoss,
  MuOnlyLoss, ProLIPLoss, :func:`create_loss`, :func:`needs_sigma`;
- :mod:`zsprob.prob.method_registry`: the training methods (loss, sigma, default loss options, step
  kind, model defaults), torch-free: read by the training defaults and the command line;
- :mod:`zsprob.prob.prolip`: ProLIP's objective (PPCL, inclusion, its VIB) and the occlusion
  inclusion term PCMEPPLoss can add;
- :mod:`zsprob.prob.pairs`: the local-rows / gathered-columns bookkeeping both loss modules use;
- :mod:`zsprob.prob.jwae`: jWAE reconstruction / adversarial prior / alignment terms;
- :mod:`zsprob.prob.msda`: Mixup / CutMix of images with soft match targets (:func:`mix_batch`);
- :mod:`zsprob.prob.reference`: broadcast reference of the PCME++ pseudo-code (tests, benchmarks).

Names are imported on first use (``from zsprob.prob import csd`` works as before), so that
``zsprob.prob.method_registry`` can be read without importing torch.
"""
from __future__ import annotations

_EXPORTS = {
    "distances": ("SCORE_NAMES", "bhattacharyya", "cosine", "csd", "elk", "inclusion_logit", "inclusion_test", "js",
                  "kl", "kl_reverse", "mc_avg_l2", "mc_match_prob", "min_kl", "sample_gaussian", "score",
                  "sq_euclidean", "uncertainty", "wasserstein2"),
    "losses": ("LOSS_NAMES", "InfoNCELoss", "MuOnlyLoss", "PCMELoss", "PCMEPPLoss", "ProbTripletLoss", "ProLIPLoss",
               "TripletLoss", "create_loss", "needs_sigma", "pseudo_positive_targets", "vib_kl"),
    "msda": ("mix_batch",),
    "jwae": ("JWAE_PRESETS", "JWAEObjective", "PriorDiscriminator", "discriminator_loss", "generator_loss",
             "max_margin_alignment", "mse_alignment", "reconstruction_loss", "sample_prior"),
    "method_registry": ("register_method", "get_method", "method_names"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name):
    import importlib

    if name in _HOME:
        return getattr(importlib.import_module(f"zsprob.prob.{_HOME[name]}"), name)
    raise AttributeError(f"module 'zsprob.prob' has no attribute {name!r}")
