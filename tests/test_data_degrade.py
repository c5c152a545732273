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
    with pytest.raises(ValueError):
        degrade.degrade_images(_scenes(1), torch.Generator(), mean=MEAN, std=STD, ops=("blur", "fog"))
    with pytest.raises(ValueError):
        degrade.degrade_images(_scenes(1), torch.Generator(), mean=MEAN, std=STD, ops=())
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
