"""Loading weights into a built model, strictly (a bad key or shape is a UserError naming it): open_clip
files (projections of another ``embed_dim`` keep their init) and zsprob checkpoints (whole, or to fine-tune).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.checkpoint import EXTRA_PREFIX
from zsprob.models.sources import Source

log = logging.getLogger(__name__)

#: the ProbCLIP module groups outside the wrapped open_clip model (``clip.``), reused by fine-tuning where they fit
HEAD_GROUPS = ("image_head", "text_head", "image_gpo", "text_gpo", "image_sigma", "text_sigma", "sigma_readout")

_PROJ_KEYS = ("visual.proj", "text_projection", "text_projection.weight", "text_projection.bias",
              "text.text_projection", "text.text_projection.weight", "text.text_projection.bias",
              "visual.head.proj.weight", "visual.head.proj.bias",  # timm towers (linear / mlp head)
              "visual.head.mlp.fc1.weight", "visual.head.mlp.fc1.bias", "visual.head.mlp.fc2.weight",
              "visual.head.mlp.fc2.bias")


def _load_torchscript_state(path: Path) -> dict | None:
    """State dict of a TorchScript archive (no Python pickle involved), or None if it is not one."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return None
    try:
        sd = torch.jit.load(str(path), map_location="cpu").state_dict()
    except Exception:  # noqa: BLE001
        return None
    for k in ("input_resolution", "context_length", "vocab_size"):
        sd.pop(k, None)
    return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


def load_open_clip_weights(model: torch.nn.Module, path: str | os.PathLike) -> list[str]:
    """Load an open_clip checkpoint file into an open_clip model, strictly; returns the projections whose shape
    differs from the checkpoint's (they keep their random init)."""
    from open_clip.convert import convert_state_dict
    from open_clip.factory import load_state_dict
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    path = Path(path)
    try:
        sd = load_state_dict(str(path), device="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any read / unpickling failure is the user's file
        sd = _load_torchscript_state(path)  # OpenAI's original .pt files are TorchScript archives
        if sd is None:
            raise UserError(f"cannot read open_clip checkpoint {path}: {type(e).__name__}: {e}") from None
    if not isinstance(sd, dict) or not sd:
        raise UserError(f"open_clip checkpoint {path} holds no state dict")
    try:
        sd = convert_state_dict(model, sd)
    except Exception:  # noqa: BLE001 - conversion only applies to third-party formats
        pass
    if "positional_embedding" in sd and not hasattr(model, "positional_embedding"):
        sd = convert_to_custom_text_state_dict(sd)
    for k in ("logit_scale", "logit_bias"):
        own = getattr(model, k, None)
        if k in sd and own is not None and sd[k].ndim != own.ndim:
            sd[k] = sd[k].reshape(own.shape)
    if "logit_bias" not in sd and getattr(model, "logit_bias", None) is not None and "logit_scale" in sd:
        sd["logit_bias"] = torch.zeros_like(model.logit_bias)
    sd.pop("text.transformer.embeddings.position_ids", None)
    try:
        resize_pos_embed(sd, model)
        resize_text_pos_embed(sd, model)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"open_clip checkpoint {path} does not fit model: {e}") from None
    return _load_state_into(model, sd, str(path))


def _load_state_into(model: torch.nn.Module, sd: dict, source: str) -> list[str]:
    """Strict load except projections of another shape (returned; they keep their init)."""
    own = model.state_dict()
    reinit, bad = [], []
    for k, v in list(sd.items()):
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            if k in _PROJ_KEYS:
                reinit.append(k)
                del sd[k]
            else:
                bad.append(f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}")
    if bad:
        raise UserError(f"open_clip checkpoint {source} does not match the model config: " + "; ".join(bad[:5]))
    res = model.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if k not in reinit]
    if missing or res.unexpected_keys:
        raise UserError(f"open_clip checkpoint {source} does not match the model: missing {missing[:5]}, "
                        f"unexpected {list(res.unexpected_keys)[:5]}")
    if reinit:
        log.warning("projections %s re-initialised: embed_dim differs from the checkpoint %s", reinit, source)
    return reinit


def load_checkpoint(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where) -> None:
    """Fill ``model`` (rebuilt from the checkpoint's config) with a zsprob checkpoint's tensors, strictly."""
    state = {k: v for k, v in tensors.items() if not k.startswith(EXTRA_PREFIX)}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(f"checkpoint {where} does not match its config: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise UserError(f"checkpoint {where} has tensors of the wrong shape: {bad[:5]}")
    model.load_state_dict(state, strict=True)


def load_checkpoint_tower(clip_model: torch.nn.Module, source: Source) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Fine-tuning: a zsprob checkpoint's ``clip.*`` tensors into ``clip_model`` (strict but for re-shaped
    projections); returns (re-initialised projections, its head tensors)."""
    tensors = source.read_tensors(verify=True)
    clip_sd = {k[len("clip."):]: v for k, v in tensors.items() if k.startswith("clip.")}
    if source.meta["config"].get("mean_head", "proj") == "fc":  # the saved tower has no ln_post / projections
        from zsprob.models.prob_clip import strip_mean_projection_

        strip_mean_projection_(clip_model)
    reinit = _load_state_into(clip_model, clip_sd, str(source.path))
    heads = {k: v for k, v in tensors.items() if not k.startswith(("clip.", EXTRA_PREFIX))}
    return reinit, heads


def load_checkpoint_heads(model: torch.nn.Module, heads: dict[str, torch.Tensor], source: Source,
                          sigma_init: str) -> None:
    """The checkpoint's heads into ``model``, group by group where keys and shapes fit (listed in
    ``config["heads_from_checkpoint"]``); the others keep their fresh init and a warning names them."""
    own = model.state_dict()
    loaded, skipped = [], []
    for group in HEAD_GROUPS:
        mine = {k: v for k, v in own.items() if k.split(".")[0] == group}
        theirs = {k: v for k, v in heads.items() if k.split(".")[0] == group}
        if not mine:
            continue
        if set(mine) == set(theirs) and all(mine[k].shape == theirs[k].shape for k in mine):
            model.load_state_dict(theirs, strict=False)
            loaded.append(group)
        else:
            skipped.append(group)
    model.config["heads_from_checkpoint"] = loaded
    if skipped:
        log.warning("zsprob checkpoint %s: %s do not fit this model (sigma_depth / pooling / embed_dim "
                    "differ) and keep their fresh init (sigma_init=%r)", source.path, skipped, sigma_init)
