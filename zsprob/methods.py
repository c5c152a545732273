"""The names every layer agrees on: training methods and prompt-selection strategies (no torch import).

One list per concept, read by the CLI (click choices), the training defaults
(:mod:`zsprob.train.defaults`), the loss registry (:mod:`zsprob.prob.losses`, whose
``LOSS_NAMES`` must equal :data:`METHODS`) and the strategy dispatcher
(:mod:`zsprob.zeroshot.selection`). Imports nothing.
"""
from __future__ import annotations

#: training objectives (``--method``): one loss each in zsprob.prob.losses
METHODS = ("pcmepp", "pcme", "infonce", "triplet", "prob-triplet", "mu-only", "prolip", "jwae")

#: prompt-selection strategies (``--strategy``): one ``select_*`` each in zsprob.zeroshot.selection
STRATEGIES = ("all", "single", "topk", "global", "auto", "threshold", "fusion", "fusion-select", "poe",
              "bprw", "zpe", "oracle", "oracle-global")

__all__ = ["METHODS", "STRATEGIES"]
