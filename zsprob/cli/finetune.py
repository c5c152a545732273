"""`zsprob finetune coco` / `flickr30k`: fine-tune on COCO or Flickr30k captions with the PCME++ recipe (thin wrapper).

No torch import at module level; the work is :func:`zsprob.train.loop.train`.
"""
import click

from zsprob.cli.train_options import common_options, print_summary, resolve_run_config, run
from zsprob.cli.types import InPath


@click.group("finetune")
def finetune():
    """Fine-tune a probabilistic image-text model (PCME++ recipe) on COCO or Flickr30k."""


@finetune.command("coco")
@click.option("--root", required=True, type=InPath("COCO root directory"),
              help="COCO directory (images and the Karpathy split JSON, see README).")
@click.option("--karpathy-json", type=InPath("COCO Karpathy split JSON", "file"), default=None,
              help="dataset_coco.json if not under ROOT.")
@click.option("--val", "val", is_flag=True,
              help="model selection: RSUM on the Karpathy val split after every epoch, best model to OUT/model-best.")
@common_options
def coco(root, karpathy_json, val, **kw):
    """Fine-tune on COCO Karpathy train (+restval) captions.

    \b
    zsprob finetune coco --config configs/finetune_coco_vitb32.yaml --root COCO --out runs/coco_b32
    """
    extra = ["data.kind=coco", f"data.root={root}"] + (["train.eval_every_epochs=1"] if val else [])
    if karpathy_json:
        extra.append(f"data.karpathy_json={karpathy_json}")
    cfg = resolve_run_config(kw, extra, default_config="finetune_coco_vitb32.yaml")
    hooks = ()
    if val:
        from zsprob.retrieval.coco import CocoValSelection
        hooks = (CocoValSelection(root, kw["out"], karpathy_json=karpathy_json, method=cfg.method),)
    summary = run(cfg, kw, hooks)
    from zsprob.cli.train_options import is_main_process
    if is_main_process():
        print_summary(summary)


@finetune.command("flickr30k")
@click.option("--root", required=True, type=InPath("Flickr30k root directory"),
              help="Flickr30k directory (flickr30k-images/ and dataset_flickr30k.json, see docs/retrieval.md).")
@click.option("--karpathy-json", type=InPath("Flickr30k Karpathy split JSON", "file"), default=None,
              help="dataset_flickr30k.json if not under ROOT.")
@click.option("--val", "val", is_flag=True,
              help="model selection: RSUM on the Karpathy val split after every epoch, best model to OUT/model-best.")
@common_options
def flickr30k(root, karpathy_json, val, **kw):
    """Fine-tune on Flickr30k Karpathy train captions (the COCO recipe's loop and sampling).

    \b
    zsprob finetune flickr30k --config configs/finetune_coco_vitb32.yaml --root FLICKR30K --out runs/f30k_b32
    """
    from zsprob.data.flickr import Flickr30kCaptions

    Flickr30kCaptions(root, split="train", karpathy_json=karpathy_json, check_images=False)  # the split file, now
    extra = ["data.kind=flickr30k", f"data.root={root}"] + (["train.eval_every_epochs=1"] if val else [])
    if karpathy_json:
        extra.append(f"data.karpathy_json={karpathy_json}")
    cfg = resolve_run_config(kw, extra, default_config="finetune_coco_vitb32.yaml")
    hooks = ()
    if val:
        from zsprob.retrieval.coco import CocoValSelection
        hooks = (CocoValSelection(root, kw["out"], karpathy_json=karpathy_json, method=cfg.method,
                                  dataset="flickr30k"),)
    summary = run(cfg, kw, hooks)
    from zsprob.cli.train_options import is_main_process
    if is_main_process():
        print_summary(summary)
