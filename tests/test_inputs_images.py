"""Every image zsprob reads goes through one decoder (zsprob.data.images) that gives 8-bit RGB, upright: before
issue 50 a 16-bit PNG (also under a .jpg name) became all white, EXIF orientation was ignored, palette
transparency printed a raw Pillow warning and an over-large image a DecompressionBombWarning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from PIL import Image

from zsprob.data.images import open_rgb, to_rgb
from zsprob.errors import UserError


def _decode(im: Image.Image, tmp_path, name="x.png", **save):
    path = tmp_path / name
    im.save(path, format=save.pop("format", None), **save)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw warning may leak
        out = open_rgb(path)
    assert out.mode == "RGB"
    return np.asarray(out)


@pytest.mark.parametrize("name", ["deep.png", "deep.jpg"])
def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_to_white(tmp_path, name):
    values = np.array([[0, 257 * 40], [30000, 65535]], dtype=np.uint16)
    got = _decode(Image.fromarray(values), tmp_path, name, format="PNG")
    assert got[..., 0].tolist() == [[0, 40], [117, 255]] and (got[..., 0] == got[..., 2]).all()


def test_32_bit_integer_and_float_images():
    ints = Image.fromarray(np.array([[0, 65535]], dtype=np.int32), "I")
    assert np.asarray(to_rgb(ints))[..., 1].tolist() == [[0, 255]]
    small = Image.fromarray(np.array([[0, 200]], dtype=np.int32), "I")  # 8-bit values in a 32-bit image: kept
    assert np.asarray(to_rgb(small))[..., 1].tolist() == [[0, 200]]
    floats = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert np.asarray(to_rgb(floats))[..., 0].tolist() == [[0, 128, 255]]


def test_palette_with_transparency_keeps_its_colours_without_a_warning(tmp_path):
    im = Image.new("P", (2, 1))
    im.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    im.putpixel((1, 0), 1)
    im.info["transparency"] = 0
    assert _decode(im, tmp_path, transparency=0).tolist() == [[[10, 20, 30], [200, 100, 50]]]


def test_alpha_is_dropped_as_torchvision_drops_it_and_cmyk_converts(tmp_path):
    rgba = Image.new("RGBA", (1, 1), (90, 80, 70, 0))
    assert _decode(rgba, tmp_path).tolist() == [[[90, 80, 70]]]
    cmyk = Image.new("CMYK", (2, 2), (0, 255, 255, 0))
    assert _decode(cmyk, tmp_path, "c.jpg", quality=100)[0, 0].tolist() == np.asarray(
        Image.open(tmp_path / "c.jpg").convert("RGB"))[0, 0].tolist()


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (4, 2), (0, 0, 0))
    im.putpixel((0, 0), (255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: rotate 90 degrees clockwise to show it
    got = _decode(im, tmp_path, "r.jpg", exif=exif, quality=100)
    assert got.shape[:2] == (4, 2) and got[0, -1].min() > 200  # the top-left pixel is now top-right


def test_an_image_over_the_pixel_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for limit_kind in ("warning", "error"):  # over the limit (a warning in Pillow), and over twice it
        if limit_kind == "error":
            monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserError, match=r"image .*big.png is refused") as e:
                open_rgb(path)
        assert "\n" not in str(e.value)


def test_the_classification_reader_uses_the_decoder(tmp_path):
    from zsprob.data.classification import _open_rgb
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((2, 2), 30000, dtype=np.uint16)).save(path)
    assert np.asarray(_open_rgb(path)).max() == 117
