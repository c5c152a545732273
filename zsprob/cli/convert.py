"""`zsprob convert`: a published ProLIP / PCME++ checkpoint -> a zsprob checkpoint (thin wrapper).

Calls :func:`zsprob.models.convert.convert.convert_to_checkpoint`; errors are one line (exit 2).
"""
import click

from zsprob.cli.options import OFFICIAL_WEIGHTS, WEIGHTS_HELP
from zsprob.cli.types import OUT_DIR, TOKENIZER, InPath


@click.command("convert")
@click.argument("source", type=InPath("official checkpoint", "any"))
@click.option("--out", required=True, type=OUT_DIR, help="zsprob checkpoint directory to write.")
@click.option("--model", "model_name", default=None,
              help="zsprob model name (default: from the layout: prolip-ViT-B-16, pcmepp-ViT-B-16, or for a COCO "
                   "trainer file, probabilistic or mu-only, pcmepp-coco-ViT-B-32 / -ViT-B-16 / -ViT-L-14 by its "
                   "patch size).")
@click.option("--layout", "layout_name", type=click.Choice(["prolip", "pcmepp-hf", "pcmepp-coco", "pcmepp-coco-mu"]), default=None,
              help="Official layout (default: detected from the key names).")
@click.option("--tokenizer", type=TOKENIZER, default=None,
              help="Local Hugging Face tokenizer directory (default: tokenizer/ next to SOURCE).")
@click.option("--weights", type=click.Choice(OFFICIAL_WEIGHTS), default=None, help=WEIGHTS_HELP)
def convert(source, out, model_name, layout_name, tokenizer, weights):
    """Convert an official checkpoint (file, Hugging Face directory or COCO trainer .ckpt), strictly.

    \b
    zsprob convert PCMEPP-ViT-B-16/ --out ckpt/pcmepp-b16
    Every official key must be consumed and every zsprob parameter filled, shapes equal.
    """
    from zsprob.models.convert.convert import convert_to_checkpoint

    path = convert_to_checkpoint(source, out, model_name=model_name, layout_name=layout_name, tokenizer=tokenizer,
                                 weights=weights)
    click.echo(f"checkpoint: {path}")
    from zsprob.models import load_meta

    chosen = load_meta(path)["config"].get("official_weights")
    if chosen is not None:  # a COCO trainer file: which copy was loaded (--weights)
        click.echo(f"weights: {chosen}")
