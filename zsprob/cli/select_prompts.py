"""`zsprob select-prompts`: rank prompt templates by text uncertainty and choose them per class.

Thin: parses options, loads the model (zsprob checkpoint or plain open_clip), calls
``zsprob.zeroshot.classify.run_selection`` and writes selection.json. No torch at import.
"""
from __future__ import annotations

import click

from zsprob.cli.types import CHECKPOINT, COUNT, OUT_FILE, TOKENIZER, InPath

from zsprob.methods import STRATEGIES


# where --tokenizer / --weights are kept (click context meta) for the model loaders, as create_model's keywords
OFFICIAL_FILE_KEYS = {"zsprob.tokenizer": "tokenizer_dir", "zsprob.weights": "weights"}
# the copies of a PCME++ COCO trainer file with SWA copies (zsprob.models.convert.swa.WEIGHTS; no torch here)
OFFICIAL_WEIGHTS = ("swa-text", "swa", "raw")
WEIGHTS_HELP = ("A PCME++ COCO trainer file's SWA copies: swa-text (the official final evaluation: SWA text "
                "encoder, raw image encoder and criterion), swa (every averaged copy) or raw (the trained weights). "
                "Default: swa-text when the file holds averaged copies, else raw.")


def _keep(key: str):
    def keep(ctx, _param, value):
        if value is not None:
            ctx.meta[key] = value
        return value
    return keep


def official_file_options(f):
    """``--tokenizer DIR`` (a local Hugging Face tokenizer, e.g. ProLIP's) and ``--weights`` (a COCO trainer
    file's SWA or raw copy), options of a published file given as --pretrained, read by the model loaders."""
    f = click.option("--weights", type=click.Choice(OFFICIAL_WEIGHTS), default=None, expose_value=False,
                     callback=_keep("zsprob.weights"), help=WEIGHTS_HELP)(f)
    return click.option("--tokenizer", type=TOKENIZER, default=None, expose_value=False,
                        callback=_keep("zsprob.tokenizer"),
                        help="Local Hugging Face tokenizer directory (ProLIP; default: tokenizer/ next to "
                             "--pretrained).")(f)


def official_file_kwargs() -> dict:
    """The create_model keywords of :func:`official_file_options` that were given."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    return {kw: meta[key] for key, kw in OFFICIAL_FILE_KEYS.items() if meta.get(key)}


def model_options(f):
    f = official_file_options(f)
    f = click.option("--pretrained", default=None, help="open_clip pretrained tag or weights file, a published "
                     "ProLIP / PCME++ checkpoint (file or directory) or a zsprob checkpoint (with --model).")(f)
    f = click.option("--model", "model_name", default=None,
                     help="A plain open_clip model name (e.g. ViT-B-32) instead of a checkpoint.")(f)
    f = click.option("--checkpoint", type=CHECKPOINT, default=None, help="zsprob checkpoint directory.")(f)
    return f


def common_options(f):
    f = click.option("--k-grid", default=None, help="K values searched by auto/global/oracle, e.g. '1-80' "
                     "or '1,2,4,8,16,32,80' (default: every K).")(f)
    f = click.option("--batch-size", type=COUNT, default=256, show_default=True)(f)
    f = click.option("--device", default=None, help="torch device (default: the model's).")(f)
    f = click.option("--cache-dir", type=click.Path(), default=None,
                     help="Prompt-bank and image-embedding cache (default: cache/ next to --out).")(f)
    f = click.option("--templates", default=None, help="Template file, one per line with {} "
                     "(default: the 80 CLIP ImageNet templates).")(f)
    f = click.option("--classes", type=click.Path(), default=None,
                     help="Class-name file (default: the dataset's class names).")(f)
    return f


def load_model(checkpoint, model_name, pretrained, device):
    from zsprob.models import load_for_inference

    m = load_for_inference(checkpoint=checkpoint, model=model_name, pretrained=pretrained, device=device,
                           **official_file_kwargs())
    meta = {"checkpoint": None if checkpoint is None else str(checkpoint), "name": getattr(m, "name", model_name),
            "pretrained": pretrained, "deterministic": bool(m.deterministic), "embed_dim": m.embed_dim}
    return m, meta


@click.command("select-prompts")
@model_options
@click.option("--dataset", type=click.Choice(["imagenet", "synthetic", "folder"]), required=True)
@click.option("--root", type=InPath("data root"), default=None,
              help="Dataset root (class names; evaluation images for zpe/bprw/oracle). SynthWorld: the "
                   "`zsprob data synthetic` output, whose classify/select split is the default selection split.")
@click.option("--topk", default="auto", show_default=True, help="auto | N | all | oracle")
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None,
              help="Overrides --topk: any strategy (see README).")
@click.option("--select-root", type=InPath("selection split"), default=None,
              help="Labelled selection split (folder per class; ImageNet: train images), disjoint from evaluation.")
@click.option("--no-select", is_flag=True, help="auto: ignore the selection split (label-free variant).")
@click.option("--threshold-c", type=float, default=1.0, show_default=True,
              help="Label-free auto: keep u <= mean + c*std per class.")
@click.option("--beta", type=float, default=1.0, show_default=True, help="fusion: weights u^-beta.")
@common_options
@click.option("--out", type=OUT_FILE, required=True, help="selection.json to write.")
def select_prompts(checkpoint, model_name, pretrained, dataset, root, topk, strategy, select_root, no_select,
                   threshold_c, beta, k_grid, batch_size, device, cache_dir, templates, classes, out):
    """Rank prompt templates by text uncertainty and select them per class."""
    from pathlib import Path

    from zsprob.zeroshot.options import parse_k_grid, strategy_from_topk

    name, k = strategy_from_topk(topk, strategy)
    parse_k_grid(k_grid)                      # fail fast on a malformed grid, before loading torch
    from zsprob.utils.io import atomic_write_json
    from zsprob.zeroshot.classify import run_selection

    model, meta = load_model(checkpoint, model_name, pretrained, device)
    cache = Path(cache_dir) if cache_dir else Path(out).resolve().parent / "cache"
    sel, doc = run_selection(model, dataset, root, strategy=name, k=k, select_root=select_root,
                             use_select=not no_select, templates=templates, classnames=classes, cache_dir=cache,
                             k_values=k_grid, threshold_c=threshold_c, beta=beta, batch_size=batch_size,
                             device=device, model_meta=meta)
    atomic_write_json(out, doc)
    ks = sel.k
    kdesc = "" if ks is None else f", K per class {min(ks)}..{max(ks)} (mean {sum(ks) / len(ks):.1f})"
    flag = " [USES EVALUATION LABELS]" if sel.uses_eval_labels else ""
    click.echo(f"{sel.label}: {len(sel.classnames)} classes x {len(sel.templates)} templates{kdesc}{flag}")
    click.echo(f"wrote {out}")
