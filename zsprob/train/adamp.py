"""AdamP (Heo et al., ICLR 2021) with the projection decision taken on the device.

AdamP is Adam for scale-invariant weights: a weight whose gradient is nearly orthogonal to it (per output
channel or over the whole tensor) loses the update's component along the weight, and its weight decay is
scaled by ``wd_ratio``. timm's ``AdamP`` decides with a Python ``if`` on a device value (a GPU wait per
parameter); here the decisions are boolean tensors over multi-tensor kernels, and the state keeps timm's
layout, so state dicts load both ways. The update in formulas: docs/training.md."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import Optimizer

from zsprob.errors import UserError


@dataclass
class _Bucket:
    """The parameters of one group that take the same step number, with their gradients and state."""
    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)


class AdamP(Optimizer):
    """AdamP with timm's arguments and defaults (``delta``: the orthogonality threshold, ``wd_ratio``: the
    weight-decay factor of projected parameters)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, delta: float = 0.1, wd_ratio: float = 0.1, nesterov: bool = False):
        betas = tuple(float(b) for b in betas)
        if lr < 0 or eps < 0 or weight_decay < 0 or delta < 0 or wd_ratio < 0:
            raise UserError(f"AdamP needs lr, eps, weight_decay, delta and wd_ratio >= 0, got lr={lr}, eps={eps}, "
                            f"weight_decay={weight_decay}, delta={delta}, wd_ratio={wd_ratio}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise UserError(f"AdamP needs two betas in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, delta=delta, wd_ratio=wd_ratio,
                        nesterov=nesterov)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("caution"):  # a group loaded from a timm state dict with caution=True
                raise UserError("zsprob's AdamP has no 'caution' mode; use optim.name: adamp-timm for it")
            for step, bucket in self._buckets(group).items():
                _update(bucket, step, group)
        return loss

    def _buckets(self, group: dict) -> dict[int, _Bucket]:
        """The group's parameters with a gradient, by their step number after this step (state made at the first)."""
        buckets: dict[int, _Bucket] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamP does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            bucket = buckets.setdefault(state["step"], _Bucket())
            bucket.params.append(p)
            bucket.grads.append(p.grad)
            bucket.exp_avgs.append(state["exp_avg"])
            bucket.exp_avg_sqs.append(state["exp_avg_sq"])
        return buckets


def _adam_directions(bucket: _Bucket, step: int, group: dict) -> list[torch.Tensor]:
    """Update the moments in place; the Adam directions m / (sqrt(v_hat) + eps) (Nesterov form on request)."""
    beta1, beta2 = group["betas"]
    grads, exp_avgs, exp_avg_sqs = bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, math.sqrt(1 - beta2 ** step))
    torch._foreach_add_(denoms, group["eps"])
    if group["nesterov"]:
        directions = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(directions, torch._foreach_mul(grads, 1 - beta1))
        torch._foreach_div_(directions, denoms)
        return directions
    return torch._foreach_div(exp_avgs, denoms)


def projection_scale(weight: torch.Tensor, grad: torch.Tensor, direction: torch.Tensor, delta: float,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, projected) of one parameter of two or more dimensions, on its device: ``direction - weight *
    scale`` is the projected update (``scale`` [channels, 1, ...]: per channel, whole tensor or zero);
    ``projected`` a 0-d boolean tensor."""
    rows = weight.shape[0]
    w, g, u = weight.reshape(rows, -1), grad.reshape(rows, -1), direction.reshape(rows, -1)
    ww, gg, wg, wu = (w * w).sum(1), (g * g).sum(1), (w * g).sum(1), (w * u).sum(1)
    w_norm, g_norm = ww.sqrt(), gg.sqrt()
    cos_rows = wg.abs() / (g_norm.clamp_min(eps) * w_norm.clamp_min(eps))
    w_norm_all, g_norm_all = ww.sum().sqrt(), gg.sum().sqrt()
    cos_all = wg.sum().abs() / (g_norm_all.clamp_min(eps) * w_norm_all.clamp_min(eps))
    channel = cos_rows.amax() < delta / math.sqrt(w.shape[1])
    layer = cos_all < delta / math.sqrt(w.numel())
    per_channel = wu / (w_norm + eps).square()
    whole = wu.sum() / (w_norm_all + eps).square()
    scale = torch.where(channel, per_channel, torch.where(layer, whole, 0.0))
    return scale.reshape((rows,) + (1,) * (weight.ndim - 1)), channel | layer


def _update(bucket: _Bucket, step: int, group: dict) -> None:
    """One AdamP step of the bucket's parameters (the update in docs/training.md)."""
    params = bucket.params
    directions = _adam_directions(bucket, step, group)
    matrices = [i for i, p in enumerate(params) if p.ndim > 1]
    projected = []
    for i in matrices:  # one tensor at a time: the scales broadcast per channel, so no multi-tensor kernel
        scale, was_projected = projection_scale(params[i], bucket.grads[i], directions[i], group["delta"],
                                                group["eps"])
        directions[i].addcmul_(params[i], scale, value=-1)
        projected.append(was_projected)
    if group["weight_decay"] > 0:
        _decay(params, matrices, projected, group)
    torch._foreach_add_(params, directions, alpha=-group["lr"] / (1 - group["betas"][0] ** step))


def _decay(params: list, matrices: list[int], projected: list[torch.Tensor], group: dict) -> None:
    """Decoupled weight decay 1 - lr * wd, wd scaled by wd_ratio where the update was projected."""
    plain = 1 - group["lr"] * group["weight_decay"]
    reduced = 1 - group["lr"] * group["weight_decay"] * group["wd_ratio"]
    in_matrices = set(matrices)
    others = [p for i, p in enumerate(params) if i not in in_matrices]
    if others:
        torch._foreach_mul_(others, plain)
    if not matrices:
        return
    constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (dtype, device) -> (plain, reduced)
    factors = []
    for i, was_projected in zip(matrices, projected):
        p = params[i]
        key = (p.dtype, p.device)
        if key not in constants:  # filled on the device: no host-to-device copy
            constants[key] = (torch.full((), plain, dtype=p.dtype, device=p.device),
                              torch.full((), reduced, dtype=p.dtype, device=p.device))
        factors.append(torch.where(was_projected, constants[key][1], constants[key][0]))
    torch._foreach_mul_([params[i] for i in matrices], factors)
