"""Pooling and output heads written by zsprob: GPO and variance bounds.

* :class:`GPO` is the Generalized Pooling Operator of Chen et al. 2021 ("Learning the best
  pooling strategy for visual semantic embedding", VSE infinity), which PCME++ uses to pool
  the token features of both heads. zsprob's own implementation: every feature dimension is
  sorted over the tokens (descending), and the sorted values are averaged with weights that
  depend only on the rank k and the number of tokens n. The weights come from a small
  bidirectional GRU run over sinusoidal encodings of the ranks 0..n-1, a linear score per
  rank and a softmax with temperature 0.1. Because the weights do not depend on the features,
  the GRU runs once per *distinct* sequence length in the batch (one run for images, a few for
  captions), which keeps it cheap on a CPU.
* :func:`bound_logvar` maps a raw log-variance smoothly into ``[log lo, log hi]`` (the
  variance bounds of Pishdad et al., [0.1, 10]).

torch provides the GRU, packing and sorting; nothing here comes from another library.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def sinusoid_encoding(n: int, dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """[n, dim] sinusoidal encodings of the positions 0..n-1 (Vaswani et al.)."""
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    half = (dim + 1) // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=device, dtype=torch.float32) * 2.0 / dim)
    ang = pos * freq[None, :]
    pe = torch.zeros(n, 2 * half, device=device, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(ang)
    pe[:, 1::2] = torch.cos(ang)
    return pe[:, :dim].to(dtype)


class GPO(nn.Module):
    """Generalized Pooling Operator: rank-weighted sum of per-dimension sorted features.

    ``forward(features [B, T, D], lengths [B] or None) -> pooled [B, D]``. Positions at or
    beyond a sample's length are padding and ignored. ``lengths=None`` means every token
    counts.
    """

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1):
        super().__init__()
        self.d_pe = int(d_pe)
        self.d_hidden = int(d_hidden)
        self.temperature = float(temperature)
        self.gru = nn.GRU(self.d_pe, self.d_hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.score = nn.Linear(self.d_hidden, 1, bias=False)

    def rank_weights(self, lengths: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [B, max_len] over sorted ranks (zero beyond each length) and the valid mask."""
        uniq, inverse = torch.unique(lengths, return_inverse=True)
        n_u = uniq.numel()
        w_dtype = self.gru.weight_ih_l0.dtype
        pe = sinusoid_encoding(max_len, self.d_pe, device=lengths.device, dtype=w_dtype)
        mask_u = torch.arange(max_len, device=lengths.device)[None, :] < uniq[:, None]  # [U, T]
        x = pe[None].expand(n_u, max_len, self.d_pe) * mask_u[..., None].to(w_dtype)
        with torch.autocast(device_type=lengths.device.type, enabled=False):
            if bool((uniq == max_len).all()):
                out, _ = self.gru(x)
            else:
                packed = pack_padded_sequence(x, uniq.cpu(), batch_first=True, enforce_sorted=False)
                out, _ = self.gru(packed)
                out, _ = pad_packed_sequence(out, batch_first=True, total_length=max_len)
            h = 0.5 * (out[..., : self.d_hidden] + out[..., self.d_hidden:])
            s = self.score(h).squeeze(-1) / self.temperature  # [U, T]
            s = s.masked_fill(~mask_u, float("-inf"))
            w = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=1)
        return w[inverse], mask_u[inverse]

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = features.shape
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.long, device=features.device)
        lengths = lengths.to(device=features.device, dtype=torch.long).clamp(1, t)
        max_len = int(lengths.max())
        feats = features[:, :max_len]
        w, mask = self.rank_weights(lengths, max_len)
        if bool(mask.all()):
            srt = feats.sort(dim=1, descending=True).values
        else:
            m = mask[..., None]
            srt = feats.masked_fill(~m, float("-inf")).sort(dim=1, descending=True).values
            srt = srt.masked_fill(~m, 0.0)  # after a descending sort the padding sits at the end
        return (srt * w[..., None].to(srt.dtype)).sum(dim=1)


def bound_logvar(raw: torch.Tensor, bounds: tuple[float, float] | None) -> torch.Tensor:
    """Map raw head outputs to log-variances in ``[log lo, log hi]`` (identity if ``bounds`` is None).

    ``log lo + (log hi - log lo) * sigmoid(raw)``: smooth, so gradients never vanish at a
    clamp; raw = 0 gives the geometric middle of the range (variance 1 for [0.1, 10]).
    """
    if bounds is None:
        return raw
    lo, hi = float(bounds[0]), float(bounds[1])
    llo, lhi = math.log(lo), math.log(hi)
    return llo + (lhi - llo) * torch.sigmoid(raw)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)
