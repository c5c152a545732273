"""Where evaluation runs: the one reading of a ``--device`` / ``--precision`` string.

:func:`resolve_device` turns ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` into a ``torch.device`` (checking
with torch that the GPU exists), :func:`encode_autocast` is the context encoders run in for a precision.
Training does not use these: accelerate places and casts its models.
"""
from __future__ import annotations

import contextlib
import os
import re

from zsprob.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
#: every precision zsprob runs in; training takes them all (``train.precision``), encoding the first two
PRECISIONS = ("fp32", "bf16", "fp16")
ENCODE_PRECISIONS = PRECISIONS[:2]
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_device(spec) -> tuple[str, int | None]:
    """(kind, index) of a device string, checked for form only (no torch): ``cuda:1`` -> ("cuda", 1)."""
    text = "auto" if spec is None else str(spec).strip().lower()
    match = _SPEC.match(text)
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise UserError(f"unknown device {spec!r}: choose {DEVICE_CHOICES}")
    return match.group(1), None if match.group(2) is None else int(match.group(2))


def resolve_device(spec=None):
    """A ``torch.device`` for ``spec``: "auto" (or None) is CUDA when ``torch.cuda.is_available()``,
    else the CPU; "cuda" without a GPU or "cuda:N" beyond ``torch.cuda.device_count()`` raise
    :class:`UserError`, as does any other string. A ``torch.device`` is checked the same way."""
    import torch

    kind, index = parse_device(spec.type + (f":{spec.index}" if spec.index is not None else "")
                               if isinstance(spec, torch.device) else spec)
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"device {spec!r} asked for, but torch sees no CUDA GPU here (use --device cpu or auto)")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise UserError(f"device {spec!r} does not exist: torch sees {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index) if index is not None else torch.device("cuda")


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`ENCODE_PRECISIONS`, else :class:`UserError`."""
    if precision not in ENCODE_PRECISIONS:
        raise UserError(f"unknown precision {precision!r}: choose {' or '.join(ENCODE_PRECISIONS)}")
    return precision


def encode_autocast(device, precision: str = "fp32"):
    """The context an encoder runs its forward passes in: ``torch.autocast`` to bfloat16 on
    ``device``'s type for "bf16", nothing for "fp32"."""
    import torch

    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def default_workers() -> int:
    """The CLI's default image-decoding workers: min(4, CPU count). Worker count never changes
    results (the DataLoader keeps dataset order and the eval transforms are deterministic)."""
    return min(4, os.cpu_count() or 1)


__all__ = ["DEVICE_CHOICES", "PRECISIONS", "ENCODE_PRECISIONS", "parse_device", "resolve_device", "check_precision",
           "encode_autocast", "default_workers"]
