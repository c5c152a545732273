"""SynthWorld: the embedded, offline image-caption world (see shared spec ``synthworld.md``).

Public API::

    world = SynthWorld(seed=0, image_size=64)
    s = world.sample("pretrain", 17, noise=0.0)   # SynthSample(image: PIL.Image, captions, meta)
    caption_matches(caption_meta, scene_meta) -> bool
    generate(out, image_size=64, num_pretrain=20000, ...) -> manifest dict
    load_retrieval_split(root, split="test") -> RetrievalSplit
    read_pretrain_items(out / "pretrain"); paired_split(n, paired_fraction)   # jWAE's unpaired streams
    make_scene([{"shape": "star"}, {"shape": "circle"}]) -> scene; world.render(scene)
    SHAPES                                           # the 20 class names

This module is the public entry: it re-exports what callers use from the package
:mod:`zsprob.data.synthworld`, which holds one step per module. Every sample is a pure function
of (seed, split, index): a random stream is seeded from a BLAKE2 hash of the three
(``synthworld.scene.scene_rng``). Scenes are sampled in :mod:`zsprob.data.synthworld.scene`,
drawn by Pillow in :mod:`zsprob.data.synthworld.render`, captioned and matched in
:mod:`zsprob.data.synthworld.captions` (analytic ambiguity, exact predicate), put together in
:mod:`zsprob.data.synthworld.world` and written by :mod:`zsprob.data.synthworld.writer`.

What libraries do: Pillow renders and encodes JPEG; ``tarfile`` writes the WebDataset
shards (fixed mtime / uid / gid / names so output is byte-identical; ``webdataset`` reads
them unchanged); scipy.sparse holds the plausible-match matrix (stored in the ``.npz``
layout ``scipy.sparse.load_npz`` reads, written by zsprob with fixed zip timestamps);
``multiprocessing`` spreads whole work units (shards, image chunks) over processes, each
unit a pure function of its arguments, so ``workers`` never changes a byte. Every file is
written to a temporary name and renamed, so an interrupted run never leaves a half-written
file; a re-run with the same arguments skips pretraining shards and images that exist.
"""
from __future__ import annotations

from zsprob.data.synthworld.captions import caption_matches
from zsprob.data.synthworld.preview import write_preview
from zsprob.data.synthworld.readers import (PretrainItems, RetrievalSplit, load_retrieval_split, paired_split,
                                            read_pretrain_items)
from zsprob.data.synthworld.scene import CONDITIONS, SHAPES
from zsprob.data.synthworld.world import DEFAULTS, PRESETS, SynthSample, SynthWorld, make_scene
from zsprob.data.synthworld.writer import generate

__all__ = ["SynthWorld", "SynthSample", "RetrievalSplit", "caption_matches", "generate",
           "load_retrieval_split", "write_preview", "make_scene", "SHAPES", "CONDITIONS", "PRESETS", "DEFAULTS",
           "read_pretrain_items", "paired_split", "PretrainItems"]
