"""The factor a model applies to a similarity score to make logits, read from its checkpoint or its weights:
what zero-shot calibration and the selective-prediction baselines of retrieval and zero-shot scale by."""
from __future__ import annotations

import math

#: CLIP's zero-shot logit scale, and open_clip's clamp of exp(logit_scale)
CLIP_ZEROSHOT_SCALE = 100.0
MAX_LOGIT_SCALE = 100.0


def model_logit_scale(model, score: str = "cosine", found: tuple | None = None) -> tuple[float, str]:
    """``(scale, where it came from)``: the factor the model applies to ``score`` to make logits. PCME++ /
    PCME (logits = -a d + b): ``a`` for ``csd``, ``2 a`` for cosine-type scores (on unit means -a ||x - c||^2
    = 2 a cos - 2 a); InfoNCE / ProLIP and plain open_clip: exp(logit_scale) clamped at 100 (halved for
    ``csd``); otherwise CLIP's 100. ``found``: :func:`logit_scale_of` (read from the model when None)."""
    kind, value, source = found or logit_scale_of(model)
    if kind == "scale":
        return (value if score == "csd" else 2.0 * value), source
    if kind == "logit_scale":
        return (value / 2.0 if score == "csd" else value), source
    return CLIP_ZEROSHOT_SCALE, source


def logit_scale_of(model) -> tuple[str, float, str]:
    """(kind, value, source) of the model's logit scale: read once (a device parameter is a host read)."""
    extra = ((getattr(model, "checkpoint_meta", None) or {}).get("extra") or {})
    params = extra.get("loss_params") or {}
    method = extra.get("method") or "checkpoint"
    if "scale" in params:
        a = float(params["scale"])
        return "scale", a, f"{method} loss scale a = {a:.4g}"
    if "logit_scale" in params:
        s = min(math.exp(float(params["logit_scale"])), MAX_LOGIT_SCALE)
        return "logit_scale", s, f"{method} loss logit_scale exp = {s:.4g}"
    param = getattr(getattr(model, "clip", None), "logit_scale", None)
    if param is not None and not extra:
        s = min(math.exp(float(param.detach().float().cpu())), MAX_LOGIT_SCALE)
        return "logit_scale", s, f"open_clip logit_scale exp = {s:.4g}"
    return "clip", CLIP_ZEROSHOT_SCALE, "CLIP zero-shot convention (100)"
