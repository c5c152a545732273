"""``--method adapter``: log-variance heads trained on the frozen towers' cached features with the sigma recipe's terms.

The terms of the demo's sigma recipe (configs/synthetic_tiny_sigma.yaml) minus the match loss (the means are
frozen): covering and inclusion of each row in its degraded copy, equal-length caption ranking
(:func:`same_length_rank`), both likelihood terms and VIB; the weighted sum: docs/posthoc.md. torch's AdamW,
LambdaLR and gradient clipping do the optimisation; the steady step reads nothing back to the host."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from zsprob.posthoc.features import PARTS
from zsprob.prob.distances import inclusion_logit
from zsprob.prob.losses import caption_nll, vib_kl
from zsprob.prob.prolip import cover_loss


@dataclass
class AdapterSettings:
    """The recipe's weights (configs/synthetic_tiny_sigma.yaml) and the optimiser of the heads."""

    steps: int = 1500
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 2.0
    occlusion_alpha: float = 0.1
    inclusion_alpha: float = 0.1
    inclusion_scale: float = 100.0
    same_length_alpha: float = 0.1
    same_length_scale: float = 10.0
    same_length_target: str = "own"  # distance to the caption's own image mean, or "centre": the batch's images' mean
    cover_scale: float = 1000.0
    cover_lambda: float = 0.002
    caption_nll_alpha: float = 0.1
    caption_nll_scale: float = 3.0
    image_nll_alpha: float = 0.1
    image_nll_scale: float = 3.0
    vib_beta: float = 1e-6
    seed: int = 0
    prior_precision: float | None = None  # laplace only: None chooses it by the evidence


def sigma_terms(adapters: dict, batch: dict[str, torch.Tensor], s: AdapterSettings) -> dict[str, torch.Tensor]:
    """Each term of the loss in docs/posthoc.md on one batch of cached rows, and ``loss``, their weighted sum."""
    lv = {part: adapters[part.split("_")[0]].logvar(batch[f"{part}_features"]) for part in PARTS}
    mu = {part: batch[f"{part}_mu"] for part in PARTS}
    matched = torch.eye(mu["image"].shape[0], device=mu["image"].device, dtype=mu["image"].dtype)
    terms = {
        "cover_image": cover_loss(mu["image"], lv["image"], mu["image_copy"], lv["image_copy"], s.cover_scale,
                                  s.cover_lambda),
        "cover_text": cover_loss(mu["text"], lv["text"], mu["text_copy"], lv["text_copy"], s.cover_scale,
                                 s.cover_lambda),
        "caption_nll": caption_nll(matched, mu["image"], mu["text"], lv["text"], s.caption_nll_scale),
        "image_nll": caption_nll(matched, mu["text"], mu["image"], lv["image"], s.image_nll_scale),
        "vib": vib_kl(mu["image"], lv["image"]) + vib_kl(mu["text"], lv["text"]),
    }
    for side in ("image", "text"):
        logit = inclusion_logit(mu[side], lv[side], mu[f"{side}_copy"], lv[f"{side}_copy"])
        terms[f"inclusion_{side}"] = -torch.nn.functional.logsigmoid(s.inclusion_scale * logit).mean()
    lengths = adapters["text"].lengths(batch["text_features"])
    if s.same_length_target not in ("own", "centre"):
        raise ValueError(f"same_length_target must be 'own' or 'centre', got {s.same_length_target!r}")
    target = mu["image"] if s.same_length_target == "own" else mu["image"].mean(0, keepdim=True)
    terms["same_length"] = same_length_rank(target, mu["text"], lv["text"], lengths, s.same_length_scale)
    terms["loss"] = (s.occlusion_alpha * (terms["cover_image"] + terms["cover_text"])
                     + s.same_length_alpha * terms["same_length"]
                     + s.inclusion_alpha * (terms["inclusion_image"] + terms["inclusion_text"])
                     + s.caption_nll_alpha * terms["caption_nll"] + s.image_nll_alpha * terms["image_nll"]
                     + s.vib_beta * terms["vib"])
    return terms


def same_length_rank(image_mu, text_mu, text_logvar, lengths, scale: float) -> torch.Tensor:
    """Among captions of the same length, the one farther from its image's mean gets the larger summed variance:
    mean over such pairs (i, j) of -log sigmoid(scale * sign(r_i - r_j) * (log S_i - log S_j)), r the squared
    distance of a caption's mean to its image's, S = ||sigma^2||_1. Zero without lengths."""
    if lengths is None:
        return text_logvar.sum() * 0.0
    r = (image_mu - text_mu).square().sum(-1)
    log_s = torch.logsumexp(text_logvar, dim=-1)
    same = (lengths[:, None] == lengths[None, :]).to(log_s.dtype)
    order = torch.sign(r[:, None] - r[None, :])
    pair = -torch.nn.functional.logsigmoid(scale * order * (log_s[:, None] - log_s[None, :]))
    weight = same * order.abs()
    return (pair * weight).sum() / weight.sum().clamp(min=1.0)


def warmup_cosine(step: int, steps: int, warmup: int) -> float:
    """lr multiplier: linear warm-up over ``warmup`` steps, then cosine to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_heads(adapters: dict, features: dict[str, torch.Tensor], s: AdapterSettings, device,
                terms=sigma_terms, progress: bool = True) -> dict:
    """Train the heads of ``adapters`` (side -> :class:`zsprob.posthoc.heads.HeadAdapter`) on ``features``
    (the feature file's tensors) for ``s.steps`` steps of ``s.batch_size`` random rows; ``terms(adapters,
    batch, s)`` gives the loss. Returns the mean of each term over the last tenth of the steps and the time."""
    from tqdm.auto import tqdm

    params = [p for a in adapters.values() for p in a.parameters()]
    for p in params:
        p.requires_grad_(True)
    data = {k: v.to(device) for k, v in features.items()}
    n = next(iter(data.values())).shape[0]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: warmup_cosine(k, s.steps, s.warmup_steps))
    generator = torch.Generator().manual_seed(int(s.seed))
    tail = max(1, s.steps // 10)
    sums: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    for step in tqdm(range(s.steps), desc="post-hoc heads", disable=not progress):
        rows = torch.randint(n, (min(s.batch_size, n),), generator=generator).to(device, non_blocking=True)
        out = terms(adapters, {k: v.index_select(0, rows) for k, v in data.items()}, s)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        sched.step()
        if step >= s.steps - tail:
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
    seconds = time.perf_counter() - start
    for p in params:
        p.requires_grad_(False)
    return {"terms": {k: float(v) / tail for k, v in sums.items()}, "train_seconds": seconds, "rows": n}


__all__ = ["AdapterSettings", "sigma_terms", "train_heads", "warmup_cosine"]
