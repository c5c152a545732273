"""Recognise an official ProLIP / PCME++ file (:func:`sniff`) and fill a built ProbCLIP with it, strictly.

This module never builds a model, so the factory can import it. The model tensors a layout lacks are
filled as its catalogue entry says (a bias of 0 where the official head has none: the same function;
the COCO trainer's missing ``logit_scale`` kept as built, unused by zsprob's losses).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS, detect_layout
from zsprob.models.convert.io import TORCH_SUFFIXES, read_state_dict, weights_file
from zsprob.models.convert.mapping import check_strict, to_zsprob

LOSS_PREFIX = "loss."


def official_to_zsprob(state: dict, kind: str) -> dict:
    """Official names -> zsprob names (the layout's split, then its rules; an unknown key is a UserError)."""
    lay = LAYOUTS[kind]
    return to_zsprob(lay.split(state), lay.rules)


def sniff(path: str | os.PathLike) -> tuple[dict, str] | None:
    """(official state dict, layout) when ``path`` is a ProLIP / PCME++ checkpoint, else None (a safetensors
    file is recognised by its key names before it is read; anything unreadable is left to open_clip)."""
    try:
        file = weights_file(path)
    except UserError:
        return None
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                detect_layout(dict.fromkeys(f.keys()))
        except Exception:  # noqa: BLE001 - not official, or not a safetensors file: the open_clip loader reports it
            return None
    elif file.suffix not in TORCH_SUFFIXES:
        return None
    try:
        state = read_state_dict(path)
        return state, detect_layout(state)
    except UserError:
        return None


def load_official(model, state: dict, kind: str, source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load ``state`` (official names, layout ``kind``) into ``model`` strictly; returns the loss's tensors."""
    lay = LAYOUTS[kind]
    converted = official_to_zsprob(state, kind)
    own = model.state_dict()
    for key in lay.zero_fills:
        if key in own and key not in converted:
            converted[key] = torch.zeros_like(own[key])
    for key in lay.keep_own:
        if key in own and key not in converted:
            converted[key] = own[key].clone()
    expected = {k: v.shape for k, v in own.items()}
    loss = {k: v for k, v in converted.items() if k.startswith(LOSS_PREFIX)}
    expected.update({k: v.shape for k, v in loss.items()})
    check_strict(converted, expected, lay.rules, str(Path(source)))
    model.load_state_dict({k: v for k, v in converted.items() if k not in loss}, strict=True)
    return {k[len(LOSS_PREFIX):]: v.detach().to(torch.float32) for k, v in loss.items()}
