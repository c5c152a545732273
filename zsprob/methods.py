"""Names every layer agrees on, torch-free: the two registries' names and the occlusion term's image views.

``METHODS`` (training objectives, ``--method``) and ``STRATEGIES`` (prompt-selection strategies,
``--strategy``) are read live from :mod:`zsprob.prob.method_registry` and
:mod:`zsprob.zeroshot.strategy_registry`, imported only when they are read.
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
    if name == "METHODS":
        from zsprob.prob.method_registry import method_names
        return method_names()
    if name == "STRATEGIES":
        from zsprob.zeroshot.strategy_registry import strategy_names
        return strategy_names()
    raise AttributeError(f"module 'zsprob.methods' has no attribute {name!r}")
