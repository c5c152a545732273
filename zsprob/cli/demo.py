"""`zsprob demo`: not in this version yet (placeholder replaced by issue 8 (demo))."""
import click

from zsprob.cli import not_available


@click.command("demo", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def demo() -> None:
    """Run the whole mission on SynthWorld and write a report."""
    not_available("zsprob demo", "issue 8 (demo)")
