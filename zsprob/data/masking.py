"""Masked copies of inputs for ProLIP's occlusion inclusion term (a partial input includes the whole).

:func:`mask_tokens` replaces ordinary caption tokens by a mask token (ProLIP's trainer), :func:`delete_tokens`
deletes them ("a red star" -> "a star"); padding and start / end tokens are never touched. The mask token is
"?" for CLIP's BPE (ordinary and below end-of-text, so argmax pooling and the bag of words' length hold), else
the tokenizer's own. :func:`mask_image_cells` blanks pixel cells (ProLIP drops ViT patches; zsprob also trains
CNNs). Draws come from an explicit generator on its own device and are copied over without blocking."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zsprob.errors import UserError
from zsprob.methods import TEXT_MASK_MODES as TEXT_MASK_NAMES
from zsprob.utils.host_sync import to_device

__all__ = ["TextMaskSpec", "text_mask_spec", "mask_tokens", "delete_tokens", "cells_to_mask", "mask_image_cells",
           "CLIP_MASK_TOKEN"]

#: the mask token zsprob uses with open_clip's CLIP BPE: "?</w>"
CLIP_MASK_TOKEN = "?</w>"


@dataclass(frozen=True)
class TextMaskSpec:
    """The id that replaces masked tokens and the ids that are never masked (padding, specials)."""
    mask_id: int
    protected_ids: tuple[int, ...]


def text_mask_spec(tokenizer) -> TextMaskSpec:
    """Mask token and protected ids for an open_clip tokenizer: "?" for CLIP's BPE (module docstring), else the
    tokenizer's mask token, ``<extra_id_99>`` or its unk token."""
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
    return to_device(torch.rand(shape, generator=generator, device=device), target.device)


def _protected(tokens: torch.Tensor, spec: TextMaskSpec) -> torch.Tensor:
    """Bool [B, L]: the tokens whose id is one of ``spec.protected_ids`` (``torch.isin`` without its
    ``unique``: a binary search in the sorted ids)."""
    if not spec.protected_ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    ids = to_device(torch.tensor(sorted(spec.protected_ids), dtype=tokens.dtype), tokens.device)
    nearest = torch.searchsorted(ids, tokens.contiguous()).clamp(max=len(spec.protected_ids) - 1)
    return ids.take(nearest) == tokens


def mask_tokens(tokens: torch.Tensor, drop_prob: float, spec: TextMaskSpec,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """A copy of ``tokens`` [B, L] where each unprotected token is replaced by ``spec.mask_id``
    with probability ``drop_prob`` (one uniform draw per position, from ``generator``)."""
    draws = _draws_like(tokens.shape, generator, tokens)
    replace = (draws < drop_prob) & ~_protected(tokens, spec)
    return tokens.masked_fill(replace, spec.mask_id)


def delete_tokens(tokens: torch.Tensor, drop_prob: float, spec: TextMaskSpec,
                  generator: torch.Generator | None = None, pad_id: int = 0) -> torch.Tensor:
    """A copy of ``tokens`` [B, L] where each unprotected token is deleted with probability ``drop_prob`` (the
    draws of :func:`mask_tokens`); the kept tokens close up in order, ``pad_id`` fills the end of the row."""
    draws = _draws_like(tokens.shape, generator, tokens)
    keep = ~((draws < drop_prob) & ~_protected(tokens, spec)) & (tokens != pad_id)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept positions first, in order
    return torch.where(keep, tokens, torch.full_like(tokens, pad_id)).gather(1, order)


#: the masking function of each ProLIPLoss.text_mask_mode (the names' order: zsprob.methods.TEXT_MASK_MODES)
TEXT_MASK_MODES = dict(zip(TEXT_MASK_NAMES, (mask_tokens, delete_tokens)))


def cells_to_mask(n_cells: int, drop_prob: float) -> int:
    """How many of ``n_cells`` cells a masked image loses: n - max(1, int(n (1 - drop_prob)))."""
    return n_cells - max(1, int(n_cells * (1.0 - drop_prob)))


def mask_image_cells(images: torch.Tensor, drop_prob: float, cell: int,
                     generator: torch.Generator | None = None, fill: float = 0.0) -> torch.Tensor:
    """A copy of ``images`` [B, C, H, W] with :func:`cells_to_mask` grid cells of ``cell`` pixels
    set to ``fill`` in every image (cells drawn per image from ``generator``; the last row / column of
    cells may be smaller)."""
    cell = int(cell)
    batch, _, height, width = images.shape
    rows, cols = -(-height // cell), -(-width // cell)
    n_drop = cells_to_mask(rows * cols, drop_prob)
    device = generator.device if generator is not None else images.device
    scores = torch.rand(batch, rows * cols, generator=generator, device=device)
    dropped = torch.zeros(batch, rows * cols, dtype=torch.bool, device=device)
    if n_drop > 0:
        dropped.scatter_(1, scores.topk(n_drop, dim=1).indices, True)
    cell_mask = to_device(dropped.view(batch, 1, rows, cols), images.device)
    cell_row = torch.arange(height, device=images.device) // cell    # the cell of each pixel row / column
    cell_col = torch.arange(width, device=images.device) // cell
    pixel_mask = cell_mask.index_select(2, cell_row).index_select(3, cell_col)
    return images.masked_fill(pixel_mask, fill)
