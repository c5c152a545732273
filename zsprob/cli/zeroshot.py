"""`zsprob zeroshot`: zero-shot classification with selected prompts (or every strategy: --compare).

Thin: checks the options and the outputs, builds one :class:`~zsprob.zeroshot.options.ZeroShotRequest`,
loads the model, calls ``zsprob.zeroshot.classify.zeroshot_eval`` or ``compare_strategies``, writes
results.json and prints a summary. No torch at import.
"""
from __future__ import annotations

import click

from zsprob.cli.options import (check_prompt_outputs, common_options, model_options, refuse_given,
                                refuse_unread_options, request_and_model)
from zsprob.cli.types import OUT_FILE, REAL, InPath
from zsprob.methods import STRATEGIES
from zsprob.zeroshot.options import COMPARE_FILES, DATASET_KINDS, SCORES


@click.command("zeroshot")
@click.argument("dataset", type=click.Choice(DATASET_KINDS))
@model_options
@click.option("--root", type=InPath("data root"), required=True,
              help="Evaluation data (ImageNet root with val/, a folder per class, or a SynthWorld output).")
@click.option("--prompts", type=InPath("selection file", "file", "make one with zsprob select-prompts"),
              default=None, help="selection.json from zsprob select-prompts.")
@click.option("--topk", default="auto", show_default=True, help="auto | N | all | oracle (without --prompts)")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None, help="Overrides --topk.")
@click.option("--select-root", type=InPath("selection split"), default=None, help="Labelled selection split for auto.")
@click.option("--score", type=click.Choice(SCORES), default="cosine", show_default=True,
              help="cosine of means; CSD between image and class Gaussians; uncertainty-adjusted cosine.")
@click.option("--unc-weight", type=REAL, default=0.5, show_default=True, help="--score unc: cos - w * ||sigma^2||_1.")
@click.option("--compare", is_flag=True, help="Evaluate every strategy in one run; print one table and write PNGs.")
@common_options
@click.option("--out", type=OUT_FILE, required=True, help="results.json to write.")
def zeroshot(**opts):
    """Zero-shot classification with selected prompts."""
    from pathlib import Path

    from zsprob.errors import UserError
    from zsprob.zeroshot.options import strategy_from_topk

    prompts, compare, out = opts["prompts"], opts["compare"], opts["out"]
    if prompts is not None and compare:
        raise UserError("--compare evaluates every strategy; it does not take --prompts")
    strategy, k = "auto", None
    if prompts is not None:
        refuse_given("with --prompts (the selection file already fixes the prompts): drop it, or leave out "
                     "--prompts to select anew", "topk", "strategy", "select_root", "templates", "classes",
                     "k_grid", "shots", "shots_split", "allow_eval_shots")
    else:
        strategy, k = strategy_from_topk(opts["topk"], opts["strategy"])
        refuse_unread_options(strategy, compare, names=("k_grid", "shots", "shots_split"))
    if opts["score"] != "unc":
        refuse_given(f"with --score {opts['score']} (it weights sigma^2 in --score unc alone)", "unc_weight")
    cache = check_prompt_outputs(opts, COMPARE_FILES if compare else ())
    model, request = request_and_model(opts, strategy=strategy, k=k, cache_dir=cache)
    from zsprob.utils.io import atomic_write_json
    from zsprob.zeroshot.classify import compare_strategies, zeroshot_eval

    if compare:
        res = compare_strategies(model, request, out_dir=Path(out).resolve().parent)
        atomic_write_json(out, {k: v for k, v in res.items() if k != "selections"})
        _echo_compare(res)
    else:
        res = zeroshot_eval(model, request)
        atomic_write_json(out, res)
        _echo_result(res)
    click.echo(f"wrote {out}")


def _echo_compare(res: dict) -> None:
    click.echo(res["table"])
    mde = res.get("min_detectable_effect") or {}
    if mde:
        click.echo(f"paired vs all on the same {mde['n_images']} images; smallest top-1 difference this set detects "
                   f"(80% power, alpha 0.05, median discordance {mde['median_discordance']:.3f}): "
                   f"{mde['mde_top1_points']:.2f} points")
    _warn_separation(res)
    if res["deterministic"]:
        click.echo("(deterministic model: strategies that need sigma^2 were skipped)")
    for name, path in res.get("files", {}).items():
        if name.endswith(("topk", "hist", "coverage")):
            click.echo(f"figure: {path}")


def _echo_result(res: dict) -> None:
    m, selection = res["metrics"], res["selection"]
    flag = " [USES EVALUATION LABELS]" if selection["uses_eval_labels"] else ""
    flag += " [TRANSDUCTIVE]" if (selection.get("protocol") or {}).get("transductive") else ""
    click.echo(f"{selection['label']} ({res['score']}): top-1 {m['top1']:.2f}%  top-5 {m['top5']:.2f}%  "
               f"mean per-class {m['mean_per_class']:.2f}%  on {m['n_images']} images{flag}")
    _warn_separation(res)


def _warn_separation(res: dict) -> None:
    from zsprob.zeroshot.metrics import separation_warning

    line = separation_warning(res.get("class_separation") or {})
    if line:
        click.echo(line, err=True)
