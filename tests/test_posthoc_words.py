"""The "which words, not how many" pairs (experiments/word_choice.py) against SynthWorld's scenes themselves."""
from __future__ import annotations

import importlib.util

import numpy as np

from zsprob.data.synthworld.captions import caption_matches
from zsprob.data.synthworld.world import SynthWorld

from conftest import ROOT

_SPEC = importlib.util.spec_from_file_location("word_choice", ROOT / "experiments" / "word_choice.py")
word_choice = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(word_choice)
word_choice_pairs = word_choice.word_choice_pairs


def test_pairs_have_equal_length_and_the_vaguer_caption_is_true_of_more_scenes():
    pairs = word_choice_pairs(200, seed=4, min_gap=0.7)
    assert len(pairs) == 200 and [p["vague"] for p in pairs] == [p["vague"] for p in word_choice_pairs(200, 4, 0.7)]
    assert all(len(p["vague"].split()) == len(p["sharp"].split()) and p["vague"] != p["sharp"] for p in pairs)
    assert len({len(p["vague"].split()) for p in pairs}) >= 3  # short and long captions alike
    # counted on scenes drawn from the world prior, the vaguer caption is true of more of them
    world = SynthWorld(seed=0)
    scenes = [world.scene("pretrain", i)[0] for i in range(3000)]
    counts = np.array([[sum(caption_matches(p[f"{side}_meta"], s) for s in scenes) for side in ("vague", "sharp")]
                       for p in pairs])
    decided = counts[:, 0] != counts[:, 1]
    assert (counts[decided, 0] > counts[decided, 1]).mean() >= 0.9
    assert counts[:, 0].sum() > 1.5 * counts[:, 1].sum()
