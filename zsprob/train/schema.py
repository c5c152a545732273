"""What a config key is, and how a config is checked against a list of them (no torch, no click).

A :class:`Key` holds everything known about one key (name, default, doc, rule, flag, whether a resume may change
it); the default's type adds the rest. :func:`check` runs every rule, :func:`nest` builds the nested defaults and
:func:`table` the docs' table. The declarations are :data:`zsprob.train.defaults.KEYS`.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from zsprob.errors import UserError, check_range
from zsprob.utils.checks import check_count, rule_text


@dataclass(frozen=True)
class Count:
    """A count: a number ``>=1``, ``>=0`` or ``>0`` (an integer unless ``real``), at most ``most``; null passes
    unless ``null`` is false."""
    rule: str = ">=1"
    real: bool = False
    most: int | None = None
    null: bool = True

    def text(self) -> str:
        kind = "number" if self.real else "integer"
        return f"{kind} {rule_text(self.rule)}" + (f", at most {self.most}" if self.most else "")


@dataclass(frozen=True)
class Range:
    """A finite number in [low, high] (``low_open`` / ``high_open`` exclude an end); for a list, each of its
    numbers. Null is refused unless ``null``; ``message`` (``{name}``, ``{value}``) words a refusal."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    null: bool = False
    message: str | None = None

    def text(self) -> str:
        top = f" and {'<' if self.high_open else '<='} {self.high:g}" if self.high < math.inf else ""
        return f"{'null or ' if self.null else ''}{'>' if self.low_open else '>='} {self.low:g}{top}"


@dataclass(frozen=True)
class OneOf:
    """One of ``choices`` (a tuple, or a function returning one: a registry read when needed); null passes
    when ``null``. ``message`` words a refusal (``{name}``, ``{value}``, ``{choices}``: "a, b or c", ``{listed}``:
    "a, b, c") when the default does not."""
    choices: tuple | Callable[[], Iterable[str]]
    null: bool = False
    message: str = "{name} must be {choices}, got {value!r}"

    def names(self) -> tuple:
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def text(self) -> str:
        return " \\| ".join(self.names()) + (" or null" if self.null else "")


#: the default of a key inside a section whose defaults come from elsewhere (a loss option)
INHERITED = object()


@dataclass(frozen=True)
class Key:
    """One config key. ``flag``: its command-line flag (``--steps``); ``free``: the section's keys at that depth
    and below take any keys (``loss``: 1, each method's options); ``routine``: how a run is carried out, not
    what it learns (another value on ``--resume`` is no change)."""
    name: str
    default: Any
    doc: str
    rule: Count | Range | OneOf | None = None
    flag: str | None = None
    free: int | None = None
    routine: bool = False

    def shown(self) -> str:
        """The key as a message names it: ``--steps (schedule.steps)`` when it has a flag."""
        return f"{self.flag_name()} ({self.name})" if self.flag else self.name

    def flag_name(self) -> str:
        return f"{self.flag} / --no-{self.flag[2:]}" if isinstance(self.default, bool) else str(self.flag)


def nest(keys: Iterable[Key]) -> dict:
    """The nested defaults of ``keys`` (in their order; keys with an inherited default add nothing)."""
    out: dict = {}
    for key in keys:
        if key.default is INHERITED:
            continue
        *sections, last = key.name.split(".")
        node = out
        for part in sections:
            node = node.setdefault(part, {})
        node[last] = key.default
    return out


