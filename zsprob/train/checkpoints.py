"""A run's checkpoints: writing a resumable step directory, restoring one, saving the final model(s).

The file format (safetensors + JSON) is :mod:`zsprob.train.state`'s; finding the directory to resume
from is :mod:`zsprob.train.resilience`'s.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from zsprob.config import Config
from zsprob.errors import UserError
from zsprob.train import optim, resilience, state
from zsprob.train.defaults import PATH_KEYS, ROUTINE_KEYS
from zsprob.train.logs import loss_scalars
from zsprob.train.run import Run
from zsprob.utils.checks import absolute_paths
from zsprob.utils.io import atomic_write_json, atomic_write_text, read_jsonl, to_json


def save_checkpoint(run: Run, step_done: int) -> None:
    """A resumable step directory: every rank's random state, then (main) models, optimiser and schedule
    state, written under a temporary name and committed by a rename (a write that fails half-way leaves
    the previous checkpoint the one ``--resume`` picks)."""
    acc, out = run.acc, run.out
    tmp = resilience.checkpoint_root(out) / f".tmp-step-{step_done:07d}"
    try:
        if run.main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        state.save_state(tmp / f"rng-rank{run.rank}", {"rng": state.rng_state()})
        acc.wait_for_everyone()
        if run.main:
            _write_main_state(run, tmp, step_done)
            commit_checkpoint(out, tmp, step_done, keep=int(run.cfg.train.keep_checkpoints))
            if run.sync is not None:
                run.sync.try_push()
    except OSError as e:
        previous = resilience.latest_valid_checkpoint(out)
        raise UserError(f"writing the checkpoint of step {step_done} failed ({e}); "
                        f"{'the last complete one is ' + str(previous) if previous else 'no complete checkpoint'}"
                        " is what --resume takes") from None
    acc.wait_for_everyone()
    resilience.fault_point("checkpoint-done", step_done, run.rank)


def commit_checkpoint(out, tmp_dir: Path, step: int, keep: int) -> Path:
    """Rename a fully written ``tmp_dir`` to ``step-NNNNNNN``, point latest.json at it, prune to ``keep``
    step directories (0: all) and drop stale temporary ones."""
    root = resilience.checkpoint_root(out)
    final = root / f"step-{step:07d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    atomic_write_json(root / "latest.json", {"step": step, "dir": final.name})
    if keep > 0:
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in steps[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        if stale != tmp_dir:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_main_state(run: Run, tmp: Path, step_done: int) -> None:
    """The main process's part of a checkpoint: model(s), then optimiser / schedule / data / RNG state."""
    save_model(run.raw, tmp / "model", run.cfg, step_done)
    if run.swa is not None and run.swa.n_averaged > 0:
        save_model(run.raw, tmp / "model-swa", run.cfg, step_done, swa=run.swa)
    resilience.fault_point("checkpoint-mid", step_done, run.rank)
    state.save_state(tmp, {
        "step": step_done, "epoch": run.cursor.epoch, "batch_in_epoch": run.cursor.pos, "world": run.world,
        "optimizer": run.optimizer.state_dict(), "schedule": run.schedule.state_dict(),
        "scaler": run.acc.scaler.state_dict() if run.acc.scaler is not None else None,
        "loss": run.raw.loss.state_dict(), "swa": run.swa.state_tensors() if run.swa is not None else None,
        "rng": state.rng_state(), "nonfinite_total": run.counters.nonfinite_total,
        "scaler_skipped_total": run.counters.scaler_skipped,
    })


