"""SynthWorld, the embedded offline image-caption world (docs/synthworld.md): the public entry, re-exporting
what callers use from :mod:`zsprob.data.synthworld`.

    world = SynthWorld(seed=0, image_size=64); s = world.sample("pretrain", 17)   # image, captions, meta
    generate(out, ...) -> manifest; load_retrieval_split(out, "test"); read_pretrain_items(out / "pretrain")
"""
from __future__ import annotations

from zsprob.data.synthworld.captions import caption_matches
from zsprob.data.synthworld.readers import (PretrainItems, RetrievalSplit, load_retrieval_split, paired_split,
                                            read_pretrain_items)
from zsprob.data.synthworld.scene import CONDITIONS, SHAPES
from zsprob.data.synthworld.world import DEFAULTS, PRESETS, SynthSample, SynthWorld, make_scene
from zsprob.data.synthworld.writer import generate, write_preview

__all__ = ["SynthWorld", "SynthSample", "RetrievalSplit", "caption_matches", "generate",
           "load_retrieval_split", "write_preview", "make_scene", "SHAPES", "CONDITIONS", "PRESETS", "DEFAULTS",
           "read_pretrain_items", "paired_split", "PretrainItems"]
