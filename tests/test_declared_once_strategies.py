"""Every strategy name and every zero-shot command-line choice list is declared once in zsprob/.

A declaration is a registration call (``register_strategy("name", ...)``) or a literal list, tuple or set
(for strategy names also a dict's keys: a per-name table) that is assigned to a name or passed to a call
(``click.Choice([...])``); a membership test (``x in ("a", "b")``) declares nothing. A second declaration
fails, naming both places."""
from __future__ import annotations

import ast
from pathlib import Path

from zsprob.zeroshot.options import COMPARE_FILES, DATASET_KINDS, SCORES, TOPK_WORDS
from zsprob.zeroshot.strategy_registry import SHOTS_SPLITS, strategy_names

PACKAGE = Path(__file__).resolve().parents[1] / "zsprob"
#: calls that declare a strategy by its name (the registry's, and the attach-by-name decorator it replaced)
DECLARING_CALLS = {"register_strategy", "strategy_runner"}
#: a literal holding this many strategy names is a parallel list of them
PARALLEL_LIST = 4


def _nodes():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            yield f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}", node


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _strings(node) -> tuple[str, ...] | None:
    """The strings of a literal collection (a dict: its keys) when every element is a string."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items:
        return None
    if all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in items):
        return tuple(item.value for item in items)
    return None


def _declared_literals(dicts: bool = True):
    """(place, strings) of every literal collection (``dicts``: also a dict's keys) assigned or passed to a call."""
    for place, node in _nodes():
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = [node.value]
        elif isinstance(node, ast.Call):
            values = list(node.args) + [keyword.value for keyword in node.keywords]
        else:
            continue
        for value in values:
            strings = None if isinstance(value, ast.Dict) and not dicts else _strings(value)
            if strings:
                yield place, strings


def test_every_strategy_name_is_declared_once():
    first: dict[str, str] = {}
    for place, node in _nodes():
        if isinstance(node, ast.Call) and _callee(node) in DECLARING_CALLS and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            assert name not in first, f"strategy {name!r} is declared at {first[name]} and again at {place}"
            first[name] = place
    assert set(first) == set(strategy_names()), "every built-in strategy is declared by one registration call"
    registry = sorted(set(place.rsplit(":", 1)[0] for place in first.values()))
    assert registry == ["zsprob/zeroshot/strategy_registry.py"], registry
    names = set(strategy_names())
    for place, strings in _declared_literals():
        shared = sorted(names & set(strings))
        assert len(shared) < PARALLEL_LIST, (f"strategy names {shared} are declared at {registry[0]} and again "
                                             f"as a list at {place}: read strategy_names() or the entries' facts")


def test_every_zero_shot_choice_list_is_declared_once():
    choices = {"DATASET_KINDS": DATASET_KINDS, "SCORES": SCORES, "SHOTS_SPLITS": SHOTS_SPLITS,
               "COMPARE_FILES": COMPARE_FILES, "TOPK_WORDS": TOPK_WORDS}
    for label, values in choices.items():
        places = [place for place, strings in _declared_literals(dicts=False) if set(strings) == set(values)]
        assert places, f"{label} is not declared as a literal anywhere in zsprob/"
        assert len(places) == 1, \
            f"{label} {tuple(values)} is declared at {places[0]} and again at {', '.join(places[1:])}"
