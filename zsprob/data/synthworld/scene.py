"""SynthWorld's vocabulary, sampling priors and scene sampling.

A scene is a JSON-able dict that fixes one image; :func:`scene_rng` seeds it from a BLAKE2b hash of (seed,
split, index). The analytic caption ambiguity (``captions``) reads these priors too: a change to the sampling
logic must be mirrored there (the tests compare the two with Monte Carlo frequencies).
"""
from __future__ import annotations

import hashlib
import math
import random as _random

import numpy as np

SHAPES: list[str] = [
    "circle", "ellipse", "square", "rectangle", "triangle", "diamond", "pentagon", "hexagon",
    "octagon", "star", "cross", "plus", "heart", "crescent", "ring", "arrow", "trapezoid",
    "semicircle", "parallelogram", "kite",
]
PLURALS: dict[str, str] = {s: (s + "es" if s.endswith(("s", "x", "ch", "sh")) else s + "s") for s in SHAPES}

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (255, 140, 0), "yellow": (250, 225, 20), "green": (30, 160, 50),
    "blue": (30, 70, 220), "purple": (130, 40, 170), "pink": (255, 120, 190), "brown": (125, 75, 30),
    "black": (15, 15, 15), "white": (250, 250, 250), "gray": (128, 128, 128),
}
COLOR_NAMES: list[str] = list(COLORS)
SIZES: list[str] = ["small", "medium", "large"]
POSITIONS: list[str] = ["top left", "top", "top right", "left", "center", "right",
                        "bottom left", "bottom", "bottom right"]
FILLS: list[str] = ["solid", "striped", "dotted", "outline"]
BACKGROUNDS: list[str] = ["plain", "gradient", "noise", "stripes"]
CONDITIONS: list[str] = ["normal", "blurry", "pixelated", "low resolution", "dark", "bright",
                         "black and white", "jpeg corrupted", "cropped", "drawing", "many"]
COND_P: np.ndarray = np.array([0.5] + [0.05] * 10)
NUM_OBJECTS: list[int] = [1, 2, 3]
NUM_OBJECTS_P: np.ndarray = np.array([0.6, 0.3, 0.1])
MANY_COUNTS: list[int] = [3, 4, 5]  # uniform
CENTER = POSITIONS.index("center")
# Conditions whose objects have no visible colour (the ground truth stores color=None).
COLORLESS = ("black and white", "drawing")

ATTRS: tuple[str, ...] = ("shape", "color", "size", "position", "fill")
VOCAB: dict[str, list[str]] = {"shape": SHAPES, "color": COLOR_NAMES, "size": SIZES,
                               "position": POSITIONS, "fill": FILLS}


class Stream:
    """Scalar random draws from Python's Mersenne Twister seeded with an int. Every draw derives from
    ``random()`` alone, whose sequence per int seed Python keeps stable across versions; ``integers(n)`` is
    one of range(n), ``sample(n, k)`` k distinct values of range(n) in random order (partial Fisher-Yates)."""

    __slots__ = ("random",)

    def __init__(self, seed: int):
        self.random = _random.Random(seed).random

    def integers(self, n: int) -> int:
        return min(n - 1, int(self.random() * n))

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.random()

    def sample(self, n: int, k: int) -> list[int]:
        pool = list(range(n))
        for i in range(k):
            j = i + min(n - i - 1, int(self.random() * (n - i)))
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


