"""The official-name maps read backwards: tests build official ProLIP / PCME++ files from zsprob models."""
from __future__ import annotations

import torch

from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS
from zsprob.models.convert import prolip


def to_official(state: dict, rules: list) -> dict:
    """zsprob names -> official names by the first rule that maps each key (an unknown key is an error)."""
    out = {}
    for name, value in state.items():
        new = next((new for rule in rules if (new := rule.backward(name)) is not None), None)
        if new is None:
            raise UserError(f"unexpected key {name!r} in the zsprob state dict (no rule of this family maps it)")
        out[new] = value
    return out


def join_unc_rows(state: dict) -> dict:
    """The inverse of :func:`zsprob.models.convert.prolip.split`: each [UNC] row back into its table."""
    out = {}
    for key, value in state.items():
        if key.endswith(prolip.UNC_ROW) and key[:-len(prolip.UNC_ROW)] in prolip.TABLES:
            continue
        row, unc = prolip.TABLES.get(key), state.get(key + prolip.UNC_ROW)
        if row is None or unc is None:
            out[key] = value
            continue
        row = row % (value.shape[0] + 1)
        out[key] = torch.cat([value[:row], unc[None].to(value.dtype), value[row:]])
    return out


def zsprob_to_official(state: dict, kind: str) -> dict:
    """The inverse of :func:`zsprob.models.convert.load.official_to_zsprob`."""
    lay = LAYOUTS[kind]
    official = to_official(state, lay.rules)
    return join_unc_rows(official) if lay.split is prolip.split else official


def branch_of(zsprob_name: str, rules: list) -> str | None:
    """Which part of the model ("mean", "sigma" or "loss") the rule that fills ``zsprob_name`` names."""
    return next((rule.branch for rule in rules if rule.backward(zsprob_name) is not None), None)
