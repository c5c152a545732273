"""GPO (VSE infinity's Generalized Pooling Operator, PCME++'s pooling) and variance bounds.

GPO averages each feature dimension's sorted values with weights from a bidirectional GRU over rank
encodings; fixed shapes and no host reads, so ``torch.compile`` traces it whole (:class:`RankGRU`
runs ``nn.GRU``'s parameters through ``torch.gru``, which dynamo traces).
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from zsprob.utils.host_sync import host_read_is_free
from zsprob.utils.masks import length_mask

_GRU_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

# cuDNN copies torch.gru's separately held weights into one buffer on every call and warns; RankGRU's weights
# are a few kilobytes, and nn.GRU's flat buffer would stop dynamo from tracing GPO.
warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk",
                        category=UserWarning)


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


class RankGRU(nn.Module):
    """The parameters of ``nn.GRU(input_size, hidden_size, bidirectional=True)`` (names, shapes, order, init),
    each direction run on its own with :meth:`direction`."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        for suffix in ("", "_reverse"):
            shapes = ((3 * self.hidden_size, self.input_size), (3 * self.hidden_size, self.hidden_size),
                      (3 * self.hidden_size,), (3 * self.hidden_size,))
            for name, shape in zip(_GRU_PARAMS, shapes):
                self.register_parameter(f"{name}_l0{suffix}", nn.Parameter(torch.empty(shape)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.GRU``'s initialisation: every parameter uniform in +-1/sqrt(hidden_size), in order."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -bound, bound)

    def direction(self, inputs: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """Hidden states [N, L, hidden] of one direction's cell over ``inputs`` [N, L, input], steps 0 to L-1 from
        a zero state (``reverse`` picks the ``_reverse`` weights; the caller orders the inputs)."""
        suffix = "_reverse" if reverse else ""
        weights = [getattr(self, f"{name}_l0{suffix}") for name in _GRU_PARAMS]
        h0 = inputs.new_zeros(1, inputs.shape[0], self.hidden_size)
        return torch.gru(inputs, h0, weights, True, 1, 0.0, self.training, False, True)[0]

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bidirectional=True"


class GPO(nn.Module):
    """Rank-weighted sum of per-dimension sorted features: ``forward(features [B, T, D], lengths [B] or None)
    -> [B, D]``; positions at or beyond a sample's length (clamped to [1, T]) are padding."""

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1):
        super().__init__()
        self.d_pe = int(d_pe)
        self.d_hidden = int(d_hidden)
        self.temperature = float(temperature)
        self.gru = RankGRU(self.d_pe, self.d_hidden)
        self.score = nn.Linear(self.d_hidden, 1, bias=False)

    def weight_table(self, length: int, every_length: bool = True, device=None) -> torch.Tensor:
        """Softmax weights over ranks: [length, length], row n-1 for n tokens (zero at ranks >= n), or with
        ``every_length`` False the one row [1, length]. GRU dtype with autocast off; softmax in float32 or wider."""
        device = self.score.weight.device if device is None else device
        w_dtype = self.gru.weight_ih_l0.dtype
        pe = sinusoid_encoding(length, self.d_pe, device=device, dtype=w_dtype)       # [T, d_pe]
        ranks = torch.arange(length, device=device)
        last = ranks if every_length else ranks[-1:]                                  # [R]: rank n-1 per row
        # the backward direction reads rank n-1-i at its step i, so rank k is its step n-1-k: one
        # index map serves both ways; k >= n (negative) is padding, which follows rank 0 and is masked
        back_index = last[:, None] - ranks[None, :]                                   # [R, T]
        valid = back_index >= 0
        back_index = back_index.clamp(min=0)
        with torch.autocast(device_type=pe.device.type, enabled=False):
            forward = self.gru.direction(pe[None])                                    # [1, T, H]
            reversed_pe = pe.index_select(0, back_index.flatten()).view(*back_index.shape, self.d_pe)
            backward = self.gru.direction(reversed_pe, reverse=True)                  # [R, T, H] by step
            backward = backward.gather(1, back_index[..., None].expand_as(backward))  # [R, T, H] by rank
            h = 0.5 * (forward + backward)
            s = self.score(h).squeeze(-1) / self.temperature                          # [R, T]
            s = s.masked_fill(~valid, float("-inf"))
            return torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=1)

    def rank_weights(self, lengths: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [B, length] over sorted ranks (zero from each length on, lengths in [1, length]) and the mask."""
        lengths = lengths.to(dtype=torch.long)
        table = self.weight_table(length, every_length=True, device=lengths.device)
        mask = length_mask(lengths, length)
        return table.index_select(0, lengths - 1), mask

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        t = features.shape[1]
        if lengths is None:
            w = self.weight_table(t, every_length=False, device=features.device)     # [1, T]
            srt = features.sort(dim=1, descending=True).values
        else:
            lengths = lengths.to(device=features.device, dtype=torch.long, non_blocking=True).clamp(1, t)
            if host_read_is_free(features.device) and not torch.compiler.is_compiling():
                # the CPU: cut at the longest sequence (the weight table is T x T GRU work)
                t = int(lengths.max())
                features = features[:, :t]
            w, mask = self.rank_weights(lengths, t)
            m = mask[..., None]
            srt = features.masked_fill(~m, float("-inf")).sort(dim=1, descending=True).values
            srt = srt.masked_fill(~m, 0.0)  # after a descending sort the padding sits at the end
        return (srt * w[..., None].to(srt.dtype)).sum(dim=1)


def bound_logvar(raw: torch.Tensor, bounds: tuple[float, float] | None) -> torch.Tensor:
    """Raw head outputs -> ``log lo + (log hi - log lo) * sigmoid(raw)`` (identity if ``bounds`` is None):
    smooth, so no gradient dies at a clamp (Pishdad et al.)."""
    if bounds is None:
        return raw
    lo, hi = float(bounds[0]), float(bounds[1])
    llo, lhi = math.log(lo), math.log(hi)
    return llo + (lhi - llo) * torch.sigmoid(raw)
