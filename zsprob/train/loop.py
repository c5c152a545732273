"""The training loop behind ``zsprob pretrain`` and ``zsprob finetune``; accelerate does devices and DDP.

One step (:mod:`zsprob.train.step`; ``--method jwae``: :mod:`zsprob.train.jwae_step`)::

    images, tokens  <- next local batch; noisy captions, MSDA   (generators seeded by (seed, step, rank))
    mu, logvar      <- model(images, tokens) (+ masked copies for ProLIP's occlusion term), autocast
    columns         <- all_gather_with_grad(mu, logvar)         (local rows x global columns)
    loss, stats     <- loss(local rows, matched, all_img, all_txt, offset)   (float32)
    backward; frozen grads dropped; unscale; clip; update unless non-finite   (the one host read)

The run (:func:`train`)::

    cfg <- resolve_config(cfg, out); train_resolved: claim out; make_accelerator; build_run
    remote_sync.for_run (resuming: pull first); restore_state (resuming)
    for step in start..total_steps:                                      (SIGTERM / SIGUSR1 caught)
        run.step_fn; schedule, SWA; log / checkpoint / hooks at their intervals; stop_if_signalled
    finish: checkpoint, final model(s), hooks, summary.json

What a run writes under ``out``: docs/training.md."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zsprob.config import dump_yaml
from zsprob.errors import Preempted, UserError
from zsprob.train import remote_sync, resilience, state
from zsprob.train.build import build_run, make_accelerator
from zsprob.train.checkpoints import restore_state, save_checkpoint, save_model
from zsprob.train.data import BatchSource
from zsprob.train.defaults import TrainConfig, resolve_config
from zsprob.train.logs import current_lrs, log_record, run_hooks
from zsprob.train.run import Run
from zsprob.train.schedule import warn_if_warmup_fills
from zsprob.utils.io import atomic_write_json, atomic_write_text

EvalHook = Callable[[nn.Module, int], dict]


def train(cfg: Any, out: str | os.PathLike, *, resume: bool | str | None = None,
          source: BatchSource | None = None, eval_hooks: Iterable[EvalHook] = (), progress: bool = True,
          overwrite: bool = False) -> dict:
    """Train as ``cfg`` says (resolved and checked here); write everything under ``out``; return the summary.

    ``resume``: "auto" (latest valid checkpoint, else fresh), "latest" / True, a step directory, False, or None
    ("auto" under torchrun's elastic agent); an ``out`` holding a run needs ``resume`` or ``overwrite``, and a
    finished run is returned unchanged. ``source``: a :class:`~zsprob.train.data.BatchSource` instead of
    ``cfg.data``; ``eval_hooks``: ``hook(model, step) -> dict`` on the main process every ``train.eval_every``.
    """
    return train_resolved(resolve_config(cfg, out), out, resume=resume, source=source, eval_hooks=eval_hooks,
                          progress=progress, overwrite=overwrite)


def train_resolved(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool | str | None = None,
                   source: BatchSource | None = None, eval_hooks: Iterable[EvalHook] = (), progress: bool = True,
                   overwrite: bool = False) -> dict:
    """:func:`train` for a config :func:`~zsprob.train.defaults.resolve_config` has resolved with this
    ``out`` (the command line resolves its own before it imports torch): nothing is checked again."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError("train_resolved() takes the TrainConfig of resolve_config(cfg, out); train() takes any config")
    out = Path(out)
    lock = resilience.claim_run_dir(out, resume, overwrite, main=os.environ.get("RANK", "0") == "0",
                                    mirrored=bool(cfg.train.remote_sync))
    refused = False
    try:
        return _train(cfg, out, resume, source, eval_hooks, progress)
    except UserError:
        refused = True
        raise
    finally:
        if lock is not None:
            lock.release(refused)


def _train(cfg, out: Path, resume, source, eval_hooks, progress: bool) -> dict:
    """:func:`train` once the run directory is claimed."""
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    acc, log_with = make_accelerator(cfg, out)
    try:
        state.seed_everything(int(cfg.seed) + acc.process_index)
        run = build_run(cfg, out, acc, log_with, source=source, hooks=eval_hooks)
        run = replace(run, sync=remote_sync.for_run(cfg, out, acc, resume))  # resuming: pulled before the search
        ckpt_dir = resilience.find_resume_dir(resume, out)
        start_step = 0
        if ckpt_dir is not None and resilience.check_resume_target(
                resilience.checkpoint_step(ckpt_dir), run.total_steps, ckpt_dir, out):
            return finished_summary(out)
        if ckpt_dir is None and run.main and (out / "metrics.jsonl").is_file():
            (out / "metrics.jsonl").unlink()  # "auto" with no checkpoint yet: the records of a killed first try
        if ckpt_dir is not None:
            start_step, epoch, pos, rng_state = restore_state(run, ckpt_dir)
            run.cursor.seek(epoch, pos)
            if rng_state is not None:  # sources skip consumed batches without drawing from these generators
                state.set_rng_state(rng_state)
        if run.main:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "config.yaml", dump_yaml(cfg))
        if log_with:
            acc.init_trackers("tensorboard")
        return run_steps(run, start_step, progress)
    finally:
        if acc.device.type == "cuda":  # TF32 was the run's: evaluation after it (the demo) is full fp32 again
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def finished_summary(out: Path) -> dict:
    """The summary of a run that has done all its steps (nothing is written)."""
    from zsprob.utils.io import read_json
    summary = read_json(out / "summary.json", "run summary")
    return {**summary, "already_finished": True}


