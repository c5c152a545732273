"""The prompt-selection strategies: one registry entry per name, carrying every fact a caller reads.

An entry (:class:`Strategy`) says which data the strategy reads (the labelled selection split, the
unlabelled evaluation images, the evaluation labels; which of them it cannot run without), whether it
ranks or weights prompts by sigma^2, whether it needs a K, where it stands in ``--compare`` and which
function runs it. Everyone reads the entries instead of keeping a list:
:func:`zsprob.zeroshot.selection.run_strategy` dispatches through them, :mod:`zsprob.zeroshot.classify`
reads what to encode and the ``--compare`` order, :mod:`zsprob.zeroshot.options` the K rule, and the
command line's ``--strategy`` choices are :func:`strategy_names` (through ``zsprob.methods.STRATEGIES``).

A strategy defined anywhere registers its function and its facts in one call, timm-style::

    register_strategy("mine", run=my_selection, needs=(SELECTION_LABELS,), sigma=True, compare=45)

``run(bank, given)`` gets the prompt bank and a :class:`StrategyInputs` holding only the data the
entry declares (a strategy that does not declare the evaluation labels never receives them) and
returns a :class:`~zsprob.zeroshot.selection.Selection`. The built-in strategies are declared below
without torch, so the command line lists and checks names instantly; their functions sit beside the
tensor math in :mod:`zsprob.zeroshot.selection` and attach themselves by name (:func:`strategy_runner`).
Plain Python; imports only zsprob.errors.
"""
from __future__ import annotations

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
    """What a strategy's function receives besides the bank (data it did not declare is ``None``).

    ``select`` / ``eval_``: ``(feats, labels)``; ``pool``: unlabelled image features; ``k``: the
    top-K of ``topk``; ``k_values``: the K grid of the searches; ``threshold_c``: the ``threshold``
    rule's c; ``beta``: fusion's exponent; ``template``: ``single``'s template; ``select_data`` /
    ``pool_data``: how the data is described in the selection's ``info``.
    """

    k: int | None = None
    select: Any = None
    pool: Any = None
    eval_: Any = None
    k_values: Any = None
    threshold_c: float = 1.0
    beta: float = 1.0
    template: str | None = None
    select_data: str = "selection split"
    pool_data: str = "unlabelled images"
    shots: int | None = None
    shots_split: str = "select"


@dataclass
class Strategy:
    """One strategy's facts and function.

    ``needs``: data it cannot run without; ``uses``: data it reads when given (``auto`` falls back to
    a label-free rule without a selection split); ``sigma``: ranks or weights prompts by sigma^2;
    ``needs_k``: takes a K from the user (``--topk N``); ``compare``: its rank in ``--compare``
    (smaller first), ``None`` to leave it out; ``run``: ``run(bank, StrategyInputs) -> Selection``;
    ``shots``: a few-shot strategy whose labelled images (``needs`` SELECTION_LABELS) come from the
    split the user names (``--shots-split``; the evaluation split only with ``--allow-eval-shots``);
    ``options``: the options of :data:`STRATEGY_OPTIONS` it reads (the command line refuses one given to a
    strategy that would ignore it); a few-shot strategy reads ``shots`` / ``shots_split`` by that fact.
    """

    name: str
    needs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    sigma: bool = False
    needs_k: bool = False
    compare: int | None = None
    run: Callable | None = None
    shots: bool = False
    options: tuple[str, ...] = ()

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

    def audit(self, shots_split: str = "select") -> dict:
        """The protocol facts of one run: evaluation labels read, transductive, which split's labels."""
        eval_shots = self.shots and shots_split == "eval"   # the shots are evaluation images, with labels
        return {"reads_eval_labels": self.reads_eval_labels or eval_shots,
                "transductive": self.transductive or eval_shots, "label_split": self.label_split(shots_split)}

    def check_k(self, k) -> None:
        """The one "needs K" rule: a strategy with ``needs_k`` refuses a missing K."""
        if self.needs_k and k is None:
            raise UserError(f"strategy '{self.name}' needs K: pass --topk N (a number)")

    def check_data(self, *, select=None, pool=None, eval_=None) -> None:
        """Refuse the first needed input that is missing, with the flag that provides it."""
        given = {SELECTION_LABELS: select, UNLABELLED_IMAGES: pool, EVAL_LABELS: eval_}
        for kind in self.needs:
            if given[kind] is None:
                raise UserError(f"strategy '{self.name}' {_MISSING[kind]}")

    def inputs(self, **given) -> StrategyInputs:
        """A :class:`StrategyInputs` holding only the data this strategy declares."""
        reads = self.reads
        for key, kind in (("select", SELECTION_LABELS), ("pool", UNLABELLED_IMAGES), ("eval_", EVAL_LABELS)):
            if kind not in reads:
                given[key] = None
        return StrategyInputs(**given)


