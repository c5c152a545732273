"""Rebuild a model from a checkpoint: :func:`load` (a zsprob checkpoint), :func:`load_for_inference` (the CLI's)
and :func:`convert_to_checkpoint` (a published ProLIP / PCME++ file, strictly: ``zsprob convert``)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS, default_model, detect_layout, require_published_weights
from zsprob.models.checkpoint import checkpoint_dir, is_checkpoint, save, saved_tokenizer
from zsprob.models.configs import model_from_config
from zsprob.models.convert.io import read_hf_config, read_state_dict
from zsprob.models.factory import create_from_official, create_model
from zsprob.models.sources import Source, identify, zsprob_source
from zsprob.models.weights import load_checkpoint


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu", *, verify: bool = True):
    """The ProbCLIP (or jWAE model) saved at ``path`` (its directory or a file in it), strictly; no pickle.
    ``verify`` checks the weights' SHA-256 (reads the file once more)."""
    return _load(zsprob_source(checkpoint_dir(path)), map_location, verify)


def _load(source: Source, map_location: str | torch.device = "cpu", verify: bool = True):
    """:func:`load` of a resolved zsprob checkpoint: the model its config describes, filled strictly."""
    meta = source.meta
    tensors = source.read_tensors(verify)
    config = dict(meta["config"])
    own_tokenizer = saved_tokenizer(checkpoint_dir(source.path), meta)
    if own_tokenizer is not None:  # the copy saved with the weights, not the directory it came from
        config["tokenizer_dir"] = own_tokenizer
    if config.get("kind") == "jwae":  # jWAE autoencoders over a frozen tower
        from zsprob.models.jwae import jwae_from_config
        model = jwae_from_config(config)
    else:
        model = model_from_config(config)
        model.config["tokenizer_dir"] = meta["config"].get("tokenizer_dir")  # its identity (fingerprint) as saved
    load_checkpoint(model, tensors, checkpoint_dir(source.path))
    model.checkpoint_meta = meta
    return model.to(map_location)


def load_for_inference(checkpoint: str | os.PathLike | None = None, model: str | None = None,
                       pretrained: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                       **create_kwargs):
    """A model in eval mode for the CLI: a zsprob ``checkpoint``, or ``model`` with optional ``pretrained``.
    An open_clip model gets native pooling and no sigma heads unless ``create_kwargs`` say otherwise."""
    if checkpoint is not None and model is not None:
        raise UserError("give either a zsprob checkpoint or an open_clip model name, not both")
    zs_file = checkpoint if checkpoint is not None else pretrained if pretrained and is_checkpoint(pretrained) else None
    if create_kwargs.get("weights") is not None and zs_file is not None:
        raise UserError(f"--weights chooses the copy of a PCME++ COCO trainer file given as --pretrained; {zs_file} "
                        "is a zsprob checkpoint, whose copy was chosen when it was converted")
    if checkpoint is not None:
        if pretrained is not None:
            raise UserError("--pretrained applies to --model, not to a zsprob checkpoint")
        m = load(checkpoint)
    elif model is not None:
        m = _model_for_inference(model, pretrained, create_kwargs)
    else:
        raise UserError("no model given: pass a zsprob checkpoint directory or an open_clip model name "
                        "(e.g. --model ViT-B-32 --pretrained openai)")
    if device is not None:
        m = m.to(device)
    return m.eval()


def _model_for_inference(model: str, pretrained, create_kwargs: dict):
    """``--model NAME [--pretrained P]``: P a zsprob checkpoint of NAME, a published file or open_clip weights."""
    require_published_weights(model, pretrained)
    source = identify(pretrained) if pretrained else Source("none")
    if source.kind == "zsprob":
        m = _load(source)
        if m.name != model:
            raise UserError(f"--pretrained {pretrained} is a zsprob checkpoint of {m.name}, not of {model}")
        return m
    if source.kind == "official":
        return create_from_official(model, pretrained, source.state, source.layout, **create_kwargs)
    kw = dict(pooling="native", deterministic=True)
    kw.update(create_kwargs)
    return create_model(model, pretrained=pretrained, **kw)


def convert_to_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *, model_name: str | None = None,
                          layout_name: str | None = None, tokenizer: str | os.PathLike | None = None,
                          weights: str | None = None) -> Path:
    """Save the ProbCLIP with the official weights of ``source`` (and its loss's tensors) to ``out``; returns the
    directory. UserError on any mismatch."""
    state = read_state_dict(source)
    kind = layout_name or detect_layout(state)
    name = model_name or default_model(kind, state)
    options = {"tokenizer_dir": str(tokenizer)} if tokenizer is not None else {}
    if weights is not None:
        options["weights"] = weights
    model = create_from_official(name, source, state, kind, **options)
    info = {"source": str(source), "layout": kind, "family": LAYOUTS[kind].family, "model": name,
            "official_keys": len(state), "hf_config": read_hf_config(source),
            "tokenizer": model.config.get("tokenizer_dir"), "weights": model.config.get("official_weights")}
    loss = {f"loss.{k}": v for k, v in model.official_loss.items()}
    return save(model, out, extra={"converted_from": info}, extra_tensors=loss)
