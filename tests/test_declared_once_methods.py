"""Every training method name (and alias) is declared once in zsprob/: by its register_method call.

The scan reads zsprob/**/*.py as syntax trees (nothing is imported). A declaration of a name is a
``register_*`` call of a method or loss naming it (``register_method("pcmepp", ...)`` and its
``aliases=``), a method or loss decorator carrying it (``@method_loss("pcmepp")``, or applied by hand,
``method_loss("prolip")(ProLIPLoss)``), a store into a method registry by it (``_REGISTRY["pcmepp"] =``),
or a literal list, tuple, set or dict holding every method name (a copied choice list). Uses of a name
(``create_loss("jwae")``, the demo's run names) are not declarations.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from zsprob.prob.method_registry import METHOD_ENTRIES

ROOT = Path(__file__).resolve().parents[1]
METHODS = set(METHOD_ENTRIES)
NAMES = METHODS | {alias for entry in METHOD_ENTRIES.values() for alias in entry.aliases}


def _callee(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _about_methods(callee: str) -> bool:
    return "method" in callee.lower() or "loss" in callee.lower()


def _strings(nodes) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _declared(node: ast.AST) -> list[tuple[str, int]]:
    """The (string, line) pairs ``node`` declares (before keeping only the method names)."""
    if isinstance(node, ast.Call) and _callee(node).startswith("register") and _about_methods(_callee(node)):
        named = _strings(node.args[:1] + [k.value for k in node.keywords if k.arg == "name"])
        for keyword in node.keywords:
            if keyword.arg == "aliases" and isinstance(keyword.value, (ast.Tuple, ast.List)):
                named += _strings(keyword.value.elts)
        return [(name, node.lineno) for name in named]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and _about_methods(_callee(node.func)):
        return [(name, node.lineno) for name in _strings(node.func.args)]  # a decorator applied by hand
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [(name, d.lineno) for d in node.decorator_list if isinstance(d, ast.Call) and _about_methods(_callee(d))
                for name in _strings(d.args)]
    if isinstance(node, ast.Assign):
        return [(name, node.lineno) for t in node.targets if isinstance(t, ast.Subscript)
                and any(word in ast.unparse(t.value).upper() for word in ("REGISTRY", "METHOD"))
                for name in _strings([t.slice])]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
        held = set(_strings(node.keys if isinstance(node, ast.Dict) else node.elts))
        return [(name, node.lineno) for name in sorted(METHODS)] if METHODS <= held else []
    return []


def declarations(sources) -> dict[str, list[str]]:
    """``{name: ["path:line", ...]}`` for every declaration of a method name in ``sources`` ((path, text) pairs)."""
    found = defaultdict(list)
    for path, text in sources:
        for node in ast.walk(ast.parse(text)):
            for name, line in _declared(node):
                if name in NAMES:
                    found[name].append((path, line))
    return {name: [f"{path}:{line}" for path, line in sorted(places)] for name, places in found.items()}


def _package_sources():
    for path in sorted((ROOT / "zsprob").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text()


def test_every_method_name_is_declared_once_by_its_registration():
    found = declarations(_package_sources())
    twice = [f"method {name!r} is declared {len(places)} times: {' and '.join(places)}"
             for name, places in sorted(found.items()) if len(places) > 1]
    assert not twice, "\n".join(twice)
    assert set(found) == NAMES, f"not found as declarations: {sorted(NAMES - set(found))}"
    assert {place.split(":")[0] for places in found.values() for place in places} == {
        "zsprob/prob/method_registry.py"}


def test_the_scan_finds_a_second_declaration_and_names_both_places():
    every = ", ".join(repr(name) for name in sorted(METHODS))
    second = ("@method_loss('pcmepp')\nclass A: pass\n"
              "register_method('vse', method_loss('prolip')(A), needs_sigma=False)\n"
              "_REGISTRY['jwae'] = None\n"
              f"CHOICES = ({every})\n"
              "create_loss('pcme')\nRUNS = {'pcmepp': 1, 'infonce': 2}\n")  # uses, not declarations
    found = declarations(list(_package_sources()) + [("zsprob/x.py", second)])
    assert found["pcmepp"][1:] == ["zsprob/x.py:1", "zsprob/x.py:5"]
    assert found["vse"][1:] == ["zsprob/x.py:3"] and found["prolip"][1:] == ["zsprob/x.py:3", "zsprob/x.py:5"]
    assert found["jwae"][1:] == ["zsprob/x.py:4", "zsprob/x.py:5"]
    assert found["pcme"][1:] == ["zsprob/x.py:5"] and found["pcme"][0].startswith("zsprob/prob/method_registry.py:")
