"""zsprob.models.convert: published ProLIP / PCME++ checkpoints -> zsprob names, strictly.

One module per family holds its name map as data (:mod:`.prolip`, :mod:`.pcmepp`);
:mod:`.mapping` applies a map in either direction and checks a converted state dict against the
shapes a model expects; :mod:`.io` reads the official files (safetensors, ``weights_only``
PyTorch files, Hugging Face directories, the official COCO trainer's checkpoint dict).
``LAYOUTS`` is the one list of official layouts: name -> (family, rules).

    state = read_state_dict("PCMEPP-ViT-B-16/")                 # official names
    zs = to_zsprob(state, LAYOUTS["pcmepp-hf"].rules)            # zsprob names; unknown key -> UserError
    check_strict(zs, expected_shapes, LAYOUTS["pcmepp-hf"].rules, "PCMEPP-ViT-B-16/")
"""
from __future__ import annotations

from dataclasses import dataclass

from zsprob.errors import UserError
from zsprob.models.convert import pcmepp, prolip
from zsprob.models.convert.io import read_hf_config, read_state_dict, weights_file
from zsprob.models.convert.mapping import Rule, branch_of, check_strict, to_official, to_zsprob


@dataclass(frozen=True)
class Layout:
    family: str
    rules: list
    description: str


LAYOUTS = {
    "prolip": Layout("prolip", prolip.RULES, "ProLIP (naver-ai/prolip) open_clip-style towers with [UNC] tokens"),
    "pcmepp-hf": Layout("pcmepp", pcmepp.HF_RULES, "PCME++ hf_models.HfPCMEPPModel (Hugging Face hub ViT-B/16)"),
    "pcmepp-coco": Layout("pcmepp", pcmepp.COCO_RULES, "checkpoint of the official PCME++ COCO trainer (train.py)"),
}


def detect_layout(state: dict) -> str:
    """The official layout a state dict is in, from its key names."""
    if any(k.startswith(("img_enc.", "txt_enc.")) for k in state):
        return "pcmepp-coco"
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


__all__ = ["LAYOUTS", "Layout", "Rule", "layout", "detect_layout", "read_state_dict", "read_hf_config",
           "weights_file", "to_zsprob", "to_official", "check_strict", "branch_of"]
