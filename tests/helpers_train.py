"""Training sources the tests feed to ``zsprob.train.train(cfg, out, source=...)``."""
from __future__ import annotations

from zsprob.train.data import BatchSource


class TensorSource(BatchSource):
    """In-memory GLOBAL batches, a list of (images [B, ...], tokens [B, L]), sliced per process; an epoch is
    the list."""

    def __init__(self, batches: list, rank: int = 0, world: int = 1):
        self.batches = batches
        self.rank, self.world = rank, world
        assert batches[0][0].shape[0] % world == 0
        self.local_batch_size = batches[0][0].shape[0] // world
        self.steps_per_epoch = len(batches)

    def epoch_batches(self, epoch, skip=0):
        n = self.local_batch_size
        for images, tokens in self.batches[skip:]:
            sl = slice(self.rank * n, (self.rank + 1) * n)
            yield images[sl], tokens[sl]


def count_step_syncs(monkeypatch, step_owner, uncounted_owner, uncounted: str, train) -> list:
    """Run ``train()`` with a :class:`~zsprob.utils.host_sync.HostSyncCounter` around each ``step_owner.one_step``
    call, one counter per step, the host-side batch preparation (``uncounted_owner.<uncounted>``) left out, and
    counted on the accelerator's path (``HOST_READ_FREE`` emptied: no CPU-only shortcuts)."""
    from zsprob.utils import host_sync

    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())
    counters = []
    real_one_step, real_uncounted = step_owner.one_step, getattr(uncounted_owner, uncounted)

    def left_out(*args, **kwargs):
        counter = counters[-1]
        before = counter.by_name.copy(), counter.where.copy()
        try:
            return real_uncounted(*args, **kwargs)
        finally:
            counter.by_name, counter.where = before

    def one_step(run, step):
        counters.append(host_sync.HostSyncCounter())
        with counters[-1]:
            return real_one_step(run, step)

    monkeypatch.setattr(uncounted_owner, uncounted, left_out)
    monkeypatch.setattr(step_owner, "one_step", one_step)
    train()
    return counters
