"""SynthWorld's preview sheet: one row per rendering condition, images with two of their captions.
"""
from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path

from zsprob.data.synthworld.files import write_atomic
from zsprob.data.synthworld.scene import CONDITIONS
from zsprob.data.synthworld.world import SynthWorld


def write_preview(path: str | os.PathLike, *, seed: int = 0, image_size: int = 64, per_condition: int = 6,
                  cell: int = 192) -> Path:
    """A PNG grid: one row per condition, ``per_condition`` images with two of their captions."""
    from PIL import Image, ImageDraw, ImageFont

    world = SynthWorld(seed, image_size)
    try:
        font = ImageFont.load_default(size=12)
        bold = ImageFont.load_default(size=15)
    except TypeError:  # Pillow < 10.1
        font = bold = ImageFont.load_default()
    disp = cell - 16
    label_w = 130
    text_h = 86
    W = label_w + per_condition * cell
    H = len(CONDITIONS) * (cell + text_h) + 10
    canvas = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(canvas)
    for r, cond in enumerate(CONDITIONS):
        y = 5 + r * (cell + text_h)
        d.text((6, y + cell // 2 - 8), cond, fill="black", font=bold)
        for c in range(per_condition):
            s = world.sample("preview", r * 1000 + c, condition=cond)
            im = s.image.resize((disp, disp), Image.NEAREST)
            x = label_w + c * cell + 8
            canvas.paste(im, (x, y + 8))
            ty = y + cell - 4
            for k, cap in enumerate(s.captions[:2]):
                for line in textwrap.wrap(cap, 30)[:3]:
                    d.text((x, ty), line, fill=((20, 20, 130), (120, 25, 25))[k], font=font)
                    ty += 14
    path = Path(path)
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    write_atomic(path, buf.getvalue())
    return path
