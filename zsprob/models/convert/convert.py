"""Official checkpoint in, zsprob model / checkpoint out (``zsprob convert``), strictly.

:func:`create_from_official` (also what ``create_model(name, pretrained=OFFICIAL)`` calls) picks a COCO
trainer file's copy (:mod:`.swa`), builds the model with the layout's head options and fills it
strictly (:mod:`.load`); the saved checkpoint carries the loss's official tensors as extra tensors.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zsprob.errors import UserError
from zsprob.models.catalogue import default_model, detect_layout, layout
from zsprob.models.configs import fresh_model, get_open_clip_config
from zsprob.models.convert.io import read_hf_config, read_state_dict
from zsprob.models.convert.load import load_official
from zsprob.models.convert.swa import select_weights


def create_from_official(name: str, source, state: dict, kind: str, **options: Any):
    """A ProbCLIP built as ``name`` with the options that reproduce the official forward, filled strictly; the
    loss's tensors in ``model.official_loss``, a COCO trainer file's copy in ``config["official_weights"]``."""
    if options.get("deterministic", False) is None:  # None: the file's own
        options.pop("deterministic")
    state, chosen = select_weights(state, kind, options.pop("weights", None), source)
    fixed = layout(kind).options_for(state, source)
    clash = sorted(k for k in fixed if k in options and options[k] != fixed[k])
    if clash:
        raise UserError(f"{source} is an official {kind} checkpoint: {', '.join(clash)} must be as it was trained "
                        f"({', '.join(f'{k}={fixed[k]!r}' for k in clash)})")
    options.update(fixed)
    hf_tokenizer = get_open_clip_config(name).get("text_cfg", {}).get("hf_tokenizer_name")
    if hf_tokenizer or options.get("tokenizer_dir"):
        from zsprob.models.hf_tokenizer import find_tokenizer_dir

        options["tokenizer_dir"] = str(find_tokenizer_dir(source, options.get("tokenizer_dir")))
    model = fresh_model(name, **options)
    model.official_loss = load_official(model, state, kind, source)
    model.config.update(pretrained=str(source), official_layout=kind)
    if chosen is not None:
        model.config["official_weights"] = chosen
    return model


def convert_checkpoint(source: str | os.PathLike, *, model_name: str | None = None, layout_name: str | None = None,
                       tokenizer: str | os.PathLike | None = None, weights: str | None = None):
    """(ProbCLIP with the official weights, loss tensors, info dict); UserError on any mismatch."""
    state = read_state_dict(source)
    kind = layout_name or detect_layout(state)
    family = layout(kind).family
    name = model_name or default_model(kind, state)
    options = {"tokenizer_dir": str(tokenizer)} if tokenizer is not None else {}
    if weights is not None:
        options["weights"] = weights
    model = create_from_official(name, source, state, kind, **options)
    info = {"source": str(source), "layout": kind, "family": family, "model": name,
            "official_keys": len(state), "hf_config": read_hf_config(source),
            "tokenizer": model.config.get("tokenizer_dir"), "weights": model.config.get("official_weights")}
    return model, model.official_loss, info


def convert_to_checkpoint(source, out, **kw) -> Path:
    """:func:`convert_checkpoint`, then ``zsprob.models.save`` to ``out``; returns the directory."""
    from zsprob.models.checkpoint import save

    model, loss, info = convert_checkpoint(source, **kw)
    return save(model, out, extra={"converted_from": info}, extra_tensors={f"loss.{k}": v for k, v in loss.items()})
