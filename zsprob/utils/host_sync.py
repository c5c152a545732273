"""Counting the tensor calls that make the host wait for the device, on any device (the CPU included).

``torch.cuda.set_sync_debug_mode`` reports them on CUDA only; :class:`HostSyncCounter` counts ``.item()``,
``bool(tensor)``, ``.cpu()``, ``unique``, ``nonzero`` and the two host-to-device copies an accelerator waits for
(``torch.tensor`` of Python data with a ``device``; ``x[tensor_index] = number``) through ``TorchFunctionMode``,
so a CPU test can pin one host sync per training step. ``torch/optim``'s calls are skipped (host step counters)."""
from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode

_THIS_FILE = __file__.replace("\\", "/")
SYNC_CALLS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                        "unique", "unique_consecutive", "nonzero", "masked_select", "equal", "allclose"})


#: device types whose operations run synchronously anyway, so a host read stalls nothing: data-dependent
#: shortcuts stay on them (a test empties it to count the accelerator's path on the CPU)
HOST_READ_FREE = {"cpu"}


def host_read_is_free(device) -> bool:
    """Whether reading a value of a tensor on ``device`` from the host costs no device stall."""
    return torch.device(device).type in HOST_READ_FREE


def _call_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name.rsplit(".", 1)[-1]


def _caller_is_torch_optim() -> bool:
    """True when the first frames above the call, up to the first one outside torch, include torch.optim."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/optim/" in filename:
            return True
        if "/torch/" not in filename and filename != _THIS_FILE:
            return False
        frame = frame.f_back
    return False


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as c: ...`` counts host-synchronising tensor calls in the block: ``c.total``,
    ``c.by_name`` (by call name) and ``c.where`` ("file:line name" of the first frame outside torch)."""

    def __init__(self):
        super().__init__()
        self.by_name: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _call_name(func)
        if name not in SYNC_CALLS:
            name = _host_copy(name, args, kwargs)
        if name is not None and not _caller_is_torch_optim():
            self.by_name[name] += 1
            self.where[f"{caller_site(sys._getframe(1))} {name}"] += 1
        return func(*args, **(kwargs or {}))


def _host_copy(name: str, args, kwargs) -> str | None:
    """The counted name of a call that copies host data to the tensor's device, or None."""
    if name in ("tensor", "as_tensor") and (kwargs or {}).get("device") is not None and args \
            and not isinstance(args[0], torch.Tensor):
        return f"{name}(host data, device=)"
    if name == "__setitem__" and len(args) == 3 and isinstance(args[2], (bool, int, float)):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) for i in index):
            return "__setitem__(tensor index, number)"
    return None


def caller_site(frame=None, *, via: bool = False) -> str:
    """``path:line`` of the first frame from ``frame`` (default: the caller's) outwards that is not torch's, the
    warnings module's or this module's; with ``via``, also the innermost torch frame passed on the way."""
    frame = frame if frame is not None else sys._getframe(1)
    inner = None
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" in filename:
            inner = inner or f"torch/{filename.rsplit('/torch/', 1)[-1]}:{frame.f_lineno}"
        elif filename != _THIS_FILE and not filename.endswith("/warnings.py"):
            site = f"{filename.rsplit('/zsprob/', 1)[-1]}:{frame.f_lineno}"
            return site + (f" (via {inner})" if via and inner else "")
        frame = frame.f_back
    return (inner if via else None) or "?"
