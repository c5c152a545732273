"""`zsprob finetune`: not in this version yet (placeholder replaced by issue 5 (training))."""
import click

from zsprob.cli import not_available


@click.command("finetune", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def finetune() -> None:
    """Fine-tune on COCO with the PCME++ recipe."""
    not_available("zsprob finetune", "issue 5 (training)")
