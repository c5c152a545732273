"""The click options and glue shared by ``zsprob pretrain`` and ``zsprob finetune`` (no torch import at module level).

First-class flags map onto config keys (a flag wins over the YAML recipe; ``--set`` wins over
both, applied last in command-line order)::

    --method M          method                  --steps N        schedule.steps (clears epochs)
    --distance D        loss.pcmepp.distance    --epochs E       schedule.epochs
    --batch-size B      data.batch_size         --lr LR          optim.lr
    --model NAME        model.name              --pretrained P   model.pretrained
    --weights W         model.weights (a PCME++ COCO trainer file's SWA or raw copy)
    --noise-ratio R     data.noise_ratio        --msda/--no-msda msda.enabled
    --precision P       train.precision         --workers N      data.num_workers
    --seed S            seed                    --threads N      train.threads
    --log-every N       train.log_every         --checkpoint-every N  train.checkpoint_every
    --eval-every N      train.eval_every        --remote-sync URL train.remote_sync
    --requeue-exit-code N train.requeue_exit_code

``--resume [auto|latest|DIR]`` and ``--resume-from DIR`` choose the checkpoint
(:mod:`zsprob.train.resilience`); without them a run under torchrun resumes "auto". An OUT that
holds a run needs ``--resume`` or ``--overwrite``; ``--steps`` with ``--epochs`` is one line.
"""
from __future__ import annotations

from pathlib import Path

import click

from zsprob.cli.options import OFFICIAL_WEIGHTS, WEIGHTS_HELP
from zsprob.cli.types import OUT_DIR

from zsprob.methods import METHODS


