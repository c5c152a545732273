"""The run's durations in optimiser steps: total, warm-up, milestones and backbone freezing, from
``cfg.schedule`` / ``cfg.freeze`` (epochs converted with the source's epoch length), and the optimiser with
its per-group lr schedule over them (the functions themselves are :mod:`zsprob.train.optim`'s).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from zsprob.config import Config
from zsprob.errors import UserError
from zsprob.train import optim
from zsprob.train.defaults import DEFAULTS


def steps_from(epochs: float | int, steps_per_epoch: int | None, what: str) -> int:
    """``epochs`` in optimiser steps (rounded up); ``what`` names the key when the epoch length is unknown."""
    if steps_per_epoch is None:
        raise UserError(f"{what} is given in epochs but the epoch length is unknown "
                        "(set data.samples_per_epoch, or give the value in steps)")
    return int(math.ceil(float(epochs) * steps_per_epoch))


@dataclass
class SchedulePlan:
    """The run's durations in optimiser steps (epochs converted with the source's epoch length)."""

    total_steps: int
    warmup: int
    milestones: list
    freeze: dict  # tower -> freeze_fn
    steps_per_epoch: int | None
    loss_scale: Callable[[int], float] | None = None  # freeze.warmup_mode loss: the embedding warm-up

    def steps_of(self, steps: Any, epochs: Any, what: str) -> int:
        return steps_from(epochs, self.steps_per_epoch, what) if epochs is not None else int(steps or 0)


def warn_if_warmup_fills(warmup: int, total_steps: int) -> None:
    """A warning when the warm-up is at least as long as the run (the lr never reaches ``optim.lr``), said once
    the run starts so that a run refused for another reason says that one line alone."""
    if warmup >= total_steps:
        warnings.warn(f"the warm-up ({warmup} steps) is not shorter than the run ({total_steps} steps): "
                      "the learning rate never reaches optim.lr; shorten it with --set schedule.warmup_steps=N")


def resolve_schedule(cfg: Config, steps_per_epoch: int | None) -> SchedulePlan:
    """Total, warm-up, milestone and backbone-freeze steps from ``cfg.schedule`` / ``cfg.freeze``."""
    sch = cfg.schedule
    total_steps = sch.steps
    if sch.epochs is not None:
        total_steps = steps_from(sch.epochs, steps_per_epoch, "schedule.epochs")
    if not total_steps:
        raise UserError("set the run length: --steps N (schedule.steps) or schedule.epochs")
    plan = SchedulePlan(int(total_steps), 0, [], {}, steps_per_epoch)
    plan.warmup = plan.steps_of(sch.warmup_steps, sch.warmup_epochs, "schedule.warmup_epochs")
    plan.milestones = list(sch.milestones_steps or [])
    if sch.milestones_epochs:
        plan.milestones += [steps_from(e, steps_per_epoch, "schedule.milestones_epochs") for e in sch.milestones_epochs]
    fz = cfg.freeze
    freeze_warmup = plan.steps_of(fz.warmup_steps, fz.warmup_epochs, "freeze.warmup_epochs")
    mode = fz.warmup_mode or DEFAULTS["freeze"]["warmup_mode"]
    frozen = {t: plan.steps_of(fz[f"{t}_steps"], fz[f"{t}_epochs"], f"freeze.{t}_epochs") for t in ("image", "text")}
    for tower, n in frozen.items():
        if n > 0:
            plan.freeze[tower] = optim.freeze_fn(n, freeze_warmup if mode == "lr" else 0)
    if mode == "loss" and freeze_warmup > 0:  # PCME++'s embedding warm-up: the whole loss x (k + 1) / R
        plan.loss_scale = optim.loss_warmup_fn(max(frozen.values()), freeze_warmup)
    return plan


def create_optimisation(cfg: Config, groups: list[dict], plan: SchedulePlan, lr: float):
    """The optimiser of ``cfg.optim`` over ``groups``, and its per-group lr schedule with backbone freezing."""
    oc, sch = cfg.optim, cfg.schedule
    optimizer = optim.create_optimizer(groups, name=oc.name, lr=lr, weight_decay=float(oc.weight_decay),
                                       betas=oc.betas, eps=float(oc.eps), fused=oc.fused)
    schedule = optim.GroupSchedule(optimizer, optim.schedule_fn(
        sch.name, total_steps=plan.total_steps, warmup_steps=plan.warmup, min_lr_ratio=float(sch.min_lr_ratio),
        milestones=plan.milestones, gamma=float(sch.gamma)), freeze=plan.freeze)
    return optimizer, schedule