def scene_rng(seed: int, split: str, index: int, *extra) -> Stream:
    """A random stream seeded from a stable hash (BLAKE2b, 128 bits) of (seed, split, index, *extra)."""
    key = "/".join(str(x) for x in (int(seed), str(split), int(index), *extra)).encode("utf-8")
    return Stream(int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little"))


def _bg_color(rng: Stream, avoid: list[tuple[int, int, int]]) -> list[int]:
    """A background colour at RGB distance >= 110 from every object colour (the first of 24 candidates, else the
    farthest); near-white is penalised (white paper is the drawing condition's)."""
    best, best_d = None, -1.0
    for _ in range(24):
        c = [rng.integers(256), rng.integers(256), rng.integers(256)]
        d = min((math.sqrt((c[0] - a[0]) ** 2 + (c[1] - a[1]) ** 2 + (c[2] - a[2]) ** 2) for a in avoid),
                default=1e9)
        if min(c) > 200:
            d = min(d, 50.0)
        if d >= 110:
            return c
        if d > best_d:
            best, best_d = c, d
    return best


def _pick(rng: Stream, cum: list[float]) -> int:
    """Index drawn from a categorical distribution given its cumulative probabilities."""
    u = rng.random()
    for i, c in enumerate(cum):
        if u < c:
            return i
    return len(cum) - 1


_COND_CUM = np.cumsum(COND_P).tolist()
_NOBJ_CUM = np.cumsum(NUM_OBJECTS_P).tolist()


def sample_scene(rng: Stream, *, shape: str | None = None, single: bool = False,
                 condition: str | None = None) -> dict:
    """One scene from the world prior (docs/synthworld.md); ``shape`` forces the main object's shape and
    ``single`` one object (classification splits), ``condition`` the condition (previews)."""
    cond = CONDITIONS[_pick(rng, _COND_CUM)]
    if condition is not None:
        cond = condition
    bg_type = "plain" if cond == "drawing" else BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    objects: list[dict] = []
    if cond == "many":
        n = int(MANY_COUNTS[rng.integers(len(MANY_COUNTS))])
        s = SHAPES[rng.integers(len(SHAPES))]
        if shape is not None:
            s = shape
        col = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        fill = FILLS[rng.integers(len(FILLS))]
        cells = rng.sample(len(POSITIONS), n)
        for c in cells:
            objects.append({"shape": s, "color": col, "size": "small", "position": POSITIONS[int(c)],
                            "fill": fill})
    else:
        n = NUM_OBJECTS[_pick(rng, _NOBJ_CUM)]
        if single:
            n = 1
        shapes = [SHAPES[int(i)] for i in rng.sample(len(SHAPES), n)]
        if shape is not None and shape not in shapes:
            shapes[0] = shape
        elif shape is not None:
            j = shapes.index(shape)
            shapes[0], shapes[j] = shapes[j], shapes[0]
        if cond == "cropped":
            edge = [i for i in range(len(POSITIONS)) if i != CENTER]
            first = int(edge[rng.integers(len(edge))])
            rest = [i for i in range(len(POSITIONS)) if i != first]
            cells = [first] + [int(rest[int(i)]) for i in rng.sample(len(rest), n - 1)]
        else:
            cells = [int(i) for i in rng.sample(len(POSITIONS), n)]
        for j in range(n):
            col = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
            size = SIZES[rng.integers(len(SIZES))]
            fill = FILLS[rng.integers(len(FILLS))]
            if cond in COLORLESS:
                col = None
            if cond == "drawing":
                fill = "outline"
            objects.append({"shape": shapes[j], "color": col, "size": size, "position": POSITIONS[cells[j]],
                            "fill": fill})
    return finish_scene(rng, cond, bg_type, objects)


def finish_scene(rng: Stream, cond: str, bg_type: str, objects: list[dict]) -> dict:
    """Add the continuous rendering parameters (so rendering is a pure function of the scene)."""
    src_cols = [COLORS[o["color"]] for o in objects if o["color"] is not None]
    if cond in COLORLESS:  # the colour the object had before the condition removed it
        src_cols = [COLORS[COLOR_NAMES[rng.integers(len(COLOR_NAMES))]] for _ in objects]
    render_objs = []
    for o in objects:
        render_objs.append({
            "dx": float(rng.uniform(-0.035, 0.035)), "dy": float(rng.uniform(-0.035, 0.035)),
            "angle": float(rng.uniform(-15, 15)), "scale": float(rng.uniform(0.9, 1.1)),
        })
    if cond == "drawing":
        bg_col = [246, 244, 236]
    else:
        bg_col = _bg_color(rng, src_cols)
    render = {
        "bg_color": bg_col,
        "bg_angle": float(rng.uniform(0, 180)),
        "bg_contrast": float(rng.uniform(35, 70)) * (1 if rng.random() < 0.5 else -1),
        "src_colors": [list(c) for c in src_cols] if cond in COLORLESS else None,
        "noise_seed": rng.integers(2**31 - 1),
        "objects": render_objs,
    }
    return {"condition": cond, "background": bg_type, "num_objects": len(objects),
            "objects": objects, "render": render}