def run_steps(run: Run, start_step: int, progress: bool) -> dict:
    """The steps from ``start_step`` to the end, then :func:`finish`, with pre-emption signals caught
    throughout (a signal during the final writes lets them complete)."""
    from tqdm.auto import tqdm
    bar = tqdm(total=run.total_steps, initial=start_step, disable=not (progress and run.main), dynamic_ncols=True,
               desc=f"{run.cfg.method}")
    if run.main:
        warn_if_warmup_fills(run.warmup_steps, run.total_steps)
    run.step_module.train()
    run.counters.loss_sum = torch.zeros((), device=run.acc.device)
    run.counters.t_interval = t_start = time.perf_counter()
    code = int(run.cfg.train.requeue_exit_code)
    with resilience.StopSignals(exit_code=code, step=start_step) as stop:
        try:
            for step in range(start_step, run.total_steps):
                stop.step = step  # named by a stop while waiting for data
                stats = run.step_fn(run, step)
                saved = after_step(run, step + 1, stats, bar)
                stop_if_signalled(run, stop, step + 1, saved)
        except Exception as e:
            refuse_failed_compile(run, e)
            raise
        finally:
            bar.close()
        return finish(run, start_step, time.perf_counter() - t_start)


def refuse_failed_compile(run: Run, error: Exception) -> None:
    """``train.compile``: an error of torch.compile's machinery (dynamo, inductor) is one line with the way
    out, not its traceback."""
    if run.cfg.train.compile and type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = next((line for line in lines if "error:" in line.lower()), lines[0] if lines else "")[:300]
        raise UserError(f"train.compile: torch.compile failed on this machine ({type(error).__name__}: {detail}); "
                        "set train.compile=false (the same run, uncompiled)") from None


def after_step(run: Run, step_done: int, stats: dict, bar) -> bool:
    """The schedule, SWA, logging, checkpoint and hooks due after ``step_done``; True if it checkpointed."""
    tc = run.cfg.train
    log_every = int(tc.log_every)
    ckpt_every = int(tc.checkpoint_every or 0)
    eval_every = int(tc.eval_every or 0)
    if tc.eval_every_epochs and run.source.steps_per_epoch:  # e.g. model selection once per epoch
        eval_every = max(1, int(round(float(tc.eval_every_epochs) * run.source.steps_per_epoch)))
    log_now = step_done % log_every == 0 or step_done == run.total_steps
    lr_groups = current_lrs(run.optimizer) if log_now else {}  # the learning rates this step used
    run.schedule.step()
    bar.update(1)
    if run.swa is not None and run.swa.should_update(step_done):
        run.swa.update(run.raw.model, run.raw.loss)
    if log_now:
        rec = log_record(run, step_done, stats, lr_groups, log_every)
        if run.main:
            bar.set_postfix(loss=f"{run.counters.last_loss:.4f}", sps=f"{rec['samples_per_s']:.0f}", refresh=False)
    saved = False
    if ckpt_every and step_done % ckpt_every == 0 and step_done != run.total_steps:
        save_checkpoint(run, step_done)
        run.counters.t_interval = time.perf_counter()
        saved = True
    if eval_every and step_done % eval_every == 0 and step_done != run.total_steps:
        run_hooks(run, step_done)
        run.acc.wait_for_everyone()
        run.counters.t_interval = time.perf_counter()
    return saved


def stop_if_signalled(run: Run, stop: resilience.StopSignals, step_done: int, saved: bool) -> None:
    """After a pre-emption signal on any process: checkpoint ``step_done`` unless just done, then raise
    :class:`Preempted` (after the last step the run finishes normally)."""
    received = run.counters.stop_anywhere if run.world > 1 else stop.received is not None  # (step.step_verdict)
    if not received or step_done == run.total_steps:
        return
    if not saved:
        save_checkpoint(run, step_done)
    if run.log_with:
        run.acc.end_training()
    code = stop.code()
    raise Preempted(f"stopped by {stop.received or 'a signal to another process'} after step {step_done} of "
                    f"{run.total_steps}; checkpoint {resilience.checkpoint_root(run.out) / f'step-{step_done:07d}'} "
                    f"written; run the same command with --resume auto to continue (exit code {code})",
                    exit_code=code, step=step_done, interrupted=stop.received == "SIGINT")


def finish(run: Run, start_step: int, wall: float) -> dict:
    """The end: a resumable checkpoint, the final model(s), the hooks, summary.json."""
    out, total_steps = run.out, run.total_steps
    save_checkpoint(run, total_steps)
    summary: dict[str, Any] = {"steps": total_steps, "start_step": start_step, "method": run.cfg.method,
                               "global_batch_size": run.global_batch_size, "world_size": run.world,
                               "final_loss": run.counters.last_loss, "nonfinite_total": run.counters.nonfinite_total,
                               "wall_s": wall,
                               "samples_per_s": run.global_batch_size * (total_steps - start_step) / max(wall, 1e-9),
                               "model": str(out / "model")}
    if run.main:
        save_model(run.raw, out / "model", run.cfg, total_steps)
        if run.swa is not None and run.swa.n_averaged > 0:
            save_model(run.raw, out / "model-swa", run.cfg, total_steps, swa=run.swa)
            summary["model_swa"] = str(out / "model-swa")
            summary["swa_n"] = run.swa.n_averaged
    run_hooks(run, total_steps)
    if run.main:
        summary["last_log"] = run.counters.last_stats
        data_stats = run.source.stats()  # e.g. the unreadable images a COCO source replaced
        if data_stats:
            summary["data"] = data_stats
        atomic_write_json(out / "summary.json", summary)
        if run.sync is not None:
            run.sync.try_push()
    run.acc.wait_for_everyone()
    if run.log_with:
        run.acc.end_training()
    return summary
