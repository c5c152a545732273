"""`zsprob demo`: run the whole pipeline on SynthWorld and write a report (thin wrapper).

The work is done by :func:`zsprob.report.demo.run_demo`, which chains the real commands.
"""
import click

from zsprob.cli.types import COUNT, COUNT0, OUT_DIR


@click.command("demo")
@click.option("--out", type=OUT_DIR, default="demo_out", show_default=True,
              help="Output folder; an existing one is resumed (finished steps are skipped).")
@click.option("--quick", is_flag=True, help="Small world and short training (about 5 minutes on 2 cores).")
@click.option("--steps", type=COUNT, default=None, help="Pretraining steps per model [default: 900, quick: 300].")
@click.option("--batch-size", type=COUNT, default=None, help="Pretraining batch size [default: 128, quick: 128].")
@click.option("--seed", type=int, default=None, help="World and training seed [default: 0].")
@click.option("--workers", type=COUNT0, default=None, help="Data loader workers during pretraining [default: 1].")
@click.option("--threads", type=COUNT, default=None, help="torch CPU threads [default: torch's].")
@click.option("--all-methods", is_flag=True,
              help="Also train PCME++ with its official objective, ProLIP, PCME and prob-triplet on the same "
                   "budget and add a table of every objective's uncertainty validity, retrieval and zero-shot "
                   "(four more trainings).")
def demo(out, quick, steps, batch_size, seed, workers, threads, all_methods):
    """Run the whole mission on SynthWorld and write OUT/report.md.

    \b
    Generates SynthWorld, pretrains PCME++ and an InfoNCE baseline, selects prompts by text
    uncertainty without evaluation labels, classifies zero-shot with every prompt strategy,
    evaluates retrieval, and writes OUT/report.md + OUT/report.json with plots.

    SIGTERM / Ctrl-C stop the running step cleanly (pretraining writes a checkpoint) and exit
    with one line (143; 130 for Ctrl-C); the same command resumes.
    """
    from zsprob.report.demo import run_demo

    run_demo(out, quick=quick, echo=click.echo, steps=steps, batch_size=batch_size, seed=seed,
             workers=workers, threads=threads, all_methods=all_methods or None)
