"""Image files decoded the one way zsprob reads them for training and evaluation: Pillow's decoder, then 8-bit RGB.

Pillow's ``convert("RGB")`` (what torchvision's and open_clip's loaders call) clips 16-bit and 32-bit grayscale
to white and warns about palette transparency; here 16-bit values are scaled to 8 bits, float images in
[0, 1] to [0, 255], a palette with transparency goes through RGBA, and alpha is dropped as torchvision drops it
(the colour under a transparent pixel is kept). EXIF orientation is applied, so a photo stands as its camera
showed it. An image over Pillow's pixel limit (``Image.MAX_IMAGE_PIXELS``) is refused in one line, not decoded.
"""
from __future__ import annotations

import io
import warnings

import numpy as np

from zsprob.errors import UserError

__all__ = ["open_rgb", "to_rgb"]

_ORIENTATION = 0x0112  # the EXIF tag


def to_rgb(im):
    """A decoded PIL image as 8-bit RGB, upright."""
    from PIL import Image, ImageOps

    if im.getexif().get(_ORIENTATION, 1) != 1:
        im = ImageOps.exif_transpose(im)
    if im.mode.startswith("I") or im.mode == "F":  # 16 / 32-bit integers, floats: scaled, not clipped
        a = np.asarray(im, dtype=np.float64)
        if im.mode == "F" and a.max(initial=0.0) <= 1.0:
            a = a * 255.0
        elif im.mode != "F" and (im.mode.startswith("I;16") or a.max(initial=0.0) > 255):
            a = a / 257.0
        im = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L")
    elif im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return im if im.mode == "RGB" else im.convert("RGB")


def open_rgb(source, name=None):
    """The image file ``source`` (a path, or the file's bytes; ``name`` for messages) fully decoded as 8-bit RGB.
    Pillow's own errors (not an image, truncated) pass through for the caller to word."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as im:
                im.load()
                return to_rgb(im)
        except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
            raise UserError(f"image {name or source} is refused: {' '.join(str(e).split())[:160]}") from None
