"""Official checkpoint in, zsprob model / checkpoint out (``zsprob convert``), strictly.

Steps: read the official file (:mod:`.io`), detect its layout, rename every key with the family's
rules (:mod:`.mapping`; an unknown key is an error), build the zsprob model the weights belong to
(``create_model``, random init), check that the renamed weights fill exactly that model's state
dict plus the loss's tensors, shape for shape, then load them and save with
``zsprob.models.save`` (safetensors + JSON, atomic). The tokenizer directory (ProLIP's SigLIP
tokenizer) is resolved and loaded with :mod:`zsprob.models.hf_tokenizer` so a missing or broken
tokenizer fails here, before anything is written.
"""
from __future__ import annotations

import os
from pathlib import Path

from zsprob.errors import UserError
from zsprob.models.convert import LAYOUTS, check_strict, detect_layout, read_state_dict, to_zsprob
from zsprob.models.convert.io import read_hf_config

# the zsprob model each official layout builds when --model is not given
DEFAULT_MODELS = {"prolip": "prolip-ViT-B-16", "pcmepp-hf": "pcmepp-ViT-B-16", "pcmepp-coco": "pcmepp-coco-ViT-B-32"}
# how each official layout pools tokens: the CLS / EOT (ProLIP: last) token, or GPO over all tokens
POOLING = {"prolip": "native", "pcmepp-hf": "native", "pcmepp-coco": "gpo"}
LOSS_PREFIX = "loss."


def _sigma_depth(kind: str, state: dict) -> int:
    marker = {"pcmepp-hf": "uncertainty_transformer.resblocks.", "pcmepp-coco": "prob_resblocks."}.get(kind)
    if marker is None:
        return 1
    blocks = {k.split(marker, 1)[1].split(".", 1)[0] for k in state if marker in k}
    return max(1, len(blocks))


def convert_checkpoint(source: str | os.PathLike, *, model_name: str | None = None, layout_name: str | None = None,
                       tokenizer: str | os.PathLike | None = None):
    """(ProbCLIP with the official weights, loss tensors, info dict); raises UserError on any mismatch."""
    import torch

    from zsprob.models import create_model

    state = read_state_dict(source)
    kind = layout_name or detect_layout(state)
    if kind not in LAYOUTS:
        raise UserError(f"unknown official layout {kind!r}; choose from {', '.join(LAYOUTS)}")
    rules = LAYOUTS[kind].rules
    converted = to_zsprob(state, rules)
    name = model_name or DEFAULT_MODELS[kind]
    tok_dir = None
    if kind == "prolip" or tokenizer is not None:  # resolved (and loaded by create_model) before anything is built
        from zsprob.models.hf_tokenizer import find_tokenizer_dir

        tok_dir = find_tokenizer_dir(source, tokenizer)
    options = {"tokenizer_dir": str(tok_dir)} if tok_dir is not None else {}
    model = create_model(name, sigma_depth=_sigma_depth(kind, state), pooling=POOLING[kind], **options)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    loss = {k: v for k, v in converted.items() if k.startswith(LOSS_PREFIX)}
    expected.update({k: v.shape for k, v in loss.items()})
    check_strict(converted, expected, rules, str(source))
    model.load_state_dict({k: v for k, v in converted.items() if k not in loss}, strict=True)
    info = {"source": str(source), "layout": kind, "family": LAYOUTS[kind].family, "model": name,
            "official_keys": len(state), "hf_config": read_hf_config(source),
            "tokenizer": None if tok_dir is None else str(tok_dir)}
    return model, {k[len(LOSS_PREFIX):]: v.detach().to(torch.float32) for k, v in loss.items()}, info


def convert_to_checkpoint(source, out, **kw) -> Path:
    """:func:`convert_checkpoint`, then ``zsprob.models.save`` to ``out``; returns the directory."""
    from zsprob.models import save

    model, loss, info = convert_checkpoint(source, **kw)
    return save(model, out, extra={"converted_from": info}, extra_tensors={f"loss.{k}": v for k, v in loss.items()})


__all__ = ["DEFAULT_MODELS", "POOLING", "convert_checkpoint", "convert_to_checkpoint"]