def restore_state(run: Run, ckpt_dir: Path) -> tuple[int, int, int, Any]:
    """Load model, loss, optimiser, schedule, scaler and SWA state from ``ckpt_dir``; returns
    (step, epoch, batch in epoch, this rank's random state or None when the world size changed)."""
    from zsprob.models import load as load_model

    _check_continues_checkpoint(run, Path(ckpt_dir))
    saved = state.load_state(ckpt_dir, require=state.MAIN_STATE_KEYS)
    loaded = load_model(Path(ckpt_dir) / "model", map_location="cpu")
    _load_parts(ckpt_dir, [(run.raw.model, loaded.state_dict(), "model"), (run.raw.loss, saved["loss"], "loss"),
                           (run.optimizer, saved["optimizer"], "optimizer"), (run.schedule, saved["schedule"],
                                                                                "schedule")])
    if saved.get("scaler") is not None and run.acc.scaler is not None:
        run.acc.scaler.load_state_dict(saved["scaler"])
    if run.swa is not None and saved.get("swa") is not None:
        run.swa.load_state_tensors(saved["swa"])
    run.counters.nonfinite_total = int(saved.get("nonfinite_total", 0))
    run.counters.scaler_skipped = int(saved.get("scaler_skipped_total", 0))
    rng_state = None
    if int(saved.get("world", 1)) == run.world:
        rank_file = Path(ckpt_dir) / f"rng-rank{run.rank}"
        rng_state = state.load_state(rank_file)["rng"] if rank_file.is_dir() else saved["rng"]
    else:
        warnings.warn(f"resuming with {run.world} processes from a {saved.get('world')}-process run: "
                      "random streams restart from the seed (the run is not bit-identical)")
    if run.main:
        _truncate_metrics(run.out / "metrics.jsonl", int(saved["step"]))
    return int(saved["step"]), int(saved["epoch"]), int(saved["batch_in_epoch"]), rng_state


def _check_continues_checkpoint(run: Run, ckpt_dir: Path) -> None:
    """``--resume`` continues the checkpoint's method (another ``--method`` is one line naming both); other
    changed settings that change what the run learns are one warning naming them."""
    from zsprob.models import load_meta

    extra = load_meta(ckpt_dir / "model").get("extra") or {}
    saved = extra.get("method")
    if saved and saved != run.cfg.method:
        raise UserError(f"--resume: the checkpoint {ckpt_dir} was trained with --method {saved}, this run asks for "
                        f"--method {run.cfg.method}; resume with --method {saved}, or start afresh with --overwrite")
    saved_cfg = extra.get("train_config")
    if isinstance(saved_cfg, dict):  # a path recorded relative (older runs) compares resolved from here
        absolute_paths(saved_cfg, PATH_KEYS)
    changed = changed_settings(saved_cfg, run.cfg.to_dict()) if isinstance(saved_cfg, dict) else []
    if changed and run.main:
        shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        warnings.warn(f"--resume: this run changes {len(changed)} setting(s) of the checkpoint's run: {shown}{more}; "
                      "it goes on with the new values (no longer exactly the run the checkpoint began)")


def changed_settings(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, new value)`` for each setting that differs, routine ones aside."""
    def leaves(d, prefix=""):
        for key, value in d.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    old, new = dict(leaves(saved)), dict(leaves(now))
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if key not in ROUTINE_KEYS and old.get(key) != new.get(key)]


def _load_parts(ckpt_dir, parts: list) -> None:
    """``load_state_dict`` of each (module, state, name); a state that does not fit is one line naming it."""
    for module, saved, name in parts:
        try:
            module.load_state_dict(saved)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            first = " ".join(str(e).split())[:300]
            raise UserError(f"--resume: the {name} state of {ckpt_dir} does not fit this run ({first}); resume with "
                            "the checkpoint's config (OUT/config.yaml), or start afresh with --overwrite") from None


def save_model(raw, path: Path, cfg: Config, step: int, swa: optim.SWA | None = None) -> None:
    """A ``zsprob.models.save`` directory of the model (or its SWA average) with the loss's parameters and the
    training config."""
    from zsprob.models import save
    model = swa.averaged.module if swa is not None else raw.model
    loss = swa.averaged_loss.module if swa is not None and swa.averaged_loss is not None else raw.loss
    extra = {"method": cfg.method, "step": step, "loss_params": loss_scalars(loss), "train_config": cfg.to_dict()}
    if swa is not None:
        extra["swa_n"] = swa.n_averaged
    save(model, path, extra=extra, extra_tensors={f"loss.{k}": v for k, v in loss.state_dict().items()})


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (a killed run may have logged past its last checkpoint)."""
    if path.is_file():
        kept = [to_json(rec, indent=None) for rec in read_jsonl(path) if int(rec.get("step", 0)) <= step]
        atomic_write_text(path, "".join(kept))
