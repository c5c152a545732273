"""`zsprob probe`: the linear-probe baseline on a model's frozen image embeddings, full and k-shot.

Thin: checks the options and the outputs, loads the model, calls ``zsprob.zeroshot.classify.run_probe``,
writes results.json and probe.png beside it, and prints a summary. No torch at import.
"""
from __future__ import annotations

import click

from zsprob.cli.options import check_prompt_outputs, device_options, model_options, request_and_model
from zsprob.cli.types import COUNT, OUT_FILE, InPath
from zsprob.zeroshot.options import DATASET_KINDS

PLOT = "probe.png"


def _shots(_ctx, _param, value):
    """``--shots 1,2,4`` -> [1, 2, 4], checked for form at parse time."""
    if value is None:
        return None
    try:
        ks = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated numbers of images per class, like 1,2,4,8,16; got {value!r}")
    if not ks or min(ks) < 1:
        raise click.BadParameter(f"each k must be at least 1, got {value!r}")
    return ks


@click.command("probe")
@click.argument("dataset", type=click.Choice(DATASET_KINDS))
@model_options
@click.option("--root", type=InPath("data root"), required=True,
              help="Evaluation data (ImageNet root with val/ and train/, a folder per class, or a SynthWorld output).")
@click.option("--train-root", "select_root", type=InPath("training split"), default=None,
              help="Labelled training images, a folder per class (default: SynthWorld's classify/select, "
                   "ImageNet's train/).")
@click.option("--shots", "kshots", default=None, callback=_shots,
              help="Images per class of the k-shot probes, e.g. 1,2,4,8,16 (default: those the smallest class holds).")
@click.option("--seeds", type=COUNT, default=3, show_default=True, help="k-shot draws per k.")
@click.option("--batch-size", type=COUNT, default=256, show_default=True)
@device_options
@click.option("--cache-dir", type=click.Path(), default=None,
              help="Image-embedding cache (default: cache/ next to --out).")
@click.option("--out", type=OUT_FILE, required=True, help="results.json to write (probe.png beside it).")
def probe(**opts):
    """Linear probe (scikit-learn logistic regression) on frozen image embeddings, full and k-shot."""
    from pathlib import Path

    cache = check_prompt_outputs(opts, (PLOT,), roots={"--root": opts["root"], "--train-root": opts["select_root"]})
    model, request = request_and_model(opts, cache_dir=cache)
    from zsprob.utils.io import atomic_write_json
    from zsprob.zeroshot.classify import run_probe
    from zsprob.zeroshot.probe import plot_probe

    res = run_probe(model, request, shots=opts["kshots"], seeds=opts["seeds"])
    title = f"{opts['dataset']} linear probe, {res['model'].get('name') or ''}"
    res["files"] = {"plot": plot_probe(res, Path(opts["out"]).resolve().parent / PLOT, title)}
    atomic_write_json(opts["out"], res)
    m = res["metrics"]
    click.echo(f"linear probe (C={res['probe']['C']:g}, {res['dataset']['n_train']} labelled images): top-1 "
               f"{m['top1']:.2f}%  top-5 {m['top5']:.2f}%  on {m['n_images']} images")
    for k, row in res["kshot"].items():
        s = row["top1"]
        ci = "" if s["ci95"] is None else f"  95% CI [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"
        click.echo(f"  {k:>3}-shot: top-1 {s['mean']:.2f}% over {s['n_seeds']} seeds{ci}")
    if res["shots_dropped"]:
        click.echo(f"  (k = {', '.join(map(str, res['shots_dropped']))} left out: a class has fewer images)")
    click.echo(f"figure: {res['files']['plot']}")
    click.echo(f"wrote {opts['out']}")
