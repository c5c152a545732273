"""Gathering embeddings across processes with gradients, for global-batch pairwise losses.

torch.distributed communicates; zsprob writes open_clip's ``gather_features(local_loss=True)`` rule: forward
``all_gather(x_local) -> X [world * n, D]``, backward ``all_reduce(SUM, dL/dX)[local slice]`` (gloo has no
reduce_scatter). With DDP averaging parameter gradients, the update equals one process's on the global batch."""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_info() -> tuple[int, int]:
    """(rank, world_size); (0, 1) outside a process group."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """``x`` of every process, concatenated in rank order along the first dimension."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=0)


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return _all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def all_gather_with_grad(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` [n, ...] of every process in rank order -> [world * n, ...], differentiable (the same n on every
    process); ``x`` itself outside a process group, None for None."""
    if x is None or not is_distributed():
        return x
    return _AllGatherWithGrad.apply(x)


def gather_gaussians(mu: torch.Tensor, logvar: torch.Tensor | None):
    """``((all_mu, all_logvar), offset)`` for the loss's ``all_img`` / ``all_txt`` arguments."""
    rank, _ = world_info()
    return (all_gather_with_grad(mu), all_gather_with_grad(logvar)), rank * mu.shape[0]


def block_diag_targets(local: torch.Tensor) -> torch.Tensor:
    """Global [N, N] match targets, block diagonal from every process's local [n, n] ones (MSDA mixes within
    a process's batch)."""
    if not is_distributed():
        return local
    with torch.no_grad():
        blocks = _all_gather(local.unsqueeze(0))  # [world, n, n]
    return torch.block_diag(*blocks.unbind(0))


def mean_across(values: torch.Tensor) -> torch.Tensor:
    """Average a tensor over processes (for logging)."""
    if not is_distributed():
        return values
    values = values.detach().clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / dist.get_world_size()
