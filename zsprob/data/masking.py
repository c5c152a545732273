"""Masked copies of inputs for ProLIP's occlusion inclusion term (a partial input includes the whole).

Pure tensor functions with an explicit ``torch.Generator`` (same generator state, same masks):

- :func:`mask_tokens`: every ordinary token of a caption is replaced by a mask token with
  probability ``drop_prob`` (independently, as ProLIP's trainer does); padding and the special
  tokens (start / end of text) are never touched, so the caption length and the pooled position
  stay where the tower expects them.
- :func:`delete_tokens`: zsprob's variant for SynthWorld's recipe: each ordinary token is DELETED
  with probability ``drop_prob`` and the rest close up (padding moves to the end), so the copy is
  a shorter caption made of a subset of the words - for a bag of words exactly a more general
  caption ("a red star" -> "a star"), which is what the inclusion term should teach.
- :func:`text_mask_spec`: the mask token and the protected ids of a tokenizer.
  open_clip's CLIP BPE (``SimpleTokenizer``) has no mask token; zsprob uses "?" (id 286 in the
  CLIP vocabulary, the id ProLIP's ``--replace-token`` help names for CLIP). It is an ordinary
  token: below the end-of-text id (49407), so a tower that pools at the largest id (open_clip's
  "argmax" pooling) still pools at end-of-text, and not 0, so a tower that counts the tokens
  before the padding (zsprob's bag of words) keeps the caption's length. Hugging Face tokenizers
  (open_clip's ``HFTokenizer``): their ``mask_token`` if they have one, else ``<extra_id_99>``
  when the vocabulary has it (id 32000 in SigLIP's, ProLIP's choice), else ``unk_token``; every
  special id of the tokenizer, and the padding id, is protected.
- :func:`mask_image_cells`: ProLIP drops patch TOKENS inside its ViT (a masked image keeps
  ``int(n_patches * drop_prob)`` patches and their position embeddings). zsprob also trains CNN
  towers, which have no tokens, so it masks the INPUT instead: the image is cut into a grid of
  ``cell`` x ``cell`` pixel cells (the last row / column may be smaller), exactly
  ``n_cells - max(1, int(n_cells * (1 - drop_prob)))`` cells, drawn per image, are set to
  ``fill`` (0 = the dataset mean after the usual normalisation) and the rest is unchanged. For a
  ViT whose patches align with the grid this hides the same information as dropping those
  patches, but the blanked patches still pass through the tower as tokens.

Every function takes tensors on any device and returns its copy on that device without waiting
on it: the draws are made on the generator's device (a CPU generator: the same masks on every
device), then copied to the tensors' device without blocking; the masks are applied with tensor
operations (no ``nonzero``, ``unique`` or host reads).

Written on plain torch (rand, topk, searchsorted); open_clip provides the tokenizers it reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zsprob.errors import UserError

__all__ = ["TextMaskSpec", "text_mask_spec", "mask_tokens", "delete_tokens", "cells_to_mask", "mask_image_cells", "CLIP_MASK_TOKEN"]

#: the mask token zsprob uses with open_clip's CLIP BPE: "?</w>"
CLIP_MASK_TOKEN = "?</w>"


@dataclass(frozen=True)
class TextMaskSpec:
    """The id that replaces masked tokens and the ids that are never masked (padding, specials)."""
    mask_id: int
    protected_ids: tuple[int, ...]


def _check_prob(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{name} must be in [0, 1], got {value}")
    return value


def text_mask_spec(tokenizer) -> TextMaskSpec:
    """Mask token and protected ids for an open_clip tokenizer (module docstring)."""
    encoder = getattr(tokenizer, "encoder", None)
    if isinstance(encoder, dict) and hasattr(tokenizer, "sot_token_id"):  # open_clip SimpleTokenizer
        protected = {0, int(tokenizer.sot_token_id), int(tokenizer.eot_token_id)}
        return TextMaskSpec(int(encoder[CLIP_MASK_TOKEN]), tuple(sorted(protected)))
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "all_special_ids"):  # open_clip HFTokenizer
        mask_id = hf.mask_token_id
        if mask_id is None:
            extra = hf.convert_tokens_to_ids("<extra_id_99>")
            mask_id = extra if extra is not None and extra != hf.unk_token_id else hf.unk_token_id
        if mask_id is None:
            raise UserError(f"tokenizer {type(hf).__name__} has no mask, <extra_id_99> or unk token to mask with")
        protected = set(int(i) for i in hf.all_special_ids)
        if hf.pad_token_id is not None:
            protected.add(int(hf.pad_token_id))
        protected.discard(int(mask_id))
        return TextMaskSpec(int(mask_id), tuple(sorted(protected)))
    raise UserError(f"cannot find a mask token for tokenizer {type(tokenizer).__name__} "
                    "(supported: open_clip's SimpleTokenizer and HFTokenizer)")


def _draws_like(shape, generator: torch.Generator | None, target: torch.Tensor) -> torch.Tensor:
    """Uniform draws of ``shape`` on the generator's device (``target``'s without one), copied to
    ``target``'s device without blocking."""
    device = generator.device if generator is not None else target.device
    return torch.rand(shape, generator=generator, device=device).to(target.device, non_blocking=True)


