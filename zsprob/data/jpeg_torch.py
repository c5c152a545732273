"""JPEG's round trip (encode at quality q, decode) without the bytes: on the images' device in torch,
and on the CPU through Pillow's libjpeg, the reference the device path equals pixel for pixel.

The device path writes libjpeg's lossy steps (colour conversion, 4:2:0 chroma, "islow" DCT, quantisation,
"fancy" upsampling) as integer tensor arithmetic, so nothing reads a pixel on the host; the steps and the
settings that make the two equal: docs/data.md."""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch

from zsprob.utils.host_sync import to_device

__all__ = ["jpeg_roundtrip", "libjpeg_bytes", "libjpeg_roundtrip", "quant_tables", "LUMINANCE_TABLE",
           "CHROMINANCE_TABLE"]

#: JPEG Annex K.1 tables (natural order: row = vertical frequency), as libjpeg's ``jcparam.c`` uses them
LUMINANCE_TABLE = (
    16, 11, 10, 16, 24, 40, 51, 61,
    12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77,
    24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101,
    72, 92, 95, 98, 112, 100, 103, 99)
CHROMINANCE_TABLE = (
    17, 18, 24, 47, 99, 99, 99, 99,
    18, 21, 26, 66, 99, 99, 99, 99,
    24, 26, 56, 99, 99, 99, 99, 99,
    47, 66, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99)

SCALEBITS = 16
ONE_HALF = 1 << (SCALEBITS - 1)
CENTER = 128


def _fix(x: float) -> int:
    """libjpeg's FIX(x): x in 16-bit fixed point, rounded."""
    return int(x * (1 << SCALEBITS) + 0.5)


