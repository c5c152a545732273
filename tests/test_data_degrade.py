"""Lossy image views for the occlusion inclusion term (zsprob.data.degrade): each operation against a
direct float64 / Pillow reference, the per-image draw, the normalisation bookkeeping, and the
trainer's wiring (image_mask_mode: degrade)."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from zsprob.data import degrade
from zsprob.errors import UserError
from zsprob.methods import DEFAULT_DEGRADE_OPS, DEGRADE_OPS
from zsprob.utils.host_sync import HostSyncCounter

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def _normalised(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _pixels(images: torch.Tensor) -> torch.Tensor:
    return images * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def _scenes(n: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Normalised images with sharp edges (squares of random colours) and some noise."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(n, 3, 1, 1, generator=g).expand(n, 3, size, size).clone()
    for b in range(n):
        top, left = (int(v) for v in torch.randint(0, size // 2, (2,), generator=g))
        pixels[b, :, top:top + size // 3, left:left + size // 3] = torch.rand(3, 1, 1, generator=g)
    pixels += 0.05 * torch.rand(pixels.shape, generator=g)
    return _normalised(pixels.clamp(0, 1))


def _gauss_blur_reference(image: np.ndarray, sigma: float, size: int) -> np.ndarray:
    """Separable float64 Gaussian convolution with reflected borders (numpy only)."""
    half = size // 2
    taps = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma) ** 2)
    taps /= taps.sum()
    out = image.astype(np.float64)
    for axis in (1, 2):
        pad = [(0, 0)] * 3
        pad[axis] = (half, half)
        padded = np.pad(out, pad, mode="reflect")
        out = sum(taps[k] * np.take(padded, np.arange(k, k + image.shape[axis]), axis=axis) for k in range(size))
    return out


@pytest.mark.parametrize("sigma", [0.8, 1.7, 3.1])
def test_blur_equals_a_float64_gaussian_convolution(sigma):
    images = _scenes(2, 32)
    out = degrade.blur(images, [sigma, sigma])
    size = 2 * math.ceil(3 * sigma) + 1
    for b in range(2):
        ref = _gauss_blur_reference(images[b].numpy(), sigma, size)
        np.testing.assert_allclose(out[b].numpy(), ref, atol=2e-5)
    # a blur removes detail: total variation falls
    tv = lambda x: (x[..., 1:, :] - x[..., :-1, :]).abs().sum() + (x[..., 1:] - x[..., :-1]).abs().sum()
    assert tv(out) < 0.8 * tv(images)


def test_blur_kernel_never_exceeds_a_small_image():
    images = _scenes(1, 8)
    out = degrade.blur(images, [5.0])   # 2 ceil(15) + 1 = 31 > 8: clipped to 7
    assert out.shape == images.shape and torch.isfinite(out).all()


def test_downsample_nearest_and_bilinear():
    images = _scenes(2, 32)
    hard = degrade.downsample(images[:1], [4.0], [True])
    # nearest: 8 x 8 blocks, each the mean of its 4 x 4 input block
    blocks = images[:1].reshape(1, 3, 8, 4, 8, 4).mean((3, 5))
    torch.testing.assert_close(hard, blocks.repeat_interleave(4, 2).repeat_interleave(4, 3), atol=1e-6, rtol=0)
    smooth = degrade.downsample(images[1:], [4.0], [False])
    assert not torch.allclose(smooth, images[1:]) and (smooth.amax() <= images[1:].amax() + 1e-5)
    constant = torch.full((1, 3, 32, 32), 0.3)
    torch.testing.assert_close(degrade.downsample(constant, [5.5], [False]), constant)


def test_dim_scales_pixel_values():
    images = _scenes(3, 16)
    out = degrade.dim(images, [0.2, 0.35, 0.5], MEAN, STD)
    torch.testing.assert_close(_pixels(out), _pixels(images) * torch.tensor([0.2, 0.35, 0.5]).view(3, 1, 1, 1),
                               atol=1e-5, rtol=0)


def test_jpeg_equals_pillow_at_the_same_quality():
    images = _scenes(2, 32)
    out = degrade.jpeg(images, [6, 18], MEAN, STD)
    as_bytes = (_pixels(images).clamp(0, 1) * 255).round().to(torch.uint8)
    for b, quality in enumerate((6, 18)):
        buf = io.BytesIO()
        Image.fromarray(as_bytes[b].permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=quality)
        ref = torch.from_numpy(np.array(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))).permute(2, 0, 1)
        got = (_pixels(out[b:b + 1])[0] * 255).round()
        # libjpeg in both; decoders may differ by a grey level in a few pixels
        assert (got - ref.float()).abs().mean() < 1.0
    assert not torch.allclose(out, images, atol=1e-3)


def test_grayscale_is_luminance_in_every_channel():
    images = _scenes(2, 16)
    out = _pixels(degrade.grayscale(images, MEAN, STD))
    luma = (_pixels(images).clamp(0, 1) * torch.tensor(degrade.LUMA).view(1, 3, 1, 1)).sum(1)
    for c in range(3):
        torch.testing.assert_close(out[:, c], luma, atol=1e-5, rtol=0)


def test_crop_keeps_a_window_and_resizes_it():
    images = _scenes(1, 32)
    out = degrade.crop(images, [0.5], [(1.0, 0.0)])      # the bottom-left 16 x 16 window
    ref = torch.nn.functional.interpolate(images[:, :, 16:32, 0:16], size=(32, 32), mode="bilinear",
                                          align_corners=False)
    torch.testing.assert_close(out, ref)


def test_shift_moves_the_content_at_the_same_scale_wrapping_around():
    images = _scenes(2, 32)
    out = degrade.shift(images, [(0.25, 0.0), (-0.125, 0.5)])
    torch.testing.assert_close(out[0, :, 8:], images[0, :, :24])      # down by 8 rows ...
    torch.testing.assert_close(out[0, :, :8], images[0, :, 24:])      # ... the bottom rows wrap to the top
    torch.testing.assert_close(out[1, :, :28, 16:], images[1, :, 4:, :16])
    # a permutation of the pixels: nothing is blurred or rescaled
    torch.testing.assert_close(out.flatten(2).sort(-1).values, images.flatten(2).sort(-1).values)


def test_sketch_is_dark_outlines_on_white_from_a_float64_sobel_reference():
    pixels = torch.full((1, 3, 16, 16), 0.8, dtype=torch.float64)
    pixels[:, :, 4:12, 4:12] = torch.tensor([0.1, 0.5, 0.2], dtype=torch.float64).view(3, 1, 1)   # a square
    images = _normalised(pixels.float())
    out = _pixels(degrade.sketch(images, [0.25], MEAN, STD))
    luma = (pixels.clamp(0, 1) * torch.tensor(degrade.LUMA, dtype=torch.float64).view(1, 3, 1, 1)).sum(1)[0]
    padded = np.pad(luma.numpy(), 1, mode="edge")
    taps = ((-1, 1), (0, 2), (1, 1))
    gx = sum(w * (padded[1 + dy:17 + dy, 2:18] - padded[1 + dy:17 + dy, 0:16]) for dy, w in taps) / 8
    gy = sum(w * (padded[2:18, 1 + dx:17 + dx] - padded[0:16, 1 + dx:17 + dx]) for dx, w in taps) / 8
    ref = 1.0 - np.minimum(1.0, np.hypot(gx, gy) / 0.25)
    for c in range(3):
        np.testing.assert_allclose(out[0, c].double().numpy(), ref, atol=1e-5)
    assert out[0, 0, 0, 0] > 0.999 and out[0, 0, 8, 8] > 0.999          # flat regions (fill too) are white
    assert out[0, 0, 8, 4] < 0.2                                         # the square's outline is dark


def test_degrade_images_draws_one_op_per_image_reproducibly():
    images = _scenes(64, 32, seed=1)
    out, choice = degrade.degrade_images(images, torch.Generator().manual_seed(7), mean=MEAN, std=STD,
                                         ops=DEGRADE_OPS, drop_prob=0.25, cell=8)
    again, choice_again = degrade.degrade_images(images, torch.Generator().manual_seed(7), mean=MEAN, std=STD,
                                                 ops=DEGRADE_OPS, drop_prob=0.25, cell=8)
    assert torch.equal(out, again) and torch.equal(choice, choice_again)
    other, _ = degrade.degrade_images(images, torch.Generator().manual_seed(8), mean=MEAN, std=STD,
                                      ops=DEGRADE_OPS, drop_prob=0.25, cell=8)
    assert not torch.equal(out, other)
    assert set(choice.tolist()) == set(range(len(DEGRADE_OPS)))      # 64 draws over 9 ops
    changed = (out - images).abs().flatten(1).amax(1) > 1e-4
    assert changed.all()                                            # every copy is degraded
    # grayscale rows are grey, dim rows are darker, and nothing else moved the input
    pix = _pixels(out)
    for b in (choice == DEGRADE_OPS.index("grayscale")).nonzero().flatten().tolist():
        assert torch.allclose(pix[b, 0], pix[b, 1], atol=1e-5)
    for b in (choice == DEGRADE_OPS.index("dim")).nonzero().flatten().tolist():
        ratio = pix[b].mean() / _pixels(images[b:b + 1]).mean()
        assert degrade.DIM_RANGE[0] - 1e-4 <= ratio <= degrade.DIM_RANGE[1] + 1e-4


def test_degrade_images_refuses_unknown_ops():
    """Unknown or no ops are refused where they enter, with the loss's options (degrade_images trusts them)."""
    from zsprob.prob.prolip import check_occlusion_options
    base = dict(inclusion_alpha_occ=0.1, drop_ratio=0.5, drop_prob=0.5, image_drop_prob=0.25, mask_patch_size=16,
                text_mask_mode="replace", inclusion_scale=1.0, inclusion_eps=0.0, image_mask_mode="degrade")
    with pytest.raises(UserError):
        check_occlusion_options(**base, image_degrade_ops=("blur", "fog"))
    with pytest.raises(UserError):
        check_occlusion_options(**base, image_degrade_ops=())
    assert DEFAULT_DEGRADE_OPS == DEGRADE_OPS[:7] and "shift" not in DEFAULT_DEGRADE_OPS  # opt-in


