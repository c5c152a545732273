"""The click options and glue shared by ``zsprob pretrain`` and ``zsprob finetune`` (no torch import at module level).

Every config key declared with a flag (:data:`zsprob.train.defaults.KEYS`) is an option typed by its rule
and documented by its doc. A flag wins over the YAML recipe, ``--set`` over both; a flag and a ``--set`` of
the same key are one line. The config is resolved and checked once, before torch is imported.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from zsprob.cli.options import OFFICIAL_WEIGHTS, WEIGHTS_HELP
from zsprob.cli.types import OutPath
from zsprob.errors import UserError
from zsprob.train.defaults import EXCLUSIVE, KEYS
from zsprob.train.schema import Count, Key, OneOf, Range

#: the keys with a flag, in declaration order
FLAGGED = tuple(key for key in KEYS if key.flag)


def _dest(key: Key) -> str:
    return key.flag[2:].replace("-", "_")


def _flag_option(key: Key):
    """The click option of ``key``'s flag: on / off for a true / false key, else typed by its rule."""
    if isinstance(key.default, bool):
        return click.option(f"{key.flag}/--no-{key.flag[2:]}", _dest(key), default=None, help=key.doc)
    kind, help_text = str, key.doc
    if key.name == "model.weights":  # the same choices as the evaluation commands' --weights
        kind, help_text = click.Choice(OFFICIAL_WEIGHTS), WEIGHTS_HELP
    elif isinstance(key.rule, OneOf):
        kind = click.Choice(key.rule.names())
    elif isinstance(key.rule, Count):
        kind = float if key.rule.real else int
    elif isinstance(key.rule, Range) or isinstance(key.default, float):
        kind = float
    return click.option(key.flag, _dest(key), type=kind, default=None, help=help_text)


def common_options(f):
    opts = [
        click.option("--config", "config_path", type=str, default=None,
                     help="YAML recipe (a path, or a name in configs/)."),
        click.option("--out", required=True, type=OutPath("dir", own="run"),
                     help="Run directory: metrics.jsonl, checkpoints/, model/ (the trained checkpoint)."),
        *map(_flag_option, FLAGGED),
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
        click.option("--no-progress", is_flag=True, help="No progress bar."),
        click.option("--allow-pipe", is_flag=True, help="Let the config file's data sources run pipe: commands."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _flag_writes(kw: dict) -> list[tuple[Key, str]]:
    """(the key whose flag wrote it, ``key=value``) for each flag given; the first key of an exclusive pair
    clears the recipe's value of the other (``--steps``: epochs; both flags given meet the schema's rule)."""
    writes = []
    for key in FLAGGED:
        value = kw.get(_dest(key))
        if value is None:
            continue
        writes.append((key, f"{key.name}={json.dumps(value) if isinstance(value, (list, bool)) else value}"))
        writes += [(key, f"{other}=null") for first, other, _ in EXCLUSIVE if first == key.name]
    return writes


def resolve_run_config(kw: dict, extra: list[str], default_config: str | None):
    """Recipe (or the run's saved config.yaml when resuming without --config) + flags + --set, checked once."""
    from zsprob.train.defaults import load_train_config, resolve_config
    path = kw.get("config_path")
    out = Path(kw["out"])
    saved = path is None and resuming(kw) and (out / "config.yaml").is_file()
    if saved:  # the run's own config: a pipe: in it was allowed when the run started
        path = str(out / "config.yaml")
    if path is None:
        path = default_config
    writes, sets = _flag_writes(kw), list(kw.get("overrides") or ())
    refuse_flag_and_set(writes, sets)
    allow = saved or bool(kw.get("allow_pipe"))
    return resolve_config(load_train_config(path, extra + [item for _, item in writes] + sets, allow), out)


def refuse_flag_and_set(writes: list[tuple[Key, str]], sets: list[str]) -> None:
    """One line when a flag and a ``--set`` write the same key (or its section), or one ``--set`` replaces
    another: otherwise the later one would silently win."""
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
        for flagged, flag_item in writes:
            written = flag_item.split("=", 1)[0]
            if written == key or written.startswith(key + "."):
                if written != flagged.name:  # a key the flag cleared (--steps: schedule.epochs)
                    raise UserError(f"{flagged.shown()} and --set {item} are both set: drop one")
                raise UserError(f"{flagged.flag_name()} and --set {item} both set {written}: give it once")


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
    """What the run did, on the main process only (torchrun starts one command per process)."""
    import os
    if not summary or os.environ.get("RANK", "0") != "0":
        return
    if summary.get("already_finished"):
        click.echo(f"the run is already finished ({summary['steps']} of {summary['steps']} steps; "
                   f"final loss {summary['final_loss']:.4f}): nothing to do (--steps above {summary['steps']} "
                   "continues it, --overwrite starts it again)")
        click.echo(f"model: {summary['model']}")
        return
    start = int(summary.get("start_step") or 0)
    last = int(summary["steps"])
    steps = (f"{last} step{'s' if last != 1 else ''}" if not start else
             f"step {last}" if last == start + 1 else f"steps {start + 1}-{last}")
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


__all__ = ["common_options", "resolve_run_config", "run", "print_summary"]
