"""The names every layer agrees on: training methods and prompt-selection strategies (no torch import).

One list per concept, read by the CLI (click choices), the training defaults
(:mod:`zsprob.train.defaults`), the loss registry (:mod:`zsprob.prob.losses`, whose
``LOSS_NAMES`` must equal :data:`METHODS`) and the strategy dispatcher
(:mod:`zsprob.zeroshot.selection`); the occlusion term's image views, read by the losses'
option checks (:mod:`zsprob.prob.prolip`) and the views themselves (:mod:`zsprob.data.degrade`).
Imports nothing.
"""
from __future__ import annotations

#: training objectives (``--method``): one loss each in zsprob.prob.losses
METHODS = ("pcmepp", "pcme", "infonce", "triplet", "prob-triplet", "mu-only", "prolip", "jwae")

#: prompt-selection strategies (``--strategy``): one ``select_*`` each in zsprob.zeroshot.selection
STRATEGIES = ("all", "single", "topk", "global", "auto", "threshold", "fusion", "fusion-select", "poe",
              "bprw", "zpe", "oracle", "oracle-global")

#: how the occlusion term's image copies are made: ``cells`` blanked (ProLIP's patch dropping on the
#: input) or ``degrade`` (one lossy operation of :data:`DEGRADE_OPS` per image; zsprob.data.degrade)
IMAGE_MASK_MODES = ("cells", "degrade")
DEGRADE_OPS = ("cells", "blur", "downsample", "dim", "jpeg", "grayscale", "crop", "shift", "sketch")
DEFAULT_DEGRADE_OPS = DEGRADE_OPS[:7]   # the demo recipe's seven; shift / sketch are opt-in

__all__ = ["METHODS", "STRATEGIES", "IMAGE_MASK_MODES", "DEGRADE_OPS", "DEFAULT_DEGRADE_OPS"]
