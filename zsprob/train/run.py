"""What one training run holds between steps: its parts (:class:`Run`, fixed once built), its
:class:`Counters` and its :class:`DataCursor` (the resumable (epoch, batch) position in a source).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zsprob.config import Config
from zsprob.errors import UserError
from zsprob.train import distributed as dist
from zsprob.train import optim, resilience
from zsprob.train.data import BatchSource


class DataCursor:
    """Walks epochs of a source; (epoch, pos) is the resumable position, pos = batches consumed. A step of
    several processes fetches its next batch early (:meth:`look_ahead`), so that whether any process ran out
    travels in the step's one reduction (:meth:`agree`)."""

    def __init__(self, source: BatchSource, device: torch.device, epoch: int = 0, pos: int = 0):
        self.source, self.device = source, device
        self.epoch, self.pos = epoch, pos
        self._it = self._ahead = None
        self._empty_epochs = 0

    def seek(self, epoch: int, pos: int) -> None:
        """Continue from batch ``pos`` of ``epoch`` (a resumed run's position)."""
        self.epoch, self.pos, self._it, self._ahead = int(epoch), int(pos), None, None

    def _fetch(self):
        """Batch ``pos`` of this epoch on this process, or None when the epoch has ended here."""
        spe = self.source.steps_per_epoch
        if spe is not None and self.pos >= spe:
            return None
        with resilience.data_wait():  # a stop signal while no batch comes stops the run
            if self._it is None:
                self._it = iter(self.source.epoch_batches(self.epoch, skip=self.pos))
            return next(self._it, None)

    def next(self):
        """The next batch, every process moving to the next epoch together when one runs out."""
        if self._ahead is not None:  # fetched by look_ahead, and every process has one (agree)
            batch, self._ahead = self._ahead, None
            self.pos += 1
            return batch
        while True:
            batch = self._fetch()
            missing = batch is None
            if dist.is_distributed():  # the first batch of an epoch: its own reduction (a step's: step_verdict)
                missing = dist.mean_across(torch.full((), float(missing), device=self.device)).item() > 0
            if not missing:
                self.pos += 1
                self._empty_epochs = 0
                return batch
            if self.pos == 0:
                self._empty_epochs += 1
                if self._empty_epochs >= 2:
                    raise UserError("the training data yielded no full batch; check --shards and the batch size "
                                    f"(local batch {self.source.local_batch_size})")
            self.agree(True)

    def look_ahead(self) -> bool:
        """Fetch the next batch before it is due (it still counts as not consumed); True if there is none here."""
        self._ahead = self._fetch()
        return self._ahead is None

    def agree(self, missing_anywhere: bool) -> None:
        """When any process has no next batch, every process starts the next epoch (dropping what it holds)."""
        if missing_anywhere:
            self.epoch, self.pos, self._it, self._ahead = self.epoch + 1, 0, None, None


@dataclass
class Counters:
    """The numbers a run changes every step: non-finite tallies and the current logging interval."""

    nonfinite_total: int = 0
    consecutive_bad: int = 0
    scaler_skipped: int = 0  # fp16: updates the GradScaler skipped (inf / NaN gradients at its scale)
    loss_sum: torch.Tensor | None = None  # on the device: summed without a host sync
    n_in_interval: int = 0
    data_time: float = 0.0
    t_interval: float = 0.0
    noisy_rows: int = 0
    last_loss: float = float("nan")
    last_stats: dict = field(default_factory=dict)
    stop_anywhere: bool = False  # several processes: a stop signal had reached one by this step's check


@dataclass(frozen=True)
class Run:
    """One training run's parts, fixed once built, plus its :class:`Counters` and :class:`DataCursor`."""

    cfg: Config
    out: Path
    acc: Any
    log_with: str | None
    step_module: nn.Module
    raw: nn.Module  # the unwrapped step module: raw.model, raw.loss
    optimizer: Any
    schedule: optim.GroupSchedule
    swa: optim.SWA | None
    source: BatchSource
    cursor: "DataCursor"
    total_steps: int
    hooks: list
    step_fn: Callable[["Run", int], dict]  # zsprob.train.step.one_step, or jWAE's own step
    clip_sets: list = field(default_factory=list)  # the trainable parameters, in the sets clipped apart
    accum_steps: int = 1  # micro-batches per step (zsprob.train.accumulate)
    text_aug: Any = None
    label_smoothing: float = 0.0
    loss_scale: Callable[[int], float] | None = None  # the embedding warm-up (freeze.warmup_mode loss)
    warmup_steps: int = 0  # the learning-rate warm-up (schedule.warmup_*), in steps
    sync: Any = None  # zsprob.train.remote_sync.RemoteSync on the main process with train.remote_sync
    counters: Counters = field(default_factory=Counters)

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def world(self) -> int:
        return self.acc.num_processes

    @property
    def main(self) -> bool:
        return self.acc.is_main_process

    @property
    def global_batch_size(self) -> int:
        return self.source.local_batch_size * self.world

    @property
    def noise(self) -> float:
        from zsprob.data.flickr import KARPATHY_KINDS  # their noise permutes the captions in the source

        return float(self.cfg.data.noise_ratio) if self.cfg.data.kind not in KARPATHY_KINDS else 0.0
