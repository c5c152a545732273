"""ProLIP (naver-ai/prolip) official state-dict names <-> zsprob names, as data.

ProLIP's towers are open_clip's with one learned [UNC] token each (zsprob's ``UncTokenHead``). Its
positional tables hold one more row, for [UNC]; :func:`split` cuts it out into its own entry
(``<table>[unc]``), so every rule maps one key to one key.
"""
from __future__ import annotations

from zsprob.models.convert.mapping import Rule

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
    import torch

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
