"""Tower adapter for zsprob's bag-of-words text tower: no blocks, a per-token projection pooled over the caption."""
from __future__ import annotations

import torch
from torch import nn

from zsprob.models.towers.openclip import TextHeads
from zsprob.utils.masks import masked_mean


class BowTextTower(TextHeads):
    """A :class:`zsprob.models.bow_text.BagOfWordsText` tower."""

    kind = "bow"
    is_clip = False

    def __init__(self, text: nn.Module):
        self.src = text
        self.blocks: list[nn.Module] = []
        self.num_blocks = 0
        self.width = text.width

    def embed(self, text: torch.Tensor):
        x, text, lengths = self.src.embed(text)
        return x, None, (text, lengths)

    def native_pool(self, x: torch.Tensor, ln: nn.Module, ctx) -> torch.Tensor:
        return masked_mean(ln(x), ctx[1])

    @staticmethod
    def depth_of(rest: str) -> int:
        return 0 if rest.startswith("token_embedding.") else 1
