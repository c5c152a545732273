"""`zsprob convert`: a published ProLIP / PCME++ checkpoint -> a zsprob checkpoint (thin wrapper).

Every refusal of ``--out`` (not empty without ``--overwrite``; SOURCE, inside it or inside ``--tokenizer``;
files that would replace SOURCE) comes before anything is read or written.
"""
from pathlib import Path

import click

from zsprob.cli.options import OFFICIAL_WEIGHTS, WEIGHTS_HELP
from zsprob.cli.types import OUT_DIR, TOKENIZER, InPath
from zsprob.models.catalogue import LAYOUTS
from zsprob.utils.paths import CHECKPOINT_FILES


def _refuse_out(source, out, tokenizer, overwrite: bool) -> None:
    """--out apart from the inputs (SOURCE, --tokenizer), and empty unless --overwrite (one line)."""
    from zsprob.errors import UserError
    from zsprob.utils.checks import check_outputs_apart, is_tokenizer_dir

    src = Path(source).expanduser()
    folder = src if src.is_dir() else src.parent if is_tokenizer_dir(src.parent) else None  # a published layout
    written = {"--out": out, **{f"--out ({name})": Path(out) / name for name in CHECKPOINT_FILES}}
    check_outputs_apart(written, files={} if src.is_dir() else {"SOURCE": source},
                        dirs={"SOURCE" if src.is_dir() else "SOURCE's": folder, "--tokenizer": tokenizer})
    outp = Path(out).expanduser()
    if outp.is_dir() and any(outp.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty; pass --overwrite to replace what it holds (e.g. an earlier "
                        "conversion)")
    from zsprob.models.export import CONFIG_NAME
    if (outp / CONFIG_NAME).exists():  # loading the directory would find that model, not the conversion
        raise UserError(f"--out {out} holds an open_clip export ({CONFIG_NAME}), which zsprob would load instead "
                        "of the converted model; write to an empty or new directory")


@click.command("convert")
@click.argument("source", type=InPath("official checkpoint", "any"))
@click.option("--out", required=True, type=OUT_DIR,
              help="zsprob checkpoint directory to write (empty, or --overwrite).")
@click.option("--model", "model_name", default=None,
              help="zsprob model name (default: the layout's published model; of a COCO trainer file, the one "
                   "with its patch size).")
@click.option("--layout", "layout_name", type=click.Choice(list(LAYOUTS)), default=None,
              help="Official layout (default: detected from the key names).")
@click.option("--tokenizer", type=TOKENIZER, default=None,
              help="Local Hugging Face tokenizer directory (default: tokenizer/ next to SOURCE).")
@click.option("--weights", type=click.Choice(OFFICIAL_WEIGHTS), default=None, help=WEIGHTS_HELP)
@click.option("--overwrite", is_flag=True,
              help="Write into a non-empty --out (replacing an earlier conversion's files); never SOURCE itself.")
def convert(source, out, model_name, layout_name, tokenizer, weights, overwrite):
    """Convert an official checkpoint (file, Hugging Face directory or COCO trainer .ckpt), strictly.

    \b
    zsprob convert PCMEPP-ViT-B-16/ --out ckpt/pcmepp-b16
    Every official key must be consumed and every zsprob parameter filled, shapes equal.
    """
    _refuse_out(source, out, tokenizer, overwrite)
    from zsprob.models.builder import convert_to_checkpoint

    path = convert_to_checkpoint(source, out, model_name=model_name, layout_name=layout_name, tokenizer=tokenizer,
                                 weights=weights)
    click.echo(f"checkpoint: {path}")
    from zsprob.models import load_meta

    chosen = load_meta(path)["config"].get("official_weights")
    if chosen is not None:  # a COCO trainer file: which copy was loaded (--weights)
        click.echo(f"weights: {chosen}")
