"""Batched embedding of image datasets and caption lists into (mu, logvar).

torch's DataLoader batches datasets, tqdm shows progress and the model's open_clip tokenizer
turns captions into tokens; zsprob only loops, moves batches to the device and concatenates.
Both functions run under ``torch.no_grad()`` with the model in eval mode (its previous mode is
restored) and return float32 CPU tensors; ``logvar`` is None for deterministic models.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from zsprob.errors import UserError


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _images_of(batch):
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, dict):
        for k in ("image", "images", "img"):
            if k in batch:
                return batch[k]
    raise UserError("encode_images expects dataset items (image_tensor, ...) or image tensors; got "
                    f"{type(batch).__name__} (did you forget the transform, e.g. model.preprocess_val?)")


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(parts, 0) if parts else torch.zeros(0, dim)


@torch.no_grad()
def encode_images(model, dataset_or_loader, *, batch_size: int = 256, device=None, num_workers: int = 0,
                  progress: bool = True, with_sigma: bool = True):
    """Embed every image of a dataset (items ``(image_tensor, ...)`` or tensors) or a DataLoader.

    Returns ``(mu [N, D], logvar [N, D] or None)``, float32 on the CPU, in dataset order.
    """
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    device = torch.device(device) if device is not None else _device_of(model)
    if isinstance(dataset_or_loader, DataLoader) or not hasattr(dataset_or_loader, "__getitem__"):
        loader: Iterable = dataset_or_loader
    else:
        loader = DataLoader(dataset_or_loader, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    want_sigma = with_sigma and not model.deterministic
    was_training = model.training
    model.eval()
    mus, lvs = [], []
    try:
        for batch in tqdm(loader, desc="encode images", disable=not progress, leave=False):
            imgs = _images_of(batch).to(device, non_blocking=True)
            mu, lv = model.encode_image(imgs, with_sigma=want_sigma)
            mus.append(mu.float().cpu())
            if lv is not None:
                lvs.append(lv.float().cpu())
    finally:
        model.train(was_training)
    return _cat(mus, model.embed_dim), (_cat(lvs, model.embed_dim) if want_sigma else None)


@torch.no_grad()
def encode_texts(model, texts: Sequence[str] | torch.Tensor, *, batch_size: int = 512, device=None,
                 progress: bool = True, with_sigma: bool = True):
    """Embed captions (a list of strings, or a LongTensor of tokens) in batches.

    Returns ``(mu [N, D], logvar [N, D] or None)``, float32 on the CPU, in input order.
    """
    from tqdm.auto import tqdm

    if isinstance(texts, str):
        raise UserError("encode_texts expects a list of captions, not a single string")
    device = torch.device(device) if device is not None else _device_of(model)
    want_sigma = with_sigma and not model.deterministic
    n = len(texts)
    was_training = model.training
    model.eval()
    mus, lvs = [], []
    try:
        for start in tqdm(range(0, n, batch_size), desc="encode texts", disable=not progress, leave=False):
            chunk = texts[start:start + batch_size]
            tokens = chunk if isinstance(chunk, torch.Tensor) else model.tokenizer(list(chunk))
            mu, lv = model.encode_text(tokens.to(device), with_sigma=want_sigma)
            mus.append(mu.float().cpu())
            if lv is not None:
                lvs.append(lv.float().cpu())
    finally:
        model.train(was_training)
    return _cat(mus, model.embed_dim), (_cat(lvs, model.embed_dim) if want_sigma else None)


__all__ = ["encode_images", "encode_texts"]
