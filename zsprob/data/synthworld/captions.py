"""SynthWorld's captions: the grammar, the match predicate and the exact caption ambiguity.

A caption is true of a scene when every object phrase is satisfied by some object and the mentioned condition,
background and count hold. Ambiguity = ln(share of the world prior's scenes the caption is true of), by exact
enumeration of ``scene``'s priors; :func:`match_matrix` evaluates the predicate for captions x scenes in numpy.
"""
from __future__ import annotations

import math
from functools import lru_cache
from itertools import product

import numpy as np

from zsprob.data.synthworld.scene import (ATTRS, BACKGROUNDS, COLOR_NAMES, COLORLESS, COND_P,
                                        CONDITIONS, FILLS, MANY_COUNTS, NUM_OBJECTS, NUM_OBJECTS_P, PLURALS,
                                        POSITIONS, SHAPES, SIZES, VOCAB)

FILL_WORD = {"solid": "solid", "striped": "striped", "dotted": "dotted", "outline": "outlined"}
POS_PHRASE = {"top left": "at the top left", "top": "at the top", "top right": "at the top right",
              "left": "on the left", "center": "in the center", "right": "on the right",
              "bottom left": "at the bottom left", "bottom": "at the bottom", "bottom right": "at the bottom right"}
BG_WORD = {"plain": "plain", "gradient": "gradient", "noise": "noisy", "stripes": "striped"}
COUNT_WORD = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
# condition -> templates in the words of the 80 CLIP ImageNet templates; "{}" = "a red star"
COND_TEMPLATES = {
    "blurry": ["a blurry photo of {}"],
    "pixelated": ["a pixelated photo of {}"],
    "low resolution": ["a low resolution photo of {}"],
    "dark": ["a dark photo of {}"],
    "bright": ["a bright photo of {}"],
    "black and white": ["a black and white photo of {}"],
    "jpeg corrupted": ["a jpeg corrupted photo of {}"],
    "cropped": ["a cropped photo of {}"],
    "drawing": ["a drawing of {}", "a sketch of {}", "a doodle of {}"],
    "many": ["a photo of many {}", "many {}"],  # "{}" = plural phrase, "red stars"
}
WRAPPERS = ["a photo of {}", "an image of {}", "there is {}", "a picture of {}", "{}", "{}"]
VAGUE = [("a shape", [{}]), ("an object", [{}]), ("a picture of something", []), ("something", [])]
KIND_P = {"full": 0.2, "partial": 0.33, "scene": 0.2, "condition": 0.22, "vague": 0.05}


def _kind_table(exclude: tuple) -> tuple[list[str], list[float]]:
    """Cumulative kind probabilities without ``exclude``; the vague rate stays KIND_P["vague"]."""
    kinds = [k for k in KIND_P if k not in exclude]
    p = np.array([KIND_P[k] for k in kinds])
    v = kinds.index("vague")
    rest = p.sum() - p[v]
    p = np.where(np.arange(len(p)) == v, KIND_P["vague"], p * (1 - KIND_P["vague"]) / rest)
    return kinds, np.cumsum(p).tolist()


_KINDS_ALL = _kind_table(())
_KINDS_NORMAL = _kind_table(("condition",))


def article(phrase: str) -> str:
    return ("an " if phrase[:1] in "aeiou" else "a ") + phrase


def object_phrase(obj: dict, attrs: set[str], plural: bool = False) -> tuple[str, dict]:
    """Words for one object mentioning ``attrs`` (subset of ATTRS) -> (phrase, mentioned)."""
    mentioned = {a: obj[a] for a in ATTRS if a in attrs and obj.get(a) is not None}
    words = []
    if "size" in mentioned:
        words.append(mentioned["size"])
    if "color" in mentioned:
        words.append(mentioned["color"])
    if "fill" in mentioned:
        words.append(FILL_WORD[mentioned["fill"]])
    head = mentioned.get("shape", "shape")
    words.append(PLURALS[head] if plural and head in PLURALS else (head + "s" if plural else head))
    phrase = " ".join(words)
    if not plural:
        phrase = article(phrase)
    if "position" in mentioned:
        phrase += " " + POS_PHRASE[mentioned["position"]]
    return phrase, mentioned


def _meta(text, kind, objects, condition=None, background=None, count=None) -> dict:
    return {"text": text, "kind": kind, "objects": objects, "condition": condition,
            "background": background, "count": count}


