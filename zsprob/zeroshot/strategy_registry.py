"""The prompt-selection strategies: one declaration per name, holding every fact a caller reads and its code.

An entry (:class:`Strategy`) is read by dispatch, encoding and the command line's choices. The built-ins are
declared at the end with ``"module:function"`` (imported on the first run), so the command line reads the
names without torch; a new one: ``register_strategy("mine", run=fn, needs=(SELECTION_LABELS,), sigma=True,
compare=45)``, where ``run(bank, given)`` takes the bank and a :class:`StrategyInputs` and returns a
:class:`~zsprob.zeroshot.selection_base.Selection`. Plain Python."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from zsprob.errors import UserError

#: the data a strategy may read besides the prompt bank
SELECTION_LABELS = "selection labels"          # the labelled selection split (--select-root)
UNLABELLED_IMAGES = "unlabelled images"        # the evaluation images without their labels
EVAL_LABELS = "evaluation labels"              # the evaluation split with its labels (oracles only)
DATA_KINDS = (SELECTION_LABELS, UNLABELLED_IMAGES, EVAL_LABELS)

#: what run_strategy says when a needed input is missing
_MISSING = {SELECTION_LABELS: "needs a labelled selection split (--select-root)",
            UNLABELLED_IMAGES: "needs unlabelled images",
            EVAL_LABELS: "needs the evaluation split and its labels"}


@dataclass(frozen=True)
class StrategyInputs:
    """What a strategy's function receives besides the bank (data it did not declare is ``None``): the
    :class:`~zsprob.zeroshot.options.ZeroShotRequest`, ``select`` / ``eval_`` as ``(feats, labels)``, the
    unlabelled ``pool`` features, and how the selection's ``info`` describes the data."""

    request: Any
    select: Any = None
    pool: Any = None
    eval_: Any = None
    select_data: str = "selection split"
    pool_data: str = "unlabelled images"


@dataclass
class Strategy:
    """One strategy's facts and function.

    ``needs``: data it cannot run without; ``uses``: data it reads when given; ``sigma``: ranks or weights
    prompts by sigma^2; ``needs_k``: takes ``--topk N``; ``compare``: its rank in ``--compare`` (None: left
    out); ``code``: ``run(bank, StrategyInputs) -> Selection`` or ``"module:function"``; ``shots``: its
    labelled images come from the split ``--shots-split`` names; ``options``: the
    :data:`STRATEGY_OPTIONS` it reads (the command line refuses them for any other strategy).
    """

    name: str
    code: Callable | str
    needs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    sigma: bool = False
    needs_k: bool = False
    compare: int | None = None
    shots: bool = False
    options: tuple[str, ...] = ()

    @property
    def run(self) -> Callable:
        """The strategy's function (a ``"module:function"`` is imported once, here)."""
        if isinstance(self.code, str):
            module, _, name = self.code.partition(":")
            self.code = getattr(importlib.import_module(module), name)
        return self.code

    @property
    def reads(self) -> tuple[str, ...]:
        """Every kind of data the strategy reads (needed or used when given)."""
        return self.needs + tuple(kind for kind in self.uses if kind not in self.needs)

    @property
    def reads_eval_labels(self) -> bool:
        return EVAL_LABELS in self.reads

    @property
    def transductive(self) -> bool:
        """Reads the unlabelled evaluation images (the evaluation set shapes the classifier)."""
        return UNLABELLED_IMAGES in self.reads

    def label_split(self, shots_split: str = "select") -> str | None:
        """The split any labels it reads come from (None: it reads no label)."""
        if self.shots:
            return "evaluation split" if shots_split == "eval" else "selection split"
        if EVAL_LABELS in self.reads:
            return "evaluation split"
        if SELECTION_LABELS in self.reads:
            return "selection split" if SELECTION_LABELS in self.needs else "selection split (when given)"
        return None

    def eval_shots(self, shots_split: str) -> bool:
        """Whether its labelled shots are evaluation images (``--shots-split eval``)."""
        return self.shots and shots_split == "eval"

    def shots_source(self, shots_split: str, select, eval_):
        """What its ``select`` input holds: the evaluation split's for eval shots."""
        return eval_ if self.eval_shots(shots_split) else select

    def audit(self, shots_split: str = "select") -> dict:
        """The protocol facts of one run: evaluation labels read, transductive, which split's labels."""
        eval_shots = self.eval_shots(shots_split)
        return {"reads_eval_labels": self.reads_eval_labels or eval_shots,
                "transductive": self.transductive or eval_shots, "label_split": self.label_split(shots_split)}

    def check_k(self, k) -> None:
        if self.needs_k and k is None:
            raise UserError(f"strategy '{self.name}' needs K: pass --topk N (a number)")

    def check_data(self, *, select=None, pool=None, eval_=None) -> None:
        """Refuse the first needed input that is missing, with the flag that provides it."""
        given = {SELECTION_LABELS: select, UNLABELLED_IMAGES: pool, EVAL_LABELS: eval_}
        for kind in self.needs:
            if given[kind] is None:
                raise UserError(f"strategy '{self.name}' {_MISSING[kind]}")

    def inputs(self, request, **given) -> StrategyInputs:
        """A :class:`StrategyInputs` holding only the data this strategy declares."""
        reads = self.reads
        for key, kind in (("select", SELECTION_LABELS), ("pool", UNLABELLED_IMAGES), ("eval_", EVAL_LABELS)):
            if kind not in reads:
                given[key] = None
        return StrategyInputs(request, **given)


_REGISTRY: dict[str, Strategy] = {}

#: the options a strategy may read (command-line names: --k-grid, --threshold-c, --beta, --shots, --shots-split)
STRATEGY_OPTIONS = ("k_grid", "threshold_c", "beta", "shots", "shots_split")


