"""`zsprob export`: a zsprob checkpoint -> an open_clip / Hugging Face model directory with a model card (thin)."""
import click

from zsprob.cli.types import CHECKPOINT, OUT_DIR, InPath


@click.command("export")
@click.argument("checkpoint", type=CHECKPOINT)
@click.option("--format", "fmt", default="open_clip", show_default=True,
              help="Target format: open_clip (open_clip_config.json, open_clip_model.safetensors, README.md).")
@click.option("--out", required=True, type=OUT_DIR, help="Directory to write (empty, or --overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace the files of an earlier export in --out.")
@click.option("--eval-file", "eval_files", multiple=True, type=InPath("evaluation results", "file"),
              help="A zsprob eval metrics.json or zeroshot results.json whose figures go into the model card "
                   "(repeatable).")
def export(checkpoint, fmt, out, overwrite, eval_files):
    """Export a zsprob model for open_clip: the means as an open_clip model, sigma heads beside them.

    \b
    zsprob export runs/tiny/model --format open_clip --out hf/tiny
    python -c 'import open_clip; open_clip.create_model_and_transforms("local-dir:hf/tiny")'
    Refused (one line, nothing written): GPO pooling, bag-of-words text, [UNC] tokens, PCME++'s COCO fc head.
    """
    from zsprob.models.export import export_open_clip

    path = export_open_clip(checkpoint, out, fmt=fmt, overwrite=overwrite, eval_files=eval_files)
    click.echo(f"open_clip directory: {path}")
