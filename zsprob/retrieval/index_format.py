"""What a CSD index is, without torch: its kinds, augmentations, the options each kind reads, its files,
and the embedding sides it is built on and searched from. :mod:`zsprob.retrieval.search` builds, writes
and reads indexes by these names; ``zsprob index`` offers them as choices at parse time.
"""
from __future__ import annotations

#: "flat" (FAISS exact), "hnsw", "ivf" (FAISS approximate), "torch" (exact, no FAISS)
KINDS = ("flat", "hnsw", "ivf", "torch")
#: the augmentations: inner product or squared L2 (see zsprob.retrieval.search)
METRICS = ("ip", "l2")
#: the build / search options that one kind of index reads
KIND_OPTIONS = {"hnsw_m": "hnsw", "ef_construction": "hnsw", "ef_search": "hnsw", "nlist": "ivf", "nprobe": "ivf"}
#: the sides of an embeddings file (E.npz) an index holds or a search queries with
SIDES = ("image", "caption")
#: every file an index directory may hold
INDEX_FILES = ("index.json", "ids.npy", "index.faiss", "gallery.npy")
FORMAT_VERSION = 1


def default_metric(kind: str) -> str:
    """Graph and inverted-file indexes work better on L2 than on raw inner products."""
    return "l2" if kind in ("hnsw", "ivf") else "ip"


def backend_file(kind: str) -> str:
    """The file holding an index's vectors: the torch gallery or the FAISS index."""
    return "gallery.npy" if kind == "torch" else "index.faiss"
