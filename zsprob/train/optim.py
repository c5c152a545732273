"""Optimisers, parameter groups, learning-rate schedules, backbone freezing and SWA (imports torch lazily).

torch provides AdamW / Adam / SGD and ``swa_utils.AveragedModel``, timm ``AdamP`` (``adamp-timm``); the
default AdamP is :mod:`zsprob.train.adamp`. zsprob writes the parameter grouping (``optim.grouping``: zsprob
or naver-ai/pcmepp's official groups, read from ``param_info()``), the schedules and the backbone
freeze-then-warm-up factor, all in optimiser steps so that resuming is exact. The lr rule and both
groupings: docs/training.md."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

from zsprob.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: the names of ``optim.name`` (the config's rule reads them here, without importing torch)
OPTIMIZERS = ("adamp", "adamp-timm", "adamw", "adam", "sgd")
#: the names of ``schedule.name``
SCHEDULES = ("cosine", "step", "constant")


def no_weight_decay(name: str, p: torch.Tensor) -> bool:
    """Norms, biases and scalars (a, b, temperature, logit scale) are not weight-decayed (open_clip's rule)."""
    if p.ndim < 2:
        return True
    low = name.lower()
    return any(k in low for k in ("norm", "ln_", ".ln", ".bn", "bias", "logit_scale"))


def _tower_mult(tower: str, image_lr_mult: float, text_lr_mult: float) -> float:
    return image_lr_mult if tower == "image" else text_lr_mult if tower == "text" else 1.0


def _zsprob_group(name: str, p: torch.Tensor, info: dict | None, *, layer_decay: float | None,
                  image_lr_mult: float, text_lr_mult: float) -> tuple[str, bool, int, bool, float]:
    """(tower, backbone, depth key, weight-decayed, lr scale) of one parameter, zsprob's rule."""
    info = info or {}
    tower = info.get("tower", "other")
    backbone = bool(info.get("backbone", False))
    depth, num_layers = int(info.get("depth", 0)), int(info.get("num_layers", 0))
    scale = 1.0
    decayed_layers = backbone and layer_decay not in (None, 1.0)
    if backbone:
        scale *= _tower_mult(tower, image_lr_mult, text_lr_mult)
        if decayed_layers and num_layers > 0:
            scale *= layer_decay ** max(0, num_layers - depth)
    return tower, backbone, depth if decayed_layers else -1, not no_weight_decay(name, p), scale


def _official_group(name: str, p: torch.Tensor, info: dict | None, *, layer_decay: float | None,
                    image_lr_mult: float, text_lr_mult: float) -> tuple[str, bool, int, bool, float]:
    """(tower, backbone, depth key, weight-decayed, lr scale) of one parameter, naver-ai/pcmepp's rule."""
    tower = info.get("tower", "other") if info else "other"
    if tower not in ("image", "text"):
        return tower, False, -1, False, 1.0
    backbone = bool(info.get("backbone", False))
    depth = int(info.get("depth", 0))
    num_layers = int(info.get("num_layers", 0))
    in_block = 0 < depth < num_layers
    if not (backbone or in_block):
        return tower, False, -1, True, 1.0
    scale = _tower_mult(tower, image_lr_mult, text_lr_mult)
    if in_block and layer_decay not in (None, 1.0):
        return tower, True, depth, True, scale * layer_decay ** (num_layers - depth)
    return tower, True, -1, True, scale


def param_groups(module: nn.Module, *, lr: float, weight_decay: float,
                 param_info: dict | None = None, prefix: str = "",
                 layer_decay: float | None = None, image_lr_mult: float = 1.0,
                 text_lr_mult: float = 1.0, grouping: str = "zsprob") -> list[dict]:
    """Optimiser parameter groups of ``module`` by ``grouping`` (docs/training.md). ``param_info``: ``ProbCLIP.
    param_info()``, keyed by parameter name without ``prefix``; a parameter it lacks (the loss's a, b) is "other".
    Each group carries ``lr_scale``, ``tower``, ``backbone`` and ``group_name`` (read by the schedule)."""
    rule = _official_group if grouping == "official" else _zsprob_group
    param_info = param_info or {}
    buckets: dict[tuple, dict] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        info = param_info.get(name[len(prefix):] if prefix and name.startswith(prefix) else name)
        tower, backbone, depth_key, decay, scale = rule(
            name, p, info, layer_decay=layer_decay, image_lr_mult=image_lr_mult, text_lr_mult=text_lr_mult)
        key = (tower, backbone, depth_key, decay)
        if key not in buckets:
            gname = f"{tower}{'-backbone' if backbone else ''}" + \
                (f"-d{depth_key}" if depth_key >= 0 else "") + ("" if decay else "-nowd")
            buckets[key] = {"params": [], "lr": lr * scale, "weight_decay": weight_decay if decay else 0.0,
                            "lr_scale": scale, "tower": tower, "backbone": backbone,
                            "group_name": gname}
        buckets[key]["params"].append(p)
    return list(buckets.values())


def create_optimizer(groups: list[dict], *, name: str = "adamp", lr: float = 5e-4,
                     weight_decay: float = 1e-4, betas: Iterable[float] = (0.9, 0.999),
                     eps: float = 1e-8, fused: bool = False, **kwargs) -> torch.optim.Optimizer:
    """The optimiser ``name`` of :data:`OPTIMIZERS`: AdamP (:mod:`zsprob.train.adamp`; ``adamp-timm``: timm's,
    one or two host syncs per weight matrix and step), or torch's AdamW / Adam / SGD, multi-tensor (foreach)
    on every device, or fused (``optim.fused``: faster, equal to float rounding only)."""
    import torch

    betas = tuple(float(b) for b in betas)
    if name in ("adamp", "adamp-timm"):
        if fused:
            raise UserError(f"optim.fused applies to torch's adamw / adam / sgd, not to {name}")
        if name == "adamp-timm":
            from timm.optim import AdamP
        else:
            from zsprob.train.adamp import AdamP
        return AdamP(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    kwargs.setdefault("fused" if fused else "foreach", True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=kwargs.pop("momentum", 0.9), weight_decay=weight_decay,
                               **kwargs)
    adam = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    return adam(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


# ----------------------------------------------------------------------------- schedules

def schedule_fn(name: str, *, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0,
                milestones: Iterable[int] = (), gamma: float = 0.1) -> Callable[[int], float]:
    """Multiplier of the base lr at optimiser step ``s`` (0-based: the lr used BY step s) of the schedule
    ``name`` (:data:`SCHEDULES`), after a linear warm-up."""
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, int(warmup_steps))
    milestones = sorted(int(m) for m in milestones)

    def warm(s: int) -> float:
        return (s + 1) / (warmup_steps + 1) if s < warmup_steps else 1.0

    def cosine(s: int) -> float:
        if s < warmup_steps:
            return warm(s)
        span = max(1, total_steps - warmup_steps)
        prog = min(1.0, (s - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    def step(s: int) -> float:
        return warm(s) * gamma ** sum(1 for m in milestones if s >= m)
    return {"cosine": cosine, "step": step, "constant": warm}[name]


def freeze_fn(freeze_steps: int, unfreeze_warmup_steps: int) -> Callable[[int], float]:
    """0 for the first ``freeze_steps`` steps, then a linear ramp to 1."""
    freeze_steps = max(0, int(freeze_steps))
    ramp = max(0, int(unfreeze_warmup_steps))

    def f(s: int) -> float:
        if s < freeze_steps:
            return 0.0
        if s < freeze_steps + ramp:
            return (s - freeze_steps + 1) / (ramp + 1)
        return 1.0
    return f


def loss_warmup_fn(start: int, length: int) -> Callable[[int], float]:
    """PCME++'s embedding warm-up: the loss of step ``start + k`` is multiplied by (k + 1) / ``length`` for
    k < ``length``, by 1 elsewhere (the lr is untouched)."""
    start, length = int(start), max(1, int(length))

    def f(s: int) -> float:
        return (s - start + 1) / length if start <= s < start + length else 1.0
    return f


class GroupSchedule:
    """Per-group lr = initial_lr * schedule(s) * freeze_g(s) (a LambdaLR whose state is one int, for the JSON
    state); ``freeze``: tower -> :func:`freeze_fn`, applied to that tower's backbone groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float],
                 freeze: dict[str, Callable[[int], float]] | None = None):
        self.optimizer = optimizer
        self.schedule = schedule
        self.freeze = freeze or {}
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.step_count = 0
        self._apply()

    def factor(self, group: dict, s: int) -> float:
        f = self.schedule(s)
        tower = group.get("tower", "other")
        if group.get("backbone") and tower in self.freeze:
            f *= self.freeze[tower](s)
        return f

    def frozen_groups(self, s: int | None = None) -> list[dict]:
        s = self.step_count if s is None else s
        return [g for g in self.optimizer.param_groups
                if g.get("backbone") and g.get("tower") in self.freeze and self.freeze[g["tower"]](s) == 0.0]

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * self.factor(g, self.step_count)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


def zero_frozen_grads(groups: list[dict]) -> None:
    """Drop the gradients of frozen groups so the optimiser neither moves nor updates their state."""
    for g in groups:
        for p in g["params"]:
            p.grad = None


# ----------------------------------------------------------------------------- SWA

class SWA:
    """Stochastic weight averaging (torch's ``AveragedModel``): the weights after every ``every``-th step past
    ``start`` (with ``every`` = an epoch, PCME++'s end-of-epoch weights); ``loss``: a loss with parameters
    (PCME++'s a, b) averaged with them, as the official ``swa_criterion`` (``averaged_loss``)."""

    def __init__(self, model: nn.Module, *, start: int, every: int, device=None, loss: nn.Module | None = None):
        from torch.optim.swa_utils import AveragedModel
        self.start = int(start)
        self.every = max(1, int(every))
        self.averaged = AveragedModel(model, device=device, use_buffers=True)
        has_params = loss is not None and any(True for _ in loss.parameters())
        self.averaged_loss = AveragedModel(loss, device=device, use_buffers=True) if has_params else None
        for p in self.averaged.parameters():
            p.requires_grad_(False)
        if self.averaged_loss is not None:
            for p in self.averaged_loss.parameters():
                p.requires_grad_(False)

    @property
    def n_averaged(self) -> int:
        return int(self.averaged.n_averaged.item())

    def should_update(self, step_done: int) -> bool:
        """``step_done``: number of optimiser steps finished."""
        return step_done > self.start and (step_done - self.start) % self.every == 0

    def update(self, model: nn.Module, loss: nn.Module | None = None) -> None:
        import torch

        with torch.no_grad():
            self.averaged.update_parameters(model)
            if self.averaged_loss is not None and loss is not None:
                self.averaged_loss.update_parameters(loss)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().cpu() for k, v in self.averaged.state_dict().items()}
        if self.averaged_loss is not None:
            out.update({"loss_avg." + k: v.detach().cpu() for k, v in self.averaged_loss.state_dict().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        own = {k: v for k, v in tensors.items() if not k.startswith("loss_avg.")}
        self.averaged.load_state_dict(own)
        rest = {k[len("loss_avg."):]: v for k, v in tensors.items() if k.startswith("loss_avg.")}
        if self.averaged_loss is not None and rest:
            self.averaged_loss.load_state_dict(rest)
