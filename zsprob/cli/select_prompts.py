"""`zsprob select-prompts`: not in this version yet (placeholder replaced by issue 6 (zero-shot))."""
import click

from zsprob.cli import not_available


@click.command("select-prompts", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def select_prompts() -> None:
    """Rank prompt templates by text uncertainty and select them per class."""
    not_available("zsprob select-prompts", "issue 6 (zero-shot)")
