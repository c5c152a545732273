"""zsprob.train: one training loop for pretraining and fine-tuning (accelerate).

Owns the loop (:mod:`~zsprob.train.loop`, :func:`train`), the config's keys and their checks
(:mod:`~zsprob.train.defaults`, :mod:`~zsprob.train.schema`), the run's parts (``build``, ``step``,
``run``, ``data``, ``optim``, ``schedule``), its files (``checkpoints``, ``state``, ``logs``,
``remote_sync``, ``resilience``) and jWAE's step and data. May import config, data, models, prob,
``zsprob.methods``, ``zsprob.errors`` and ``zsprob.utils``; never zeroshot, retrieval, report or cli.
Imports are lazy, so ``import zsprob.train`` does not import torch::

    from zsprob.train import train, load_train_config
    cfg = load_train_config("configs/synthetic_tiny.yaml", ["data.shards=sw/pretrain", "schedule.steps=300"])
    summary = train(cfg, "runs/tiny")          # runs/tiny/model is the trained checkpoint
"""
from __future__ import annotations

__all__ = ["train", "DEFAULTS", "METHODS", "load_train_config", "with_defaults", "TrainConfig"]


def __getattr__(name):
    if name == "train":
        from zsprob.train.loop import train
        return train
    if name in ("DEFAULTS", "METHODS", "load_train_config", "with_defaults", "TrainConfig"):
        from zsprob.train import defaults
        return getattr(defaults, name)
    raise AttributeError(name)
