"""A bag-of-words text tower (:class:`BagOfWordsText`), and :class:`BowCLIP` pairing it with an open_clip
image tower (``"text_cfg": {"tower": "bow", ...}``): trained from scratch on SynthWorld it does not collapse
as the text transformer does (docs/findings.md).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zsprob.models.word_mixer import make_mixer
from zsprob.utils.masks import masked_mean


class BagOfWordsText(nn.Module):
    """Caption tokens [B, L] -> mean of per-token projected word embeddings [B, embed_dim]."""

    def __init__(self, embed_dim: int, vocab_size: int = 49408, width: int = 128, context_length: int = 77,
                 pad_id: int = 0, embed_init_std: float = 1.0, mixer: str = "none", mixer_layers: int = 1,
                 mixer_heads: int = 4, mixer_hidden: int | None = None, mixer_buckets: int = 2 ** 15):
        super().__init__()
        self.embed_dim = int(embed_dim)
        self.vocab_size = int(vocab_size)
        self.width = int(width)
        self.context_length = int(context_length)
        self.pad_id = int(pad_id)
        self.token_embedding = nn.Embedding(self.vocab_size, self.width)
        self.text_projection = nn.Linear(self.width, self.embed_dim, bias=False)
        self.ln_final = nn.Identity()  # ProbCLIP's heads apply "ln, projection, pooling"; a bag has no norm
        self.embed_init_std = float(embed_init_std)
        self.init_parameters()
        # built after the bag's own init, so the default ("none") draws exactly what it always drew
        self.mixer = make_mixer(mixer, self.width, self.context_length, mixer_layers, mixer_heads, mixer_hidden,
                                mixer_buckets)

    def init_parameters(self) -> None:
        nn.init.normal_(self.token_embedding.weight, std=self.embed_init_std)
        nn.init.normal_(self.text_projection.weight, std=self.width ** -0.5)

    def lengths(self, text: torch.Tensor) -> torch.Tensor:
        """Number of tokens before the padding (start-of-text .. end-of-text), at least 1."""
        return (text != self.pad_id).sum(dim=-1).clamp(min=1)

    def embed(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(word embeddings [B, L, width], the tokens, lengths); the full context is kept (no host read)."""
        x, lengths = self.token_embedding(text), self.lengths(text)
        if self.mixer is not None:
            x = self.mixer(x, lengths, text)
        return x, text, lengths

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        x, _, lengths = self.embed(text)
        return self.text_projection(masked_mean(x, lengths))


class BowCLIP(nn.Module):
    """open_clip image tower + :class:`BagOfWordsText`, with open_clip's CLIP interface."""

    def __init__(self, embed_dim: int, vision_cfg: dict, text_cfg: dict, quick_gelu: bool = False,
                 init_logit_scale: float = math.log(1 / 0.07), **_ignored):
        super().__init__()
        from open_clip.model import _build_vision_tower

        text_cfg = {k: v for k, v in dict(text_cfg).items() if k != "tower"}
        unknown = set(text_cfg) - {"vocab_size", "width", "context_length", "pad_id", "embed_init_std", "mixer",
                                   "mixer_layers", "mixer_heads", "mixer_hidden", "mixer_buckets"}
        if unknown:
            raise TypeError(f"bag-of-words text_cfg got unexpected keys {sorted(unknown)}")
        self.visual = _build_vision_tower(embed_dim, vision_cfg, quick_gelu, None)
        self.text = BagOfWordsText(embed_dim, **text_cfg)
        self.context_length = self.text.context_length
        self.vocab_size = self.text.vocab_size
        self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        f = self.visual(image)
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        f = self.text(text)
        return F.normalize(f, dim=-1) if normalize else f

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None):
        img = self.encode_image(image, normalize=True) if image is not None else None
        txt = self.encode_text(text, normalize=True) if text is not None else None
        return img, txt, self.logit_scale.exp()


def is_bow_config(cfg: dict) -> bool:
    return dict(cfg.get("text_cfg") or {}).get("tower") == "bow"
