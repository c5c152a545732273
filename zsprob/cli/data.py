"""`zsprob data`: generate SynthWorld (``zsprob data synthetic``).

Thin: parses options and calls :func:`zsprob.data.synthetic.generate`; no torch import. OUT is a new or empty
folder or a world of its own, held under the run lock (:class:`zsprob.train.resilience.RunLock`) while written,
so that two runs never mix their worlds in one folder.
"""
from __future__ import annotations

import click

from zsprob.cli.types import COUNT, COUNT0, SHARE, OutPath
from zsprob.data.synthworld.world import DEFAULTS, MAX_SIZE, MIN_SIZE, PRESETS
from zsprob.errors import UserError


def _preset_help(name: str) -> str:
    s = dict(DEFAULTS, **PRESETS[name])
    return (f"{name}: {s['num_pretrain']} pretraining images, {s['shard_size']} per shard; "
            f"{s['num_classify_select']} + {s['num_classify_eval']} images per class for classify select / eval; "
            f"{s['num_retrieval']} + {s['num_retrieval_val']} retrieval test / val images")


@click.group("data")
def data() -> None:
    """Generate SynthWorld and inspect datasets."""


@data.command("synthetic")
@click.option("--out", required=True, type=OutPath("dir", own="world"),
              help="Output folder: new, empty, or a SynthWorld (completed, or replaced with --overwrite).")
@click.option("--preset", type=click.Choice(list(PRESETS)), default="default", show_default=True,
              help=f"Size preset; explicit --num-* options override it. {'; '.join(map(_preset_help, PRESETS))}.")
@click.option("--image-size", type=int, default=None,
              help=f"Canvas size in pixels, {MIN_SIZE}..{MAX_SIZE} [default: {DEFAULTS['image_size']}].")
@click.option("--num-pretrain", type=COUNT0, default=None, help="Pretraining images (WebDataset shards).")
@click.option("--num-classify-select", type=COUNT0, default=None,
              help="Labelled images per class for prompt selection (classify/select).")
@click.option("--num-classify-eval", type=COUNT0, default=None, help="Images per class for zero-shot evaluation.")
@click.option("--num-retrieval", type=COUNT0, default=None, help="Retrieval test images (5 captions each).")
@click.option("--num-retrieval-val", type=COUNT0, default=None, help="Retrieval val images (5 captions each).")
@click.option("--noise", type=SHARE, default=None,
              help=f"Noisy-correspondence rate of the pretraining captions, 0..1 [default: {DEFAULTS['noise']:g}].")
@click.option("--seed", type=int, default=None, help=f"World seed [default: {DEFAULTS['seed']}].")
@click.option("--shard-size", type=COUNT, default=None,
              help=f"Samples per pretraining shard [default: {DEFAULTS['shard_size']}; "
                   f"quick: {PRESETS['quick']['shard_size']}].")
@click.option("--workers", type=COUNT, default=1, show_default=True,
              help="Processes; output bytes do not depend on it.")
@click.option("--preview", is_flag=True, help="Also write OUT/preview.png (one row per condition, with captions).")
@click.option("--preview-only", is_flag=True, help="Only write OUT/preview.png (no dataset).")
@click.option("--overwrite", is_flag=True, help="Replace a SynthWorld generated in OUT with other arguments.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def synthetic(out, preset, image_size, num_pretrain, num_classify_select, num_classify_eval, num_retrieval,
              num_retrieval_val, noise, seed, shard_size, workers, preview, preview_only, overwrite,
              no_progress) -> None:
    """Generate SynthWorld under OUT: pretrain/ shards, classify/select|eval/, retrieval/, manifest.json."""
    import json
    import time
    from pathlib import Path

    from zsprob.data.synthetic import generate, write_preview

    given = dict(image_size=image_size, num_pretrain=num_pretrain, num_classify_select=num_classify_select,
                 num_classify_eval=num_classify_eval, num_retrieval=num_retrieval,
                 num_retrieval_val=num_retrieval_val, noise=noise, seed=seed, shard_size=shard_size)
    cfg = {**DEFAULTS, **PRESETS[preset], **{k: v for k, v in given.items() if v is not None}}
    lock = _claim(Path(out))
    try:
        if preview_only:
            p = write_preview(Path(out) / "preview.png", seed=cfg["seed"], image_size=cfg["image_size"])
            click.echo(f"preview: {p}")
            return
        t0 = time.perf_counter()
        m = generate(out, workers=workers, progress=not no_progress, overwrite=overwrite, preview=preview, **cfg)
        wall = time.perf_counter() - t0
    except UserError:
        lock.release(refused=True)  # refused before writing: a folder the lock made goes too
        raise
    finally:
        lock.release()
    st, c = m["stats"], m["counts"]
    click.echo(f"SynthWorld written to {out} (seed {m['seed']}, {m['image_size']} px, noise {m['noise']})")
    click.echo(f"  pretrain:  {c['pretrain']} images in {c['pretrain_shards']} shards")
    click.echo(f"  classify:  {len(m['classes'])} classes, select {c['classify_select']} "
               f"({c['classify_select_per_class']}/class), eval {c['classify_eval']} "
               f"({c['classify_eval_per_class']}/class)")
    click.echo(f"  retrieval: test {c['retrieval_test']} images / {c['retrieval_test_captions']} captions, "
               f"val {c['retrieval_val']} / {c['retrieval_val_captions']}")
    if preview:
        click.echo(f"  preview:   {Path(out) / 'preview.png'}")
    click.echo(f"rendered {st['rendered']} images in {st['generation_seconds']:.1f} s "
               f"({st['samples_per_second']:.0f} samples/s with {workers} worker{'s' if workers > 1 else ''}); "
               f"total {wall:.1f} s")
    click.echo(json.dumps({"samples_per_second": round(st["samples_per_second"], 1), "rendered": st["rendered"],
                           "workers": workers, "seconds": round(wall, 2)}))


def _claim(out):
    """The lock of ``out`` (one line when another run holds it), then one line unless ``out`` is new, empty or
    a SynthWorld: a folder of the user's files is never written into."""
    from zsprob.train.resilience import LOCK_NAME, RunLock
    from zsprob.utils.checks import owner_kind

    lock = RunLock(out).acquire()
    if owner_kind(out) is None and any(p.name != LOCK_NAME for p in out.iterdir()):
        lock.release()
        raise UserError(f"--out {out} holds files but no SynthWorld; write the world to a new or empty folder")
    return lock
