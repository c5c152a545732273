"""SynthWorld rendering: scene dict -> PIL image. Pillow draws polygons at twice the size and reduces them
(anti-aliasing) and applies the conditions (blur, resampling, JPEG, greyscale); numpy makes the
backgrounds and brightness changes. zsprob writes the shapes, fills and the order of operations.
"""
from __future__ import annotations

import io
import math
from functools import lru_cache

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter

from zsprob.data.synthworld.scene import COLORS, POSITIONS

SIZE_RADIUS = {"small": 0.13, "medium": 0.2, "large": 0.28}  # radius as a fraction of the canvas
SS = 2  # supersampling factor


def _circle(n=48, r=1.0, cx=0.0, cy=0.0, a0=0.0, a1=2 * math.pi):
    t = np.linspace(a0, a1, n, endpoint=False)
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1)


def _regular(k, r=1.0, rot=-math.pi / 2):
    t = rot + np.arange(k) * 2 * math.pi / k
    return np.stack([r * np.cos(t), r * np.sin(t)], 1)


def _crescent():
    d, r2 = 0.55, 0.8
    x = (1 + d * d - r2 * r2) / (2 * d)
    y = math.sqrt(1 - x * x)
    th0 = math.atan2(y, x)
    outer = np.stack([np.cos(t := np.linspace(th0, 2 * math.pi - th0, 28)), np.sin(t)], 1)
    ph0 = math.atan2(y, x - d)
    ph = np.linspace(2 * math.pi - ph0, ph0, 24)
    inner = np.stack([d + r2 * np.cos(ph), r2 * np.sin(ph)], 1)
    pts = np.concatenate([outer, inner])
    pts[:, 0] += 0.3
    return pts


