"""What `zsprob demo` trains: the main two models and their recipes, and the extra runs of ``--all-methods``.

Each run names the ``--method`` it trains with (these are demo runs, not ``zsprob.methods.METHODS``).
"""
from __future__ import annotations

DEMO_MODELS = ("pcmepp", "infonce")
#: each model's recipe: PCME++ with the decoupled uncertainty changes (sigma^2 that tracks ambiguity,
#: docs/findings.md), InfoNCE on the same model, data, budget and seed
RECIPES = {"pcmepp": "synthetic_tiny_sigma.yaml", "infonce": "synthetic_tiny.yaml"}
#: ``--all-methods``: name -> (recipe, --method, extra arguments); each writes OUT/methods/NAME/
#: {run, retrieval/metrics.json, compare.json}. The objectives as their official code sets them, on the
#: demo's model: PCME++ without the sigma recipe, ProLIP with pooled-feature [UNC] heads (the bag of
#: words has no token to append), PCME in its official form, Pishdad et al.'s probabilistic triplet.
DEMO_EXTRA_RUNS = {
    "pcmepp-official": ("synthetic_tiny.yaml", "pcmepp", []),
    "prolip": ("synthetic_tiny.yaml", "prolip", ["--set", "model.overrides.sigma_head=unc"]),
    "pcme": ("synthetic_tiny.yaml", "pcme", []),
    "prob-triplet": ("synthetic_tiny.yaml", "prob-triplet", []),
}
