"""zsprob.train: one training loop for pretraining and fine-tuning (accelerate).

Owns the training loop, its data sources, optimisers, schedules, resumable state and defaults. May
import config, data, models, prob, ``zsprob.methods``, ``zsprob.errors`` and ``zsprob.utils``; never
zeroshot, retrieval, report or cli.

    from zsprob.config import load_config
    from zsprob.train import train, DEFAULTS
    cfg = load_config("configs/synthetic_tiny.yaml", ["data.shards=sw/pretrain", "schedule.steps=300"],
                      defaults=DEFAULTS)
    summary = train(cfg, "runs/tiny")          # runs/tiny/model is the trained checkpoint

Modules: :mod:`~zsprob.train.loop` (the loop, :func:`train`), :mod:`~zsprob.train.optim`
(parameter groups with layer-wise lr decay and backbone multipliers, AdamP / AdamW, schedules,
backbone freezing, SWA), :mod:`~zsprob.train.state` (checkpoint + exact-resume state,
safetensors + JSON), :mod:`~zsprob.train.distributed` (all-gather with gradients),
:mod:`~zsprob.train.data` (batch sources with resumable positions, noisy correspondence),
:mod:`~zsprob.train.hooks` (evaluation hooks), :mod:`~zsprob.train.defaults` (every config key).
Imports are lazy so ``import zsprob.train`` does not import torch.
"""
from __future__ import annotations

__all__ = ["train", "DEFAULTS", "METHODS", "load_train_config"]


def __getattr__(name):
    if name == "train":
        from zsprob.train.loop import train
        return train
    if name in ("DEFAULTS", "METHODS"):
        from zsprob.train import defaults
        return getattr(defaults, name)
    if name == "load_train_config":
        return load_train_config
    raise AttributeError(name)


def load_train_config(path=None, overrides=()):
    """A recipe (YAML) over :data:`DEFAULTS`, patched with ``a.b=v`` overrides."""
    from zsprob.config import load_config
    from zsprob.train.defaults import COUNT_KEYS, DEFAULTS
    from zsprob.utils.checks import check_counts
    cfg = load_config(path, list(overrides), defaults=DEFAULTS)
    check_counts(cfg, COUNT_KEYS)
    return cfg
