"""What a training DataLoader worker does at start: leave the stop to the main process.

A scheduler (SLURM, ``timeout``) signals every process of the job, and Ctrl-C reaches the whole
terminal group. The training process catches SIGTERM / SIGUSR1 to finish its step and write a
checkpoint (:class:`zsprob.train.resilience.StopSignals`). A worker killed by the same signal would make
torch raise in the main process ("DataLoader worker ... is killed by signal") before it can do so.
So a worker ignores SIGINT and SIGUSR1, and leaves quietly (exit status 0, which torch does not treat
as a failure) on SIGTERM; the main process needs no further batch once it is stopping, and torch's own
shutdown, which ends workers with SIGTERM, still ends them at once.
"""
from __future__ import annotations

import os
import signal


def _leave(signum, frame) -> None:
    os._exit(0)


def leave_stop_signals_to_the_main_process(worker_id: int) -> None:
    """``worker_init_fn`` of the training loaders (see the module docstring)."""
    for name, action in (("SIGINT", signal.SIG_IGN), ("SIGUSR1", signal.SIG_IGN), ("SIGTERM", _leave)):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, action)


__all__ = ["leave_stop_signals_to_the_main_process"]
