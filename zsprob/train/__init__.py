"""zsprob.train: one training loop for pretraining and fine-tuning (accelerate).

Owns the loop, the config's keys and checks (``defaults``, ``schema``), the run's parts and files, and
jWAE's step and data. May import config, data, models, prob, errors and utils; never zeroshot, retrieval,
report or cli. ``import zsprob.train`` does not import torch::

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
