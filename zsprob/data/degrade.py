"""Lossy views of images for the occlusion inclusion term: "an image is included in a degraded copy of itself".

:func:`degrade_images` puts each image (normalised [B, C, H, W], any device) through one operation of ``ops``
at a random strength (the table: docs/data.md). Random numbers come from one CPU generator and rows move by
index tensors copied without blocking; JPEG is Pillow on the CPU and :func:`zsprob.data.jpeg_torch.jpeg_roundtrip`
elsewhere, so no operation syncs. torchvision blurs, ``interpolate`` resamples; the rest is zsprob's."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from zsprob.data.masking import mask_image_cells
from zsprob.data.jpeg_torch import jpeg_roundtrip, libjpeg_roundtrip
from zsprob.methods import DEFAULT_DEGRADE_OPS
from zsprob.utils.host_sync import host_read_is_free, to_device

__all__ = ["degrade_images", "blur", "downsample", "dim", "jpeg", "grayscale", "crop", "shift", "sketch"]

BLUR_RANGE = (0.02, 0.07)        # Gaussian sigma as a share of the image side
DOWNSAMPLE_RANGE = (3.0, 8.0)    # the side is divided by this factor
DIM_RANGE = (0.15, 0.5)          # pixel values are multiplied by this factor
JPEG_QUALITY = (5, 20)           # inclusive
CROP_RANGE = (0.5, 0.8)          # side of the kept window as a share of the image side
SHIFT_RANGE = (0.25, 0.45)       # length of the move as a share of the image side
SKETCH_RANGE = (0.15, 0.35)      # gradient magnitude (pixel units) drawn fully black
LUMA = (0.299, 0.587, 0.114)


def _host(draws: torch.Tensor) -> list:
    """Python values of a draw made on the CPU generator: host data, read outside ``HostSyncCounter``'s
    view; a tensor on another device is refused."""
    if draws.device.type != "cpu":
        raise ValueError(f"only the CPU generator's draws are read on the host, got a tensor on {draws.device}")
    with torch._C.DisableTorchFunction():
        return draws.tolist()


def _uniform(generator, n: int, low: float, high: float) -> list[float]:
    return _host(low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64))


def _on(values, like: torch.Tensor) -> torch.Tensor:
    """Host numbers as a tensor of ``like``'s dtype on ``like``'s device (copied without blocking)."""
    return to_device(torch.as_tensor(values, dtype=like.dtype), like.device)


def _stats(mean, std, images: torch.Tensor):
    shape = (1, images.shape[1], 1, 1)
    return _on(mean, images).reshape(shape), _on(std, images).reshape(shape)


def _to_pixels(images, mean, std):
    mean, std = _stats(mean, std, images)
    return (images * std + mean).clamp(0.0, 1.0), mean, std


def blur(images: torch.Tensor, sigmas: Sequence[float]) -> torch.Tensor:
    """Gaussian blur of each image with its sigma in pixels (kernel 2 ceil(3 sigma) + 1, at most the
    largest odd size inside the image; reflected borders: torchvision's ``gaussian_blur``)."""
    from torchvision.transforms.functional import gaussian_blur

    side = min(images.shape[-2:])
    out = []
    for image, sigma in zip(images, sigmas):
        size = min(2 * math.ceil(3 * sigma) + 1, 2 * ((side - 1) // 2) + 1)
        out.append(gaussian_blur(image, [size, size], [float(sigma), float(sigma)]))
    return torch.stack(out)


def downsample(images: torch.Tensor, factors: Sequence[float], nearest: Sequence[bool]) -> torch.Tensor:
    """Each image area-averaged down to round(side / factor) (at least 2) and resized back, by
    nearest neighbours (hard blocks, "pixelated") or bilinearly ("low resolution")."""
    height, width = images.shape[-2:]
    out = []
    for image, factor, hard in zip(images, factors, nearest):
        small = F.interpolate(image[None], size=(max(2, round(height / factor)), max(2, round(width / factor))),
                              mode="area")
        up = (F.interpolate(small, size=(height, width), mode="nearest") if hard else
              F.interpolate(small, size=(height, width), mode="bilinear", align_corners=False))
        out.append(up[0])
    return torch.stack(out)


def dim(images: torch.Tensor, factors: Sequence[float], mean, std) -> torch.Tensor:
    """Pixel values times each image's factor, on normalised tensors: ((x std + m) f - m) / std."""
    factor = _on(factors, images).reshape(-1, 1, 1, 1)
    mean, std = _stats(mean, std, images)
    return images * factor + (mean / std) * (factor - 1.0)


def jpeg(images: torch.Tensor, qualities: Sequence[int], mean, std) -> torch.Tensor:
    """Each image JPEG-encoded at its quality and decoded (pixels clamped to [0, 1], 8 bits): by Pillow
    where a host read is free, else on the device by :func:`zsprob.data.jpeg_torch.jpeg_roundtrip`
    (the same pixels)."""
    pixels, mean, std = _to_pixels(images, mean, std)
    as_bytes = (pixels * 255.0).round().to(torch.uint8)
    if host_read_is_free(images.device):
        decoded = libjpeg_roundtrip(as_bytes, qualities)
    else:
        decoded = jpeg_roundtrip(as_bytes, qualities)
    return (decoded.to(images.dtype) / 255.0 - mean) / std


def _luma(pixels: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luminance of RGB pixels [B, 3, H, W] -> [B, 1, H, W]."""
    return (pixels * _on(LUMA, pixels).reshape(1, 3, 1, 1)).sum(1, keepdim=True)


def grayscale(images: torch.Tensor, mean, std) -> torch.Tensor:
    """Luminance (ITU-R 601 weights, on pixels clamped to [0, 1]) in every channel; images that are
    not RGB come back unchanged."""
    if images.shape[1] != 3:
        return images.clone()
    pixels, mean, std = _to_pixels(images, mean, std)
    return (_luma(pixels).expand_as(pixels) - mean) / std


def crop(images: torch.Tensor, ratios: Sequence[float], offsets: Sequence[tuple[float, float]]) -> torch.Tensor:
    """A square-proportioned window of ratio x (height, width) of each image, its corner at offset
    (dy, dx) in [0, 1] of the free room, resized back bilinearly."""
    height, width = images.shape[-2:]
    out = []
    for image, ratio, (dy, dx) in zip(images, ratios, offsets):
        ch, cw = max(1, round(height * ratio)), max(1, round(width * ratio))
        top, left = int(dy * (height - ch)), int(dx * (width - cw))
        window = image[None, :, top:top + ch, left:left + cw]
        out.append(F.interpolate(window, size=(height, width), mode="bilinear", align_corners=False)[0])
    return torch.stack(out)


def shift(images: torch.Tensor, moves: Sequence[tuple[float, float]]) -> torch.Tensor:
    """Each image's content moved by (dy, dx) (signed shares of the height / width), wrapping around:
    an object that crosses the frame is cut in two, and no fill draws streaks a rendered image lacks."""
    height, width = images.shape[-2:]
    return torch.stack([image.roll((round(dy * height), round(dx * width)), dims=(-2, -1))
                        for image, (dy, dx) in zip(images, moves)])


def sketch(images: torch.Tensor, thresholds: Sequence[float], mean, std) -> torch.Tensor:
    """Dark outlines on white: per pixel 1 - min(1, g / t), g the Sobel gradient magnitude of the
    luminance (pixels clamped to [0, 1], replicated borders), t the image's threshold; the same value
    in every channel."""
    pixels, mean, std = _to_pixels(images, mean, std)
    luma = _luma(pixels) if images.shape[1] == 3 else pixels.mean(1, keepdim=True)
    kx = _on([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], images) / 8.0
    kernels = torch.stack([kx, kx.t()])[:, None]                       # [2, 1, 3, 3]: d/dx, d/dy
    grad = F.conv2d(F.pad(luma, (1, 1, 1, 1), mode="replicate"), kernels)
    magnitude = grad.square().sum(1, keepdim=True).sqrt()
    t = _on(thresholds, images).reshape(-1, 1, 1, 1)
    drawn = 1.0 - (magnitude / t).clamp(max=1.0)
    return (drawn.expand_as(pixels) - mean) / std


def _apply(name: str, images, generator, mean, std, drop_prob, cell):
    """One operation on ``images`` with strengths drawn from ``generator`` (module docstring)."""
    n, side = images.shape[0], min(images.shape[-2:])
    if name == "cells":
        return mask_image_cells(images, drop_prob, cell, generator)
    if name == "blur":
        return blur(images, [s * side for s in _uniform(generator, n, *BLUR_RANGE)])
    if name == "downsample":
        factors = _uniform(generator, n, *DOWNSAMPLE_RANGE)
        return downsample(images, factors, _host(torch.rand(n, generator=generator) < 0.5))
    if name == "dim":
        return dim(images, _uniform(generator, n, *DIM_RANGE), mean, std)
    if name == "jpeg":
        return jpeg(images, _host(torch.randint(JPEG_QUALITY[0], JPEG_QUALITY[1] + 1, (n,), generator=generator)),
                    mean, std)
    if name == "grayscale":
        return grayscale(images, mean, std)
    if name == "shift":
        lengths = _uniform(generator, n, *SHIFT_RANGE)
        angles = _uniform(generator, n, 0.0, 2.0 * math.pi)
        return shift(images, [(r * math.sin(a), r * math.cos(a)) for r, a in zip(lengths, angles)])
    if name == "sketch":
        return sketch(images, _uniform(generator, n, *SKETCH_RANGE), mean, std)
    ratios = _uniform(generator, n, *CROP_RANGE)
    offsets = _host(torch.rand(n, 2, generator=generator, dtype=torch.float64))
    return crop(images, ratios, offsets)


def degrade_images(images: torch.Tensor, generator: torch.Generator, *, mean: Sequence[float], std: Sequence[float],
                   ops: Sequence[str] = DEFAULT_DEGRADE_OPS, drop_prob: float = 0.25,
                   cell: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image of ``images`` [B, C, H, W] (normalised with ``mean`` / ``std``) through one operation of
    ``ops`` drawn per image; ``generator``: a CPU generator (None: torch's global one); ``drop_prob`` /
    ``cell``: the ``cells`` operation's share and cell size. Returns the degraded copy and each image's
    index into ``ops``, both on the images' device.
    """
    ops = tuple(ops)
    choice = torch.randint(len(ops), (images.shape[0],), generator=generator)
    chosen = _host(choice)
    out = images.clone()
    for index, name in enumerate(ops):
        rows = [row for row, drawn in enumerate(chosen) if drawn == index]
        if rows:
            where = to_device(torch.tensor(rows, dtype=torch.long), images.device)
            degraded = _apply(name, images.index_select(0, where), generator, mean, std, drop_prob, cell)
            out.index_copy_(0, where, degraded)
    return out, to_device(choice, images.device)
