"""Counting the tensor calls that make the host wait for the device, on any device (the CPU included).

``torch.cuda.set_sync_debug_mode`` reports them on CUDA only; :class:`HostSyncCounter` counts host reads
(``.item()``, ``bool(tensor)``, copies into host memory), data-dependent shapes (``nonzero``, a boolean-mask index)
and the host-to-device copies an accelerator waits for (``torch.tensor(list, device=)``, ``x[tensor_index] = 1``)
through ``TorchFunctionMode``, so a CPU test can pin one host sync per step; ``torch/optim``'s calls are skipped."""
from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode

_THIS_FILE = __file__.replace("\\", "/")
SYNC_CALLS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                        "unique", "unique_consecutive", "nonzero", "argwhere", "masked_select", "equal", "allclose"})


#: device types whose operations run synchronously anyway, so a host read stalls nothing: data-dependent
#: shortcuts stay on them (a test empties it to count the accelerator's path on the CPU)
HOST_READ_FREE = {"cpu"}


def host_read_is_free(device) -> bool:
    """Whether reading a value of a tensor on ``device`` from the host costs no device stall."""
    return torch.device(device).type in HOST_READ_FREE


def pins_memory(device) -> bool:
    """Whether host tensors bound for ``device`` go through page-locked memory (CUDA: the copy then does not block)."""
    return device is not None and torch.device(device).type == "cuda"


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` on ``device`` without blocking: a CPU tensor bound for CUDA is copied from page-locked memory."""
    return (x.pin_memory() if x.device.type == "cpu" and pins_memory(device) else x).to(device, non_blocking=True)


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
        name = counted_name(getattr(func, "__name__", ""), args, kwargs or {})
        if name is not None:
            site, _, in_optim = _walk(sys._getframe(1))
            if not in_optim:
                self.by_name[name] += 1
                self.where[f"{site} {name}"] += 1
        return func(*args, **(kwargs or {}))


def counted_name(name: str, args, kwargs: dict) -> str | None:
    """The name a call is counted under, or None. A copy into host memory counts when it leaves a device or names
    the host as "cpu" (a CPU-only run's ``x.to(device)`` and ``copy_`` stand for the accelerator's own copies)."""
    index = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:2]
    if name in SYNC_CALLS:
        return name
    if name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
        return "__getitem__(bool mask)"
    if name == "to" and not kwargs.get("non_blocking"):  # a non-blocking copy to the host is pinned: no wait
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        target = target.device if isinstance(target, torch.Tensor) else target
        if target == "cpu" or isinstance(target, torch.device) and target.type == "cpu" != args[0].device.type:
            return "to(cpu)"
    if name == "copy_" and args[0].device.type == "cpu" != args[1].device.type:
        return "copy_(into host)"
    if name in ("tensor", "as_tensor") and kwargs.get("device") is not None and args \
            and not isinstance(args[0], torch.Tensor):
        return f"{name}(host data, device=)"
    if name == "__setitem__" and isinstance(args[-1], (bool, int, float)) \
            and any(isinstance(i, torch.Tensor) for i in index):
        return "__setitem__(tensor index, number)"
    return None


def _walk(frame) -> tuple[str, str | None, bool]:
    """From ``frame`` outwards to the first frame that is not torch's, the warnings module's or this module's: its
    "path:line", the innermost torch frame passed on the way (or None) and whether torch.optim's was passed."""
    inner, optim = None, False
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" in filename:
            inner = inner or f"torch/{filename.rsplit('/torch/', 1)[-1]}:{frame.f_lineno}"
            optim = optim or "/torch/optim/" in filename
        elif filename != _THIS_FILE and not filename.endswith("/warnings.py"):
            return f"{filename.rsplit('/zsprob/', 1)[-1]}:{frame.f_lineno}", inner, optim
        frame = frame.f_back
    return "?", inner, optim


def caller_site(frame=None, *, via: bool = False) -> str:
    """``path:line`` of the first frame from ``frame`` (default: the caller's) outwards that is not torch's, the
    warnings module's or this module's; with ``via``, also the innermost torch frame passed on the way."""
    site, inner, _ = _walk(frame if frame is not None else sys._getframe(1))
    return site + (f" (via {inner})" if via and inner else "")
