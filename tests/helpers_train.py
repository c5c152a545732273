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
