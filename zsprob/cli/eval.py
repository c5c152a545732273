"""`zsprob eval`: not in this version yet (placeholder replaced by issue 7 (retrieval))."""
import click

from zsprob.cli import not_available


@click.command("eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def eval_() -> None:
    """Retrieval evaluation."""
    not_available("zsprob eval", "issue 7 (retrieval)")
