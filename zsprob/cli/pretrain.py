"""`zsprob pretrain`: pretrain a probabilistic image-text model on shards (thin wrapper; no torch import)."""
import click

from zsprob.cli.train_options import common_options, print_summary, resolve_run_config, run
from zsprob.data.captions import FLAVOUR_CAPTION_KEYS, SHARD_KINDS


@click.command("pretrain")
@click.option("--data", "data_kind", type=click.Choice(sorted(SHARD_KINDS)), default=None,
              help="Shard flavour: SynthWorld, any img2dataset shards, or RedCaps (caption cleaning).")
@click.option("--shards", type=str, default=None,
              help="A directory of .tar shards, or a pattern like 'redcaps/{00000..00999}.tar' ('::' joins sources).")
@common_options
def pretrain(data_kind, shards, **kw):
    """Pretrain a probabilistic image-text model (PCME++ by default) on image-text shards.

    \b
    zsprob pretrain --config configs/synthetic_tiny.yaml --data synthetic --shards SW/pretrain \\
        --method pcmepp --out runs/tiny
    The trained checkpoint is OUT/model (OUT/model-swa with SWA); OUT/metrics.jsonl logs the run.
    """
    extra = []
    if data_kind:
        # the flavour's caption key replaces the recipe's; a --set data.pipeline.caption_key=... comes later, wins
        extra += [f"data.kind={data_kind}", f"data.pipeline.caption_key={FLAVOUR_CAPTION_KEYS[data_kind]}"]
    if shards:
        import json
        extra.append(f"data.shards={json.dumps(shards)}")  # verbatim: '::' or ': ' must not read as YAML
    cfg = resolve_run_config(kw, extra, default_config="synthetic_tiny.yaml")
    if cfg.data.kind in SHARD_KINDS:
        from zsprob.utils.checks import check_shards
        check_shards(cfg.data.kind, cfg.data.shards)  # before torch is imported
        if cfg.data.kind == "synthetic":
            from zsprob.data.synthworld.checks import check_pretrain_shards
            check_pretrain_shards(cfg.data.shards)
    from zsprob.train.hooks import default_hooks
    print_summary(run(cfg, kw, hooks=default_hooks(cfg)))