@pytest.mark.parametrize("options", [{"image_mask_mode": "fog"}, {"image_mask_mode": "degrade",
                                                                   "image_degrade_ops": ["blur", "fog"]},
                                     {"image_mask_mode": "degrade", "image_degrade_ops": []}])
def test_loss_options_are_checked(options):
    from zsprob.prob import PCMEPPLoss
    from zsprob.prob.prolip import ProLIPLoss
    for cls in (PCMEPPLoss, ProLIPLoss):
        with pytest.raises(UserError):
            cls(inclusion_alpha_occ=0.1, **options)


def test_trainer_makes_degraded_copies_with_the_models_normalisation():
    from zsprob.models import create_model
    from zsprob.prob import PCMEPPLoss
    from zsprob.train.step import ContrastiveStep
    model = create_model("zsprob-tiny-bow", seed=0)
    pre = model.config["preprocess_cfg"]
    loss = PCMEPPLoss(inclusion_alpha_occ=0.1, drop_ratio=0.5, image_mask_mode="degrade",
                      image_degrade_ops="dim,grayscale")
    assert loss.image_degrade_ops == ("dim", "grayscale")
    step = ContrastiveStep(model, loss, seed=3)
    images = _scenes(8, 64)
    tokens = model.tokenizer(["a red star", "a blue circle", "a shape", "two squares"] * 2)
    masked_images, _ = step.masked_inputs(images, tokens, step=5)
    again, _ = step.masked_inputs(images, tokens, step=5)
    assert masked_images.shape == (4, 3, 64, 64) and torch.equal(masked_images, again)
    pix = masked_images * torch.tensor(pre["std"]).view(1, 3, 1, 1) + torch.tensor(pre["mean"]).view(1, 3, 1, 1)
    orig = images[:4] * torch.tensor(pre["std"]).view(1, 3, 1, 1) + torch.tensor(pre["mean"]).view(1, 3, 1, 1)
    for b in range(4):
        grey = torch.allclose(pix[b, 0], pix[b, 2], atol=1e-5)
        darker = pix[b].mean() < 0.55 * orig[b].mean()
        assert grey != darker                                        # exactly one of the two ops
    cells = ContrastiveStep(model, PCMEPPLoss(inclusion_alpha_occ=0.1, drop_ratio=0.5), seed=3)
    assert not torch.equal(cells.masked_inputs(images, tokens, step=5)[0], masked_images)
    total, stats = step(images, tokens, step=5)
    assert torch.isfinite(total) and "img_inclusion" in stats


