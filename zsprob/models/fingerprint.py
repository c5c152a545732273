"""A model's identity: a cheap fingerprint of its config and weights.

Zero-shot caches and selection files, evaluation results and exports name the model they were made
with by :func:`model_fingerprint`, so a file made with another model is refused rather than mixed in.
"""
from __future__ import annotations

import hashlib
import json


def model_fingerprint(model) -> str:
    """A cheap identity of a model's weights, for cache keys.

    Hashes the model config (when it has one), every parameter/buffer name and shape, and a
    strided sample of each tensor's values (up to 256 numbers) plus its sum. Any training
    step changes it; it costs a fraction of a second even for ViT-L.
    """
    import torch

    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        try:
            h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        except TypeError:
            h.update(repr(cfg).encode())
    h.update(type(model).__name__.encode())
    with torch.no_grad():
        for name, t in list(model.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            if t.numel() == 0 or not (t.is_floating_point() or t.dtype in (torch.int64, torch.int32)):
                continue
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 256)
            sample = flat[::step][:256].double().cpu()
            h.update(sample.numpy().tobytes())
            h.update(repr(float(flat.double().sum().cpu())).encode())
    return h.hexdigest()[:32]


def model_identity(model) -> dict:
    """What a results file records of the model it was made with: its fingerprint and name."""
    return {"id": model_fingerprint(model), "name": getattr(model, "name", None)}


__all__ = ["model_fingerprint", "model_identity"]
