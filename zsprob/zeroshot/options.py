"""The zero-shot request: one record of what ``select-prompts`` / ``zeroshot`` / ``--compare`` are asked to do.

:class:`ZeroShotRequest` holds the data, the prompts, the strategy and its options, the score and how to
encode; the command line builds it and every entry point of :mod:`zsprob.zeroshot.classify` takes it. Its
choices are declared here, without torch; an invalid request is one :class:`UserError` line when made.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from zsprob.data.classification import KINDS as DATASET_KINDS  # noqa: F401  (the kinds the data layer reads)
from zsprob.errors import UserError
from zsprob.zeroshot.strategy_registry import check_shots_split, get_strategy

#: how an image is scored against a class (zsprob.zeroshot.metrics.class_scores)
SCORES = ("cosine", "csd", "unc")
#: what ``--compare`` writes into its folder (zsprob.zeroshot.classify.compare_on_features)
COMPARE_FILES = ("compare.md", "compare.json", "accuracy_vs_topk.png", "per_class_k_hist.png", "selections",
                 "risk_coverage.png")
#: the words ``--topk`` takes besides a number
TOPK_WORDS = ("auto", "all", "oracle")


@dataclass(frozen=True)
class ZeroShotRequest:
    """One zero-shot or prompt-selection request, checked when it is made.

    ``templates``, ``classnames`` and ``class_prompts`` take a file (read here, once) or its content; ``sources``
    then names the file each came from. ``prompts`` is a finished selection.json (``zeroshot_eval`` only);
    ``k_values`` the K grid (a list, or text like "1-80"); ``model_meta`` how result files describe the model.
    """

    dataset: str = "synthetic"
    root: Any = None
    select_root: Any = None
    use_select: bool = True
    prompts: Any = None
    templates: Any = None
    classnames: Any = None
    class_prompts: Any = None
    strategy: str = "auto"
    k: int | None = None
    k_values: Any = None
    threshold_c: float = 1.0
    beta: float = 1.0
    shots: int | None = None
    shots_split: str = "select"
    allow_eval_shots: bool = False
    score: str = "cosine"
    unc_weight: float = 0.5
    cache_dir: Any = None
    batch_size: int = 256
    device: Any = None
    num_workers: int = 0
    precision: str = "fp32"
    progress: bool = True
    model_meta: dict | None = None
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.dataset not in DATASET_KINDS:
            raise UserError(f"unknown dataset kind {self.dataset!r}; choose from {', '.join(DATASET_KINDS)}")
        get_strategy(self.strategy)
        check_shots_split(self.shots_split, self.allow_eval_shots)
        if self.shots is not None and self.shots < 1:
            raise UserError(f"--shots must be at least 1, got {self.shots}")
        if self.score not in SCORES:
            raise UserError(f"unknown score {self.score!r}; choose from {', '.join(SCORES)}")
        if self.prompts is not None and self.class_prompts is not None:
            raise UserError("--prompts is a finished selection; --class-prompts chooses prompts, give one of them")
        if self.class_prompts is not None and self.templates is not None:
            raise UserError("--class-prompts gives each class its own prompts; it does not take --templates")
        self._read_files()
        self._check_k()
        if isinstance(self.k_values, str):
            parse_k_grid(self.k_values)  # its form; the bound is the bank's number of templates

    def _check_k(self) -> None:
        """``k`` within the prompts per class (the templates, or the longest pool), before anything is encoded."""
        from zsprob.zeroshot.prompts import load_templates

        if self.k is None or self.prompts is not None:
            return
        pools = self.class_prompts
        count = max(map(len, pools.values())) if isinstance(pools, dict) else len(self.templates or load_templates())
        if not 1 <= self.k <= count:
            raise UserError(f"--topk must be between 1 and {count} (the prompts per class), got {self.k}")

    def _read_files(self) -> None:
        from zsprob.zeroshot.pools import load_class_prompts
        from zsprob.zeroshot.prompts import load_classnames, load_templates

        sources = dict(self.sources)
        for name, load in (("class_prompts", load_class_prompts), ("templates", load_templates),
                           ("classnames", load_classnames)):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)):
                object.__setattr__(self, name, load(value))
                sources[name] = str(value)
        object.__setattr__(self, "sources", sources)


_FIELDS = {f.name for f in fields(ZeroShotRequest)}


def as_request(request: ZeroShotRequest | None = None, **changes) -> ZeroShotRequest:
    """``request`` with ``changes`` (field names of :class:`ZeroShotRequest`), or a new one made of them."""
    if request is None:
        return ZeroShotRequest(**changes)
    return replace(request, **changes) if changes else request


#: request fields the command line names otherwise (option -> field)
_RENAMED = {"classes": "classnames", "k_grid": "k_values", "workers": "num_workers"}


def request_from_options(opts: dict, **fields) -> ZeroShotRequest:
    """The request of ``select-prompts`` / ``zeroshot`` from their parsed options, with ``fields`` on top."""
    given = {_RENAMED.get(name, name): value for name, value in opts.items() if _RENAMED.get(name, name) in _FIELDS}
    if "no_select" in opts:
        given["use_select"] = not opts["no_select"]
    return ZeroShotRequest(**{**given, **fields})


def parse_k_grid(text: str | None, T: int | None = None):
    """``"1,2,4,8"`` or ``"1-80"`` -> sorted list of ints (``None`` -> all K); with ``T`` (the number of
    templates) every K is at most T and T itself ('all') is always a candidate."""
    if text is None or str(text).strip() == "":
        return None
    ranges = []
    for part in filter(None, (part.strip() for part in str(text).split(","))):
        low, _, high = part.partition("-")
        try:
            ranges.append(range(int(low), int(high or low) + 1))
        except ValueError:
            raise UserError(f"--k-grid must be comma-separated integers or ranges like 1-80, got {text!r}") from None
    if not all(ranges):
        raise UserError(f"--k-grid ranges go from low to high (like 1-80), got {text!r}")
    out = sorted({k for values in ranges for k in values})
    if not out or out[0] < 1 or (T is not None and out[-1] > T):
        bound = f"the number of templates ({T})" if T is not None else "the number of templates"
        raise UserError(f"--k-grid values must be between 1 and {bound}, got {text!r}")
    if T is not None and out[-1] != T:
        out.append(T)
    return out


def strategy_from_topk(topk: str | None, strategy: str | None):
    """``--topk auto|N|all|oracle`` and ``--strategy`` as (strategy name, K or None); a strategy that needs K
    takes ``--topk N``."""
    if strategy is not None:
        entry = get_strategy(strategy)
        if not entry.needs_k:
            return strategy, None
        k = int(topk) if topk is not None and str(topk).isdigit() else None
        entry.check_k(k)
        return strategy, k
    t = (topk or "auto").strip().lower()
    if t in TOPK_WORDS:
        return t, None
    if t.isdigit() and int(t) >= 1:
        return "topk", int(t)
    raise UserError(f"--topk must be auto, all, oracle or a positive number, got {topk!r}")