# ----------------------------------------------------------------------------- any device, bit-identical to the CPU code

class Reference:
    """zsprob's previous degrade functions (CPU only), kept verbatim but for the docstrings; the
    ``cells`` operation calls the current mask_image_cells, itself bit-identical to its previous
    version (tests/test_data_masking.py)."""

    @staticmethod
    def uniform(generator, n, low, high):
        return (low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)).tolist()

    @staticmethod
    def stats(mean, std, images):
        shape = (1, images.shape[1], 1, 1)
        return (torch.as_tensor(mean, dtype=images.dtype).reshape(shape),
                torch.as_tensor(std, dtype=images.dtype).reshape(shape))

    @classmethod
    def to_pixels(cls, images, mean, std):
        mean, std = cls.stats(mean, std, images)
        return (images * std + mean).clamp(0.0, 1.0), mean, std

    @staticmethod
    def blur(images, sigmas):
        from torchvision.transforms.functional import gaussian_blur
        side = min(images.shape[-2:])
        out = []
        for image, sigma in zip(images, sigmas):
            size = min(2 * math.ceil(3 * sigma) + 1, 2 * ((side - 1) // 2) + 1)
            out.append(gaussian_blur(image, [size, size], [float(sigma), float(sigma)]))
        return torch.stack(out)

    @staticmethod
    def downsample(images, factors, nearest):
        F = torch.nn.functional
        height, width = images.shape[-2:]
        out = []
        for image, factor, hard in zip(images, factors, nearest):
            small = F.interpolate(image[None], size=(max(2, round(height / factor)), max(2, round(width / factor))),
                                  mode="area")
            up = (F.interpolate(small, size=(height, width), mode="nearest") if hard else
                  F.interpolate(small, size=(height, width), mode="bilinear", align_corners=False))
            out.append(up[0])
        return torch.stack(out)

    @classmethod
    def dim(cls, images, factors, mean, std):
        factor = torch.as_tensor(factors, dtype=images.dtype).reshape(-1, 1, 1, 1)
        mean, std = cls.stats(mean, std, images)
        return images * factor + (mean / std) * (factor - 1.0)

    @classmethod
    def jpeg(cls, images, qualities, mean, std):
        pixels, mean, std = cls.to_pixels(images, mean, std)
        as_bytes = (pixels * 255.0).round().to(torch.uint8)
        decoded = [_pillow_jpeg(image, q) for image, q in zip(as_bytes, qualities)]
        return (torch.stack(decoded).to(images.dtype) / 255.0 - mean) / std

    @staticmethod
    def luma(pixels):
        return (pixels * torch.tensor(degrade.LUMA, dtype=pixels.dtype).reshape(1, 3, 1, 1)).sum(1, keepdim=True)

    @classmethod
    def grayscale(cls, images, mean, std):
        if images.shape[1] != 3:
            return images.clone()
        pixels, mean, std = cls.to_pixels(images, mean, std)
        return (cls.luma(pixels).expand_as(pixels) - mean) / std

    @staticmethod
    def crop(images, ratios, offsets):
        height, width = images.shape[-2:]
        out = []
        for image, ratio, (dy, dx) in zip(images, ratios, offsets):
            ch, cw = max(1, round(height * ratio)), max(1, round(width * ratio))
            top, left = int(dy * (height - ch)), int(dx * (width - cw))
            window = image[None, :, top:top + ch, left:left + cw]
            out.append(torch.nn.functional.interpolate(window, size=(height, width), mode="bilinear",
                                                       align_corners=False)[0])
        return torch.stack(out)

    @staticmethod
    def shift(images, moves):
        height, width = images.shape[-2:]
        return torch.stack([image.roll((round(dy * height), round(dx * width)), dims=(-2, -1))
                            for image, (dy, dx) in zip(images, moves)])

    @classmethod
    def sketch(cls, images, thresholds, mean, std):
        F = torch.nn.functional
        pixels, mean, std = cls.to_pixels(images, mean, std)
        luma = cls.luma(pixels) if images.shape[1] == 3 else pixels.mean(1, keepdim=True)
        kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=images.dtype) / 8.0
        kernels = torch.stack([kx, kx.t()])[:, None]
        grad = F.conv2d(F.pad(luma, (1, 1, 1, 1), mode="replicate"), kernels)
        magnitude = grad.square().sum(1, keepdim=True).sqrt()
        t = torch.as_tensor(thresholds, dtype=images.dtype).reshape(-1, 1, 1, 1)
        drawn = 1.0 - (magnitude / t).clamp(max=1.0)
        return (drawn.expand_as(pixels) - mean) / std

    @classmethod
    def apply(cls, name, images, generator, mean, std, drop_prob, cell):
        n, side = images.shape[0], min(images.shape[-2:])
        if name == "cells":
            return degrade.mask_image_cells(images, drop_prob, cell, generator)
        if name == "blur":
            return cls.blur(images, [s * side for s in cls.uniform(generator, n, *degrade.BLUR_RANGE)])
        if name == "downsample":
            factors = cls.uniform(generator, n, *degrade.DOWNSAMPLE_RANGE)
            return cls.downsample(images, factors, (torch.rand(n, generator=generator) < 0.5).tolist())
        if name == "dim":
            return cls.dim(images, cls.uniform(generator, n, *degrade.DIM_RANGE), mean, std)
        if name == "jpeg":
            quality = degrade.JPEG_QUALITY
            return cls.jpeg(images, torch.randint(quality[0], quality[1] + 1, (n,), generator=generator).tolist(),
                            mean, std)
        if name == "grayscale":
            return cls.grayscale(images, mean, std)
        if name == "shift":
            lengths = cls.uniform(generator, n, *degrade.SHIFT_RANGE)
            angles = cls.uniform(generator, n, 0.0, 2.0 * math.pi)
            return cls.shift(images, [(r * math.sin(a), r * math.cos(a)) for r, a in zip(lengths, angles)])
        if name == "sketch":
            return cls.sketch(images, cls.uniform(generator, n, *degrade.SKETCH_RANGE), mean, std)
        ratios = cls.uniform(generator, n, *degrade.CROP_RANGE)
        offsets = torch.rand(n, 2, generator=generator, dtype=torch.float64).tolist()
        return cls.crop(images, ratios, offsets)

    @classmethod
    def degrade_images(cls, images, generator, *, mean, std, ops=DEFAULT_DEGRADE_OPS, drop_prob=0.25, cell=16):
        ops = tuple(ops)
        choice = torch.randint(len(ops), (images.shape[0],), generator=generator)
        out = images.clone()
        for index, name in enumerate(ops):
            rows = (choice == index).nonzero().flatten()
            if len(rows):
                out[rows] = cls.apply(name, images[rows], generator, mean, std, drop_prob, cell)
        return out, choice


def _both(images, seed, **options):
    """(new result, reference result), each from a fresh generator with ``seed``, and whether both
    generators end in the same state."""
    g_new, g_ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    new = degrade.degrade_images(images, g_new, mean=MEAN, std=STD, **options)
    ref = Reference.degrade_images(images, g_ref, mean=MEAN, std=STD, **options)
    return new, ref, torch.equal(g_new.get_state(), g_ref.get_state())


@pytest.mark.parametrize("op", DEGRADE_OPS)
def test_each_op_is_bit_identical_to_the_cpu_reference(op):
    images = _scenes(6, 32, seed=2)
    for seed in range(3):
        (out, choice), (ref, ref_choice), same_state = _both(images, seed, ops=(op,), drop_prob=0.4, cell=8)
        assert torch.equal(out, ref) and torch.equal(choice, ref_choice) and same_state, (op, seed)
        assert not torch.equal(out, images)


@pytest.mark.parametrize("ops", [DEGRADE_OPS, DEFAULT_DEGRADE_OPS, ("blur", "crop"), tuple(reversed(DEGRADE_OPS))])
def test_mixed_ops_are_bit_identical_to_the_cpu_reference(ops):
    images = _scenes(24, 32, seed=3)
    for seed in range(4):
        (out, choice), (ref, ref_choice), same_state = _both(images, seed, ops=ops, drop_prob=0.25, cell=8)
        assert torch.equal(out, ref) and torch.equal(choice, ref_choice) and same_state, (ops, seed)
    one, ref_one, _ = _both(images[:1], 9, ops=ops)      # batch 1, default cell size
    assert torch.equal(one[0], ref_one[0])
    rect = torch.randn(5, 3, 24, 40, generator=torch.Generator().manual_seed(1))    # not square
    other, ref_other, _ = _both(rect, 2, ops=ops, cell=8)
    assert torch.equal(other[0], ref_other[0])


def test_the_individual_ops_keep_their_signatures_and_results():
    images = _scenes(3, 32, seed=4)
    assert torch.equal(degrade.blur(images, [0.9, 1.6, 2.2]), Reference.blur(images, [0.9, 1.6, 2.2]))
    assert torch.equal(degrade.downsample(images, [3.0, 4.5, 7.0], [True, False, True]),
                       Reference.downsample(images, [3.0, 4.5, 7.0], [True, False, True]))
    assert torch.equal(degrade.dim(images, [0.2, 0.3, 0.4], MEAN, STD),
                       Reference.dim(images, [0.2, 0.3, 0.4], MEAN, STD))
    assert torch.equal(degrade.jpeg(images, [5, 12, 20], MEAN, STD), Reference.jpeg(images, [5, 12, 20], MEAN, STD))
    assert torch.equal(degrade.grayscale(images, MEAN, STD), Reference.grayscale(images, MEAN, STD))
    offsets = [(0.0, 1.0), (0.3, 0.7), (1.0, 0.0)]
    assert torch.equal(degrade.crop(images, [0.5, 0.6, 0.8], offsets), Reference.crop(images, [0.5, 0.6, 0.8], offsets))
    moves = [(0.25, 0.0), (-0.3, 0.2), (0.1, -0.45)]
    assert torch.equal(degrade.shift(images, moves), Reference.shift(images, moves))
    assert torch.equal(degrade.sketch(images, [0.15, 0.25, 0.35], MEAN, STD),
                       Reference.sketch(images, [0.15, 0.25, 0.35], MEAN, STD))


def _accelerator_path(monkeypatch):
    """Take the path of a device where a host read is not free (the device-side JPEG) on the CPU."""
    from zsprob.utils import host_sync
    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())


