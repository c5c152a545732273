"""Name maps between an official state dict and zsprob's, as data, and the strict check.

A family's map is a list of :class:`Rule`: an official key template and the zsprob key it becomes, with
``{i}`` for a block index and ``{rest}`` for a dotted tail; a rule reads both ways, so the strict check
(every official key consumed, every expected key filled, shapes equal) names a key by its official name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from zsprob.errors import UserError

_FIELDS = {"i": r"(?P<i>\d+)", "rest": r"(?P<rest>[A-Za-z0-9_.]+)"}


def _compile(template: str) -> re.Pattern:
    parts = re.split(r"(\{i\}|\{rest\})", template)
    return re.compile("^" + "".join(_FIELDS[p[1:-1]] if p in ("{i}", "{rest}") else re.escape(p)
                                   for p in parts) + "$")


@dataclass(frozen=True)
class Rule:
    """``official`` <-> ``zsprob`` key templates; ``branch`` says which part of the model it fills."""

    official: str
    zsprob: str
    branch: str = "mean"  # "mean", "sigma" or "loss"
    _patterns: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_patterns", (_compile(self.official), _compile(self.zsprob)))

    def forward(self, name: str) -> str | None:
        match = self._patterns[0].match(name)
        return self.zsprob.format(**match.groupdict()) if match else None

    def backward(self, name: str) -> str | None:
        match = self._patterns[1].match(name)
        return self.official.format(**match.groupdict()) if match else None


def to_zsprob(state: Mapping, rules: list[Rule], what: str = "official checkpoint") -> dict:
    """Rename every official key by the first rule that maps it (an unknown key is a UserError naming it)."""
    out: dict = {}
    for name, value in state.items():
        new = next((new for rule in rules if (new := rule.forward(name)) is not None), None)
        if new is None:
            raise UserError(f"unexpected key {name!r} in the {what} (no rule of this family maps it)")
        if new in out:
            raise UserError(f"two {what} keys map onto {new!r} (e.g. {name!r})")
        out[new] = value
    return out


def check_strict(converted: Mapping, expected_shapes: Mapping, rules: list[Rule], source: str) -> None:
    """Every expected key present with its shape, and nothing else; one line naming the first bad key."""
    for name, shape in expected_shapes.items():
        if name not in converted:
            official = next((o for r in rules if (o := r.backward(name)) is not None), None)
            hint = f" (official {official!r})" if official else ""
            raise UserError(f"{source}: missing key for {name!r}{hint}")
        got = tuple(converted[name].shape)
        if got != tuple(shape):
            official = next((o for r in rules if (o := r.backward(name)) is not None), name)
            raise UserError(f"{source}: key {official!r} has shape {got}, the model expects {tuple(shape)} "
                            f"for {name!r}")
    extra = [name for name in converted if name not in expected_shapes]
    if extra:
        official = next((o for r in rules if (o := r.backward(extra[0])) is not None), extra[0])
        raise UserError(f"{source}: key {official!r} ({extra[0]!r}) has no place in the model"
                        f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
