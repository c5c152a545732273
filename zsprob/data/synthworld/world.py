"""SynthWorld's world: :class:`SynthWorld` puts a scene (``scene``), its image (``render``) and five captions
(``captions``) together per (seed, split, index); hand-made scenes; the constants the writer and the CLI
read (sizes, presets, retrieval image ids).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from zsprob.data.synthworld.captions import ambiguity, caption_key, make_caption
from zsprob.data.synthworld.render import render_scene
from zsprob.data.synthworld.scene import BACKGROUNDS, CONDITIONS, SHAPES, VOCAB, finish_scene, sample_scene, scene_rng
from zsprob.errors import UserError

FORMAT_VERSION = 1
MIN_SIZE, MAX_SIZE = 32, 224
CAPTIONS_PER_IMAGE = 5
# recorded in every manifest as written (the module path in it is an old name): a change changes every world's bytes
AMBIGUITY_METHOD = ("analytic: ln P(caption true | scene ~ world prior), exact enumeration over the "
                    "sampling priors (zsprob.data.synth_captions.caption_probability)")
# a demo-sized world (docs/synthworld.md)
DEFAULTS: dict[str, Any] = dict(image_size=64, num_pretrain=20000, num_classify_select=10,
                                num_classify_eval=50, num_retrieval=1000, num_retrieval_val=500,
                                noise=0.0, seed=0, shard_size=1000)
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "quick": dict(num_pretrain=2000, num_classify_select=4, num_classify_eval=10, num_retrieval=200,
                  num_retrieval_val=100, shard_size=500),
}
RETRIEVAL_ID_BASE = {"test": 1_000_000, "val": 2_000_000}


@dataclass
class SynthSample:
    image: Any  # PIL.Image.Image (RGB, image_size x image_size)
    captions: list[str]
    meta: dict


def check_image_size(image_size: int) -> int:
    """``image_size`` as an int, or a UserError when it is not an integer from MIN_SIZE to MAX_SIZE."""
    if not isinstance(image_size, (int, np.integer)) or not MIN_SIZE <= int(image_size) <= MAX_SIZE:
        raise UserError(f"SynthWorld image size must be an integer from {MIN_SIZE} to {MAX_SIZE}, got {image_size!r}")
    return int(image_size)


class SynthWorld:
    """The world: ``sample(split, index)`` renders one scene with five captions and ground truth. Splits named
    ``classify*`` hold one main object of shape ``SHAPES[index % len(SHAPES)]``; the others follow the prior."""

    def __init__(self, seed: int = 0, image_size: int = 64):
        self.seed = int(seed)
        self.image_size = check_image_size(image_size)

    def scene(self, split: str, index: int, condition: str | None = None) -> tuple[dict, Any]:
        rng = scene_rng(self.seed, split, index)
        if str(split).startswith("classify"):
            sc = sample_scene(rng, shape=SHAPES[int(index) % len(SHAPES)], single=True, condition=condition)
        else:
            sc = sample_scene(rng, condition=condition)
        return sc, rng

    def captions_for(self, scene: dict, rng, split: str, index: int,
                     noise: float = 0.0) -> list[dict]:
        metas = []
        seen: set = set()
        for k in range(CAPTIONS_PER_IMAGE):
            u = rng.random()  # always drawn so clean captions do not depend on the noise rate
            cm = make_caption(rng, scene)
            key = caption_key(cm)
            for _ in range(30):  # five captions saying different things, when the scene allows
                if key not in seen:
                    break
                cm = make_caption(rng, scene)
                key = caption_key(cm)
            seen.add(key)
            cm["noisy"] = False
            if u < noise:
                orng = scene_rng(self.seed, split, index, "noise", k)
                other = sample_scene(orng)
                cm = make_caption(orng, other)
                cm["noisy"] = True
                key = caption_key(cm)
            cm["ambiguity"] = ambiguity(cm, key)
            metas.append(cm)
        return metas

    def render(self, scene: dict):
        """Render a scene dict (from ``scene()`` or :func:`make_scene`) at this world's size."""
        return render_scene(scene, self.image_size)

    def meta(self, split: str, index: int, noise: float = 0.0, condition: str | None = None) -> dict:
        """The ground truth of ``sample(split, index)`` without rendering the image: the scene and its captions."""
        sc, rng = self.scene(split, index, condition)
        cms = self.captions_for(sc, rng, split, index, float(noise))
        return {"seed": self.seed, "split": str(split), "index": int(index), "image_size": self.image_size,
                **sc, "captions": cms}

    def sample(self, split: str, index: int, noise: float = 0.0, condition: str | None = None) -> SynthSample:
        """The (seed, split, index) sample; ``condition`` forces a condition (previews only)."""
        if not 0.0 <= float(noise) <= 1.0:
            raise UserError(f"noise must be in [0, 1], got {noise}")
        meta = self.meta(split, index, noise, condition)
        return SynthSample(image=render_scene(meta, self.image_size), captions=[c["text"] for c in meta["captions"]],
                           meta=meta)


def make_scene(objects: list[dict], *, condition: str = "normal", background: str = "plain",
               seed: int = 0) -> dict:
    """A hand-made scene for controlled experiments (Pishdad et al.'s A vs A and B). ``objects``: dicts with
    ``shape`` and optionally ``color`` ("red"), ``size`` ("medium"), ``position`` (distinct cells; default:
    the first free of center, left, right, ...) and ``fill`` ("solid"); rendering details come from ``seed``."""
    if condition not in CONDITIONS:
        raise UserError(f"unknown condition {condition!r}; one of {CONDITIONS}")
    if background not in BACKGROUNDS:
        raise UserError(f"unknown background {background!r}; one of {BACKGROUNDS}")
    order = ["center", "left", "right", "top", "bottom", "top left", "top right", "bottom left", "bottom right"]
    used = {o["position"] for o in objects if o.get("position")}
    objs = []
    for o in objects:
        o = dict(o)
        if "shape" not in o:
            raise UserError("every object needs a shape")
        o.setdefault("color", "red")
        o.setdefault("size", "medium")
        o.setdefault("fill", "solid")
        if not o.get("position"):
            o["position"] = next(p for p in order if p not in used)
            used.add(o["position"])
        if condition in ("black and white", "drawing"):
            o["color"] = None
        if condition == "drawing":
            o["fill"] = "outline"
        for a in ("shape", "color", "size", "position", "fill"):
            if o[a] is not None and o[a] not in VOCAB[a]:
                raise UserError(f"unknown {a} {o[a]!r}; one of {VOCAB[a]}")
        objs.append({a: o[a] for a in ("shape", "color", "size", "position", "fill")})
    if len({o["position"] for o in objs}) != len(objs):
        raise UserError("objects must be in distinct positions")
    key = json.dumps([objs, condition, background], sort_keys=True)
    rng = scene_rng(seed, "custom:" + key, 0)
    return finish_scene(rng, condition, "plain" if condition == "drawing" else background, objs)

