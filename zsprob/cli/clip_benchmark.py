"""`zsprob clip-benchmark ...`: CLIP_benchmark's own command line with model type "zsprob" registered (thin).

Every argument goes to CLIP_benchmark unchanged (``zsprob clip-benchmark eval --help`` is its help;
``zsprob clip-benchmark --help`` this page); ``eval`` gets ``--model_type zsprob`` and an empty
``--pretrained`` unless given (:func:`zsprob.integrations.clip_benchmark.cli_args`).
"""
import click


@click.command("clip-benchmark", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def clip_benchmark(ctx, args):
    """Run CLIP_benchmark (its datasets and metrics) on zsprob models: --model CKPT (a zsprob checkpoint or
    export) or --model NAME --pretrained PATH. Its options: zsprob clip-benchmark eval --help.

    \b
    zsprob clip-benchmark eval --dataset cifar10 --dataset_root data/cifar10 --model runs/tiny/model
    """
    if not args or args[0] in ("-h", "--help"):
        click.echo(ctx.get_help())
        return 0
    from zsprob.integrations.clip_benchmark import run_cli

    return run_cli(list(args))
