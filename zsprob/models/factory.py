"""create_model: any open_clip model name or zsprob config (+ pretrained weights) -> ProbCLIP.

The steps, each in its module: what ``pretrained`` names (:func:`zsprob.models.sources.identify`:
nothing, an open_clip tag / file / directory, a published ProLIP / PCME++ file, a zsprob
checkpoint to fine-tune), the open_clip config and zsprob options
(:func:`zsprob.models.configs.resolve_options`; an open_clip model directory's own
``open_clip_config.json`` gives the config and the preprocessing), the open_clip model, its weights
(:mod:`zsprob.models.weights`: loaded into the mean branch *before* the log-variance heads are
copied, so ``sigma_init="copy"`` copies the pretrained head; projections whose shape differs
from the checkpoint are re-initialised), ``model.config`` (everything needed to rebuild the
model) and the ProbCLIP around it. A published file goes to
:func:`zsprob.models.convert.convert.create_from_official` whole.

What open_clip does: configs, towers, checkpoint reading, tokenizers and transforms (see the
modules above); zsprob never downloads (a pretrained tag must be in the local cache, otherwise
a :class:`zsprob.UserError` names the file to fetch and where to put it). This module is the top
of the model-building side: only :mod:`zsprob.models.builder` and the package import it.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from zsprob.errors import UserError
from zsprob.models.configs import (build_open_clip, get_open_clip_config, list_models, model_config,
                                   model_from_config, register_model_configs, resolve_options, wrap)
from zsprob.models.convert.convert import create_from_official
from zsprob.models.open_clip_dir import read_config
from zsprob.models.sources import Source, identify, resolve_pretrained
from zsprob.models.weights import load_checkpoint_heads, load_checkpoint_tower, load_open_clip_weights


def create_model(name: str, pretrained: str | os.PathLike | None = None, *, embed_dim: int | None = None,
                 sigma_depth: int = 1, sigma_init: str = "random", pooling: str = "gpo",
                 deterministic: bool | None = None, var_bounds=None, cache_dir: str | None = None,
                 seed: int | None = None, **overrides: Any):
    """Build a :class:`~zsprob.models.prob_clip.ProbCLIP`.

    name: an open_clip model name (``open_clip.list_models()``, e.g. ``ViT-B-16``) or a zsprob
        config from configs/models/ (``zsprob-tiny``, ``ViT-S-16-d128``).
    pretrained: None (random init), an open_clip pretrained tag whose weights are in the local
        cache (``openai``, ``laion2b_s34b_b88k``, ...), or a path to an open_clip checkpoint
        (state dict in .pt/.pth/.bin/.safetensors, or a directory holding one). The weights go into
        the mean branch; the log-variance branch follows ``sigma_init``. A published ProLIP or
        PCME++ checkpoint (file or Hugging Face directory, :mod:`zsprob.models.convert`) is
        recognised by its key names and loaded whole and strictly, the head options from its layout
        (a COCO trainer file's SWA or raw copy: option ``weights``, :func:`create_from_official`).
    embed_dim: embedding size D (default: the config's). A pretrained projection of another size
        is re-initialised (and marked ``backbone=False`` in :meth:`param_info`).
    sigma_depth, sigma_init, pooling, deterministic, var_bounds: see :class:`ProbCLIP`; deterministic=None
        is False, or a published file's own (a PCME++ COCO mu-only file: True; a contradicting value: error).
    seed: seeds torch's RNG before building, so random inits are reproducible.
    overrides: zsprob options ``sigma_head`` ("block" | "unc"), ``sigma_layout`` ("official" |
        "legacy"), ``sigma_ln_init`` (None), ``sigma_ln_init_bias`` (0.0) (see
        :mod:`zsprob.models.sigma_heads`), ``sigma_param`` ("logvar" | "logsigma": the head predicts
        log sigma, as PCME's code), ``sigma_shape`` ("diagonal" | "spherical_mean" | "spherical_one",
        Pishdad et al.), ``normalize_mu`` (True), ``gpo_dim`` (32),
        ``sigma_bias_init`` (0.0; -10 with ``sigma_head="unc"``, ProLIP's init_unc_bias),
        ``truncate_text`` (True), ``size_augment`` (0.0; VSE infinity / PCME++ use 0.2 for fine-tuning),
        ``tokenizer_dir`` (a local Hugging Face tokenizer directory, e.g. ProLIP's SigLIP tokenizer),
        ``unc_layout`` ("zsprob" | "prolip"), ``mean_head`` ("proj" | "fc": PCME++'s COCO trainer layout);
        open_clip options ``image_size``, ``context_length``,
        ``quick_gelu``, ``patch_dropout``; or ``open_clip_cfg={...}`` merged into the open_clip
        config (e.g. ``{"vision_cfg": {"layers": 2}}``).
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


def _check_official_embed_dim(name: str, source: Source, embed_dim: int | None) -> None:
    """A published file's architecture is fixed: ``embed_dim`` may only repeat the model's own size
    (e.g. a recipe's D = 1024)."""
    if embed_dim is not None and int(embed_dim) == int(get_open_clip_config(name).get("embed_dim", -1)):
        embed_dim = None  # the model's own size is no change
    if embed_dim is not None:
        raise UserError(f"{source.path} is an official {source.layout} checkpoint: its architecture is fixed "
                        "(no embed_dim option)")


def _load_tower(clip_model: torch.nn.Module, source: Source, ckpt) -> tuple[list[str], dict]:
    """The weights of the wrapped open_clip model: an open_clip file (``ckpt``) or a zsprob
    checkpoint's tower; returns (re-initialised projections, the zsprob checkpoint's head tensors)."""
    if ckpt is not None:
        return load_open_clip_weights(clip_model, ckpt), {}
    if source.kind == "zsprob":
        return load_checkpoint_tower(clip_model, source)
    return [], {}


__all__ = ["create_model", "create_from_official", "list_models", "register_model_configs", "resolve_pretrained",
           "load_open_clip_weights", "model_from_config", "build_open_clip", "get_open_clip_config"]