@pytest.mark.parametrize("accelerator", [False, True])
def test_no_op_makes_a_host_sync(accelerator, monkeypatch):
    """No host sync on the CPU's path nor on an accelerator's (the device-side JPEG), rows that
    draw jpeg included."""
    if accelerator:
        _accelerator_path(monkeypatch)
    images = _scenes(32, 32, seed=5)
    for seed, ops, jpeg_rows in [(5, DEGRADE_OPS, 1), (1, ("jpeg", "blur"), 18)]:
        with HostSyncCounter() as counter:
            _, choice = degrade.degrade_images(images, torch.Generator().manual_seed(seed), mean=MEAN, std=STD,
                                               ops=ops, cell=8)
        assert counter.total == 0, counter.where
        assert int((choice == ops.index("jpeg")).sum()) == jpeg_rows
    with HostSyncCounter() as counter:
        _, choice = degrade.degrade_images(images, torch.Generator().manual_seed(0), mean=MEAN, std=STD,
                                           ops=DEGRADE_OPS, cell=8)
    assert counter.total == 0, counter.where
    assert len(set(choice.tolist())) == len(DEGRADE_OPS) - 1        # every op but jpeg ran (seed 0)


# ----------------------------------------------------------------------------- the device-side JPEG against libjpeg

def _photos(n: int, height: int, width: int, seed: int, channels: int = 3) -> torch.Tensor:
    """uint8 images [n, C, H, W] with what JPEG has to code: flat areas, sharp-edged squares of
    other colours, a smooth gradient, fine noise (every fourth image: noise only)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(n, channels, 1, 1, generator=g).expand(n, channels, height, width).clone()
    for b in range(n):
        for _ in range(3):
            top, left = int(torch.randint(0, height, (1,), generator=g)), int(torch.randint(0, width, (1,), generator=g))
            pixels[b, :, top:top + max(1, height // 3), left:left + max(1, width // 3)] = torch.rand(channels, 1, 1,
                                                                                                   generator=g)
    ramp = torch.linspace(0, 1, height)[:, None] * torch.linspace(0, 1, width)[None]
    pixels = 0.75 * pixels + 0.15 * ramp + 0.1 * torch.rand(pixels.shape, generator=g)
    pixels[::4] = torch.rand(pixels[::4].shape, generator=g)
    return (pixels.clamp(0, 1) * 255).round().to(torch.uint8)


def _pillow_jpeg(image: torch.Tensor, quality: int) -> torch.Tensor:
    """One uint8 [C, H, W] image through Pillow's JPEG encoder and decoder at its defaults."""
    buffer = io.BytesIO()
    pixels = image.permute(1, 2, 0).numpy()
    Image.fromarray(pixels[..., 0] if image.shape[0] == 1 else pixels).save(buffer, "JPEG", quality=int(quality))
    decoded = np.asarray(Image.open(buffer)).reshape(image.shape[1], image.shape[2], -1)
    return torch.from_numpy(decoded.copy()).permute(2, 0, 1)