def _partial_attrs(rng, obj: dict, allow_position: bool = True) -> set[str]:
    avail = [a for a in ("color", "size", "fill", "position") if obj.get(a) is not None
             and (allow_position or a != "position")]
    attrs = {a for a in avail if rng.random() < 0.3}
    if rng.random() < 0.8:
        attrs.add("shape")
    if not attrs:
        attrs.add("shape" if rng.random() < 0.5 or not avail else avail[rng.integers(len(avail))])
    if attrs >= set(ATTRS):
        attrs.discard("position")
    return attrs


def make_caption(rng, scene: dict, kind: str | None = None) -> dict:
    """One caption (meta dict with ``text``) that is true of ``scene``."""
    objs = scene["objects"]
    cond = scene["condition"]
    if kind is None:
        kinds, cum = _KINDS_NORMAL if cond == "normal" else _KINDS_ALL
        u = rng.random()
        kind = next((k for k, c in zip(kinds, cum) if u < c), kinds[-1])
    wrap = WRAPPERS[rng.integers(len(WRAPPERS))]
    obj = objs[rng.integers(len(objs))]
    if kind == "vague":
        text, phrases = VAGUE[rng.integers(len(VAGUE))]
        return _meta(text, kind, [dict(p) for p in phrases])
    if kind == "full":
        ph, m = object_phrase(obj, set(ATTRS))
        return _meta(wrap.format(ph), kind, [m])
    if kind == "partial":
        ph, m = object_phrase(obj, _partial_attrs(rng, obj))
        return _meta(wrap.format(ph), kind, [m])
    if kind == "condition":
        tmpl = COND_TEMPLATES[cond][rng.integers(len(COND_TEMPLATES[cond]))]
        if cond == "many":
            attrs = {a for a in ("color", "fill") if rng.random() < 0.4} | {"shape"}
            ph, m = object_phrase(obj, attrs, plural=True)
        else:
            ph, m = object_phrase(obj, _partial_attrs(rng, obj, allow_position=False))
        return _meta(tmpl.format(ph), kind, [m], condition=cond)
    # scene captions: several objects, background, count
    r = rng.random()
    n = len(objs)
    if n >= 2 and cond != "many" and r < 0.6:
        k = n if (n == 2 or rng.random() < 0.5) else 2
        idx = sorted(rng.sample(n, k))
        parts, ms = [], []
        for i in idx:
            attrs = _partial_attrs(rng, objs[i]) | {"shape"}
            ph, m = object_phrase(objs[i], attrs)
            parts.append(ph)
            ms.append(m)
        text = ", ".join(parts[:-1]) + " and " + parts[-1]
        return _meta(wrap.format(text), kind, ms)
    bg = scene["background"]
    if (n >= 2 and r < 0.8) or (n == 1 and r < 0.5) or cond == "many":
        count_word = COUNT_WORD[n] + (" shape" if n == 1 else " shapes")
        text = f"{count_word} on a {BG_WORD[bg]} background"
        return _meta(wrap.format(text), kind, [], background=bg, count=n)
    ph, m = object_phrase(obj, _partial_attrs(rng, obj))
    return _meta(wrap.format(f"{ph} on a {BG_WORD[bg]} background"), kind, [m], background=bg)


# --------------------------------------------------------------------------- predicate

def caption_matches(caption_meta: dict, scene_meta: dict) -> bool:
    """True when the caption is true of the scene (see the module docstring)."""
    c = caption_meta.get("condition")
    if c is not None and scene_meta["condition"] != c:
        return False
    b = caption_meta.get("background")
    if b is not None and scene_meta["background"] != b:
        return False
    n = caption_meta.get("count")
    if n is not None and len(scene_meta["objects"]) != n:
        return False
    for ph in caption_meta.get("objects", []):
        if not any(all(o.get(a) == v for a, v in ph.items()) for o in scene_meta["objects"]):
            return False
    return True


MAX_SLOTS = 5
_CODE = {a: {v: i for i, v in enumerate(VOCAB[a])} for a in ATTRS}


def encode_scenes(scenes: list[dict]) -> dict[str, np.ndarray]:
    """Scenes -> integer arrays for :func:`match_matrix` (-1 = empty slot / no colour)."""
    n = len(scenes)
    cond = np.array([CONDITIONS.index(s["condition"]) for s in scenes], dtype=np.int16)
    bg = np.array([BACKGROUNDS.index(s["background"]) for s in scenes], dtype=np.int16)
    cnt = np.array([len(s["objects"]) for s in scenes], dtype=np.int16)
    obj = np.full((len(ATTRS), n, MAX_SLOTS), -1, dtype=np.int16)
    for i, s in enumerate(scenes):
        for j, o in enumerate(s["objects"]):
            for k, a in enumerate(ATTRS):
                v = o.get(a)
                if v is not None:
                    obj[k, i, j] = _CODE[a][v]
    return {"condition": cond, "background": bg, "count": cnt, "objects": obj}


