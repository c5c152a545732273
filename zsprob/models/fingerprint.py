"""A model's identity: a cheap fingerprint of its config and weights, so a file made with another model is refused."""
from __future__ import annotations

import hashlib
import json

#: the integer type whose bits each floating-point dtype is summed as (see :func:`model_fingerprint`)
_BITS = {2: "int16", 4: "int32", 8: "int64"}


def model_fingerprint(model) -> str:
    """A cheap identity of a model's config and weights, the same on every machine and thread count: every
    tensor's name, shape, a strided sample and the integer sum of its values' bit patterns (exact)."""
    return _fingerprint(model, _bit_sum)


def legacy_fingerprint(model) -> str:
    """The earlier fingerprint (each tensor's float64 sum in place of its bit sum), so older files are still taken."""
    return _fingerprint(model, lambda flat: repr(float(flat.double().sum().cpu())))


def _bit_sum(flat) -> str:
    import torch
    bits = flat.view(getattr(torch, _BITS[flat.element_size()])) if flat.is_floating_point() else flat
    return str(int(bits.sum(dtype=torch.int64)))


def _fingerprint(model, tensor_sum) -> str:
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
            h.update(flat[::step][:256].double().cpu().numpy().tobytes())
            h.update(tensor_sum(flat).encode())
    return h.hexdigest()[:32]


def is_model(made_with: str, model, own: str | None = None) -> bool:
    """Whether a file's model id ``made_with`` names ``model`` (``own``: its fingerprint, when known)."""
    own = own or model_fingerprint(model)
    return made_with == own or made_with == legacy_fingerprint(model)


def model_identity(model) -> dict:
    """What a results file records of the model it was made with: its fingerprint and name."""
    return {"id": model_fingerprint(model), "name": getattr(model, "name", None)}
