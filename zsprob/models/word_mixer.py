"""Word mixers of the bag-of-words tower (``text_cfg.mixer``): in a plain bag a prompt template shifts every
class alike. ``"mlp"``, ``"transformer"`` and ``"bigram"`` (fastText's hashed bigrams) map word vectors
[B, L, w] to [B, L, w]; their residual output layers start at zero, so a mixed tower starts as the bag.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zsprob.errors import UserError
from zsprob.utils.checks import check_count
from zsprob.utils.masks import length_mask, masked_mean

MIXERS = ("none", "mlp", "transformer", "bigram")
BIGRAM_PRIME = 1_000_003  # token pair (a, b) -> (a * BIGRAM_PRIME + b) mod buckets


def _zero_(layer: nn.Linear) -> None:
    nn.init.zeros_(layer.weight)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class PooledWordMLP(nn.Module):
    """Word vectors [B, L, w] -> each plus ``MLP(LN(masked mean))``: the pooled words pass a GELU MLP."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        _zero_(self.fc2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(masked_mean(x, lengths)))))[:, None, :]


class WordBlock(nn.Module):
    """A pre-LayerNorm transformer block without a causal mask: attention over the caption's words, then an MLP."""

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        if width % heads:
            raise UserError(f"mixer width {width} is not divisible by mixer_heads {heads}")
        self.heads = int(heads)
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        _zero_(self.out)
        _zero_(self.fc2)

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """x [B, L, w]; keys [B, 1, 1, L] bool, True where a position may be attended to."""
        b, n, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = x + self.out(att.transpose(1, 2).reshape(b, n, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class WordTransformer(nn.Module):
    """Word embeddings [B, L, w] + learned positions -> ``layers`` :class:`WordBlock` s -> [B, L, w]."""

    def __init__(self, width: int, context_length: int, layers: int, heads: int, hidden: int):
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        self.blocks = nn.ModuleList(WordBlock(width, heads, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        keys = length_mask(lengths, x.shape[1])[:, None, None, :]
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)
        for blk in self.blocks:
            x = blk(x, keys)
        return x


class BigramMixer(nn.Module):
    """Word vectors [B, L, w] -> each plus the hashed embedding of the bigram (this token, the next one) it
    starts; the caption's last token starts none. The table starts at zero."""

    def __init__(self, width: int, buckets: int):
        super().__init__()
        self.buckets = int(buckets)
        self.bigram = nn.Embedding(self.buckets, width)
        nn.init.zeros_(self.bigram.weight)

    def bigram_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, L - 1] table rows of the token pairs (tokens[:, i], tokens[:, i + 1])."""
        pairs = tokens.long()
        return (pairs[:, :-1] * BIGRAM_PRIME + pairs[:, 1:]) % self.buckets

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[1]
        if n < 2:
            return x
        starts = length_mask(lengths - 1, n - 1)[..., None].to(x.dtype)         # a bigram inside the caption
        pairs = self.bigram(self.bigram_ids(tokens)).to(x.dtype) * starts         # [B, L - 1, w]
        return x + F.pad(pairs, (0, 0, 0, 1))


def make_mixer(kind: str, width: int, context_length: int, layers: int, heads: int,
               hidden: int | None, buckets: int = 2 ** 15) -> nn.Module | None:
    """The mixer ``kind`` names (None for ``"none"``); ``hidden`` defaults to 4 x width."""
    if kind not in MIXERS:
        raise UserError(f"text_cfg mixer must be one of {', '.join(MIXERS)}, got {kind!r}")
    hidden = int(hidden) if hidden else 4 * int(width)
    if kind == "bigram":  # null: the default table size
        return BigramMixer(width, check_count(buckets, "mixer_buckets") or 2 ** 15)
    if kind == "mlp":
        return PooledWordMLP(width, hidden)
    if kind == "transformer":
        if int(layers) < 1 or int(heads) < 1:
            raise UserError(f"mixer_layers and mixer_heads must be >= 1, got {layers} and {heads}")
        return WordTransformer(width, context_length, int(layers), int(heads), hidden)
    return None