def get(cfg: Any, dotted: str) -> Any:
    """The value at ``dotted`` in a nested config, or None."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def check(cfg: Any, keys: tuple[Key, ...], defaults: Mapping, exclusive: Iterable[tuple[str, str, str]] = ()) -> None:
    """Every rule of ``keys`` over ``cfg``, the first mistake as one :class:`UserError` line: no unknown key (each
    section a mapping), then each key in declaration order, then the ``(key, other, why)`` pairs that exclude
    each other. Numbers given as strings that spell them (YAML reads ``2e-3`` as one) are stored as floats."""
    free = {k.name: k.free for k in keys if k.free is not None}
    _known(cfg, defaults, free, "")
    for key in keys:
        *sections, last = key.name.split(".")
        node = get(cfg, ".".join(sections)) if sections else cfg
        if isinstance(node, Mapping) and last in node and key.default is not INHERITED:
            node[last] = _checked(key, node[last])
            if key.free is not None and isinstance(key.default, Mapping):
                _typed(node[last], key.default, f"{key.name}.")
    for key, other, why in exclusive:
        first, second = get(cfg, key), get(cfg, other)
        if first is not None and second is not None:
            raise UserError(f"{key} ({first}) and {other} ({second}) are both set: drop one ({why})")


def _known(cfg: Mapping, defaults: Mapping, free: dict, prefix: str, depth: int | None = None) -> None:
    """No key outside ``defaults`` (the nearest known one named), every section a mapping; below a key of
    ``free`` (name -> depth) the sections at that depth take any keys."""
    for name, value in cfg.items():
        dotted = f"{prefix}{name}"
        if name not in defaults:
            near = difflib.get_close_matches(str(name), [str(k) for k in defaults], n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else \
                f"known keys here: {', '.join(map(str, defaults)) or 'none'}"
            raise UserError(f"unknown config key {dotted} ({hint})")
        default = defaults[name]
        if isinstance(default, Mapping) and not isinstance(value, Mapping):  # `optim: null`, `model.overrides=5`
            raise UserError(f"{dotted} must be a section of keys (a mapping, as in the defaults), got {value!r}")
        below = free.get(dotted, None if depth is None else depth - 1)
        if isinstance(default, Mapping) and default and (below is None or below > 0):
            _known(value, default, free, f"{dotted}.", below)


def _checked(key: Key, value: Any) -> Any:
    """``value`` of ``key`` checked by its rule and its default's type; numbers spelled as strings made floats."""
    rule, name = key.rule, key.name
    if isinstance(rule, Count) and value is None and not rule.null:
        raise UserError(f"{key.shown()} must be {'a number' if rule.real else 'an integer'} {rule_text(rule.rule)}, "
                        "got None")
    if isinstance(rule, Count):
        counted = check_count(value, key.shown(), rule.rule, not rule.real)
        if rule.most and counted is not None and counted > rule.most:
            raise UserError(f"{key.shown()} must be at most {rule.most}, got {value!r}")
    value = _typed_value(name, value, key.default)
    if isinstance(rule, Range):
        value = _in_range(name, value, rule)
    if isinstance(rule, OneOf) and not (rule.null and value is None) and value not in rule.names():
        names = rule.names()
        choices = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        raise UserError(rule.message.format(name=name, value=value, choices=choices, listed=", ".join(names)))
    return value


def _typed(section: Mapping, defaults: Mapping, prefix: str) -> None:
    """The type checks of :func:`_typed_value` over a section of free keys, by the defaults it has."""
    for name, default in defaults.items():
        if name in section:
            section[name] = _typed_value(f"{prefix}{name}", section[name], default)
            if isinstance(default, Mapping) and isinstance(section[name], Mapping):
                _typed(section[name], default, f"{prefix}{name}.")


def _typed_value(name: str, value: Any, default: Any) -> Any:
    """A true / false default takes YAML booleans only (``bool("maybe")`` would be true); a float default a
    finite number or null; a list of numbers as many finite numbers."""
    if isinstance(default, bool) and not isinstance(value, bool):
        raise UserError(f"{name} must be true or false, got {value!r}")
    if value is None:
        return value
    if isinstance(default, float):
        number = _as_float(value)
        if not (_is_number(number) and math.isfinite(number)):
            raise UserError(f"{name} must be a finite number, got {value!r}")
        return number
    if isinstance(default, list) and default and all(_is_number(v) for v in default):
        items = [_as_float(v) for v in value] if isinstance(value, (list, tuple)) else None
        if not (items is not None and len(items) == len(default) and all(_is_number(v) and math.isfinite(v)
                                                                          for v in items)):
            raise UserError(f"{name} must be a list of {len(default)} finite numbers like {default}, got {value!r}")
        return items
    return value


def _in_range(name: str, value: Any, rule: Range) -> Any:
    """``value`` as a float in ``rule``'s range (each number of a list); null only when the rule allows it."""
    if value is None and rule.null:
        return value
    many = isinstance(value, list) and not rule.null
    items = value if many and value else [value]
    try:
        checked = [check_range("not a number" if isinstance(v, (bool, list, dict)) or v is None else v,
                               name, rule.low, rule.high, rule.low_open) for v in items]
        if rule.high_open and any(v >= rule.high for v in checked):
            raise UserError(name)
    except UserError:
        if rule.message:
            raise UserError(rule.message.format(name=name, value=value)) from None
        raise UserError(f"{name} must be {'null or ' if rule.null else ''}{'numbers' if many else 'a number'} "
                        f"{Range(rule.low, rule.high, rule.low_open, rule.high_open).text()}, got {value!r}") from None
    return checked if many and value else checked[0]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_float(x: Any) -> Any:
    """``x`` as a float when it is a string that spells a number (YAML reads ``2e-3`` as a string); else ``x``."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def table(keys: Iterable[Key]) -> str:
    """The docs' table of keys (docs/training.md): key, default, flag, rule, what it does."""
    def cell(value: Any) -> str:
        if value is INHERITED:
            return "its loss's"
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        return f"`{text}`" if not isinstance(value, Mapping) else "(each method's defaults)" if value else "`{}`"
    rows = ["| key | default | flag | rule | what |", "|---|---|---|---|---|"]
    for key in keys:
        rule = key.rule.text() if key.rule else ""
        flag = f"`{key.flag_name()}`" if key.flag else ""
        rows.append(f"| `{key.name}` | {cell(key.default)} | {flag} | {rule} | {key.doc.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"
