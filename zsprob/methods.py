"""Names every layer agrees on: the views of the two registries and the occlusion term's image views.

``METHODS`` (training objectives, ``--method``) and ``STRATEGIES`` (prompt-selection strategies,
``--strategy``) are read live from their registries, where each name carries its facts:
:mod:`zsprob.prob.method_registry` (loss, sigma, default loss options, step kind) and
:mod:`zsprob.zeroshot.strategy_registry` (data read, sigma^2, K, ``--compare`` order); both are
torch-free, so the command line's choices cost no torch import. The occlusion term's image views are
read by the losses' option checks (:mod:`zsprob.prob.prolip`) and the views themselves
(:mod:`zsprob.data.degrade`). Imports the two registries only when ``METHODS`` / ``STRATEGIES`` are read.
"""
from __future__ import annotations

#: how the occlusion term's image copies are made: ``cells`` blanked (ProLIP's patch dropping on the
#: input) or ``degrade`` (one lossy operation of :data:`DEGRADE_OPS` per image; zsprob.data.degrade)
IMAGE_MASK_MODES = ("cells", "degrade")
#: how the masked caption copies are made: tokens replaced by a mask token, or deleted (zsprob.data.masking)
TEXT_MASK_MODES = ("replace", "delete")
DEGRADE_OPS = ("cells", "blur", "downsample", "dim", "jpeg", "grayscale", "crop", "shift", "sketch")
DEFAULT_DEGRADE_OPS = DEGRADE_OPS[:7]   # the demo recipe's seven; shift / sketch are opt-in

__all__ = ["METHODS", "STRATEGIES", "IMAGE_MASK_MODES", "TEXT_MASK_MODES", "DEGRADE_OPS", "DEFAULT_DEGRADE_OPS"]


def __getattr__(name):
    if name == "METHODS":  # training objectives (--method): zsprob.prob.method_registry
        from zsprob.prob.method_registry import method_names
        return method_names()
    if name == "STRATEGIES":  # prompt-selection strategies (--strategy): zsprob.zeroshot.strategy_registry
        from zsprob.zeroshot.strategy_registry import strategy_names
        return strategy_names()
    raise AttributeError(f"module 'zsprob.methods' has no attribute {name!r}")
