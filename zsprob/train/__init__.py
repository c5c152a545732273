"""zsprob.train: one training loop for pretraining and fine-tuning (accelerate).

Owns the training loop, its data sources, optimisers, schedules, resumable state and defaults. May
import config, data, models, prob, ``zsprob.methods``, ``zsprob.errors`` and ``zsprob.utils``; never
zeroshot, retrieval, report or cli.

    from zsprob.train import train, load_train_config
    cfg = load_train_config("configs/synthetic_tiny.yaml", ["data.shards=sw/pretrain", "schedule.steps=300"])
    summary = train(cfg, "runs/tiny")          # runs/tiny/model is the trained checkpoint

Modules: :mod:`~zsprob.train.loop` (the loop, :func:`train`), :mod:`~zsprob.train.optim`
(parameter groups with layer-wise lr decay and backbone multipliers, AdamP / AdamW, schedules,
backbone freezing, SWA), :mod:`~zsprob.train.state` (checkpoint + exact-resume state,
safetensors + JSON), :mod:`~zsprob.train.distributed` (all-gather with gradients),
:mod:`~zsprob.train.data` (batch sources with resumable positions, noisy correspondence),
:mod:`~zsprob.train.hooks` (evaluation hooks), :mod:`~zsprob.train.defaults` (every config key,
merged into a config in one place), :mod:`~zsprob.train.remote_sync` (the run directory mirrored to
an fsspec URL, pulled back on resume),
:mod:`~zsprob.train.jwae_step` / :mod:`~zsprob.train.jwae_data` (``--method jwae``: the
discriminator / autoencoder alternation and the paired + unpaired SynthWorld batches).
Imports are lazy so ``import zsprob.train`` does not import torch.
"""
from __future__ import annotations

__all__ = ["train", "DEFAULTS", "METHODS", "load_train_config", "with_defaults", "TrainConfig"]


def __getattr__(name):
    if name == "train":
        from zsprob.train.loop import train
        return train
    if name in ("DEFAULTS", "METHODS"):
        from zsprob.train import defaults
        return getattr(defaults, name)
    if name in ("load_train_config", "with_defaults", "TrainConfig"):
        from zsprob.train import defaults
        return getattr(defaults, name)
    raise AttributeError(name)