def match_vector(caption_meta: dict, enc: dict[str, np.ndarray]) -> np.ndarray:
    """Boolean [n_scenes]: the predicate of one caption against encoded scenes."""
    ok = np.ones(len(enc["condition"]), dtype=bool)
    c = caption_meta.get("condition")
    if c is not None:
        ok &= enc["condition"] == CONDITIONS.index(c)
    b = caption_meta.get("background")
    if b is not None:
        ok &= enc["background"] == BACKGROUNDS.index(b)
    n = caption_meta.get("count")
    if n is not None:
        ok &= enc["count"] == n
    for ph in caption_meta.get("objects", []):
        slot = enc["count"][:, None] > np.arange(MAX_SLOTS)[None, :]
        for a, v in ph.items():
            slot = slot & (enc["objects"][ATTRS.index(a)] == _CODE[a][v])
        ok &= slot.any(1)
    return ok


def match_matrix(caption_metas: list[dict], scenes: list[dict]):
    """scipy.sparse.csr_matrix [n_scenes, n_captions] bool of the predicate (exact)."""
    import scipy.sparse as sp

    enc = encode_scenes(scenes)
    rows, cols = [], []
    cache: dict = {}
    for j, cm in enumerate(caption_metas):
        key = caption_key(cm)
        if key not in cache:
            cache[key] = np.flatnonzero(match_vector(cm, enc))
        r = cache[key]
        rows.append(r)
        cols.append(np.full(len(r), j, dtype=np.int64))
    rows_a = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    cols_a = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    m = sp.csr_matrix((np.ones(len(rows_a), dtype=bool), (rows_a, cols_a)),
                      shape=(len(scenes), len(caption_metas)))
    m.sort_indices()
    return m


def caption_key(cm: dict) -> tuple:
    """Hashable form of what a caption asserts (texts with equal keys are true of the same scenes)."""
    phrases = tuple(sorted(tuple(sorted(p.items())) for p in cm.get("objects", [])))
    return (phrases, cm.get("condition"), cm.get("background"), cm.get("count"))


# --------------------------------------------------------------------------- ambiguity

def ambiguity(caption_meta: dict, key: tuple | None = None) -> float:
    """ln P(caption true of a scene drawn from the world prior), exact (analytic); ``key``: the caption's
    :func:`caption_key` if already computed."""
    p = _key_probability(caption_key(caption_meta) if key is None else key)
    if p <= 0:  # cannot happen for a caption generated from a scene of the world prior
        return float("-inf")
    return min(0.0, float(math.log(p)))  # clamp float round-off above 1


# Values the prior treats specially keep their identity; all others of an attribute are
# exchangeable under the prior, so they are renamed in order of appearance (canonical form).
_SPECIAL = {"shape": (), "color": (), "size": ("small",), "position": ("center",), "fill": ("outline",)}
_POOLS = {a: [v for v in VOCAB[a] if v not in _SPECIAL[a]] for a in ATTRS}


def canonical_key(key: tuple) -> tuple:
    """A key with the same probability as ``key`` under the prior (maximises cache hits)."""
    phrases_t, cond, bg, count = key
    maps: dict[str, dict] = {}
    new_phrases = []
    for ph in phrases_t:
        items = []
        for a, v in ph:
            if v in _SPECIAL[a]:
                items.append((a, v))
                continue
            m = maps.setdefault(a, {})
            if v not in m:
                m[v] = _POOLS[a][len(m)]
            items.append((a, m[v]))
        new_phrases.append(tuple(sorted(items)))
    return (tuple(sorted(new_phrases)), cond, bg, count)


@lru_cache(maxsize=500_000)
def _key_probability(key: tuple) -> float:
    return caption_probability(canonical_key(key))


@lru_cache(maxsize=200_000)
def caption_probability(key: tuple) -> float:
    """P(caption with ``caption_key`` ``key`` is true of a scene ~ world prior)."""
    phrases_t, cond, bg, count = key
    total = 0.0
    for ci, c in enumerate(CONDITIONS):
        if cond is not None and c != cond:
            continue
        pc = float(COND_P[ci])
        if bg is not None:
            if c == "drawing":
                pc *= 1.0 if bg == "plain" else 0.0
            else:
                pc *= 1.0 / len(BACKGROUNDS)
        if pc == 0:
            continue
        if c == "many":
            counts = [(n, 1.0 / len(MANY_COUNTS)) for n in MANY_COUNTS]
        else:
            counts = list(zip(NUM_OBJECTS, NUM_OBJECTS_P.tolist()))
        for n, pn in counts:
            if count is not None and n != count:
                continue
            total += pc * pn * _phrases_prob(phrases_t, _regime(c), n)
    return total


