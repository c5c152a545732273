"""A model's identity: a cheap fingerprint of its config and weights, so a file made with another model is refused."""
from __future__ import annotations

import hashlib
import json

#: the integer type whose bits each floating-point dtype is summed as (see :func:`model_fingerprint`)
_BITS = {2: "int16", 4: "int32", 8: "int64"}


def model_fingerprint(model) -> str:
    """A cheap identity of a model's config and weights, the same on every machine and thread count: every
    tensor's name, shape, a strided sample and the integer sum of its values' bit patterns (exact)."""
    return _fingerprint(model, _bit_sum, lambda total: str(int(total)))


def legacy_fingerprint(model) -> str:
    """The earlier fingerprint (each tensor's float64 sum in place of its bit sum), so older files are still taken."""
    return _fingerprint(model, lambda flat: flat.double().sum(), lambda total: repr(float(total)))


def _bit_sum(flat):
    import torch
    bits = flat.view(getattr(torch, _BITS[flat.element_size()])) if flat.is_floating_point() else flat
    return bits.sum(dtype=torch.int64)


def _fingerprint(model, tensor_sum, text) -> str:
    """Each tensor's sample and ``tensor_sum`` made where the tensor lives, then read to the host together (one
    read per kind, not one per tensor: on a GPU each read waits for the device)."""
    import torch

    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        try:
            h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        except TypeError:
            h.update(repr(cfg).encode())
    h.update(type(model).__name__.encode())
    heads, samples, sums, device = [], [], [], None
    with torch.no_grad():
        for name, t in list(model.state_dict().items()):
            hashed = t.numel() > 0 and (t.is_floating_point() or t.dtype in (torch.int64, torch.int32))
            heads.append((name, tuple(t.shape), hashed))
            if hashed:
                flat = t.detach().reshape(-1)
                device = device or flat.device  # (one model, one device: these moves are no-ops)
                samples.append(flat[::max(1, flat.numel() // 256)][:256].double().to(device))
                sums.append(tensor_sum(flat).reshape(1).to(device))
        sampled = torch.cat(samples).cpu().numpy() if samples else None
        totals = torch.cat(sums).cpu().tolist() if sums else []
    start, k = 0, 0
    for name, shape, hashed in heads:
        h.update(name.encode())
        h.update(str(shape).encode())
        if hashed:
            n = samples[k].numel()
            h.update(sampled[start:start + n].tobytes())
            h.update(text(totals[k]).encode())
            start, k = start + n, k + 1
    return h.hexdigest()[:32]


def is_model(made_with: str, model, own: str | None = None) -> bool:
    """Whether a file's model id ``made_with`` names ``model`` (``own``: its fingerprint, when known)."""
    own = own or model_fingerprint(model)
    return made_with == own or made_with == legacy_fingerprint(model)


def model_identity(model) -> dict:
    """What a results file records of the model it was made with: its fingerprint and name."""
    return {"id": model_fingerprint(model), "name": getattr(model, "name", None)}
