"""`zsprob index`: build and search exact / approximate CSD indexes (FAISS or torch).

Thin: parses options and calls :mod:`zsprob.retrieval.search`, with the names of
:mod:`zsprob.retrieval.index_format` (torch-free) as choices. Refuses in one line an option the kind of index
does not use, an ``--out`` that is an input, and a build ``--out`` holding an index (without ``--overwrite``).
"""
from __future__ import annotations

import os
from pathlib import Path

import click

from zsprob.cli.options import resolve_device, scoring_device_option
from zsprob.cli.types import COUNT, COUNT0, EMBEDDINGS, OUT_DIR, OUT_FILE, InPath
from zsprob.retrieval.index_format import INDEX_FILES, KIND_OPTIONS, KINDS, METRICS, SIDES, backend_file


def _load_side(path, side: str):
    """(ids, mu, logvar) of the ``side`` ("image" or "caption") of an E.npz."""
    from zsprob.retrieval.embeddings import load_embeddings

    e = load_embeddings(path)
    return getattr(e, f"{side}_ids"), getattr(e, f"{side}_mu"), getattr(e, f"{side}_logvar")


def _refuse_unused(kind: str, names) -> None:
    """One line for an option the user gave that this kind of index would silently ignore."""
    from click.core import ParameterSource

    from zsprob.errors import UserError

    ctx = click.get_current_context()
    for name in names:
        if KIND_OPTIONS[name] != kind and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT):
            raise UserError(f"--{name.replace('_', '-')} applies to --kind {KIND_OPTIONS[name]} indexes only, "
                            f"not to kind {kind}")


def _search_record(index_dir, k: int, qids, res) -> dict:
    """The search --out JSON: ids of -1 and csd null where fewer than k neighbours were found."""
    import numpy as np

    finite = np.isfinite(res.csd)
    csd = res.csd if finite.all() else np.where(finite, res.csd.astype(object), None)
    return {"index": str(index_dir), "k": k, "query_ids": qids, "ids": res.ids, "csd": csd}


@click.group("index")
def index() -> None:
    """Build and search CSD indexes: exact CSD ranking as nearest-neighbour search on augmented vectors."""


@index.command("build")
@click.option("--embeddings", type=EMBEDDINGS, required=True, help="E.npz (see `zsprob eval coco --help`).")
@click.option("--gallery", type=click.Choice(SIDES), default="caption", show_default=True,
              help="which side of the npz to index.")
@click.option("--kind", type=click.Choice(KINDS), default="flat", show_default=True)
@click.option("--metric", type=click.Choice(METRICS), default=None,
              help="augmentation (default: ip for flat/torch, l2 for hnsw/ivf).")
@click.option("--hnsw-m", type=COUNT, default=32, show_default=True)
@click.option("--ef-construction", type=COUNT, default=80, show_default=True)
@click.option("--ef-search", type=COUNT, default=64, show_default=True)
@click.option("--nlist", type=COUNT, default=None, help="IVF lists (default ~4 sqrt(N)).")
@click.option("--nprobe", type=COUNT, default=16, show_default=True)
@click.option("--out", type=OUT_DIR, required=True, help="index directory to write (without an index in it, or "
              "--overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace the index an existing --out holds.")
@scoring_device_option
def build(embeddings, gallery, kind, metric, hnsw_m, ef_construction, ef_search, nlist, nprobe, out, overwrite,
          device):
    """Index one side of an embeddings file."""
    from zsprob.cli.options import refuse_overwriting_inputs
    from zsprob.errors import UserError
    from zsprob.retrieval.search import build_index

    _refuse_unused(kind, tuple(KIND_OPTIONS))
    written = (backend_file(kind), "ids.npy", "index.json")
    refuse_overwriting_inputs({f"--out ({name})": Path(out) / name for name in written}, {"--embeddings": embeddings})
    held = [name for name in INDEX_FILES if os.path.lexists(Path(out) / name)]
    if held and not overwrite:
        raise UserError(f"--out {out} already holds an index ({', '.join(held)}); pass --overwrite to replace it, "
                        "or choose another directory")
    device = resolve_device(device)
    ids, mu, logvar = _load_side(embeddings, gallery)
    idx = build_index(mu, logvar, kind=kind, metric=metric, ids=ids, hnsw_m=hnsw_m, ef_construction=ef_construction,
                      ef_search=ef_search, nlist=nlist, nprobe=nprobe, device=device)
    path = idx.save(out)
    click.echo(f"indexed {len(idx)} {gallery}s (kind={idx.kind}, metric={idx.metric}, dim={idx.dim}"
               f"{', ' + ', '.join(f'{k}={v}' for k, v in idx.params.items()) if idx.params else ''}) -> {path}")


@index.command("search")
@click.option("--index", "index_dir", type=InPath("index directory", hint="build one with `zsprob index build`"),
              required=True, help="index directory from `zsprob index build`.")
@click.option("--queries", type=EMBEDDINGS, required=True, help="E.npz holding the queries.")
@click.option("--query-side", type=click.Choice(SIDES), default="image", show_default=True)
@click.option("-k", "--k", "k", type=COUNT, default=10, show_default=True)
@click.option("--ef-search", type=COUNT, default=None, help="override HNSW efSearch.")
@click.option("--nprobe", type=COUNT, default=None, help="override IVF nprobe.")
@click.option("--out", type=OUT_FILE, default=None, help="write results JSON here.")
@click.option("--show", type=COUNT0, default=3, show_default=True, help="print the results of this many queries.")
@scoring_device_option
def search(index_dir, queries, query_side, k, ef_search, nprobe, out, show, device):
    """Top-k gallery items by CSD for every query."""
    import time

    from zsprob.cli.options import refuse_overwriting_inputs
    from zsprob.retrieval.search import load_index
    from zsprob.utils.io import atomic_write_json

    index_files = {f"the index's {name}": Path(index_dir) / name for name in INDEX_FILES}
    refuse_overwriting_inputs({"--out": out}, {"--queries": queries, **index_files})
    device = resolve_device(device)
    idx = load_index(index_dir)
    _refuse_unused(idx.kind, ("ef_search", "nprobe"))
    qids, mu, logvar = _load_side(queries, query_side)
    idx.set_search_params(ef_search=ef_search, nprobe=nprobe)
    idx = idx.to(device)
    if k > len(idx):
        click.echo(f"note: -k {k} is more than the index holds; returning all {len(idx)} "
                   f"item{'s' if len(idx) > 1 else ''} per query")
        k = len(idx)
    t = time.perf_counter()
    res = idx.search(mu, logvar, k)
    dt = time.perf_counter() - t
    click.echo(f"searched {len(qids)} queries in {dt:.3f}s ({len(qids) / max(dt, 1e-9):.0f} queries/s), "
               f"index {idx.kind}/{idx.metric} with {len(idx)} items on {idx.device}")
    for i in range(min(show, len(qids))):
        items = ", ".join(f"{int(g)} ({c:.4g})" for g, c in zip(res.ids[i], res.csd[i]))
        click.echo(f"query {int(qids[i])}: {items}")
    if out:
        atomic_write_json(out, _search_record(index_dir, k, qids, res))
        click.echo(f"wrote {out}")
