"""The one exception type for errors a user can cause, and the helpers that word them alike.

Raise :class:`UserError` with a message that says what is wrong and what to do; the command line
prints it as one line on stderr and exits 2 (a traceback only with ``zsprob --debug``). A run stopped by
one of :data:`STOP_SIGNALS` raises :class:`Preempted`, which exits with its own code.
"""
from __future__ import annotations

import math
from typing import Any


class UserError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""


def one_line(text) -> str:
    """``str(text)`` with every run of whitespace (newlines too) as one space: how a message is printed."""
    return " ".join(str(text).split())


def not_found(what: str, path, hint: str = "") -> UserError:
    """The error for a missing input: "WHAT not found: PATH (HINT)"."""
    return UserError(f"{what} not found: {path}" + (f" ({hint})" if hint else ""))


def require_file(path, what: str, hint: str = "", kind: str = "file") -> "object":
    """Return ``Path(path)`` if it is an existing file (``kind="dir"``: directory), else raise :func:`not_found`'s
    error; ``what`` names it ("COCO Karpathy split JSON"), ``hint`` says where it comes from or how to make it."""
    from pathlib import Path

    p = Path(path)
    if not (p.is_dir() if kind == "dir" else p.is_file()):
        raise not_found(what, p, hint)
    return p


def require_dir(path, what: str, hint: str = "") -> "object":
    """Return ``Path(path)`` if it is an existing directory, else raise :class:`UserError`."""
    return require_file(path, what, hint, kind="dir")


def check_range(value: Any, what: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``float(value)`` if it is a finite number >= ``low`` (> ``low`` with ``low_open``) and <= ``high``;
    otherwise one :class:`UserError` line "WHAT must be a number >= LOW and <= HIGH, got VALUE" (an infinite
    bound unsaid; "a finite number" when both are)."""
    limits = [f"{'>' if low_open else '>='} {low:g}"] if low > -math.inf else []
    limits += [f"<= {high:g}"] if high < math.inf else []
    wording = f"a number {' and '.join(limits)}" if limits else "a finite number"
    refusal = UserError(f"{what} must be {wording}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise refusal from None
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or number > high:
        raise refusal
    return number


#: the signals that stop a run (and the demo's runner) after a checkpoint instead of killing it
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
#: exit codes of a stopped run, as a shell reports them: 128 + SIGINT after Ctrl-C, 128 + SIGTERM otherwise
#: (the default ``--requeue-exit-code``)
INTERRUPT_EXIT_CODE = 130
PREEMPT_EXIT_CODE = 143


def stop_exit_code(signal_name: str | None, requeue_exit_code: int = PREEMPT_EXIT_CODE) -> int:
    """The exit code of a run stopped by ``signal_name``: :data:`INTERRUPT_EXIT_CODE` after Ctrl-C, else
    ``requeue_exit_code``."""
    return INTERRUPT_EXIT_CODE if signal_name == "SIGINT" else requeue_exit_code


class Preempted(Exception):
    """A run stopped early on a pre-emption signal after writing a resumable checkpoint: the command line
    exits with ``exit_code`` (``--requeue-exit-code``); ``step`` is the checkpoint's step."""

    def __init__(self, message: str, exit_code: int, step: int, interrupted: bool = False):
        super().__init__(message)
        self.exit_code = int(exit_code)
        self.step = int(step)
        self.interrupted = bool(interrupted)  # stopped by the user's Ctrl-C, not a scheduler