_REGISTRY: dict[str, Strategy] = {}

#: the options a strategy may read: the K grid of the searches, the threshold rule's c, fusion's beta and
#: the few-shot strategies' shots (the ``StrategyInputs`` fields ``k_values``, ``threshold_c``, ``beta``,
#: ``shots``, ``shots_split``; on the command line --k-grid, --threshold-c, --beta, --shots, --shots-split)
STRATEGY_OPTIONS = ("k_grid", "threshold_c", "beta", "shots", "shots_split")


def register_strategy(name: str, *, run: Callable | None = None, needs=(), uses=(), sigma: bool = False,
                      needs_k: bool = False, compare: int | None = None, shots: bool = False,
                      options=()) -> Strategy:
    """Add a strategy (its name last in the ``--strategy`` choices); returns its entry.

    ``run`` may be attached later by :func:`strategy_runner` (the built-ins do so from
    :mod:`zsprob.zeroshot.selection`). A name already registered, an unknown kind of data or a
    strategy that needs K in ``--compare`` (which passes none) is a programming error (ValueError).
    """
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
    entry = Strategy(name, needs, uses, bool(sigma), bool(needs_k), compare, run, bool(shots), options)
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


def shots_source(entry: Strategy, shots_split: str, select, eval_):
    """What a strategy's ``select`` input holds: the named split's (feats, labels) for a few-shot strategy."""
    if entry.shots and shots_split == "eval":
        return eval_
    return select


def strategy_runner(name: str):
    """Decorator: ``fn`` runs the registered strategy ``name`` (``fn(bank, StrategyInputs)``)."""
    def attach(fn):
        entry = _REGISTRY.get(name)
        if entry is None:
            raise ValueError(f"strategy {name!r} is not registered")
        entry.run = fn
        return fn
    return attach


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


def sigma_strategies() -> tuple[str, ...]:
    """The strategies that rank or weight prompts by sigma^2 (refused for a deterministic model)."""
    return tuple(name for name, entry in _REGISTRY.items() if entry.sigma)


def readers_of(option: str) -> tuple[str, ...]:
    """The strategies that read the option ``option`` (one of :data:`STRATEGY_OPTIONS`)."""
    return tuple(name for name, entry in _REGISTRY.items() if option in entry.options)


def strategies_without_runner() -> list[str]:
    return [name for name, entry in _REGISTRY.items() if entry.run is None]


def __getattr__(name):  # the old constant names, read live from the registry
    views = {"STRATEGIES": strategy_names, "COMPARE_ORDER": compare_order, "SIGMA_STRATEGIES": sigma_strategies}
    if name in views:
        return views[name]()
    raise AttributeError(name)


# ----------------------------------------------------------------------------- the built-in strategies
# (the table in zsprob.zeroshot.selection's docstring says what each does; the functions are there)

register_strategy("all", compare=10)
register_strategy("single", compare=20)
register_strategy("topk", sigma=True, needs_k=True)
register_strategy("global", needs=(SELECTION_LABELS,), sigma=True, compare=30, options=("k_grid",))
register_strategy("auto", uses=(SELECTION_LABELS,), sigma=True, compare=40, options=("k_grid", "threshold_c"))
register_strategy("threshold", sigma=True, compare=50, options=("threshold_c",))
register_strategy("fusion", sigma=True, compare=60, options=("beta",))
register_strategy("fusion-select", needs=(SELECTION_LABELS,), sigma=True, compare=70)
register_strategy("poe", sigma=True, compare=80)
register_strategy("bprw", needs=(UNLABELLED_IMAGES,), sigma=True, compare=90)               # ProLIP "use NN"
register_strategy("bprw-fewshot", needs=(SELECTION_LABELS,), sigma=True, compare=95, shots=True)  # ProLIP shots
register_strategy("zpe", needs=(UNLABELLED_IMAGES,), compare=100)
register_strategy("carprt", needs=(UNLABELLED_IMAGES,), compare=104)          # CARPRT, class-specific weights
register_strategy("carprt-shared", needs=(UNLABELLED_IMAGES,), compare=106)   # its class-shared counterpart

register_strategy("oracle", needs=(EVAL_LABELS,), sigma=True, compare=120, options=("k_grid",))
register_strategy("oracle-global", needs=(EVAL_LABELS,), sigma=True, compare=110, options=("k_grid",))