def register_strategy(name: str, *, run: Callable | str | None = None, needs=(), uses=(), sigma: bool = False,
                      needs_k: bool = False, compare: int | None = None, shots: bool = False,
                      options=()) -> Strategy:
    """Add a strategy (its name last in the ``--strategy`` choices); returns its entry. A wrong registration
    is a programming error (ValueError)."""
    if name in _REGISTRY:
        raise ValueError(f"strategy {name!r} is already registered")
    needs, uses = tuple(needs), tuple(uses)
    unknown = [kind for kind in needs + uses if kind not in DATA_KINDS]
    if unknown:
        raise ValueError(f"strategy {name!r}: unknown data {unknown} (choose from {DATA_KINDS})")
    if needs_k and compare is not None:
        raise ValueError(f"strategy {name!r} needs K, which --compare does not pass: use compare=None")
    if shots and SELECTION_LABELS not in needs:
        raise ValueError(f"strategy {name!r}: a few-shot strategy needs its shots (SELECTION_LABELS)")
    options = tuple(options) + (("shots", "shots_split") if shots else ())
    if any(option not in STRATEGY_OPTIONS for option in options):
        raise ValueError(f"strategy {name!r}: options must be among {STRATEGY_OPTIONS}, got {options}")
    if run is None:
        raise ValueError(f"strategy {name!r} has no function: pass run=function or run='module:function'")
    entry = Strategy(name, run, needs, uses, bool(sigma), bool(needs_k), compare, bool(shots), options)
    _REGISTRY[name] = entry
    return entry


SHOTS_SPLITS = ("select", "eval")


def check_shots_split(shots_split: str, allow_eval_shots: bool = False) -> None:
    """Refuse few-shot labels taken from the evaluation split unless the user allowed it by name."""
    if shots_split not in SHOTS_SPLITS:
        raise UserError(f"--shots-split must be one of {', '.join(SHOTS_SPLITS)}, got {shots_split!r}")
    if shots_split == "eval" and not allow_eval_shots:
        raise UserError("--shots-split eval takes the few-shot labels from the evaluation split that is then scored "
                        "(ProLIP's --use_gt protocol); pass --allow-eval-shots to run it, and the row is marked")


def get_strategy(name: str) -> Strategy:
    """The entry of ``name``; an unknown name is one :class:`UserError` line with the choices."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UserError(f"unknown strategy {name!r}; choose from {', '.join(_REGISTRY)}")
    return entry


def strategy_names() -> tuple[str, ...]:
    """Every strategy, in registration order (the ``--strategy`` choices)."""
    return tuple(_REGISTRY)


def compare_order() -> tuple[str, ...]:
    """The strategies ``--compare`` runs, by their ``compare`` rank (ties: registration order)."""
    ranked = [entry for entry in _REGISTRY.values() if entry.compare is not None]
    return tuple(entry.name for entry in sorted(ranked, key=lambda entry: entry.compare))


def readers_of(option: str) -> tuple[str, ...]:
    """The strategies that read the option ``option`` (one of :data:`STRATEGY_OPTIONS`)."""
    return tuple(name for name, entry in _REGISTRY.items() if option in entry.options)


# ----------------------------------------------------------------------------- the built-in strategies
# what each does: the table in docs/zeroshot.md; its function: the module named beside it

_SELECTION, _BASELINES, _CARPRT = "zsprob.zeroshot.selection", "zsprob.zeroshot.baselines", "zsprob.zeroshot.carprt"

register_strategy("all", run=f"{_SELECTION}:run_all", compare=10)
register_strategy("single", run=f"{_SELECTION}:run_single", compare=20)
register_strategy("topk", run=f"{_SELECTION}:run_topk", sigma=True, needs_k=True)
register_strategy("global", run=f"{_SELECTION}:run_global", needs=(SELECTION_LABELS,), sigma=True, compare=30,
                  options=("k_grid",))
register_strategy("auto", run=f"{_SELECTION}:run_auto", uses=(SELECTION_LABELS,), sigma=True, compare=40,
                  options=("k_grid", "threshold_c"))
register_strategy("threshold", run=f"{_SELECTION}:run_threshold", sigma=True, compare=50, options=("threshold_c",))
register_strategy("fusion", run=f"{_SELECTION}:run_fusion", sigma=True, compare=60, options=("beta",))
register_strategy("fusion-select", run=f"{_SELECTION}:run_fusion_select", needs=(SELECTION_LABELS,), sigma=True,
                  compare=70)
register_strategy("poe", run=f"{_SELECTION}:run_poe", sigma=True, compare=80)
register_strategy("bprw", run=f"{_BASELINES}:run_bprw", needs=(UNLABELLED_IMAGES,), sigma=True,  # ProLIP "use NN"
                  compare=90)
register_strategy("bprw-fewshot", run=f"{_BASELINES}:run_bprw_fewshot", needs=(SELECTION_LABELS,),  # ProLIP shots
                  sigma=True, compare=95, shots=True)
register_strategy("zpe", run=f"{_BASELINES}:run_zpe", needs=(UNLABELLED_IMAGES,), compare=100)
register_strategy("carprt", run=f"{_CARPRT}:run_carprt", needs=(UNLABELLED_IMAGES,), compare=104)  # class-specific
register_strategy("carprt-shared", run=f"{_CARPRT}:run_carprt_shared", needs=(UNLABELLED_IMAGES,), compare=106)
register_strategy("oracle", run=f"{_SELECTION}:run_oracle", needs=(EVAL_LABELS,), sigma=True, compare=120,
                  options=("k_grid",))
register_strategy("oracle-global", run=f"{_SELECTION}:run_oracle_global", needs=(EVAL_LABELS,), sigma=True,
                  compare=110, options=("k_grid",))
