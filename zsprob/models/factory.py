"""create_model: any open_clip model name or zsprob config (+ pretrained weights) -> ProbCLIP.

The weights go into the mean branch *before* the log-variance heads are made, so ``sigma_init="copy"``
copies the pretrained head. A published ProLIP / PCME++ file (:func:`create_from_official`) is built with
its layout's head options and filled strictly. zsprob never downloads.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS
from zsprob.models.configs import (build_open_clip, get_open_clip_config, list_models, model_config,
                                   model_from_config, register_model_configs, resolve_options, wrap)
from zsprob.models.convert.load import load_official
from zsprob.models.convert.swa import select_weights
from zsprob.models.open_clip_dir import read_config
from zsprob.models.sources import Source, identify, resolve_pretrained
from zsprob.models.weights import load_checkpoint_heads, load_checkpoint_tower, load_open_clip_weights


def create_model(name: str, pretrained: str | os.PathLike | None = None, *, embed_dim: int | None = None,
                 sigma_depth: int = 1, sigma_init: str = "random", pooling: str = "gpo",
                 deterministic: bool | None = None, var_bounds=None, cache_dir: str | None = None,
                 seed: int | None = None, **overrides: Any):
    """A :class:`~zsprob.models.prob_clip.ProbCLIP` named ``name`` (open_clip's or the catalogue's).

    ``pretrained``: None, a cached open_clip tag, an open_clip file or directory (the mean branch), a published
    ProLIP / PCME++ file (whole, strictly; ``weights`` picks a COCO trainer file's copy) or a zsprob checkpoint
    (its heads kept where they fit). A pretrained projection of another size than ``embed_dim`` is
    re-initialised. ``overrides``: the head options, ``tokenizer_dir`` and open_clip's (docs/models.md).
    """
    register_model_configs()
    source = identify(pretrained)
    if source.kind == "official":  # a published ProLIP / PCME++ file: converted in memory, strictly
        _check_official_embed_dim(name, source, embed_dim)
        return create_from_official(name, pretrained, source.state, source.layout, var_bounds=var_bounds,
                                    seed=seed, deterministic=deterministic, **overrides)
    ckpt_config = source.meta["config"] if source.kind == "zsprob" else None
    dir_config = read_config(pretrained) if source.kind == "open_clip" else None  # an open_clip model directory
    if ckpt_config:
        base = copy.deepcopy(ckpt_config["open_clip_cfg"])
    else:  # a directory's own model_cfg (open_clip_config.json) is what its weights fit
        base = copy.deepcopy(dir_config["model_cfg"]) if dir_config else get_open_clip_config(name)
    ocfg, options, tokenizer_dir = resolve_options(
        base, overrides, embed_dim, pretrained, checkpoint_config=ckpt_config, sigma_depth=sigma_depth,
        sigma_init=sigma_init, pooling=pooling, deterministic=deterministic, var_bounds=var_bounds)
    ckpt, pcfg = (None, {})
    if source.kind == "open_clip":
        ckpt, pcfg = resolve_pretrained(name, pretrained, cache_dir=cache_dir)
        if pcfg.get("quick_gelu", False) and not ocfg.get("quick_gelu", False):
            ocfg["quick_gelu"] = True  # e.g. OpenAI weights were trained with QuickGELU
    if seed is not None:
        torch.manual_seed(int(seed))

    clip_model = build_open_clip(ocfg)
    reinit, heads = _load_tower(clip_model, source, ckpt)
    config = model_config(name, ocfg, options, tokenizer_dir=tokenizer_dir, pretrained_cfg=pcfg,
                          pretrained=pretrained, reinit=reinit)
    if ckpt_config:
        config["preprocess_cfg"] = copy.deepcopy(ckpt_config.get("preprocess_cfg", config["preprocess_cfg"]))
        config["preprocess_cfg"]["size"] = ocfg["vision_cfg"].get("image_size", 224)
    model = wrap(clip_model, config, options)
    if heads:  # the checkpoint's heads (GPO, log-variance heads) are reused, group by group, where they fit
        load_checkpoint_heads(model, heads, source, sigma_init)
    return model


def create_from_official(name: str, source, state: dict, kind: str, **options: Any):
    """A ProbCLIP built as ``name`` with the options that reproduce the official forward, filled strictly; the
    loss's tensors in ``model.official_loss``, a COCO trainer file's copy in ``config["official_weights"]``."""
    if options.get("deterministic", False) is None:  # None: the file's own
        options.pop("deterministic")
    state, chosen = select_weights(state, kind, options.pop("weights", None), source)
    fixed = LAYOUTS[kind].options_for(state, source)
    clash = sorted(k for k in fixed if k in options and options[k] != fixed[k])
    if clash:
        raise UserError(f"{source} is an official {kind} checkpoint: {', '.join(clash)} must be as it was trained "
                        f"({', '.join(f'{k}={fixed[k]!r}' for k in clash)})")
    options.update(fixed)
    hf_tokenizer = get_open_clip_config(name).get("text_cfg", {}).get("hf_tokenizer_name")
    if hf_tokenizer or options.get("tokenizer_dir"):
        from zsprob.models.hf_tokenizer import find_tokenizer_dir

        options["tokenizer_dir"] = str(find_tokenizer_dir(source, options.get("tokenizer_dir")))
    model = create_model(name, None, **options)
    model.official_loss = load_official(model, state, kind, source)
    model.config.update(pretrained=str(source), official_layout=kind)
    if chosen is not None:
        model.config["official_weights"] = chosen
    return model


def _check_official_embed_dim(name: str, source: Source, embed_dim: int | None) -> None:
    """A published file's architecture is fixed: ``embed_dim`` may only repeat the model's own size."""
    if embed_dim is not None and int(embed_dim) != int(get_open_clip_config(name).get("embed_dim", -1)):
        raise UserError(f"{source.path} is an official {source.layout} checkpoint: its architecture is fixed "
                        "(no embed_dim option)")


def _load_tower(clip_model: torch.nn.Module, source: Source, ckpt) -> tuple[list[str], dict]:
    """Fill the open_clip model from ``ckpt`` or a zsprob checkpoint: (re-initialised projections, head tensors)."""
    if ckpt is not None:
        return load_open_clip_weights(clip_model, ckpt), {}
    if source.kind == "zsprob":
        return load_checkpoint_tower(clip_model, source)
    return [], {}
