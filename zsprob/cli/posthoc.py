"""`zsprob posthoc`: log-variance heads for a frozen model, its means untouched (thin wrapper of
:func:`zsprob.posthoc.run.posthoc`; no torch import at module level)."""
from __future__ import annotations

import math

import click

from zsprob.cli.options import (model_options, official_file_kwargs, refuse_given, refuse_overwriting_inputs,
                                 resolve_device)
from zsprob.cli.types import COUNT, COUNT0, OUT_DIR, POSITIVE, InPath, Real
from zsprob.posthoc import DATA_KINDS, METHODS

NONNEG = Real(0.0, math.inf)


@click.command("posthoc")
@model_options
@click.option("--data", "data_kind", type=click.Choice(DATA_KINDS), required=True,
              help="synthetic / webdataset: image-caption shards (--shards); coco: the Karpathy train split (--root).")
@click.option("--shards", default=None, help="Shards: a directory of .tar files (a SynthWorld root: its pretrain/) "
              "or a brace pattern.")
@click.option("--root", type=InPath("COCO root"), default=None, help="COCO root (--data coco).")
@click.option("--method", type=click.Choice(list(METHODS)), default="adapter", show_default=True,
              help="adapter: heads trained with the sigma recipe's terms (aleatoric); laplace: K-FAC Laplace "
                   "variance of the projections (epistemic).")
@click.option("--views", type=COUNT, default=2, show_default=True,
              help="Passes over the data, each with its own caption draw, degraded images and word-deleted captions.")
@click.option("--max-samples", type=COUNT, default=None, help="At most this many images per view.")
@click.option("--steps", type=COUNT, default=1500, show_default=True, help="Training steps of the heads.")
@click.option("--batch-size", type=COUNT, default=256, show_default=True, help="Rows per training step.")
@click.option("--lr", type=POSITIVE, default=2e-3, show_default=True)
@click.option("--inclusion-alpha", type=NONNEG, default=0.1, show_default=True,
              help="Weight of ProLIP's inclusion test of each original inside its degraded / word-deleted copy.")
@click.option("--same-length-alpha", type=NONNEG, default=0.1, show_default=True,
              help="Weight of the ranking of equally long captions by their distance to their image's mean.")
@click.option("--seed", type=COUNT0, default=0, show_default=True, help="Heads' init, copies and batches.")
@click.option("--prior-precision", type=POSITIVE, default=None,
              help="laplace: the Gaussian prior's precision (default: chosen by the evidence on the data).")
@click.option("--features", "feature_file", type=click.Path(dir_okay=False), default=None,
              help="The feature file (default OUT/features.safetensors; reused when it holds the same draws).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--workers", type=COUNT0, default=0, show_default=True, help="Data loader workers.")
@click.option("--threads", type=COUNT, default=None, help="torch CPU threads.")
@click.option("--overwrite", is_flag=True, help="Replace OUT/model if it exists.")
@click.option("--out", type=OUT_DIR, required=True, help="Output directory: OUT/model, OUT/summary.json.")
def posthoc(checkpoint, model_name, pretrained, data_kind, shards, root, method, views, max_samples, steps, batch_size,
            lr, inclusion_alpha, same_length_alpha, seed, prior_precision, feature_file, device, workers, threads,
            overwrite, out):
    """Give a frozen model trained log-variance heads; its means stay bit-identical.

    \b
    zsprob posthoc --checkpoint runs/infonce/model --data synthetic --shards sw/pretrain --out ph
    zsprob eval synthetic --checkpoint ph/model --root sw
    """
    from pathlib import Path

    from zsprob.errors import UserError

    if data_kind == "coco" and shards:
        raise UserError("--shards is for --data synthetic / webdataset; --data coco reads --root")
    if data_kind != "coco" and root is not None:
        raise UserError(f"--root is for --data coco; --data {data_kind} reads --shards")
    if data_kind == "coco" and root is None:
        raise UserError("--data coco needs --root (the COCO directory)")
    if data_kind != "coco":
        from zsprob.utils.checks import check_shards
        check_shards(data_kind, shards)  # given, and a SynthWorld path that exists
        if data_kind == "synthetic":
            from zsprob.data.synthworld.checks import check_pretrain_shards
            check_pretrain_shards(shards)
        local = Path(str(shards)).expanduser()
        if local.is_dir() and not any(local.glob("*.tar")):  # before any model or feature work
            raise UserError(f"no *.tar shards in directory {local}")
    if method == "laplace":
        refuse_given("with --method laplace (they weigh terms of the adapter; laplace distils its posterior instead)",
                     "inclusion_alpha", "same_length_alpha")
    else:
        refuse_given(f"with --method {method} (it is --method laplace's prior)", "prior_precision")
    out_path = Path(out)
    refuse_overwriting_inputs({"--out": out_path, "--out (its model/)": out_path / "model",
                               "--out (its summary.json)": out_path / "summary.json",
                               "--features": Path(feature_file) if feature_file else out_path / "features.safetensors"},
                              {}, checkpoint=checkpoint, pretrained=pretrained)
    if (out_path / "model").exists() and not overwrite:
        raise UserError(f"{out_path / 'model'} exists; pass --overwrite to replace it")
    import torch

    from zsprob.models import load_for_inference
    from zsprob.posthoc.adapter import AdapterSettings
    from zsprob.posthoc.features import DataSpec
    from zsprob.posthoc.run import posthoc as run_posthoc

    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    frozen = load_for_inference(checkpoint=checkpoint, model=model_name, pretrained=pretrained, device=dev,
                                **official_file_kwargs())
    source = {"checkpoint": None if checkpoint is None else str(checkpoint), "model": model_name,
              "pretrained": None if pretrained is None else str(pretrained)}  # how the frozen model was named
    data = DataSpec(data_kind, root if data_kind == "coco" else shards, max_samples=max_samples, workers=workers)
    settings = AdapterSettings(steps=steps, batch_size=batch_size, lr=lr, seed=seed, prior_precision=prior_precision,
                               inclusion_alpha=inclusion_alpha, same_length_alpha=same_length_alpha)
    summary = run_posthoc(frozen, data, out, method=method, views=views, settings=settings, device=dev,
                          feature_file=feature_file, source=source)
    click.echo(f"posthoc {method}: {summary['rows']} rows ({views} views) -> {Path(out) / 'model'} "
               f"(features {summary['feature_seconds']:.1f} s, heads {summary['train_seconds']:.1f} s)")
