"""What a run writes about itself while it runs: metrics.jsonl records, TensorBoard scalars (accelerate's
tracker), evaluation hooks. The interval's summed loss is read on the host here, at logging steps only.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from zsprob.train import distributed as dist
from zsprob.train.run import Run
from zsprob.utils.io import append_jsonl


def read_scalars(values: list) -> list[float]:
    """Numbers and one-element tensors as floats, the tensors read on the host together: one stacked copy
    from the first tensor's device, one sync."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()).to(tensors[0].device) for t in tensors]).tolist()
                if tensors else ())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def loss_scalars(loss: nn.Module) -> dict[str, float]:
    """The loss's one-number parameters (PCME++'s a, b, ...) by name."""
    named = {name: p for name, p in loss.named_parameters() if p.numel() == 1}
    return dict(zip(named, read_scalars(list(named.values()))))


def current_lrs(optimizer) -> dict[str, float]:
    """The learning rate of each parameter group, by group name."""
    return {g.get("group_name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}


def log_record(run: Run, step_done: int, stats: dict, lr_groups: dict, log_every: int) -> dict:
    """The metrics.jsonl record of the interval ending at ``step_done`` (its mean loss, the last step's terms,
    learning rates, throughput, counts); resets the interval."""
    now = time.perf_counter()
    mean_loss = (run.counters.loss_sum / max(1, run.counters.n_in_interval))
    if run.world > 1:
        mean_loss = dist.mean_across(mean_loss)
    # the interval's mean loss, the last step's terms on this process (rank 0), the loss's one-number parameters
    # and the fp16 loss scale: read in one stacked copy
    terms = {k: v for k, v in stats.items() if k not in ("step", "epoch", "loss") and (
        isinstance(v, torch.Tensor) and v.numel() == 1 or isinstance(v, (int, float, np.floating, np.integer)))}
    terms.update({k: p for k, p in run.raw.loss.named_parameters() if p.numel() == 1 and k not in terms})
    scale = getattr(run.acc.scaler, "_scale", None)
    read = read_scalars([mean_loss, *terms.values()] + ([scale] if scale is not None else []))
    interval_loss = read[0] if run.counters.n_in_interval else None  # None: all skipped
    if interval_loss is not None:
        run.counters.last_loss = interval_loss
    steps_in = step_done - (step_done - 1) // log_every * log_every if step_done == run.total_steps else log_every
    rec: dict[str, Any] = {"step": step_done, "epoch": run.cursor.epoch, "loss": interval_loss,
                           **dict(zip(terms, read[1:]))}
    rec["lr"] = max(lr_groups.values()) if lr_groups else 0.0
    rec["lr_groups"] = lr_groups
    elapsed = now - run.counters.t_interval
    rec["samples_per_s"] = run.global_batch_size * steps_in / max(elapsed, 1e-9)
    rec["data_time_frac"] = run.counters.data_time / max(elapsed, 1e-9)
    rec["nonfinite_total"] = run.counters.nonfinite_total
    if run.acc.scaler is not None:  # fp16: the loss scale now and the updates the scaler has skipped
        if scale is not None:
            rec["loss_scale"] = read[-1]
        rec["scaler_skipped_total"] = run.counters.scaler_skipped
    if run.noise > 0:
        rec["noisy_pairs"] = run.counters.noisy_rows
    data_stats = run.source.stats()
    if data_stats:
        rec["data"] = data_stats
    if run.swa is not None:
        rec["swa_n"] = run.swa.n_averaged
    run.counters.last_stats = rec
    if run.main:
        append_jsonl(run.out / "metrics.jsonl", rec)
        if run.log_with:
            run.acc.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step_done)
    run.counters.loss_sum.zero_()
    run.counters.n_in_interval = 0
    run.counters.data_time = 0.0
    run.counters.t_interval = time.perf_counter()
    return rec


def run_hooks(run: Run, step_done: int) -> None:
    """The evaluation hooks on the main process (model in eval mode, no grad); results to metrics.jsonl."""
    if not run.hooks or not run.main:
        return
    results = {}
    model = run.raw.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for hook in run.hooks:
            results.update(hook(model, step_done) or {})
    model.train(was_training)
    append_jsonl(run.out / "metrics.jsonl", {"step": step_done, "eval": results})
    if run.log_with:
        run.acc.log({f"eval/{k}": v for k, v in results.items() if isinstance(v, (int, float))}, step=step_done)
