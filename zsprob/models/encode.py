"""Batched embedding of image datasets and caption lists into (mu, logvar): float32 CPU tensors in input
order, computed in eval mode (the model's mode restored), optionally under bf16 autocast."""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

from zsprob.errors import UserError
from zsprob.utils.devices import encode_autocast


def _device_of(model, device) -> torch.device:
    return torch.device(device) if device is not None else next(model.parameters()).device


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


#: batches of results kept on the device between copies to the host (each copy waits for the device)
HOST_COPY_EVERY = 64


def _to_host(parts: list[torch.Tensor], done: list[torch.Tensor]) -> None:
    """Append the device results ``parts`` to ``done`` as one float32 CPU tensor (one host copy), and empty it."""
    if parts:
        done.append(torch.cat(parts, 0).float().cpu())
        parts.clear()


def _encode_all(model, encode, batches: Iterable[torch.Tensor], device, precision: str, with_sigma: bool):
    """``encode`` (the image or text tower) over ``batches`` in eval mode: (mu [N, D], logvar [N, D] or None).
    Results stay on the device for :data:`HOST_COPY_EVERY` batches, then go to the host in one copy."""
    autocast = encode_autocast(device, precision)
    want_sigma = with_sigma and not model.deterministic
    was_training = model.training
    model.eval()
    pending, done = ([], []), ([], [])  # (means, log-variances) on the device / on the host

    def flush():
        for part, out in zip(pending, done):
            _to_host(part, out)
    try:
        for batch in batches:
            with autocast:
                mu, lv = encode(batch, with_sigma=want_sigma)
            pending[0].append(mu)
            if lv is not None:
                pending[1].append(lv)
            if len(pending[0]) == HOST_COPY_EVERY:
                flush()
        flush()
    finally:
        model.train(was_training)
    mus, lvs = (torch.cat(out, 0) if out else torch.zeros(0, model.embed_dim) for out in done)
    return mus, (lvs if want_sigma else None)


@torch.no_grad()
def encode_images(model, dataset_or_loader, *, batch_size: int = 256, device=None, num_workers: int = 0,
                  progress: bool = True, with_sigma: bool = True, precision: str = "fp32"):
    """Embed every image of a dataset (items ``(image_tensor, ...)`` or tensors) or a DataLoader:
    ``(mu [N, D], logvar [N, D] or None)``, float32 on the CPU, in dataset order."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    device = _device_of(model, device)
    if isinstance(dataset_or_loader, DataLoader) or not hasattr(dataset_or_loader, "__getitem__"):
        loader: Iterable = dataset_or_loader
    else:
        workers = int(num_workers)  # decoding processes, kept across passes; pinned batches for CUDA
        loader = DataLoader(dataset_or_loader, batch_size=batch_size, shuffle=False, num_workers=workers,
                            pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    batches = (_images_of(batch).to(device, non_blocking=True)
               for batch in tqdm(loader, desc="encode images", disable=not transient_bars(progress), leave=False))
    return _encode_all(model, model.encode_image, batches, device, precision, with_sigma)


def transient_bars(progress: bool) -> bool:
    """Whether to show a self-erasing progress bar; the CLI turns them off (``ZSPROB_TRANSIENT_BARS=0``) when
    stderr is not a terminal, where a later ``zsprob: error:`` line would follow the bar on its line."""
    return bool(progress) and os.environ.get("ZSPROB_TRANSIENT_BARS", "1") != "0"


@torch.no_grad()
def encode_texts(model, texts: Sequence[str] | torch.Tensor, *, batch_size: int = 512, device=None,
                 progress: bool = True, with_sigma: bool = True, precision: str = "fp32"):
    """Embed captions (a list of strings, or a LongTensor of tokens) in batches:
    ``(mu [N, D], logvar [N, D] or None)``, float32 on the CPU, in input order."""
    from tqdm.auto import tqdm

    if isinstance(texts, str):
        raise UserError("encode_texts expects a list of captions, not a single string")
    device = _device_of(model, device)
    chunks = (texts[start:start + batch_size]
              for start in tqdm(range(0, len(texts), batch_size), desc="encode texts",
                                disable=not transient_bars(progress), leave=False))
    batches = ((chunk if isinstance(chunk, torch.Tensor) else model.tokenizer(list(chunk))).to(device)
               for chunk in chunks)
    return _encode_all(model, model.encode_text, batches, device, precision, with_sigma)
