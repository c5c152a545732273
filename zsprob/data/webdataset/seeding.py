"""The shard pipeline's seeds: one mixing rule for (seed, epoch, rank, worker, ...) tuples, the seeds a
fresh DataLoader gives its workers (so persistent workers re-seed as fresh ones), and a private seeding
of torch's and Python's global generators around one call. numpy's ``SeedSequence`` mixes the parts.
"""
from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (numpy's SeedSequence of their low 32 bits; order sensitive)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0]
               & 0x7FFFFFFFFFFFFFFF)


def loader_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator a fresh DataLoader for ``epoch`` draws its worker base seed from (a private one:
    creating the iterator must not consume the caller's global RNG)."""
    return torch.Generator().manual_seed(mix_seed(seed, epoch))


def loader_base_seed(generator: torch.Generator) -> int:
    """The base seed a fresh DataLoader iterator draws from ``generator`` for its workers (torch's draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def seed_worker_as_fresh(base_seed: int, worker: int) -> None:
    """Seed this worker's global generators (random, torch, numpy) as torch seeds worker ``worker`` of a fresh
    DataLoader iterator with ``base_seed``, so a persistent worker starts each epoch as a new one would."""
    from torch.utils.data._utils.worker import _generate_state  # torch's numpy seeding of workers

    random.seed(base_seed + worker)
    torch.manual_seed(base_seed + worker)
    np.random.seed(_generate_state(base_seed, worker))


def call_seeded(seed: int, fn: Callable, *args):
    """``fn(*args)`` with torch's default generator and Python's random seeded by ``seed``, both restored after."""
    torch_state, python_state = torch.default_generator.get_state(), random.getstate()
    try:
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        return fn(*args)
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(python_state)