def _protected(tokens: torch.Tensor, spec: TextMaskSpec) -> torch.Tensor:
    """Bool [B, L]: the tokens whose id is one of ``spec.protected_ids`` (``torch.isin`` without its
    ``unique``: a binary search in the sorted ids)."""
    if not spec.protected_ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    ids = torch.tensor(sorted(spec.protected_ids), dtype=tokens.dtype).to(tokens.device, non_blocking=True)
    nearest = torch.searchsorted(ids, tokens.contiguous()).clamp(max=len(spec.protected_ids) - 1)
    return ids.take(nearest) == tokens


def mask_tokens(tokens: torch.Tensor, drop_prob: float, spec: TextMaskSpec,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """A copy of ``tokens`` [B, L] where each unprotected token is replaced by ``spec.mask_id``
    with probability ``drop_prob`` (one uniform draw per position, from ``generator``)."""
    drop_prob = _check_prob("drop_prob", drop_prob)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, L], got {tuple(tokens.shape)}")
    draws = _draws_like(tokens.shape, generator, tokens)
    replace = (draws < drop_prob) & ~_protected(tokens, spec)
    return tokens.masked_fill(replace, spec.mask_id)


def delete_tokens(tokens: torch.Tensor, drop_prob: float, spec: TextMaskSpec,
                  generator: torch.Generator | None = None, pad_id: int = 0) -> torch.Tensor:
    """A copy of ``tokens`` [B, L] where each unprotected token is deleted with probability
    ``drop_prob`` (one uniform draw per position, from ``generator``, the same draws as
    :func:`mask_tokens`); the kept tokens keep their order and the freed positions become
    ``pad_id`` at the end of the row."""
    drop_prob = _check_prob("drop_prob", drop_prob)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, L], got {tuple(tokens.shape)}")
    draws = _draws_like(tokens.shape, generator, tokens)
    keep = ~((draws < drop_prob) & ~_protected(tokens, spec)) & (tokens != pad_id)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept positions first, in order
    return torch.where(keep, tokens, torch.full_like(tokens, pad_id)).gather(1, order)


#: text masking functions by ProLIPLoss.text_mask_mode
TEXT_MASK_MODES = {"replace": mask_tokens, "delete": delete_tokens}


def cells_to_mask(n_cells: int, drop_prob: float) -> int:
    """How many of ``n_cells`` cells a masked image loses: n - max(1, int(n (1 - drop_prob)))."""
    return n_cells - max(1, int(n_cells * (1.0 - drop_prob)))


def mask_image_cells(images: torch.Tensor, drop_prob: float, cell: int,
                     generator: torch.Generator | None = None, fill: float = 0.0) -> torch.Tensor:
    """A copy of ``images`` [B, C, H, W] with :func:`cells_to_mask` grid cells of ``cell`` pixels
    set to ``fill`` in every image (cells drawn per image from ``generator``)."""
    drop_prob = _check_prob("image drop_prob", drop_prob)
    if images.dim() != 4:
        raise ValueError(f"images must be [B, C, H, W], got {tuple(images.shape)}")
    cell = int(cell)
    if cell < 1:
        raise UserError(f"mask cell size must be >= 1 pixel, got {cell}")
    batch, _, height, width = images.shape
    rows, cols = -(-height // cell), -(-width // cell)
    n_drop = cells_to_mask(rows * cols, drop_prob)
    device = generator.device if generator is not None else images.device
    scores = torch.rand(batch, rows * cols, generator=generator, device=device)
    dropped = torch.zeros(batch, rows * cols, dtype=torch.bool, device=device)
    if n_drop > 0:
        dropped.scatter_(1, scores.topk(n_drop, dim=1).indices, True)
    cell_mask = dropped.view(batch, 1, rows, cols).to(images.device, non_blocking=True)
    cell_row = torch.arange(height, device=images.device) // cell    # the cell of each pixel row / column
    cell_col = torch.arange(width, device=images.device) // cell
    pixel_mask = cell_mask.index_select(2, cell_row).index_select(3, cell_col)
    return images.masked_fill(pixel_mask, fill)