def _regime(c: str) -> str:
    if c in ("many", "cropped", "drawing", "black and white"):
        return c
    return "standard"


def _classes(values_needed: list, vocab: list) -> list[tuple]:
    """Mentioned values each as its own class plus one 'other' class: [(value|None, weight)]."""
    vals = sorted(set(values_needed))
    rest = len(vocab) - len(vals)
    out = [(v, 1) for v in vals]
    if rest:
        out.append((None, rest))
    return out


@lru_cache(maxsize=200_000)
def _phrases_prob(phrases_t: tuple, regime: str, n: int) -> float:
    """P(every phrase is satisfied by some object | regime, n objects)."""
    phrases = [dict(p) for p in phrases_t]
    K = len(phrases)
    if K == 0:
        return 1.0
    need = {a: [p[a] for p in phrases if a in p] for a in ATTRS}
    if regime == "many":
        return _many_prob(phrases, need, n)
    if K == 1:
        return _single_phrase_prob(phrases[0], regime, n)
    shapes_named = [p.get("shape") for p in phrases]
    if None not in shapes_named and len(set(shapes_named)) == K:
        return _distinct_shapes_prob(phrases, regime, n)
    return _dp_prob(phrases_t, regime, n)


def _iid_match_prob(ph: dict, regime: str) -> float:
    """P(an object's colour, size and fill match the phrase) (independent of everything else)."""
    q = 1.0
    if "color" in ph:
        q *= 0.0 if regime in COLORLESS else 1.0 / len(COLOR_NAMES)
    if "size" in ph:
        q *= 1.0 / len(SIZES)
    if "fill" in ph:
        q *= (1.0 if ph["fill"] == "outline" else 0.0) if regime == "drawing" else 1.0 / len(FILLS)
    return q


def _distinct_shapes_prob(phrases: list[dict], regime: str, n: int) -> float:
    """Every phrase names a different shape, so each is matched by a different object: a sum over the ordered
    choices of object slots of P(those shapes) x P(named cells) x the independent attribute probabilities."""
    from itertools import permutations

    K = len(phrases)
    if K > n:
        return 0.0
    q = 1.0
    for ph in phrases:
        q *= _iid_match_prob(ph, regime)
    if q == 0.0:
        return 0.0
    p_shapes = 1.0
    for i in range(K):
        p_shapes /= len(SHAPES) - i
    npos = len(POSITIONS)
    total = 0.0
    for slots in permutations(range(n), K):
        named = {slots[k]: ph["position"] for k, ph in enumerate(phrases) if "position" in ph}
        cells = list(named.values())
        m = len(cells)
        if len(set(cells)) < m:
            continue
        if regime == "cropped":
            if 0 in named:
                if named[0] == "center":
                    continue
                pp = 1.0 / (npos - 1)
                for i in range(m - 1):
                    pp /= npos - 1 - i
            else:
                free0 = (npos - 1) - sum(1 for c in cells if c != "center")
                pp = free0 / (npos - 1)
                for i in range(m):
                    pp /= npos - 1 - i
        else:
            pp = 1.0
            for i in range(m):
                pp /= npos - i
        total += pp
    return total * p_shapes * q


