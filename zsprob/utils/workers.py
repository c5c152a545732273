"""What a training DataLoader worker does at start: leave the stop to the main process.

A scheduler's SIGTERM or a terminal's Ctrl-C reaches every process of the job; the training process
catches it to finish its step and checkpoint (:class:`zsprob.train.resilience.StopSignals`). A worker
killed meanwhile would make torch raise in the main process first, so a worker ignores SIGINT and
SIGUSR1, and on SIGTERM keeps serving for :data:`SIGTERM_GRACE_S` seconds, then exits 0; a second
SIGTERM (torch's own shutdown) ends it at once.
"""
from __future__ import annotations

import os
import signal

#: seconds a worker keeps serving after a SIGTERM (the main process finishes its step meanwhile)
SIGTERM_GRACE_S = 20


def _leave(signum, frame) -> None:
    os._exit(0)


def _on_sigterm(signum, frame) -> None:
    if getattr(_on_sigterm, "armed", False):  # the second one: torch's shutdown, or an insistent sender
        os._exit(0)
    _on_sigterm.armed = True
    signal.signal(signal.SIGALRM, _leave)
    signal.alarm(SIGTERM_GRACE_S)


def leave_stop_signals_to_the_main_process(worker_id: int) -> None:
    """``worker_init_fn`` of the training loaders (see the module docstring)."""
    for name, action in (("SIGINT", signal.SIG_IGN), ("SIGUSR1", signal.SIG_IGN), ("SIGTERM", _on_sigterm)):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, action)


__all__ = ["leave_stop_signals_to_the_main_process", "SIGTERM_GRACE_S"]
