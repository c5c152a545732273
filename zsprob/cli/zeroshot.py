"""`zsprob zeroshot`: zero-shot classification with selected prompts (or every strategy: --compare).

Thin: parses options, loads the model, calls ``zsprob.zeroshot.classify.zeroshot_eval`` or
``compare_strategies``, writes results.json and prints a summary. No torch at import. An ``--out`` (or a
file --compare writes beside it, or the cache folder) that is an input file (``--prompts p.json --out
p.json``), lies inside the model's directory or would replace a file of the dataset is refused in one line
before anything is loaded or written.
"""
from __future__ import annotations

import click

from zsprob.cli.options import (check_prompt_inputs, common_options, load_model, model_options, prompt_outputs,
                                refuse_given, refuse_overwriting_inputs, refuse_unread_options, resolve_device)
from zsprob.cli.types import OUT_FILE, REAL, InPath
from zsprob.methods import STRATEGIES

#: what --compare writes beside --out (zsprob.zeroshot.classify.compare_on_features)
COMPARE_FILES = ("compare.md", "compare.json", "accuracy_vs_topk.png", "per_class_k_hist.png", "selections")


@click.command("zeroshot")
@click.argument("dataset", type=click.Choice(["imagenet", "synthetic", "folder"]))
@model_options
@click.option("--root", type=InPath("data root"), required=True,
              help="Evaluation data (ImageNet root with val/, a folder per class, or a SynthWorld output).")
@click.option("--prompts", type=InPath("selection file", "file", "make one with zsprob select-prompts"),
              default=None, help="selection.json from zsprob select-prompts.")
@click.option("--topk", default="auto", show_default=True, help="auto | N | all | oracle (without --prompts)")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None, help="Overrides --topk.")
@click.option("--select-root", type=InPath("selection split"), default=None, help="Labelled selection split for auto.")
@click.option("--score", type=click.Choice(["cosine", "csd", "unc"]), default="cosine", show_default=True,
              help="cosine of means; CSD between image and class Gaussians; uncertainty-adjusted cosine.")
@click.option("--unc-weight", type=REAL, default=0.5, show_default=True, help="--score unc: cos - w * ||sigma^2||_1.")
@click.option("--compare", is_flag=True, help="Evaluate every strategy in one run; print one table and write PNGs.")
@common_options
@click.option("--out", type=OUT_FILE, required=True, help="results.json to write.")
def zeroshot(dataset, checkpoint, model_name, pretrained, root, prompts, topk, strategy, select_root, score,
             unc_weight, compare, shots_split, shots, allow_eval_shots, class_prompts, k_grid, batch_size, device,
             workers, precision, cache_dir, templates, classes, out):
    """Zero-shot classification with selected prompts."""
    from pathlib import Path

    from zsprob.errors import UserError
    from zsprob.zeroshot.options import parse_k_grid, strategy_from_topk

    if prompts is not None and compare:
        raise UserError("--compare evaluates every strategy; it does not take --prompts")
    if prompts is not None:
        refuse_given("with --prompts (the selection file already fixes the prompts): drop it, or leave out "
                     "--prompts to select anew", "topk", "strategy", "select_root", "templates", "classes",
                     "k_grid", "shots", "shots_split", "allow_eval_shots")
    else:
        refuse_unread_options(strategy_from_topk(topk, strategy)[0], compare,
                              names=("k_grid", "shots", "shots_split"))
    if score != "unc":
        refuse_given(f"with --score {score} (it weights sigma^2 in --score unc alone)", "unc_weight")
    cache = check_prompt_inputs(templates=templates, classes=classes, class_prompts=class_prompts, k_grid=k_grid,
                                shots_split=shots_split, allow_eval_shots=allow_eval_shots, cache_dir=cache_dir,
                                out=out)
    refuse_overwriting_inputs(prompt_outputs(out, cache, cache_dir is not None, COMPARE_FILES if compare else ()),
                              {"--prompts": prompts, "--templates": templates, "--classes": classes,
                               "--class-prompts": class_prompts}, checkpoint=checkpoint, pretrained=pretrained,
                              data={"--root": root, "--select-root": select_root})
    shot_args = {"shots": shots, "shots_split": shots_split, "allow_eval_shots": allow_eval_shots,
                 "class_prompts": class_prompts}
    device = resolve_device(device)
    encoding = {"device": device, "num_workers": workers, "precision": precision}
    from zsprob.utils.io import atomic_write_json
    from zsprob.zeroshot.classify import compare_strategies, zeroshot_eval

    out = Path(out)
    model, meta = load_model(checkpoint, model_name, pretrained, device)
    if compare:
        kv = parse_k_grid(k_grid) if k_grid else None
        res = compare_strategies(model, root, dataset, out_dir=out.resolve().parent, select_root=select_root,
                                 templates=templates, classnames=classes, cache_dir=cache, k_values=kv, score=score,
                                 unc_weight=unc_weight, batch_size=batch_size, model_meta=meta, **encoding, **shot_args)
        doc = {k: v for k, v in res.items() if k != "selections"}
        atomic_write_json(out, doc)
        click.echo(res["table"])
        _echo_detectable_effect(res.get("min_detectable_effect") or {})
        _warn_separation(res)
        if res["deterministic"]:
            click.echo("(deterministic model: strategies that need sigma^2 were skipped)")
        for name, path in res.get("files", {}).items():
            if name.endswith(("topk", "hist")):
                click.echo(f"figure: {path}")
        click.echo(f"wrote {out}")
        return
    name, k = (None, None) if prompts is not None else strategy_from_topk(topk, strategy)
    res = zeroshot_eval(model, dataset, root, prompts=prompts, strategy=name or "auto", k=k, select_root=select_root,
                        templates=templates, classnames=classes, cache_dir=cache, k_values=k_grid, score=score,
                        unc_weight=unc_weight, batch_size=batch_size, model_meta=meta, **encoding, **shot_args)
    atomic_write_json(out, res)
    m = res["metrics"]
    flag = " [USES EVALUATION LABELS]" if res["selection"]["uses_eval_labels"] else ""
    flag += " [TRANSDUCTIVE]" if (res["selection"].get("protocol") or {}).get("transductive") else ""
    click.echo(f"{res['selection']['label']} ({score}): top-1 {m['top1']:.2f}%  top-5 {m['top5']:.2f}%  "
               f"mean per-class {m['mean_per_class']:.2f}%  on {m['n_images']} images{flag}")
    _warn_separation(res)
    click.echo(f"wrote {out}")


def _echo_detectable_effect(mde: dict) -> None:
    if mde:
        click.echo(f"paired vs all on the same {mde['n_images']} images; smallest top-1 difference this set detects "
                   f"(80% power, alpha 0.05, median discordance {mde['median_discordance']:.3f}): "
                   f"{mde['mde_top1_points']:.2f} points")


def _warn_separation(res: dict) -> None:
    from zsprob.zeroshot.classify import separation_warning

    line = separation_warning(res.get("class_separation") or {})
    if line:
        click.echo(line, err=True)