@lru_cache(maxsize=100_000)
def _dp_prob(phrases_t: tuple, regime: str, n: int) -> float:
    """General case: dynamic programme over the objects (exact)."""
    phrases = [dict(p) for p in phrases_t]
    K = len(phrases)
    need = {a: [p[a] for p in phrases if a in p] for a in ATTRS}
    shape_cls = [v for v, _ in _classes(need["shape"], SHAPES) if v is not None]
    pos_cls = [v for v, _ in _classes(need["position"], POSITIONS) if v is not None]
    n_other_shape = len(SHAPES) - len(shape_cls)
    n_other_pos = len(POSITIONS) - len(pos_cls)
    center_named = "center" in pos_cls

    # per-object distribution over satisfied-phrase masks given (shape class, pos class);
    # colour / size / fill are independent of everything else
    col_cls = [(None, 1.0)] if regime in COLORLESS else \
        [(v, w / len(COLOR_NAMES)) for v, w in _classes(need["color"], COLOR_NAMES)]
    size_cls = [(v, w / len(SIZES)) for v, w in _classes(need["size"], SIZES)]
    fill_cls = [("outline", 1.0)] if regime == "drawing" else \
        [(v, w / len(FILLS)) for v, w in _classes(need["fill"], FILLS)]

    def _mask_dist(shape, pos) -> dict[int, float]:
        out: dict[int, float] = {}
        for (cv, cw), (sv, sw), (fv, fw) in product(col_cls, size_cls, fill_cls):
            obj = {"shape": shape, "position": pos, "color": cv, "size": sv, "fill": fv}
            mask = 0
            for k, p in enumerate(phrases):
                if all(obj[a] is not None and obj[a] == v for a, v in p.items()):
                    mask |= 1 << k
            out[mask] = out.get(mask, 0.0) + cw * sw * fw
        return out

    mask_cache: dict = {}
    full = (1 << K) - 1
    # state: (covered mask, used named shapes mask, used named cells mask, used other cells)
    states: dict[tuple, float] = {(0, 0, 0, 0): 1.0}
    for j in range(n):
        new: dict[tuple, float] = {}
        shapes_left = len(SHAPES) - j
        for (cov, us, up, uo), pr in states.items():
            used_named_shapes = bin(us).count("1")
            # shape options
            sopts = [(i, 1.0 / shapes_left) for i in range(len(shape_cls)) if not us >> i & 1]
            other_s = n_other_shape - (j - used_named_shapes)
            if other_s > 0:
                sopts.append((-1, other_s / shapes_left))
            # position options (object 0 of a cropped scene avoids the centre)
            if regime == "cropped" and j == 0:
                tot = len(POSITIONS) - 1
                popts = [(i, 1.0 / tot) for i in range(len(pos_cls)) if pos_cls[i] != "center"]
                other_p = n_other_pos - (0 if center_named else 1)
                if other_p > 0:
                    popts.append((-1, other_p / tot))
            else:
                tot = len(POSITIONS) - j
                popts = [(i, 1.0 / tot) for i in range(len(pos_cls)) if not up >> i & 1]
                other_p = n_other_pos - uo
                if other_p > 0:
                    popts.append((-1, other_p / tot))
            for si, sw in sopts:
                for pi, pw in popts:
                    key = (si, pi)
                    if key not in mask_cache:
                        mask_cache[key] = _mask_dist(shape_cls[si] if si >= 0 else None,
                                                     pos_cls[pi] if pi >= 0 else None)
                    nus = us | (1 << si) if si >= 0 else us
                    nup = up | (1 << pi) if pi >= 0 else up
                    nuo = uo + (1 if pi < 0 else 0)
                    for m, mw in mask_cache[key].items():
                        st = (cov | m, nus, nup, nuo)
                        new[st] = new.get(st, 0.0) + pr * sw * pw * mw
        states = new
    return float(sum(p for (cov, *_), p in states.items() if cov == full))


def _single_phrase_prob(ph: dict, regime: str, n: int) -> float:
    """Closed form for one phrase: shapes and cells never repeat within a scene, so a named shape or cell is
    on at most one object; q = P(an object's independent attributes match)."""
    q = _iid_match_prob(ph, regime)
    if "position" in ph:
        npos = len(POSITIONS)
        if regime == "cropped":  # object 0 avoids the centre, the others draw from what is left
            if ph["position"] == "center":
                occ = (n - 1) / (npos - 1)
            else:
                occ = 1 / (npos - 1) + (npos - 2) / (npos - 1) * (n - 1) / (npos - 1)
        else:
            occ = n / npos
    if "shape" in ph and "position" in ph:
        return occ * q / len(SHAPES)
    if "shape" in ph:
        return n / len(SHAPES) * q
    if "position" in ph:
        return occ * q
    return 1.0 - (1.0 - q) ** n


def _many_prob(phrases: list[dict], need: dict, n: int) -> float:
    """'many': n copies sharing shape, colour, fill (size small) on n distinct cells."""
    total = 0.0
    for (sv, sw), (cv, cw), (fv, fw) in product(_classes(need["shape"], SHAPES),
                                                _classes(need["color"], COLOR_NAMES),
                                                _classes(need["fill"], FILLS)):
        obj = {"shape": sv, "color": cv, "fill": fv, "size": "small"}
        cells = set()
        ok = True
        for p in phrases:
            if not all(obj[a] is not None and obj[a] == v for a, v in p.items() if a != "position"):
                ok = False
                break
            if "position" in p:
                cells.add(p["position"])
        if not ok or len(cells) > n:
            continue
        q = len(cells)
        pcells = math.comb(len(POSITIONS) - q, n - q) / math.comb(len(POSITIONS), n)
        total += (sw / len(SHAPES)) * (cw / len(COLOR_NAMES)) * (fw / len(FILLS)) * pcells
    return total

