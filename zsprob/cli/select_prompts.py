"""`zsprob select-prompts`: rank prompt templates by text uncertainty and choose them per class.

Thin: checks the options and the outputs, builds one :class:`~zsprob.zeroshot.options.ZeroShotRequest`,
loads the model, calls ``zsprob.zeroshot.classify.run_selection`` and writes selection.json. No torch at
import.
"""
from __future__ import annotations

import click

from zsprob.cli.options import (check_prompt_outputs, common_options, model_options, refuse_unread_options,
                                request_and_model)
from zsprob.cli.types import OUT_FILE, REAL, InPath
from zsprob.methods import STRATEGIES
from zsprob.zeroshot.options import DATASET_KINDS


@click.command("select-prompts")
@model_options
@click.option("--dataset", type=click.Choice(DATASET_KINDS), required=True)
@click.option("--root", type=InPath("data root"), default=None,
              help="Dataset root (class names; evaluation images for zpe/bprw/oracle). SynthWorld: the "
                   "`zsprob data synthetic` output, whose classify/select split is the default selection split.")
@click.option("--topk", default="auto", show_default=True, help="auto | N | all | oracle")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None,
              help="Overrides --topk: any strategy (docs/zeroshot.md describes each).")
@click.option("--select-root", type=InPath("selection split"), default=None,
              help="Labelled selection split (folder per class; ImageNet: train images), disjoint from evaluation.")
@click.option("--no-select", is_flag=True, help="auto: ignore the selection split (label-free variant).")
@click.option("--threshold-c", type=REAL, default=1.0, show_default=True,
              help="Label-free auto: keep u <= mean + c*std per class.")
@click.option("--beta", type=REAL, default=1.0, show_default=True, help="fusion: weights u^-beta.")
@common_options
@click.option("--out", type=OUT_FILE, required=True, help="selection.json to write.")
def select_prompts(**opts):
    """Rank prompt templates by text uncertainty and select them per class."""
    from zsprob.zeroshot.options import strategy_from_topk

    out = opts["out"]
    strategy, k = strategy_from_topk(opts["topk"], opts["strategy"])
    refuse_unread_options(strategy, compare=False)
    cache = check_prompt_outputs(opts)
    model, request = request_and_model(opts, strategy=strategy, k=k, cache_dir=cache)
    from zsprob.utils.io import atomic_write_json
    from zsprob.zeroshot.classify import run_selection

    sel, doc = run_selection(model, request)
    atomic_write_json(out, doc)
    ks = sel.k
    kdesc = "" if ks is None else f", K per class {min(ks)}..{max(ks)} (mean {sum(ks) / len(ks):.1f})"
    flag = " [USES EVALUATION LABELS]" if sel.uses_eval_labels else ""
    flag += " [TRANSDUCTIVE: reads the evaluation images]" if doc["protocol"]["transductive"] else ""
    prompts = "templates" if sel.class_prompts is None else "prompt slots (per-class pools)"
    click.echo(f"{sel.label}: {len(sel.classnames)} classes x {len(sel.templates)} {prompts}{kdesc}{flag}")
    click.echo(f"wrote {out}")
