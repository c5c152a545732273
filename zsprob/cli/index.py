"""`zsprob index`: not in this version yet (placeholder replaced by issue 7 (retrieval))."""
import click

from zsprob.cli import not_available


@click.command("index", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def index() -> None:
    """Build and search CSD indexes."""
    not_available("zsprob index", "issue 7 (retrieval)")
