"""The one exception type for errors a user can cause.

Missing paths, corrupted checkpoints, unknown model names, malformed configs, class-list
mismatches: raise :class:`UserError` with a message that says what is wrong and what to do.
The command line prints it as a single line on stderr and exits with status 2 (a traceback
only with ``zsprob --debug``). Library users catch it like any exception.
"""


class UserError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""


def not_found(what: str, path, hint: str = "") -> UserError:
    """The error for a missing input: "WHAT not found: PATH (HINT)"."""
    return UserError(f"{what} not found: {path}" + (f" ({hint})" if hint else ""))


def require_file(path, what: str, hint: str = "") -> "object":
    """Return ``Path(path)`` if it is an existing file, else raise :class:`UserError`.

    ``what`` names the file for the message ("COCO Karpathy split JSON"), ``hint`` says
    where it comes from or how to make it.
    """
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise not_found(what, p, hint)
    return p


def require_dir(path, what: str, hint: str = "") -> "object":
    """Return ``Path(path)`` if it is an existing directory, else raise :class:`UserError`."""
    from pathlib import Path

    p = Path(path)
    if not p.is_dir():
        raise not_found(what, p, hint)
    return p


class Preempted(Exception):
    """A training run stopped early on a pre-emption signal after writing a resumable checkpoint.

    ``exit_code`` is what the command line exits with (``--requeue-exit-code``), ``step`` the step
    of the checkpoint written.
    """

    def __init__(self, message: str, exit_code: int, step: int):
        super().__init__(message)
        self.exit_code = int(exit_code)
        self.step = int(step)
