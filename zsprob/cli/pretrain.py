"""`zsprob pretrain`: not in this version yet (placeholder replaced by issue 5 (training))."""
import click

from zsprob.cli import not_available


@click.command("pretrain", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def pretrain() -> None:
    """Pretrain a probabilistic image-text model on image-text shards."""
    not_available("zsprob pretrain", "issue 5 (training)")
