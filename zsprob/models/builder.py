"""Build a model from a checkpoint: :func:`load` (a zsprob checkpoint) and :func:`load_for_inference`.

The builder side of the models package (timm's ``_builder`` beside ``_factory``): it reads the
file format through :mod:`zsprob.models.checkpoint` and builds the model through
:mod:`zsprob.models.factory`; neither of those imports this module. safetensors reads the
tensors; the shape and key checks against the rebuilt model are zsprob's.
"""
from __future__ import annotations

import os

import torch

from zsprob.errors import UserError
from zsprob.models.checkpoint import EXTRA_PREFIX, checkpoint_dir, is_checkpoint, load_meta, read_tensors
from zsprob.models.factory import create_from_official, create_model, model_from_config, sniff_official


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu", *, verify: bool = True):
    """Rebuild the ProbCLIP (or the jWAE model, :mod:`zsprob.models.jwae`) saved at ``path`` (directory,
    or a file inside it). No pickle involved.

    ``verify`` checks the weights' SHA-256 against zsprob.json (reads the file once more).
    """
    d = checkpoint_dir(path)
    meta = load_meta(d)
    tensors = read_tensors(d, meta, verify)
    if meta["config"].get("kind") == "jwae":  # jWAE autoencoders over a frozen tower
        from zsprob.models.jwae import jwae_from_config
        model = jwae_from_config(meta["config"])
    else:
        model = model_from_config(meta["config"])
    state = {k: v for k, v in tensors.items() if not k.startswith(EXTRA_PREFIX)}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(f"checkpoint {d} does not match its config: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise UserError(f"checkpoint {d} has tensors of the wrong shape: {bad[:5]}")
    model.load_state_dict(state, strict=True)
    model.checkpoint_meta = meta
    return model.to(map_location)


def load_for_inference(checkpoint: str | os.PathLike | None = None, model: str | None = None,
                       pretrained: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                       **create_kwargs):
    """A model in eval mode for the CLI: a zsprob checkpoint, or a plain open_clip model.

    ``checkpoint``: a zsprob checkpoint directory. Otherwise ``model`` (an open_clip name or zsprob
    config) with optional ``pretrained`` (tag in the local cache or checkpoint file) is wrapped
    with native pooling and no sigma heads, so its mean equals open_clip's normalised features
    and logvar is None (pass ``create_kwargs`` to change that). A published ProLIP / PCME++
    checkpoint as ``pretrained`` keeps its log-variance heads (``create_kwargs`` may carry
    ``tokenizer_dir``, and ``weights`` for a COCO trainer file's SWA or raw copy).
    """
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
    elif model is not None and pretrained and is_checkpoint(pretrained):  # a zsprob checkpoint (e.g. converted)
        m = load(pretrained)
        if m.name != model:
            raise UserError(f"--pretrained {pretrained} is a zsprob checkpoint of {m.name}, not of {model}")
    elif model is not None:
        official = sniff_official(pretrained) if pretrained else None
        if official is not None:  # a published ProLIP / PCME++ checkpoint: mean and log sigma^2 as trained
            m = create_from_official(model, pretrained, *official, **create_kwargs)
        else:
            kw = dict(pooling="native", deterministic=True)
            kw.update(create_kwargs)
            m = create_model(model, pretrained=pretrained, **kw)
    else:
        raise UserError("no model given: pass a zsprob checkpoint directory or an open_clip model name "
                        "(e.g. --model ViT-B-32 --pretrained openai)")
    if device is not None:
        m = m.to(device)
    return m.eval()


__all__ = ["load", "load_for_inference"]
