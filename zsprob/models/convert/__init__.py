"""zsprob.models.convert: published ProLIP / PCME++ checkpoints -> zsprob names, strictly.

One module per family holds its name map as data (:mod:`.prolip`, :mod:`.pcmepp`);
:mod:`.mapping` applies a map in either direction and checks a converted state dict against the
shapes a model expects; :mod:`.io` reads the official files (safetensors, ``weights_only``
PyTorch files, Hugging Face directories, the official COCO trainer's checkpoint dict).
``LAYOUTS`` is the one list of official layouts: name -> (family, rules).

    state = read_state_dict("PCMEPP-ViT-B-16/")                 # official names
    zs = official_to_zsprob(state, "pcmepp-hf")                  # zsprob names; unknown key -> UserError
    check_strict(zs, expected_shapes, LAYOUTS["pcmepp-hf"].rules, "PCMEPP-ViT-B-16/")

:mod:`.swa` picks the SWA or raw copy of a COCO trainer file; :mod:`.load` fills a built model with
them; :mod:`.convert` builds that model (``create_from_official``, which
``create_model(name, pretrained=OFFICIAL)`` calls) and writes a zsprob checkpoint (``zsprob convert``).
Nothing here imports :mod:`zsprob.models.factory`: models are built by :mod:`zsprob.models.configs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from zsprob.errors import UserError
from zsprob.models.convert import pcmepp, prolip
from zsprob.models.convert.io import read_hf_config, read_state_dict, weights_file
from zsprob.models.convert.mapping import Rule, branch_of, check_strict, to_official, to_zsprob


def _same(state: dict) -> dict:
    return dict(state)


@dataclass(frozen=True)
class Layout:
    """``split`` / ``join``: official state <-> one key per zsprob key (ProLIP's positional rows)."""

    family: str
    rules: list
    description: str
    split: Callable[[dict], dict] = _same
    join: Callable[[dict], dict] = _same


LAYOUTS = {
    "prolip": Layout("prolip", prolip.RULES, "ProLIP (naver-ai/prolip) open_clip-style towers with [UNC] tokens",
                     prolip.split, prolip.join),
    "pcmepp-hf": Layout("pcmepp", pcmepp.HF_RULES, "PCME++ hf_models.HfPCMEPPModel (Hugging Face hub ViT-B/16)"),
    "pcmepp-coco": Layout("pcmepp", pcmepp.COCO_RULES, "checkpoint of the official PCME++ COCO trainer (train.py)"),
    "pcmepp-coco-mu": Layout("pcmepp", pcmepp.COCO_MU_RULES, "mu-only checkpoint of the official PCME++ COCO trainer "
                             "(is_probabilistic_model: false; InfoNCE / VSE infinity / PCME++ mu-only baselines)"),
}


def official_to_zsprob(state: dict, kind: str) -> dict:
    """Official names -> zsprob names (the layout's split, then its rules; an unknown key is a UserError)."""
    lay = layout(kind)
    return to_zsprob(lay.split(state), lay.rules)


def zsprob_to_official(state: dict, kind: str) -> dict:
    """The inverse of :func:`official_to_zsprob`."""
    lay = layout(kind)
    return lay.join(to_official(state, lay.rules))


def detect_layout(state: dict) -> str:
    """The official layout a state dict is in, from its key names."""
    if any(k.startswith(("img_enc.", "txt_enc.", "swa_img_enc.", "swa_txt_enc.")) for k in state):
        return pcmepp.coco_layout(state)
    if "visual.unc_embedding" in state or "text.unc_emb" in state:
        return "prolip"
    if "uncertainty_text_projection" in state or "visual.uncertainty_proj" in state:
        return "pcmepp-hf"
    raise UserError("not a ProLIP or PCME++ checkpoint: none of visual.unc_embedding, uncertainty_text_projection, "
                    "img_enc.* found")


def layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise UserError(f"unknown official layout {name!r}; choose from {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


__all__ = ["LAYOUTS", "Layout", "Rule", "layout", "detect_layout", "official_to_zsprob", "zsprob_to_official", "read_state_dict", "read_hf_config",
           "weights_file", "to_zsprob", "to_official", "check_strict", "branch_of"]