def _heart():
    t = np.linspace(0, 2 * math.pi, 40, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    pts = np.stack([x, y + 2.5], 1) / 16.5
    return pts


def _star(k=5, inner=0.45):
    t = -math.pi / 2 + np.arange(2 * k) * math.pi / k
    r = np.where(np.arange(2 * k) % 2 == 0, 1.0, inner)
    return np.stack([r * np.cos(t), r * np.sin(t)], 1)


def _plus(w=0.3):
    return np.array([(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w),
                     (-1, w), (-1, -w), (-w, -w)], dtype=float)


def _rot(pts, deg):
    a = math.radians(deg)
    c, s = math.cos(a), math.sin(a)
    return pts @ np.array([[c, s], [-s, c]])


# shape -> (outer polygon, holes) in unit coordinates (y down, radius about 1)
SHAPE_POLYS: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {
    "circle": (_circle(), []),
    "ellipse": (_circle() * np.array([1.0, 0.58]), []),
    "square": (np.array([(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]), []),
    "rectangle": (np.array([(-1, -0.52), (1, -0.52), (1, 0.52), (-1, 0.52)], dtype=float), []),
    "triangle": (_regular(3, 1.0) + np.array([0, 0.2]), []),
    "diamond": (np.array([(0, -1), (0.68, 0), (0, 1), (-0.68, 0)], dtype=float), []),
    "pentagon": (_regular(5), []),
    "hexagon": (_regular(6, rot=0.0), []),
    "octagon": (_regular(8, rot=math.pi / 8), []),
    "star": (_star(), []),
    "cross": (_rot(_plus(0.24) * 1.05, 45), []),
    "plus": (_plus(0.3), []),
    "heart": (_heart(), []),
    "crescent": (_crescent(), []),
    "ring": (_circle(), [_circle(r=0.55)]),
    "arrow": (np.array([(-1, -0.24), (0.15, -0.24), (0.15, -0.65), (1, 0), (0.15, 0.65), (0.15, 0.24),
                        (-1, 0.24)], dtype=float), []),
    "trapezoid": (np.array([(-1, 0.6), (1, 0.6), (0.48, -0.6), (-0.48, -0.6)]), []),
    "semicircle": (np.concatenate([_circle(24, a0=math.pi, a1=2 * math.pi), [[1.0, 0.0]]]) + np.array([0, 0.4]), []),
    "parallelogram": (np.array([(-1, 0.55), (0.45, 0.55), (1, -0.55), (-0.45, -0.55)]), []),
    "kite": (np.array([(0, -1), (0.62, -0.35), (0, 1), (-0.62, -0.35)], dtype=float), []),
}


@lru_cache(maxsize=64)
def _pattern(kind: str, size: int, period: int) -> Image.Image:
    """A full-canvas L mask of diagonal stripes or a dot grid (255 = pattern)."""
    yy, xx = np.mgrid[0:size, 0:size]
    if kind == "stripes":
        m = ((xx + yy) % period) < (period / 2)
    else:  # dots
        c = period / 2
        m = ((xx % period - c + 0.5) ** 2 + (yy % period - c + 0.5) ** 2) <= (period * 0.3) ** 2
    return Image.fromarray((m * 255).astype(np.uint8), "L")


def _contrast(rgb) -> tuple[int, int, int]:
    lum = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return (25, 25, 25) if lum > 150 else (240, 240, 240)


@lru_cache(maxsize=1024)
def _unit_pattern(kind: str, size: int, angle_step: int) -> np.ndarray:
    """[size, size, 1] float32 in [-0.5, 0.5]: a linear ramp or stripes along a direction (5 deg steps)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    a = math.radians(angle_step * 5)
    proj = xx * math.cos(a) + yy * math.sin(a)
    if kind == "gradient":
        out = (proj - proj.min()) / max(1e-6, float(proj.max() - proj.min())) - 0.5
    else:  # stripes, period 0.16 of the canvas
        out = (np.floor(proj * (2 / 0.16)) % 2) - 0.5
    return np.ascontiguousarray(out[..., None], dtype=np.float32)


@lru_cache(maxsize=8)
def _noise_bank(size: int) -> np.ndarray:
    """Gaussian noise (sd 34) of shape [2 size, 2 size, 3] from a fixed seed."""
    return np.random.default_rng(1234567).standard_normal((2 * size, 2 * size, 3), dtype=np.float32) * 34


def _background(scene: dict, size: int) -> Image.Image:
    """Background at ``size`` (the final canvas; upsampled for supersampled drawing)."""
    r = scene["render"]
    kind = scene["background"]
    if kind == "plain":
        return Image.new("RGB", (size, size), tuple(int(v) for v in r["bg_color"]))
    base = np.array(r["bg_color"], dtype=np.float32)
    if kind == "noise":
        bank = _noise_bank(size)  # a fixed noise texture; the scene picks a random window of it
        oy, ox = divmod(r["noise_seed"] % (size * size), size)
        arr = bank[oy:oy + size, ox:ox + size] + base
    else:
        pat = _unit_pattern(kind, size, int(round(r["bg_angle"] / 5)) % 36)
        amp = 2.4 * r["bg_contrast"] if kind == "gradient" else 1.6 * abs(r["bg_contrast"])
        arr = pat * np.float32(amp) + base
    np.maximum(arr, 0, out=arr)
    np.minimum(arr, 255, out=arr)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def _geometry(scene: dict, j: int, size: int):
    o, ro = scene["objects"][j], scene["render"]["objects"][j]
    r = SIZE_RADIUS[o["size"]] * ro["scale"]
    cell = POSITIONS.index(o["position"])
    row, col = divmod(cell, 3)
    m = r + 0.035
    cx = m + col * (1 - 2 * m) / 2 + ro["dx"]
    cy = m + row * (1 - 2 * m) / 2 + ro["dy"]
    if scene["condition"] == "cropped" and j == 0:  # push the object partly out of the frame
        out = 0.15 * r
        if col == 0:
            cx = out
        elif col == 2:
            cx = 1 - out
        if row == 0:
            cy = out
        elif row == 2:
            cy = 1 - out
    return r * size, cx * size, cy * size


def _xy(pts, rpx, cx, cy, angle):
    p = _rot(pts, angle) * rpx + np.array([cx, cy])
    return [tuple(v) for v in p.tolist()]


def render_scene(scene: dict, image_size: int) -> Image.Image:
    """Render a scene (see :func:`zsprob.data.synthworld.scene.sample_scene`) to an RGB image."""
    big = image_size * SS
    cond = scene["condition"]
    if scene["background"] == "plain":
        img = _background(scene, big)
    else:
        img = _background(scene, image_size).resize((big, big), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    order = sorted(range(len(scene["objects"])),
                   key=lambda j: -SIZE_RADIUS[scene["objects"][j]["size"]])  # larger first: none hidden
    rnd = np.random.default_rng(scene["render"]["noise_seed"] + 1) if cond == "drawing" else None
    for j in order:
        o, ro = scene["objects"][j], scene["render"]["objects"][j]
        rpx, cx, cy = _geometry(scene, j, big)
        outer, holes = SHAPE_POLYS[o["shape"]]
        pts = _xy(outer, rpx, cx, cy, ro["angle"])
        hole_pts = [_xy(h, rpx, cx, cy, ro["angle"]) for h in holes]
        if cond == "drawing":  # pencil sketch: two wobbly dark strokes, no fill colour
            w = max(2, int(round(big / 64)))
            for k in range(2):
                for poly in [outer] + holes:
                    jit = poly + rnd.normal(0, 0.035, size=poly.shape)
                    p = _xy(jit, rpx, cx, cy, ro["angle"])
                    shade = (40, 40, 45) if k == 0 else (95, 95, 100)
                    draw.line(p + [p[0]], fill=shade, width=w, joint="curve")
            continue
        col = COLORS[o["color"]] if o["color"] is not None else tuple(scene["render"]["src_colors"][j])
        wline = max(2, int(round(rpx * 0.2)))
        if o["fill"] == "outline":
            draw.polygon(pts, outline=col, width=wline)
            for hp in hole_pts:
                draw.polygon(hp, outline=col, width=wline)
            continue
        if not hole_pts and o["fill"] == "solid":  # same pixels as the mask path, fewer calls
            draw.polygon(pts, fill=col)
            continue
        # draw the mask only over the object's bounding box (cheap pastes)
        allp = np.asarray(pts)
        x0 = max(0, int(allp[:, 0].min()) - 2)
        y0 = max(0, int(allp[:, 1].min()) - 2)
        x1 = min(big, int(allp[:, 0].max()) + 3)
        y1 = min(big, int(allp[:, 1].max()) + 3)
        if x1 <= x0 or y1 <= y0:
            continue
        mask = Image.new("L", (x1 - x0, y1 - y0), 0)
        md = ImageDraw.Draw(mask)
        md.polygon([(x - x0, y - y0) for x, y in pts], fill=255)
        for hp in hole_pts:
            md.polygon([(x - x0, y - y0) for x, y in hp], fill=0)
        box = (x0, y0, x1, y1)
        img.paste(col, box, mask=mask)
        if o["fill"] in ("striped", "dotted"):
            period = max(4, int(round(rpx * (0.42 if o["fill"] == "striped" else 0.5))))
            pat = _pattern("stripes" if o["fill"] == "striped" else "dots", big, period).crop(box)
            img.paste(_contrast(col), box, mask=ImageChops.multiply(mask, pat))
            draw.polygon(pts, outline=col, width=max(1, wline // 2))
    img = img.reduce(SS)
    return apply_condition(img, scene)


def apply_condition(img: Image.Image, scene: dict) -> Image.Image:
    """The image operation of the scene's condition (objects-level ones are done while drawing)."""
    cond = scene["condition"]
    s = img.size[0]
    if cond == "blurry":
        return img.filter(ImageFilter.GaussianBlur(radius=max(1.5, s * 0.045)))
    if cond == "pixelated":  # a 16 x 16 mosaic (8 x 8 below 64 px): hard square blocks
        k = 16 if s >= 64 else max(8, s // 4)
        return img.resize((k, k), Image.BOX).resize((s, s), Image.NEAREST)
    if cond == "low resolution":  # the same information, smoothly upsampled
        k = 16 if s >= 64 else max(8, s // 4)
        return img.resize((k, k), Image.BILINEAR).resize((s, s), Image.BICUBIC)
    if cond == "dark":
        a = np.asarray(img, dtype=np.float32) * 0.27
        return Image.fromarray(a.astype(np.uint8), "RGB")
    if cond == "bright":
        a = 255 - (255 - np.asarray(img, dtype=np.float32)) * 0.38
        return Image.fromarray(a.astype(np.uint8), "RGB")
    if cond == "black and white":
        return img.convert("L").convert("RGB")
    if cond == "jpeg corrupted":
        # a quality-6 JPEG at <= 64 px (8 x 8 blocks stay visible at any canvas size) ...
        w = min(s, 64)
        small = img if w == s else img.resize((w, w), Image.BOX)
        buf = io.BytesIO()
        small.save(buf, format="JPEG", quality=6)
        a = np.array(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
        g = np.random.default_rng(scene["render"]["noise_seed"] + 2)
        # ... a corrupted band: rows shifted sideways with swapped colour channels ...
        h0 = int(g.integers(w // 4, w - w // 4))
        h1 = min(w, h0 + max(3, w // 6))
        a[h0:h1] = np.roll(a[h0:h1], int(g.integers(w // 6, w // 2)), axis=1)[..., ::-1]
        # ... and a few 8 x 8 blocks of garbage
        for _ in range(3):
            by, bx = (int(v) * 8 for v in g.integers(0, max(1, w // 8), size=2))
            a[by:by + 8, bx:bx + 8] = g.integers(0, 256, size=3, dtype=np.uint8)
        out = Image.fromarray(a, "RGB")
        return out if w == s else out.resize((s, s), Image.NEAREST)
    return img
