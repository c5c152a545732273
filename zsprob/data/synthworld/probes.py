"""Probe sets for the uncertainty-validity evidence, from SynthWorld's exact ground truth: inclusion pairs
``(general, specific)`` of captions where every scene ``specific`` is true of satisfies ``general`` and
not conversely, and Pishdad et al.'s crop test (a scene with A alone and the same scene with A and B,
captions "A" and "A and B"). Pure functions of ``seed``.
"""
from __future__ import annotations

import copy

import numpy as np

from zsprob.data.synthworld.captions import WRAPPERS, ambiguity, caption_key, object_phrase
from zsprob.data.synthworld.scene import BACKGROUNDS, COLOR_NAMES, FILLS, POSITIONS, SHAPES, SIZES
from zsprob.data.synthworld.world import make_scene
from zsprob.errors import UserError

# attributes a probe phrase may add to a bare shape, in the grammar's word order
PROBE_ATTRS = ("color", "size", "fill", "position")


def _random_object(rng: np.random.Generator, avoid_shapes=(), avoid_positions=()) -> dict:
    shapes = [s for s in SHAPES if s not in avoid_shapes]
    positions = [p for p in POSITIONS if p not in avoid_positions]
    return {"shape": shapes[rng.integers(len(shapes))], "color": COLOR_NAMES[rng.integers(len(COLOR_NAMES))],
            "size": SIZES[rng.integers(len(SIZES))], "position": positions[rng.integers(len(positions))],
            "fill": FILLS[rng.integers(len(FILLS))]}


def _caption(phrases: list[str], mentioned: list[dict], wrapper: str) -> dict:
    text = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return {"text": wrapper.format(text), "kind": "probe", "objects": mentioned, "condition": None,
            "background": None, "count": None}


def asserts_within(general: dict, specific: dict) -> bool:
    """True when every assertion of ``general`` is made by ``specific`` too (each object phrase a sub-dict of
    one of ``specific``'s, the same condition / background / count where set)."""
    for key in ("condition", "background", "count"):
        if general.get(key) is not None and general.get(key) != specific.get(key):
            return False
    return all(any(all(s.get(a) == v for a, v in g.items()) for s in specific.get("objects", []))
               for g in general.get("objects", []))


def _attribute_pair(rng: np.random.Generator, wrapper_general: str, wrapper_specific: str):
    obj = _random_object(rng)
    n_specific = int(rng.integers(1, len(PROBE_ATTRS) + 1))
    specific_attrs = set(rng.choice(PROBE_ATTRS, size=n_specific, replace=False).tolist())
    n_general = int(rng.integers(0, n_specific))
    general_attrs = set(rng.choice(sorted(specific_attrs), size=n_general, replace=False).tolist())
    general_ph, general_m = object_phrase(obj, general_attrs | {"shape"})
    specific_ph, specific_m = object_phrase(obj, specific_attrs | {"shape"})
    return _caption([general_ph], [general_m], wrapper_general), _caption([specific_ph], [specific_m], wrapper_specific)


def _conjunction_pair(rng: np.random.Generator, wrapper_general: str, wrapper_specific: str):
    first = _random_object(rng)
    second = _random_object(rng, avoid_shapes=(first["shape"],), avoid_positions=(first["position"],))
    attrs_first = {a for a in PROBE_ATTRS[:3] if rng.random() < 0.5} | {"shape"}
    attrs_second = {a for a in PROBE_ATTRS[:3] if rng.random() < 0.5} | {"shape"}
    first_ph, first_m = object_phrase(first, attrs_first)
    second_ph, second_m = object_phrase(second, attrs_second)
    return (_caption([first_ph], [first_m], wrapper_general),
            _caption([first_ph, second_ph], [first_m, second_m], wrapper_specific))


def inclusion_pairs(n_pairs: int = 1000, seed: int = 0, *, conjunction_fraction: float = 0.25) -> list[dict]:
    """``n_pairs`` distinct inclusion pairs ``{"general", "specific", "kind", "same_word_count"}`` of caption
    metas; ``kind``: "attribute" (more attributes of the same object) or "conjunction" (a second object)."""
    rng = np.random.default_rng([int(seed), 17])
    pairs, seen = [], set()
    attempts = 0
    while len(pairs) < n_pairs:
        attempts += 1
        if attempts > 50 * n_pairs:
            raise UserError(f"could not draw {n_pairs} distinct inclusion pairs")
        wrappers = [WRAPPERS[rng.integers(len(WRAPPERS))] for _ in range(2)]
        kind = "conjunction" if rng.random() < conjunction_fraction else "attribute"
        build = _conjunction_pair if kind == "conjunction" else _attribute_pair
        general, specific = build(rng, *wrappers)
        if (general["text"], specific["text"]) in seen:
            continue
        general["ambiguity"] = ambiguity(general, caption_key(general))
        specific["ambiguity"] = ambiguity(specific, caption_key(specific))
        if not (general["ambiguity"] > specific["ambiguity"] and asserts_within(general, specific)):
            continue
        seen.add((general["text"], specific["text"]))
        pairs.append({"general": general, "specific": specific, "kind": kind,
                      "same_word_count": len(general["text"].split()) == len(specific["text"].split())})
    return pairs


def crop_scenes(n_trials: int = 300, seed: int = 0) -> list[dict]:
    """Pishdad et al.'s crop trials ``{"scene_a", "scene_ab", "caption_a", "caption_ab"}``: ``scene_a`` is
    ``scene_ab`` with B removed (A's pixels identical), ``caption_ab`` "caption A and caption B"."""
    rng = np.random.default_rng([int(seed), 4])
    trials = []
    for index in range(n_trials):
        obj_a = _random_object(rng)
        obj_b = _random_object(rng, avoid_shapes=(obj_a["shape"],), avoid_positions=(obj_a["position"],))
        background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
        scene_ab = make_scene([obj_a, obj_b], background=background, seed=int(seed) * 1_000_003 + index)
        scene_a = copy.deepcopy(scene_ab)
        scene_a["objects"] = scene_a["objects"][:1]
        scene_a["num_objects"] = 1
        scene_a["render"]["objects"] = scene_a["render"]["objects"][:1]
        attrs_a = {"shape", "color"} | {a for a in ("size", "fill") if rng.random() < 0.5}
        attrs_b = {"shape", "color"} | {a for a in ("size", "fill") if rng.random() < 0.5}
        phrase_a, mentioned_a = object_phrase(obj_a, attrs_a)
        phrase_b, mentioned_b = object_phrase(obj_b, attrs_b)
        trials.append({"scene_a": scene_a, "scene_ab": scene_ab,
                       "caption_a": _caption([phrase_a], [mentioned_a], "{}"),
                       "caption_ab": _caption([phrase_a, phrase_b], [mentioned_a, mentioned_b], "{}")})
    return trials