def common_options(f):
    opts = [
        click.option("--config", "config_path", type=str, default=None,
                     help="YAML recipe (a path, or a name in configs/)."),
        click.option("--out", required=True, type=OUT_DIR,
                     help="Run directory: metrics.jsonl, checkpoints/, model/ (the trained checkpoint)."),
        click.option("--method", type=click.Choice(METHODS), default=None,
                     help="Training objective (default: the recipe's, else pcmepp)."),
        click.option("--distance", type=click.Choice(["csd", "wd"]), default=None,
                     help="PCME++ distance: csd (paper) or wd (2-Wasserstein ablation)."),
        click.option("--steps", type=int, default=None, help="Total optimiser steps."),
        click.option("--epochs", type=float, default=None, help="Total epochs (needs a known epoch length)."),
        click.option("--batch-size", type=int, default=None, help="GLOBAL batch size (all processes)."),
        click.option("--lr", type=float, default=None, help="Base learning rate."),
        click.option("--model", "model_name", type=str, default=None, help="Model name (open_clip or configs/models)."),
        click.option("--pretrained", type=str, default=None, help="open_clip pretrained tag or checkpoint file."),
        click.option("--weights", type=click.Choice(OFFICIAL_WEIGHTS), default=None, help=WEIGHTS_HELP),
        click.option("--noise-ratio", type=float, default=None,
                     help="Share of training captions replaced by wrong ones (PCME++ Table 2)."),
        click.option("--msda/--no-msda", default=None, help="Mixup / CutMix with soft targets (PCME++ Sec. 2.4)."),
        click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None),
        click.option("--workers", type=int, default=None, help="Data loader worker processes per process."),
        click.option("--seed", type=int, default=None),
        click.option("--threads", type=int, default=None, help="torch CPU threads."),
        click.option("--log-every", type=int, default=None, help="Steps between metrics.jsonl records."),
        click.option("--checkpoint-every", type=int, default=None, help="Steps between resumable checkpoints."),
        click.option("--eval-every", type=int, default=None, help="Steps between evaluation hooks."),
        click.option("--remote-sync", type=str, default=None, metavar="URL",
                     help="Mirror OUT to an fsspec URL (s3://, gs://, file://) after each checkpoint; "
                          "--resume pulls a newer checkpoint from it."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override any config value, e.g. --set optim.layer_decay=0.7 (repeatable)."),
        click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[auto|latest|DIR]",
                     help="Continue exactly: latest (the default value) from OUT/checkpoints/latest.json; auto from "
                          "the latest valid checkpoint if any, else start afresh (the default under torchrun); "
                          "or a step directory."),
        click.option("--resume-from", type=click.Path(), default=None, help="Continue from a step directory."),
        click.option("--overwrite", is_flag=True,
                     help="OUT holds an earlier run: remove its files and start afresh (without --resume or "
                          "--overwrite such an OUT is refused)."),
        click.option("--requeue-exit-code", type=click.IntRange(0, 255), default=None,
                     help="Exit code after SIGTERM / SIGUSR1 (checkpoint written first) [default: 143]."),
        click.option("--no-progress", is_flag=True, help="No progress bar."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def flag_overrides(kw: dict) -> list[str]:
    """``key=value`` strings for the first-class flags that were given."""
    import json
    out: list[str] = []

    def put(key, value):
        if value is not None:
            out.append(f"{key}={json.dumps(value) if isinstance(value, (list, bool)) else value}")

    put("method", kw.get("method"))
    if kw.get("distance") is not None:
        put("loss.pcmepp.distance", kw["distance"])
    if kw.get("steps") is not None and kw.get("epochs") is not None:
        from zsprob.errors import UserError
        raise UserError(f"--steps {kw['steps']} and --epochs {kw['epochs']} both set the run's length: drop one "
                        "(--steps counts optimiser steps, --epochs passes over the data)")
    if kw.get("steps") is not None:
        put("schedule.steps", kw["steps"])
        out.append("schedule.epochs=null")
    put("schedule.epochs", kw.get("epochs"))
    put("data.batch_size", kw.get("batch_size"))
    put("optim.lr", kw.get("lr"))
    put("model.name", kw.get("model_name"))
    put("model.pretrained", kw.get("pretrained"))
    put("model.weights", kw.get("weights"))
    put("data.noise_ratio", kw.get("noise_ratio"))
    if kw.get("msda") is not None:
        out.append(f"msda.enabled={'true' if kw['msda'] else 'false'}")
    put("train.precision", kw.get("precision"))
    put("data.num_workers", kw.get("workers"))
    put("seed", kw.get("seed"))
    put("train.threads", kw.get("threads"))
    put("train.log_every", kw.get("log_every"))
    put("train.checkpoint_every", kw.get("checkpoint_every"))
    put("train.eval_every", kw.get("eval_every"))
    put("train.remote_sync", kw.get("remote_sync"))
    put("train.requeue_exit_code", kw.get("requeue_exit_code"))
    return out


def resolve_run_config(kw: dict, extra: list[str], default_config: str | None):
    """Recipe (or the run's saved config.yaml when resuming without --config) + flags + --set."""
    from zsprob.train import load_train_config
    from zsprob.train.defaults import resolve_config
    path = kw.get("config_path")
    out = Path(kw["out"])
    if path is None and resuming(kw) and (out / "config.yaml").is_file():
        path = str(out / "config.yaml")
    if path is None:
        path = default_config
    flags, sets = flag_overrides(kw), list(kw.get("overrides") or ())
    refuse_flag_and_set(flags, sets, kw)
    return resolve_config(load_train_config(path, extra + flags + sets), out)  # every check, before torch


#: the flag that writes each config key (``flag_overrides``), for the messages
FLAG_OF_KEY = {"method": "--method", "loss.pcmepp.distance": "--distance", "schedule.steps": "--steps",
               "schedule.epochs": "--epochs", "data.batch_size": "--batch-size", "optim.lr": "--lr",
               "model.name": "--model", "model.pretrained": "--pretrained", "model.weights": "--weights",
               "data.noise_ratio": "--noise-ratio", "msda.enabled": "--msda / --no-msda",
               "train.precision": "--precision", "data.num_workers": "--workers", "seed": "--seed",
               "train.threads": "--threads", "train.log_every": "--log-every",
               "train.checkpoint_every": "--checkpoint-every", "train.eval_every": "--eval-every",
               "train.remote_sync": "--remote-sync", "train.requeue_exit_code": "--requeue-exit-code"}


def refuse_flag_and_set(flags: list[str], sets: list[str], kw: dict) -> None:
    """One line when a flag and a ``--set`` write the same key (or ``--set`` replaces the section holding
    it): otherwise the later one would silently win."""
    from zsprob.errors import UserError
    seen: dict[str, str] = {}
    for item in sets:  # the same key twice, or a key and then a section that replaces it: the later would win
        key = item.split("=", 1)[0].strip()  # (a section and then a key inside it refines it: allowed)
        for other_key, other in seen.items():
            if key == other_key or other_key.startswith(key + "."):
                raise UserError(f"--set {other} and then --set {item} both set {other_key}; the later would "
                                "replace the earlier: give it once")
        seen[key] = item
    for item in sets:
        key = item.split("=", 1)[0].strip()
        for flag_item in flags:
            written = flag_item.split("=", 1)[0]
            if written == key or written.startswith(key + "."):
                if written == "schedule.epochs" and kw.get("steps") is not None:
                    raise UserError(f"--steps (schedule.steps) and --set {item} both set the run's length: drop one")
                raise UserError(f"{FLAG_OF_KEY.get(written, written)} and --set {item} both set {written}: "
                                "give it once")


def resuming(kw: dict) -> bool:
    """Whether this launch continues a run (then OUT/config.yaml is the recipe unless --config is given)."""
    from zsprob.train.resilience import latest_valid_checkpoint, resume_mode
    mode = resume_mode(kw.get("resume_from") or kw.get("resume"))
    if mode == "auto":
        return latest_valid_checkpoint(kw["out"]) is not None
    return mode is not None


def run(cfg, kw: dict, hooks=()) -> dict:
    from zsprob.train.loop import train_resolved
    resume = kw.get("resume_from") or kw.get("resume")
    try:
        summary = train_resolved(cfg, kw["out"], resume=resume, eval_hooks=hooks, progress=not kw.get("no_progress"),
                                 overwrite=bool(kw.get("overwrite")))
    finally:
        # under torchrun / accelerate launch: leave the process group cleanly (gloo can abort at exit otherwise)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def print_summary(summary: dict) -> None:
    if not summary:
        return
    if summary.get("already_finished"):
        click.echo(f"the run is already finished ({summary['steps']} of {summary['steps']} steps; "
                   f"final loss {summary['final_loss']:.4f}): nothing to do (--steps above {summary['steps']} "
                   "continues it, --overwrite starts it again)")
        click.echo(f"model: {summary['model']}")
        return
    start = int(summary.get("start_step") or 0)
    last = int(summary["steps"])
    steps = (f"{last} step{'s' if last != 1 else ''}" if not start else f"step {last}" if last == start + 1 else f"steps {start + 1}-{last}")
    steps += f" (resumed at step {start})" if start else ""
    click.echo(f"trained {summary['method']} for {steps} "
               f"(global batch {summary['global_batch_size']}, {summary['world_size']} process(es)): "
               f"final loss {summary['final_loss']:.4f}, {summary['samples_per_s']:.1f} samples/s")
    click.echo(f"model: {summary['model']}")
    if summary.get("model_swa"):
        click.echo(f"SWA model: {summary['model_swa']}")
    bad = (summary.get("data") or {}).get("bad_images")
    if bad:
        click.echo(f"{bad} unreadable training image(s) were replaced by copies of readable samples of their batches")


def is_main_process() -> bool:
    import os
    return os.environ.get("RANK", "0") == "0"


__all__ = ["common_options", "flag_overrides", "resolve_run_config", "run", "print_summary", "is_main_process"]
