"""Every training config key is declared once: in zsprob/train/defaults.py (``KEYS``), with its default, rule,
doc and flag. A second declaration anywhere in zsprob/ fails here with a message naming both places:

- a ``Key(...)`` of a declared key outside the schema, or the same key twice in ``KEYS``;
- a literal table of keys: a tuple / list / set / dict holding two or more declared dotted keys (``COUNT_KEYS``,
  ``FLAG_OF_KEY``, a frozenset of keys that may change on resume ...), or a nested dict whose paths are three or
  more declared keys (a second ``DEFAULTS``);
- a table written as calls: three or more calls of one function in one scope, each naming a declared key
  (``put("schedule.steps", ...)``, ``put("optim.lr", ...)``, ...);
- a flag-to-key table in text: a string (a docstring) pairing three or more declared flags with their keys;
- a flag string of a training key in the training command line's modules (the click options are derived).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "zsprob/train/defaults.py"
#: the modules of the training commands, where a flag literal would be a second declaration of the flag
TRAIN_CLI = ("zsprob/cli/train_options.py", "zsprob/cli/pretrain.py", "zsprob/cli/finetune.py")
CONTAINERS = (ast.Tuple, ast.List, ast.Set, ast.Dict)
#: second declarations known today in modules outside the training config's area, as (path, key) (this list
#: may only shrink: a new entry fails the test)
KNOWN_ELSEWHERE: set[tuple[str, str]] = set()


def declarations() -> tuple[dict[str, int], dict[str, str], list[str]]:
    """({dotted key: line of its Key(...) in the schema}, {key: its flag}, [keys declared twice in the schema])."""
    tree = ast.parse((ROOT / SCHEMA).read_text(encoding="utf-8"))
    lines: dict[str, int] = {}
    flags: dict[str, str] = {}
    twice = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Key" and node.args:
            name = node.args[0].value
            if name in lines:
                twice.append(name)
            lines.setdefault(name, node.lineno)
            flag = [k.value for k in node.keywords if k.arg == "flag"]
            if flag:
                flags[name] = flag[0].value
    return lines, flags, twice


def _strings(node: ast.AST) -> list[tuple[str, int]]:
    return [(n.value, n.lineno) for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _paths(node: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """The dotted paths of a nested dict literal's string keys (``{"optim": {"lr": 1}}`` -> optim.lr)."""
    out = []
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                out.append((prefix + key.value, key.lineno))
                out += _paths(value, f"{prefix}{key.value}.")
    return out


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside the functions defined in it."""
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
            yield from _own_nodes(child)


def second_declarations(source: str, path: str, keys: dict[str, int], flags: dict[str, str]) -> list[str]:
    """Every second declaration of a key in ``source`` (the module at ``path``), as one message each."""
    dotted = {k for k in keys if "." in k}
    tree = ast.parse(source)
    found: list[str] = []

    def again(key: str, line: int, what: str) -> None:
        found.append(f"config key {key} is declared in {SCHEMA}:{keys[key]} and again in {path}:{line} ({what})")

    def tables(node: ast.AST) -> None:
        if isinstance(node, CONTAINERS):
            named = sorted({(s, line) for s, line in _strings(node) if s in dotted}, key=lambda x: x[1])
            if len({s for s, _ in named}) >= 2:
                again(named[0][0], named[0][1], f"a table of {len({s for s, _ in named})} keys")
                return
            nested = [(path, line) for path, line in _paths(node) if path in dotted]
            if len(nested) >= 3:
                again(nested[0][0], nested[0][1], f"a nested dict of {len(nested)} keys (a DEFAULTS)")
                return
        for child in ast.iter_child_nodes(node):
            tables(child)

    tables(tree)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        calls = defaultdict(list)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Call):
                named = [(a.value, a.lineno) for a in node.args if isinstance(a, ast.Constant) and a.value in keys]
                callee = ast.unparse(node.func)
                if named and callee == "Key":
                    again(named[0][0], named[0][1], "a Key outside the schema")
                elif named:
                    calls[callee].extend(named)
        for callee, named in calls.items():
            if len({s for s, _ in named}) >= 3:
                again(named[0][0], named[0][1], f"{len(named)} calls of {callee} naming keys")
    for text, line in _strings(tree):
        paired = [k for k, flag in flags.items() if re.search(rf"{re.escape(flag)}\b[^\n]*?\s{re.escape(k)}\b", text)]
        if len(paired) >= 3:
            again(paired[0], line, f"a flag-to-key table in text, {len(paired)} rows")
        if path in TRAIN_CLI and text in flags.values():
            key = next(k for k, flag in flags.items() if flag == text)
            again(key, line, f"its flag {text} spelled in the command line")
    return found


def test_every_config_key_is_declared_once():
    keys, flags, twice = declarations()
    assert len(keys) >= 90 and not twice, f"declared twice in {SCHEMA}: {twice}"
    found = []
    for path in sorted((ROOT / "zsprob").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != SCHEMA:
            found += [f for f in second_declarations(path.read_text(encoding="utf-8"), rel, keys, flags)
                      if (rel, f.split()[2]) not in KNOWN_ELSEWHERE]
    assert not found, "\n".join(found)


def test_the_scan_catches_the_tables_the_schema_replaced():
    """The shapes the config had before its schema, each caught and named with both places."""
    keys, flags, _ = declarations()
    old = '''"""The flags::

    --steps N        schedule.steps      --epochs E       schedule.epochs
    --batch-size B   data.batch_size     --lr LR          optim.lr
"""
COUNT_KEYS = (("schedule.steps", "--steps", ">=1", True), ("data.batch_size", "--batch-size", ">=1", True))
FLAG_OF_KEY = {"schedule.steps": "--steps", "optim.lr": "--lr"}
RUNNING_KEYS = frozenset({"schedule.steps", "train.log_every"})


def flag_overrides(kw):
    put("schedule.steps", kw.get("steps"))
    put("data.batch_size", kw.get("batch_size"))
    put("optim.lr", kw.get("lr"))


def declare():
    return Key("optim.lr", 1e-3, "again")


DEFAULTS = {"seed": 0, "optim": {"lr": 5e-4, "eps": 1e-8}, "train": {"tf32": True}}
'''
    found = second_declarations(old, "zsprob/cli/train_options.py", keys, flags)
    whats = " | ".join(found)
    for what in ("a table of 2 keys", "3 calls of put naming keys", "a flag-to-key table in text",
                 "a Key outside the schema", "its flag --steps spelled in the command line", "a nested dict of 3 keys"):
        assert what in whats, (what, found)
    assert sum("a table of" in f for f in found) == 3  # COUNT_KEYS, FLAG_OF_KEY, RUNNING_KEYS
    assert all(f.startswith("config key ") and f" is declared in {SCHEMA}:" in f and
               " and again in zsprob/cli/train_options.py:" in f for f in found), found
