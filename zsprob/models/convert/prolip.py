"""ProLIP (naver-ai/prolip, ``prolip.model.ProLIP``) official state-dict names <-> zsprob names.

ProLIP's towers are open_clip's ViT and TextTransformer with one extra learned [UNC] token each
(``visual.unc_embedding``, ``text.unc_emb``) whose output goes through its own projection
(``visual.uncertainty_proj``, ``text.text_uncertainty_projection``) to log sigma^2. The mean
branch keeps open_clip's names under ``clip.``; the [UNC] parameters map onto the
``image_sigma`` / ``text_sigma`` :class:`zsprob.models.sigma_heads.UncTokenHead` that
``sigma_head: "unc"`` builds.

The positional tables are one row longer than open_clip's, for the [UNC] token: the image
table is [CLS, UNC, patches...], the text table [tokens..., UNC, CLS]. :func:`split` cuts the
[UNC] row out into its own entry (named ``<table>[unc]``), :func:`join` puts it back, so the
renaming rules below stay one key to one key.
"""
from __future__ import annotations

import torch

from zsprob.models.convert.mapping import Rule

FAMILY = "prolip"
MODELS = ("prolip-ViT-B-16", "prolip-ViT-B-16-long", "prolip-ViT-L-16", "prolip-ViT-H-14", "prolip-ViT-SO400M-14")
UNC_ROW = "[unc]"  # suffix of the split-off [UNC] row of a positional table
# table -> index of its [UNC] row: image row 1 (after CLS), text the second-to-last row (before CLS)
TABLES = {"visual.positional_embedding": 1, "text.positional_embedding": -2}

RULES = [
    # uncertainty: the [UNC] tokens, their positions and their projections
    Rule("visual.positional_embedding" + UNC_ROW, "image_sigma.unc_pos_embedding", "sigma"),
    Rule("text.positional_embedding" + UNC_ROW, "text_sigma.unc_pos_embedding", "sigma"),
    Rule("visual.unc_embedding", "image_sigma.unc_embedding", "sigma"),
    Rule("visual.uncertainty_proj.{rest}", "image_sigma.uncertainty_proj.{rest}", "sigma"),
    Rule("text.unc_emb", "text_sigma.unc_emb", "sigma"),
    Rule("text.text_uncertainty_projection.{rest}", "text_sigma.text_uncertainty_projection.{rest}", "sigma"),
    # mean: open_clip CustomTextCLIP names (visual.*, text.*, logit scale and SigLIP bias)
    Rule("logit_scale", "clip.logit_scale"),
    Rule("logit_bias", "clip.logit_bias"),
    Rule("visual.{rest}", "clip.visual.{rest}"),
    Rule("text.{rest}", "clip.text.{rest}"),
]


def split(state: dict) -> dict:
    """Official state -> the same with each positional table's [UNC] row as its own ``<table>[unc]`` entry."""
    out = {}
    for key, value in state.items():
        row = TABLES.get(key)
        if row is None or value.ndim != 2 or value.shape[0] < 3:
            out[key] = value
            continue
        row = row % value.shape[0]
        out[key] = torch.cat([value[:row], value[row + 1:]])
        out[key + UNC_ROW] = value[row]
    return out


def join(state: dict) -> dict:
    """The inverse of :func:`split`."""
    out = {}
    for key, value in state.items():
        if key.endswith(UNC_ROW) and key[:-len(UNC_ROW)] in TABLES:
            continue
        row = TABLES.get(key)
        unc = state.get(key + UNC_ROW)
        if row is None or unc is None:
            out[key] = value
            continue
        row = row % (value.shape[0] + 1)
        out[key] = torch.cat([value[:row], unc[None].to(value.dtype), value[row:]])
    return out
