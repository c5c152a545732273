"""`zsprob reproduce`: a published result in one command, the paper's figures beside the measured ones.

Thin: parses the options and calls :func:`zsprob.reproduce.run.reproduce` (or lists the recipes). No torch at
import.
"""
from __future__ import annotations

import click

from zsprob.cli.types import COUNT, OUT_DIR, InPath
from zsprob.reproduce.recipes import RECIPES


@click.command("reproduce")
@click.argument("name", required=False)
@click.option("--list", "list_", is_flag=True, help="List the recipes and what each reads.")
@click.option("--data-root", type=InPath("data root"), default=None,
              help="Folder holding coco/, imagenet/ and redcaps/ as docs/reproduce.md lays them out.")
@click.option("--pretrained", default=None, help="The published weights (file or directory) the recipe evaluates.")
@click.option("--variant", default=None, help="Backbone or method (default: the recipe's first; --list names them).")
@click.option("--seeds", type=COUNT, default=3, show_default=True, help="Training runs (recipes that train).")
@click.option("--smoke", is_flag=True, help="The same steps on real-format miniatures with a tiny model (CI).")
@click.option("--out", type=OUT_DIR, default=None,
              help="Run folder (reproduce.json, reproduce.md, each step's output).")
def reproduce(name, list_, data_root, pretrained, variant, seeds, smoke, out):
    """Reproduce a table of the papers (PCME++, ProLIP) with the published figures beside the measured ones."""
    from pathlib import Path

    from zsprob.errors import UserError

    if list_:
        for r in RECIPES.values():
            state = f"  [cannot run: {r.unsupported}]" if r.unsupported else ""
            variants = f"  variants: {', '.join(r.variants)}" if r.variants else ""
            click.echo(f"{r.name}: {r.title}\n    {r.source}; reads {', '.join(r.data)}{variants}{state}")
        return
    if name is None or out is None:
        raise UserError("give a recipe NAME and --out DIR (zsprob reproduce --list names the recipes)")
    if data_root is None and not smoke:
        raise UserError("give --data-root DIR (or --smoke for the miniature run)")
    if smoke and (data_root is not None or pretrained is not None):
        raise UserError("--smoke makes its own miniature data and tiny model: drop --data-root and --pretrained")
    from zsprob.reproduce.run import Context, get_recipe, reproduce as run

    recipe = get_recipe(name)
    ctx = Context(name, Path(data_root or "."), Path(out), variant or (recipe.variants or ("",))[0], pretrained,
                  seeds if recipe.seeds else 1, smoke)
    doc = run(ctx, echo=click.echo)
    click.echo(Path(out, "reproduce.md").read_text(encoding="utf-8"))
    click.echo(f"wrote {Path(out) / 'reproduce.json'}" + (" (smoke run)" if doc["smoke"] else ""))