def _libjpeg(images: torch.Tensor, qualities) -> torch.Tensor:
    from zsprob.data.jpeg_torch import libjpeg_roundtrip
    return libjpeg_roundtrip(images, qualities)


@pytest.mark.parametrize("height, width", [(32, 32), (37, 53), (24, 40), (17, 9), (8, 8), (64, 48), (54, 2), (6, 4)])
def test_device_jpeg_equals_libjpeg(height, width):
    """Every pixel equal to the CPU codec's round trip (Pillow's libjpeg-turbo) at qualities 5..20 (and
    1, 50, 90, 100), colour and greyscale, sizes that are and are not multiples of the 16-pixel MCU."""
    from zsprob.data.jpeg_torch import jpeg_roundtrip
    for channels in (3, 1):
        images = _photos(20, height, width, seed=height * 100 + width, channels=channels)
        qualities = list(range(5, 21)) + [1, 50, 90, 100]
        got = jpeg_roundtrip(images, qualities)
        ref = _libjpeg(images, qualities)
        assert got.dtype == torch.uint8 and got.shape == images.shape
        assert torch.equal(got, ref), (channels, (got.float() - ref.float()).abs().mean())
        assert (got.float() - images.float()).abs().mean() > 1.0       # and JPEG did lose something


def test_device_jpeg_tables_are_the_ones_libjpeg_writes():
    """quant_tables(q) against the DQT segments of the CPU codec's encoded files (zigzag order)."""
    from zsprob.data.jpeg_torch import libjpeg_bytes, quant_tables
    zigzag = sorted(range(64), key=lambda i: (i // 8 + i % 8, (i // 8) if (i // 8 + i % 8) % 2 else -(i // 8)))
    image = _photos(1, 16, 16, seed=0)[0]
    for quality in (1, 5, 12, 20, 49, 50, 75, 100):
        data = libjpeg_bytes(image, quality)
        at, tables = data.index(b"\xff\xdb"), {}
        while data[at:at + 2] == b"\xff\xdb":
            length = int.from_bytes(data[at + 2:at + 4], "big")
            segment = data[at + 4:at + 2 + length]
            while segment:
                tables[segment[0] & 15], segment = segment[1:65], segment[65:]
            at += 2 + length
        luma, chroma = quant_tables(quality)
        for index, table in ((0, luma), (1, chroma)):
            natural = [0] * 64
            for position, value in zip(zigzag, tables[index]):
                natural[position] = value
            assert natural == table, (quality, index)


def test_the_cpu_codec_equals_torchvisions_on_the_images_the_demo_degrades(tmp_path):
    """Pillow's round trip (the CPU codec since torchvision's JPEG functions were deprecated) gives the
    pixels and the very bytes of torchvision's ``decode_jpeg(encode_jpeg(image, q))``, the codec the demo's
    figures were made with: on a 64 px SynthWorld's pretraining images as the demo's recipe sees them
    (open_clip's training transform, then back to 8-bit pixels as ``degrade.jpeg`` does), and on the
    images as written, at every quality the jpeg view draws."""
    io_module = pytest.importorskip("torchvision.io")
    if not hasattr(io_module, "encode_jpeg"):
        pytest.skip("this torchvision has no JPEG functions left to compare with")
    from open_clip.transform import AugmentationCfg, image_transform

    from zsprob.data.jpeg_torch import libjpeg_bytes, libjpeg_roundtrip
    from zsprob.data.synthetic import generate, read_pretrain_items
    generate(tmp_path, image_size=64, num_pretrain=48, num_classify_select=0, num_classify_eval=0, num_retrieval=0,
             num_retrieval_val=0, shard_size=48, progress=False)
    written = [Image.open(io.BytesIO(data)).convert("RGB") for data in read_pretrain_items(tmp_path / "pretrain").jpegs]
    transform = image_transform(64, is_train=True, mean=MEAN, std=STD,            # the demo model's (CLIP's stats)
                                aug_cfg=AugmentationCfg(scale=(0.9, 1.0)))
    torch.manual_seed(0)
    pixels = _pixels(torch.stack([transform(image) for image in written])).clamp(0, 1)
    as_bytes = torch.cat([(pixels * 255.0).round().to(torch.uint8),
                          torch.stack([torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
                                       for image in written])])
    for quality in range(degrade.JPEG_QUALITY[0], degrade.JPEG_QUALITY[1] + 1):
        qualities = [quality] * len(as_bytes)
        ours = libjpeg_roundtrip(as_bytes, qualities)
        theirs = torch.stack([io_module.decode_jpeg(io_module.encode_jpeg(image, quality=quality))
                              for image in as_bytes])
        assert torch.equal(ours, theirs), quality
        written = bytes(io_module.encode_jpeg(as_bytes[0], quality=quality).tolist())
        assert libjpeg_bytes(as_bytes[0], quality) == written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jpeg_view_on_an_accelerator_equals_the_cpus(dtype, monkeypatch):
    """degrade.jpeg through the device-side codec (a device where a host read is not free) gives
    the CPU's libjpeg result, in float32 and float64, and the same again on a second call."""
    images = _scenes(6, 37, seed=7).to(dtype)
    qualities = [5, 8, 11, 14, 17, 20]
    cpu = degrade.jpeg(images, qualities, MEAN, STD)
    _accelerator_path(monkeypatch)
    with HostSyncCounter() as counter:
        device = degrade.jpeg(images, qualities, MEAN, STD)
    assert counter.total == 0 and device.dtype == dtype
    assert torch.equal(device, cpu) and torch.equal(degrade.jpeg(images, qualities, MEAN, STD), device)


def test_device_jpeg_refuses_what_jpeg_cannot_code():
    from zsprob.data.jpeg_torch import jpeg_roundtrip
    with pytest.raises(ValueError, match="1 or 3"):
        jpeg_roundtrip(torch.zeros(1, 2, 8, 8, dtype=torch.uint8), [10])
    with pytest.raises(ValueError, match="one quality"):
        jpeg_roundtrip(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), [10])
    with pytest.raises(ValueError, match="one quality"):
        jpeg_roundtrip(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), [0])


def test_images_without_values_are_degraded_on_their_device():
    """On the meta device (shapes, no values) every op runs, jpeg included: nothing reads a pixel
    on the host; the choices come back on the images' device."""
    images = torch.empty(16, 3, 32, 32, device="meta")
    out, choice = degrade.degrade_images(images, torch.Generator().manual_seed(0), mean=MEAN, std=STD,
                                         ops=DEGRADE_OPS, cell=8)
    assert out.device.type == "meta" and out.shape == images.shape and choice.device.type == "meta"
    with pytest.raises(ValueError, match="CPU generator's draws"):     # only CPU draws are read on the host
        degrade._host(torch.zeros(2, device="meta"))
