"""`zsprob data`: not in this version yet (placeholder replaced by issue 4 (data))."""
import click

from zsprob.cli import not_available


@click.command("data", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def data() -> None:
    """Generate SynthWorld and inspect datasets."""
    not_available("zsprob data", "issue 4 (data)")