def quant_tables(quality: int) -> tuple[list[int], list[int]]:
    """(luminance, chrominance) quantisation tables at ``quality`` (1..100), 64 entries each in
    natural order, as ``jpeg_set_quality(quality, force_baseline=TRUE)`` makes them."""
    quality = min(max(int(quality), 1), 100)
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality  # libjpeg's jpeg_quality_scaling
    luminance, chrominance = ([min(max((v * scale + 50) // 100, 1), 255) for v in basic]
                              for basic in (LUMINANCE_TABLE, CHROMINANCE_TABLE))
    return luminance, chrominance


def _pad_to(plane: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[B, H, W] edge-replicated at the bottom and right to multiples of ``rows`` and ``cols``."""
    height, width = plane.shape[-2:]
    pad_h, pad_w = -height % rows, -width % cols
    if not (pad_h or pad_w):
        return plane
    # replicate padding through index gathers: torch's replicate padding has no integer kernels
    row_index = torch.arange(height + pad_h, device=plane.device).clamp_(max=height - 1)
    col_index = torch.arange(width + pad_w, device=plane.device).clamp_(max=width - 1)
    return plane.index_select(-2, row_index).index_select(-1, col_index)


def _rgb_to_ycbcr(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 [B, 3, H, W] -> Y, Cb, Cr int32 [B, H, W] (libjpeg's ``rgb_ycc_convert``)."""
    r, g, b = rgb.unbind(1)
    y = (_fix(0.29900) * r + _fix(0.58700) * g + _fix(0.11400) * b + ONE_HALF) >> SCALEBITS
    offset = (CENTER << SCALEBITS) + ONE_HALF - 1
    cb = (-_fix(0.16874) * r - _fix(0.33126) * g + _fix(0.5) * b + offset) >> SCALEBITS
    cr = (_fix(0.5) * r - _fix(0.41869) * g - _fix(0.08131) * b + offset) >> SCALEBITS
    return y, cb, cr


def _ycbcr_to_rgb(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
    """Y, Cb, Cr int32 [B, H, W] -> RGB int32 [B, 3, H, W] clamped to [0, 255] (``ycc_rgb_convert``)."""
    cb, cr = cb - CENTER, cr - CENTER
    red = y + ((_fix(1.40200) * cr + ONE_HALF) >> SCALEBITS)
    green = y + ((-_fix(0.34414) * cb + ONE_HALF - _fix(0.71414) * cr) >> SCALEBITS)
    blue = y + ((_fix(1.77200) * cb + ONE_HALF) >> SCALEBITS)
    return torch.stack([red, green, blue], 1).clamp_(0, 255)


def _downsample(plane: torch.Tensor) -> torch.Tensor:
    """2 x 2 averages of int32 [B, H, W] (H, W even) with libjpeg's bias 1, 2, 1, 2, ... along a row."""
    batch, height, width = plane.shape
    sums = plane.reshape(batch, height // 2, 2, width // 2, 2).sum((2, 4))
    bias = 1 + torch.arange(width // 2, device=plane.device, dtype=plane.dtype) % 2
    return (sums + bias) >> 2


def _upsample(plane: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """int32 [B, h, w] chroma -> [B, height, width] by libjpeg's ``h2v2_fancy_upsample`` (9 / 3 / 3 / 1
    weights, edges replicated, biases 8 and 7); chroma at most two samples wide is repeated 2 x 2."""
    if plane.shape[-1] <= 2:
        return plane.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :height, :width]
    up, down = torch.cat([plane[:, :1], plane[:, :-1]], 1), torch.cat([plane[:, 1:], plane[:, -1:]], 1)
    colsum = torch.stack([3 * plane + up, 3 * plane + down], 2).flatten(1, 2)         # [B, 2h, w]
    left = torch.cat([colsum[..., :1], colsum[..., :-1]], -1)
    right = torch.cat([colsum[..., 1:], colsum[..., -1:]], -1)
    even, odd = (3 * colsum + left + 8) >> 4, (3 * colsum + right + 7) >> 4
    return torch.stack([even, odd], -1).flatten(-2, -1)[:, :height, :width]


#: the integer DCT pair's fixed point: constants in 13 bits, 2 more bits kept between the passes
CONST_BITS, PASS1_BITS = 13, 2
#: the rotations of the Loeffler-Ligtenberg-Moschytz factorisation (libjpeg's "islow" DCT) in CONST_BITS fixed point
LLM = {name: int(float(name) * (1 << CONST_BITS) + 0.5) for name in (
    "0.298631336", "0.390180644", "0.541196100", "0.765366865", "0.899976223", "1.175875602", "1.501321110",
    "1.847759065", "1.961570560", "2.053119869", "2.562915447", "3.072711026")}


def _descale(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x / 2^bits rounded half up (libjpeg's DESCALE: add half, shift right arithmetically)."""
    return (x + (1 << (bits - 1))) >> bits


def _odd_rotation(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor):
    """The odd half of the 8-point LLM butterfly, shared by both directions (forward: from x3 - x4, x2 - x5,
    x1 - x6, x0 - x7; inverse: from coefficients 7, 5, 3, 1)."""
    z1, z2, z3, z4 = a + d, b + c, a + c, b + d
    z5 = (z3 + z4) * LLM["1.175875602"]
    z1, z2 = z1 * -LLM["0.899976223"], z2 * -LLM["2.562915447"]
    z3, z4 = z3 * -LLM["1.961570560"] + z5, z4 * -LLM["0.390180644"] + z5
    return (a * LLM["0.298631336"] + z1 + z3, b * LLM["2.053119869"] + z2 + z4,
            c * LLM["3.072711026"] + z2 + z3, d * LLM["1.501321110"] + z1 + z4)


def _fdct_pass(samples: torch.Tensor, first: bool) -> torch.Tensor:
    """One pass of libjpeg's ``jpeg_fdct_islow`` along the last dimension (8 values): the first
    pass (rows) keeps PASS1_BITS extra bits, the second (columns) removes them."""
    x = samples.unbind(-1)
    s0, s1, s2, s3 = x[0] + x[7], x[1] + x[6], x[2] + x[5], x[3] + x[4]
    t10, t13, t11, t12 = s0 + s3, s0 - s3, s1 + s2, s1 - s2
    bits = CONST_BITS - PASS1_BITS if first else CONST_BITS + PASS1_BITS
    out0, out4 = ((t10 + t11) << PASS1_BITS, (t10 - t11) << PASS1_BITS) if first else \
        (_descale(t10 + t11, PASS1_BITS), _descale(t10 - t11, PASS1_BITS))
    z1 = (t12 + t13) * LLM["0.541196100"]
    out2, out6 = _descale(z1 + t13 * LLM["0.765366865"], bits), _descale(z1 - t12 * LLM["1.847759065"], bits)
    out7, out5, out3, out1 = (_descale(v, bits) for v in
                              _odd_rotation(x[3] - x[4], x[2] - x[5], x[1] - x[6], x[0] - x[7]))
    return torch.stack([out0, out1, out2, out3, out4, out5, out6, out7], -1)


def _idct_pass(coefficients: torch.Tensor, bits: int) -> torch.Tensor:
    """One pass of libjpeg's ``jpeg_idct_islow`` along the last dimension, descaled by ``bits``."""
    w = coefficients.unbind(-1)
    z1 = (w[2] + w[6]) * LLM["0.541196100"]
    even2, even3 = z1 - w[6] * LLM["1.847759065"], z1 + w[2] * LLM["0.765366865"]
    even0, even1 = (w[0] + w[4]) << CONST_BITS, (w[0] - w[4]) << CONST_BITS
    t10, t13, t11, t12 = even0 + even3, even0 - even3, even1 + even2, even1 - even2
    o0, o1, o2, o3 = _odd_rotation(w[7], w[5], w[3], w[1])
    outs = (t10 + o3, t11 + o2, t12 + o1, t13 + o0, t13 - o0, t12 - o1, t11 - o2, t10 - o3)
    return torch.stack([_descale(v, bits) for v in outs], -1)


def _fdct(blocks: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8 (y), 8 (x)] level-shifted samples -> 8 x the DCT-II coefficients [..., v, u]
    (libjpeg's scaling: its quantiser divides by 8 q)."""
    rows = _fdct_pass(blocks, True)
    return _fdct_pass(rows.transpose(-1, -2), False).transpose(-1, -2)


def _idct(coefficients: torch.Tensor) -> torch.Tensor:
    """Dequantised int64 coefficients [..., v, u] -> samples [..., y, x] before the +128 shift."""
    columns = _idct_pass(coefficients.transpose(-1, -2), CONST_BITS - PASS1_BITS).transpose(-1, -2)
    return _idct_pass(columns, CONST_BITS + PASS1_BITS + 3)


def _lossy_blocks(plane: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """int32 [B, H, W] samples (H, W multiples of 8) through the 8 x 8 DCT, quantisation by ``tables`` (int64
    [B, 8, 8], rounded half away from zero) and back: the decoded int32 samples."""
    batch, height, width = plane.shape
    blocks = (plane.to(torch.int64) - CENTER).reshape(batch, height // 8, 8, width // 8, 8).transpose(2, 3)
    eighths = _fdct(blocks)                                   # [B, H/8, W/8, 8, 8]: 8 x the coefficients
    steps = tables[:, None, None]
    quantised = eighths.sign() * ((eighths.abs() + 4 * steps) // (8 * steps))
    samples = _idct(quantised * steps)
    samples = (((samples + 512) & 1023) - 512 + CENTER).clamp_(0, 255).to(torch.int32)   # libjpeg's range limit
    return samples.transpose(2, 3).reshape(batch, height, width)


def jpeg_roundtrip(images: torch.Tensor, qualities: Sequence[int]) -> torch.Tensor:
    """Each image of ``images`` (uint8 [B, C, H, W]; C = 3: 4:2:0 colour, C = 1: greyscale) encoded at its
    quality (1..100) and decoded, on the images' device; returns uint8 [B, C, H, W]."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be [B, 1 or 3, H, W], got {tuple(images.shape)}")
    qualities = [int(q) for q in qualities]
    if len(qualities) != images.shape[0] or not all(1 <= q <= 100 for q in qualities):
        raise ValueError(f"one quality in 1..100 per image, got {qualities} for {images.shape[0]} images")
    height, width = images.shape[-2:]
    tables = [quant_tables(q) for q in qualities]
    luma_tables, chroma_tables = (to_device(torch.tensor([t[i] for t in tables], dtype=torch.int64).reshape(-1, 8, 8),
                                            images.device) for i in (0, 1))
    pixels = images.to(torch.int32)
    if images.shape[1] == 1:
        luma = _lossy_blocks(_pad_to(pixels[:, 0], 8, 8), luma_tables)
        return luma[:, None, :height, :width].to(torch.uint8)
    y, cb, cr = _rgb_to_ycbcr(pixels)
    y = _lossy_blocks(_pad_to(y, 16, 16), luma_tables)[:, :height, :width]
    # libjpeg pads the columns before downsampling, the rows after (the last chroma row repeated)
    chroma_h, chroma_w = -(-height // 2), -(-width // 2)
    cb, cr = (_pad_to(_downsample(_pad_to(c, 2, 16)), 8, 8) for c in (cb, cr))
    cb, cr = (_upsample(_lossy_blocks(c, chroma_tables)[:, :chroma_h, :chroma_w], height, width)
              for c in (cb, cr))
    return _ycbcr_to_rgb(y, cb, cr).to(torch.uint8)


def libjpeg_bytes(image: torch.Tensor, quality: int) -> bytes:
    """One uint8 [C, H, W] CPU image (C = 1 or 3) as baseline JPEG at ``quality``, encoded by Pillow's
    libjpeg with its defaults (4:2:0 chroma for colour): the bytes torchvision's ``encode_jpeg`` wrote."""
    from PIL import Image

    with torch._C.DisableTorchFunction():  # a read on the CPU, where it stalls nothing
        pixels = image.permute(1, 2, 0).contiguous().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buffer, "JPEG", quality=int(quality))
    return buffer.getvalue()


def libjpeg_roundtrip(images: torch.Tensor, qualities: Sequence[int]) -> torch.Tensor:
    """:func:`jpeg_roundtrip` on the CPU through Pillow's libjpeg: each uint8 [C, H, W] image of ``images``
    encoded at its quality and decoded; returns uint8 [B, C, H, W]."""
    from PIL import Image

    decoded = []
    for image, quality in zip(images, qualities):
        pixels = np.asarray(Image.open(io.BytesIO(libjpeg_bytes(image, quality))))
        decoded.append(torch.from_numpy(pixels.reshape(*pixels.shape[:2], -1).copy()).permute(2, 0, 1))
    return torch.stack(decoded)
