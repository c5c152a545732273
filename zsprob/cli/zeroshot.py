"""`zsprob zeroshot`: not in this version yet (placeholder replaced by issue 6 (zero-shot))."""
import click

from zsprob.cli import not_available


@click.command("zeroshot", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def zeroshot() -> None:
    """Zero-shot classification with selected prompts."""
    not_available("zsprob zeroshot", "issue 6 (zero-shot)")
