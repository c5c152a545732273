"""Text SizeAugment on token batches, as naver-ai/pcmepp applies it to COCO training captions.

Each token between start and end is selected with probability ``share``, then masked (``masking``), randomised
(``erasing``) or deleted. Unlike the official code, random tokens come from ``[1, vocab_size - 2)``, so neither
padding nor CLIP's start / end ids appear inside a caption. Tokens [B, L] stay on their device; nothing is read back.
"""
from __future__ import annotations

import torch

from zsprob.errors import UserError
from zsprob.utils.host_sync import to_device

__all__ = ["size_augment_tokens", "mask_token_of", "TextSizeAugment"]

CLIP_MASK_TOKEN = 44  # open_clip SimpleTokenizer().encoder["M"]
CLIP_VOCAB_SIZE = 49408


def mask_token_of(tokenizer) -> tuple[int, int]:
    """(mask token id, vocabulary size) of a tokenizer: CLIP's "M" BPE token, or CLIP's ids."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    encoder = getattr(inner, "encoder", None)
    mask = encoder.get("M", CLIP_MASK_TOKEN) if isinstance(encoder, dict) else CLIP_MASK_TOKEN
    vocab = getattr(inner, "vocab_size", None) or CLIP_VOCAB_SIZE
    return int(mask), int(vocab)


def _checked(share: float, masking: float, erasing: float) -> tuple[float, float, float]:
    """The three shares as floats, refused in one line when masking + erasing > 1 (the config schema holds
    each in [0, 1])."""
    values = tuple(float(v) for v in (share, masking, erasing))
    if values[1] + values[2] > 1.0:
        raise UserError(f"text SizeAugment masking + erasing must be <= 1, got {masking} + {erasing}")
    return values


def size_augment_tokens(tokens: torch.Tensor, *, share: float = 0.2, masking: float = 0.5,
                        erasing: float = 0.1, mask_token: int = CLIP_MASK_TOKEN,
                        vocab_size: int = CLIP_VOCAB_SIZE, generator: torch.Generator | None = None,
                        return_counts: bool = False):
    """``tokens`` [B, L] (not modified) with caption tokens masked, randomised or deleted (module docstring);
    ``generator`` draws on its own device (None: torch's global RNG on the tokens' device). Returns [B, L]
    tokens padded with 0, and with ``return_counts`` the counts of candidates, masked, random and deleted
    tokens (reading them waits on the device).
    """
    if tokens.dim() != 2:
        raise UserError(f"text SizeAugment expects tokens [B, L], got shape {tuple(tokens.shape)}")
    share, masking, erasing = _checked(share, masking, erasing)
    if vocab_size < 4:
        raise UserError(f"text SizeAugment needs a vocabulary of at least 4 tokens, got {vocab_size}")
    bsz, length = tokens.shape
    device = tokens.device
    positions = torch.arange(length, device=device).expand(bsz, length)
    nonzero = tokens != 0
    last = torch.where(nonzero, positions, torch.zeros_like(positions)).amax(dim=1, keepdim=True)
    candidates = (positions > 0) & (positions < last)
    draw, random_ids = _draws(bsz, length, vocab_size, generator, device)
    selected = candidates & (draw < share)
    within = draw / share if share > 0 else draw
    masked = selected & (within < masking)
    randomised = selected & (within >= masking) & (within < masking + erasing)
    deleted = selected & ~masked & ~randomised
    out = torch.where(masked, torch.full_like(tokens, mask_token), tokens)
    out = torch.where(randomised, random_ids.to(tokens.dtype), out)
    shortened = _close_gaps(out, ~deleted)
    if not return_counts:
        return shortened
    counts = {"candidates": int(candidates.sum()), "masked": int(masked.sum()),
              "random": int(randomised.sum()), "deleted": int(deleted.sum())}
    return shortened, counts


def _draws(bsz: int, length: int, vocab_size: int, generator: torch.Generator | None, device: torch.device):
    """The selection draw U[0, 1) and the random token ids, both [B, L], drawn on the generator's
    device (the tokens' device without a generator) and moved to ``device`` without waiting."""
    where = generator.device if generator is not None else device
    draw = torch.rand(bsz, length, generator=generator, device=where)
    random_ids = torch.randint(1, vocab_size - 2, (bsz, length), generator=generator, device=where)
    return to_device(draw, device), to_device(random_ids, device)


def _close_gaps(tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's kept tokens moved to the front in order, padded with 0: output position p takes the
    (p + 1)-th kept token, found by a sorted search in the running count (no data-dependent shapes)."""
    bsz, length = tokens.shape
    kept_so_far = keep.long().cumsum(dim=1)
    wanted = torch.arange(1, length + 1, device=tokens.device).expand(bsz, length).contiguous()
    source = torch.searchsorted(kept_so_far, wanted).clamp_(max=length - 1)
    present = wanted <= kept_so_far[:, -1:]
    return torch.where(present, tokens.gather(1, source), torch.zeros_like(tokens))


class TextSizeAugment:
    """The training loop's view: config values and the tokenizer's ids bound once."""

    def __init__(self, share: float, masking: float, erasing: float, tokenizer=None):
        self.share, self.masking, self.erasing = _checked(share, masking, erasing)
        self.mask_token, self.vocab_size = mask_token_of(tokenizer)

    def __call__(self, tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return size_augment_tokens(tokens, share=self.share, masking=self.masking, erasing=self.erasing,
                                   mask_token=self.mask_token, vocab_size=self.vocab_size, generator=generator)
