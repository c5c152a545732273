"""`zsprob finetune coco` / `flickr30k`: fine-tune on COCO or Flickr30k captions with the PCME++ recipe
(thin wrapper; no torch import)."""
import click

from zsprob.cli.train_options import common_options, print_summary, resolve_run_config, run
from zsprob.cli.types import InPath

DEFAULT_CONFIG = "finetune_coco_vitb32.yaml"


@click.group("finetune")
def finetune():
    """Fine-tune a probabilistic image-text model (PCME++ recipe) on COCO or Flickr30k."""


def dataset_options(title: str, root_help: str, split_file: str):
    """The options of one fine-tuning command: its data root, its split file, --val and the common ones."""
    def wrap(command):
        for option in reversed((
                click.option("--root", required=True, type=InPath(f"{title} root directory"), help=root_help),
                click.option("--karpathy-json", type=InPath(f"{title} Karpathy split JSON", "file"), default=None,
                             help=f"{split_file} if not under ROOT."),
                click.option("--val", "val", is_flag=True,
                             help="model selection: RSUM on the Karpathy val split after every epoch, "
                                  "best model to OUT/model-best."),
                common_options)):
            command = option(command)
        return command
    return wrap


def _finetune(kind: str, root, karpathy_json, val: bool, kw: dict) -> None:
    """Resolve the recipe for data ``kind`` ("coco" or "flickr30k"), add the val-RSUM hook with --val, train."""
    extra = [f"data.kind={kind}", f"data.root={root}"] + (["train.eval_every_epochs=1"] if val else [])
    if karpathy_json:
        extra.append(f"data.karpathy_json={karpathy_json}")
    cfg = resolve_run_config(kw, extra, default_config=DEFAULT_CONFIG)
    hooks = ()
    if val:
        from zsprob.retrieval.coco import CocoValSelection
        hooks = (CocoValSelection(root, kw["out"], karpathy_json=karpathy_json, method=cfg.method, dataset=kind),)
    print_summary(run(cfg, kw, hooks))


@finetune.command("coco")
@dataset_options("COCO", "COCO directory (images and the Karpathy split JSON; layout: docs/data.md).",
                 "dataset_coco.json")
def coco(root, karpathy_json, val, **kw):
    """Fine-tune on COCO Karpathy train (+restval) captions.

    \b
    zsprob finetune coco --config configs/finetune_coco_vitb32.yaml --root COCO --out runs/coco_b32
    """
    _finetune("coco", root, karpathy_json, val, kw)


@finetune.command("flickr30k")
@dataset_options("Flickr30k", "Flickr30k directory (flickr30k-images/ and dataset_flickr30k.json, "
                              "see docs/retrieval.md).", "dataset_flickr30k.json")
def flickr30k(root, karpathy_json, val, **kw):
    """Fine-tune on Flickr30k Karpathy train captions (the COCO recipe's loop and sampling).

    \b
    zsprob finetune flickr30k --config configs/finetune_coco_vitb32.yaml --root FLICKR30K --out runs/f30k_b32
    """
    from zsprob.data.flickr import Flickr30kCaptions

    Flickr30kCaptions(root, split="train", karpathy_json=karpathy_json, check_images=False)  # the split file, now
    _finetune("flickr30k", root, karpathy_json, val, kw)
