#!/usr/bin/env python
"""Which words, not how many: does a model's caption sigma^2 say which of two equally long captions is vaguer?

Pairs of single-object SynthWorld captions with the same number of words naming different attributes of
the same object ("a large star" vs "a red star"); the one true of more scenes (SynthWorld's exact
ambiguity, :func:`zsprob.data.synthworld.captions.ambiguity`) should get the larger ||sigma^2||_1, which
a sigma that only counts words gets right by chance. Backs the "which words" figures of docs/posthoc.md:

    python experiments/word_choice.py ph_adapter/model --pairs 1000 --seed 0
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from zsprob.data.synthworld.captions import ambiguity, object_phrase
from zsprob.data.synthworld.scene import COLOR_NAMES, FILLS, POSITIONS, SHAPES, SIZES

ATTRIBUTES = ("color", "size", "fill", "position")


def _object(rng: np.random.Generator) -> dict:
    pick = lambda values: values[int(rng.integers(len(values)))]  # noqa: E731
    return {"shape": pick(SHAPES), "color": pick(COLOR_NAMES), "size": pick(SIZES), "position": pick(POSITIONS),
            "fill": pick(FILLS)}


def _caption(obj: dict, attrs) -> dict:
    text, mentioned = object_phrase(obj, set(attrs) | {"shape"})
    return {"text": text, "kind": "probe", "objects": [mentioned], "condition": None, "background": None,
            "count": None}


def word_choice_pairs(n_pairs: int = 1000, seed: int = 0, min_gap: float = 0.1) -> list[dict]:
    """Pairs {vague, sharp, gap, vague_meta, sharp_meta}: same object, same word count, different attributes
    named, the vague caption's exact log-ambiguity larger by at least ``min_gap`` nats (metas: SynthWorld's
    caption records, for :func:`zsprob.data.synthworld.captions.caption_matches`)."""
    rng = np.random.default_rng(seed)
    subsets = [s for k in (1, 2, 3) for s in itertools.combinations(ATTRIBUTES, k)]
    pairs, tries = [], 0
    while len(pairs) < n_pairs and tries < 50 * n_pairs:
        tries += 1
        obj = _object(rng)
        first, second = (subsets[int(i)] for i in rng.choice(len(subsets), size=2, replace=False))
        meta_a, meta_b = _caption(obj, first), _caption(obj, second)
        amb_a, amb_b = ambiguity(meta_a), ambiguity(meta_b)
        if len(meta_a["text"].split()) != len(meta_b["text"].split()) or abs(amb_a - amb_b) < min_gap:
            continue
        vague, sharp = (meta_a, meta_b) if amb_a > amb_b else (meta_b, meta_a)
        pairs.append({"vague": vague["text"], "sharp": sharp["text"], "gap": abs(amb_a - amb_b),
                      "vague_meta": vague, "sharp_meta": sharp})
    return pairs


@torch.no_grad()
def word_choice_accuracy(model, pairs: list[dict], batch_size: int = 256) -> dict:
    """Share of pairs whose vaguer caption has the larger ||sigma^2||_1, with its binomial SE."""
    def uncertainty(texts):
        out = []
        for start in range(0, len(texts), batch_size):
            tokens = model.tokenizer(texts[start:start + batch_size])
            device = next(model.parameters()).device
            out.append(model.encode_text(tokens.to(device))[1].exp().sum(1).cpu())
        return torch.cat(out)

    vague = uncertainty([p["vague"] for p in pairs])
    sharp = uncertainty([p["sharp"] for p in pairs])
    correct = (vague > sharp).double()
    n = len(pairs)
    acc = float(correct.mean())
    return {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / max(n, 1)), "n": n,
            "examples": [(p["vague"], p["sharp"]) for p in pairs[:3]]}


def main() -> None:
    import argparse
    import json

    from zsprob.models import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a zsprob checkpoint directory with caption sigma^2")
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="0: the figures reported; 1: the selection pairs")
    args = parser.parse_args()
    result = word_choice_accuracy(load(args.checkpoint).eval(), word_choice_pairs(args.pairs, seed=args.seed))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
