"""Fill a built ProbCLIP with an official ProLIP / PCME++ state dict, strictly.

``zsprob.models.create_model(name, pretrained=OFFICIAL)`` calls :func:`sniff` (is the file an
official checkpoint, and which layout?), :func:`official_options` (the zsprob head options that
reproduce the official forward) and :func:`load_official`; this module never builds a model, so
the factory can import it. torch's ``load_state_dict(strict=True)`` does the loading; the checks
before it (every official key consumed, every zsprob key filled, shapes equal, one line naming
the key) are :func:`zsprob.models.convert.mapping.check_strict`.

Constant fills: PCME++'s official sigma projection has no bias (HF layout) or its own (the COCO
trainer's biased ``fc``), zsprob's block head always has one more (``image_sigma.bias`` /
``text_sigma.bias``); it is set to 0, which computes the same function. The COCO trainer's files
have no ``logit_scale``; the wrapped open_clip model keeps its own (frozen, unused by zsprob's
losses: ``KEEP_OWN``).

The COCO trainer's mu-only files (layout ``pcmepp-coco-mu``, ``is_probabilistic_model: false``) build a
deterministic model (``deterministic=True``: no log sigma^2 heads, ``logvar`` is None); a COCO file with
some uncertainty modules but not all is neither layout (one line naming what it has and lacks).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.convert import LAYOUTS, check_strict, detect_layout, official_to_zsprob, pcmepp
from zsprob.models.convert.io import TORCH_SUFFIXES, read_state_dict, weights_file

LOSS_PREFIX = "loss."
ZERO_FILLS = {"pcmepp-hf": ("image_sigma.bias", "text_sigma.bias"),
              "pcmepp-coco": ("image_sigma.bias", "text_sigma.bias")}
KEEP_OWN = {"pcmepp-coco": ("clip.logit_scale",), "pcmepp-coco-mu": ("clip.logit_scale",)}


def _sigma_depth(kind: str, state: dict) -> int:
    marker = {"pcmepp-hf": "uncertainty_transformer.resblocks.", "pcmepp-coco": "prob_resblocks."}.get(kind)
    if marker is None:
        return 1
    blocks = {k.split(marker, 1)[1].split(".", 1)[0] for k in state if marker in k}
    return max(1, len(blocks))


def official_options(kind: str, state: dict, source: str | os.PathLike = "checkpoint") -> dict:
    """create_model options under which a zsprob model computes what the official code computes."""
    if kind == "prolip":
        return dict(sigma_head="unc", unc_layout="prolip", pooling="native", sigma_depth=1, deterministic=False)
    if kind == "pcmepp-hf":
        return dict(sigma_head="block", sigma_layout="official", pooling="native",
                    sigma_depth=_sigma_depth(kind, state), sigma_ln_init=None, deterministic=False)
    # pcmepp/models/{img,txt}_encoder.py: fc + GPO on every token of the CLIP trunks (no ln_post, no projections)
    coco = dict(mean_head="fc", pooling="gpo", gpo_dim=32, normalize_mu=True)
    if kind == "pcmepp-coco-mu":  # EncoderClipImageFull / EncoderTextClip: no uncertainty modules
        return dict(coco, deterministic=True)
    if kind == "pcmepp-coco":
        present, absent = pcmepp.coco_sigma_parts(state)
        if absent:
            raise UserError(f"{source}: neither PCME++ COCO layout: it has {', '.join(present)} but no "
                            f"{', '.join(absent)} (a probabilistic trainer file has all four, a mu-only one none)")
        # the std branch: fc + GPO on the uncertainty blocks, a LayerNorm with sigma_ln_init
        with_ln = any(k.startswith(("img_enc.image_std_ln.", "txt_enc.text_std_ln.")) for k in state)
        return dict(coco, sigma_head="block", sigma_layout="official", sigma_init="random", deterministic=False,
                    sigma_depth=_sigma_depth(kind, state), sigma_ln_init=0.01 if with_ln else None)
    raise UserError(f"unknown official layout {kind!r}")


def sniff(path: str | os.PathLike) -> tuple[dict, str] | None:
    """(official state dict, layout) when ``path`` is a ProLIP / PCME++ checkpoint, else None.

    A safetensors file is recognised from its key names alone; a PyTorch file is read
    (``weights_only``); anything unreadable here is left to open_clip's loader.
    """
    try:
        file = weights_file(path)
    except UserError:
        return None
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                keys = dict.fromkeys(f.keys())
            detect_layout(keys)
        except UserError:
            return None
        except Exception:  # noqa: BLE001 - not a safetensors file: the open_clip loader reports it
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
    converted = official_to_zsprob(state, kind)
    own = model.state_dict()
    for key in ZERO_FILLS.get(kind, ()):
        if key in own and key not in converted:
            converted[key] = torch.zeros_like(own[key])
    for key in KEEP_OWN.get(kind, ()):
        if key in own and key not in converted:
            converted[key] = own[key].clone()
    expected = {k: v.shape for k, v in own.items()}
    loss = {k: v for k, v in converted.items() if k.startswith(LOSS_PREFIX)}
    expected.update({k: v.shape for k, v in loss.items()})
    check_strict(converted, expected, LAYOUTS[kind].rules, str(Path(source)))
    model.load_state_dict({k: v for k, v in converted.items() if k not in loss}, strict=True)
    return {k[len(LOSS_PREFIX):]: v.detach().to(torch.float32) for k, v in loss.items()}


__all__ = ["LOSS_PREFIX", "ZERO_FILLS", "KEEP_OWN", "official_options", "sniff", "load_official"]
