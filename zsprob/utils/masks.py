"""Length masks over padded token sequences: which of a row's ``L`` positions are its own tokens.

Every text tower and head that pools over a caption's first ``lengths`` positions uses these (plain
torch, no host reads).
"""
from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] bool, True at a row's first ``lengths[b]`` positions."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


def masked_sum(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of x [B, L, C] over each row's first ``lengths`` positions: [B, C]."""
    return (x * length_mask(lengths, x.shape[1])[..., None].to(x.dtype)).sum(1)


def masked_mean(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, L, C] over each row's first ``lengths`` positions (lengths >= 1): [B, C]."""
    return masked_sum(x, lengths) / lengths[:, None].to(x.dtype)


__all__ = ["length_mask", "masked_mean", "masked_sum"]
