"""Stop signals inside a process: handlers installed for a block and restored after it (the training loop's
:class:`zsprob.train.resilience.StopSignals`, the demo's :class:`zsprob.report.pipeline.StopGuard`), and what a
training DataLoader worker does with them; signals and exit codes are :mod:`zsprob.errors`'.

A job's SIGTERM or Ctrl-C reaches every process; the trainer catches it to finish its step and checkpoint. A
worker killed meanwhile would make torch raise first, so a worker ignores SIGINT and SIGUSR1 and, on SIGTERM,
keeps serving for :data:`SIGTERM_GRACE_S` seconds, then exits 0; a second SIGTERM ends it at once."""
from __future__ import annotations

import os
import signal
import threading

from zsprob.errors import STOP_SIGNALS

#: seconds a worker keeps serving after a SIGTERM (the main process finishes its step meanwhile)
SIGTERM_GRACE_S = 20


def install_stop_handlers(handler) -> dict:
    """Install ``handler`` for each stop signal this platform has, in the main thread only (Python refuses
    elsewhere); returns {signal: previous handler} for :func:`restore_handlers` ({} off the main thread)."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                old[sig] = signal.signal(sig, handler)
    return old


def restore_handlers(old: dict) -> None:
    """Put back the handlers :func:`install_stop_handlers` replaced; ``old`` is emptied."""
    for sig, handler in old.items():
        signal.signal(sig, handler)
    old.clear()


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
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, _on_sigterm if name == "SIGTERM" else signal.SIG_IGN)
