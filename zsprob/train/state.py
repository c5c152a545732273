"""Training state for exact resume: safetensors for tensors, JSON for the rest (nothing is pickled).

A checkpoint is ``OUT/checkpoints/step-NNNNNN/`` holding ``model/`` (:func:`zsprob.models.save`),
``model-swa/`` (once SWA started), ``state.safetensors`` (optimizer tensors, RNG states, SWA average) and
``state.json`` (step, data position, optimizer scalars, scheduler, scaler, Python RNG); ``latest.json``
beside them (``{"step": 500, "dir": "step-000500"}``) is written last, atomically. zsprob flattens nested
state dicts into safetensors keys; safetensors does the tensor I/O."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.utils.io import atomic_write, atomic_write_json, read_json

TENSOR = "__tensor__"
NDARRAY = "__ndarray__"
TUPLE = "__tuple__"


def flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Replace every tensor / ndarray in a nested structure by a reference into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {TENSOR: prefix}
    if isinstance(obj, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(obj))
        return {NDARRAY: prefix}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            sk = str(k)
            out[("i:" + sk) if isinstance(k, int) else sk] = flatten(v, tensors, f"{prefix}/{sk}")
        return out
    if isinstance(obj, tuple):
        return {TUPLE: [flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a training state")


def unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(obj, dict):
        if TENSOR in obj and len(obj) == 1:
            return tensors[obj[TENSOR]]
        if NDARRAY in obj and len(obj) == 1:
            return tensors[obj[NDARRAY]].numpy()
        if TUPLE in obj and len(obj) == 1:
            return tuple(unflatten(v, tensors) for v in obj[TUPLE])
        out = {}
        for k, v in obj.items():
            key: Any = int(k[2:]) if k.startswith("i:") else k
            out[key] = unflatten(v, tensors)
        return out
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    return obj


# ----------------------------------------------------------------------------- RNG

def rng_state() -> dict:
    """Python, numpy, torch CPU and (with CUDA) the current device's generator states (a process owns one
    GPU, and a checkpoint must resume on a machine that shows another number of them)."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(),
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    """The inverse of :func:`rng_state`; a CUDA state saved as a list (older checkpoints: one per visible
    device) gives the current device its entry, or the first one."""
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_st = st["numpy"]
    np.random.set_state((np_st[0], np.asarray(np_st[1], dtype=np.uint32), int(np_st[2]),
                         int(np_st[3]), float(np_st[4])))
    torch.set_rng_state(st["torch"].to(torch.uint8))
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda.to(torch.uint8))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- files

def save_state(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` (nested dict with tensors) as ``path/state.safetensors`` + ``path/state.json``."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = flatten(state, tensors, "s")
    atomic_write(path / "state.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write_json(path / "state.json", meta)


#: what a step directory's main state.json holds (an rng-rank* directory holds "rng" only)
MAIN_STATE_KEYS = ("step", "epoch", "batch_in_epoch", "optimizer", "schedule", "loss", "rng")


def load_state(path: str | os.PathLike, require: tuple = ()) -> dict:
    """Read a state written by :func:`save_state`; ``require``: keys it must hold (step / epoch /
    batch_in_epoch as integers). A damaged state is one UserError line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    meta = read_json(path / "state.json", "training state")
    missing = [k for k in require if not isinstance(meta, dict) or k not in meta]
    not_int = [k for k in ("step", "epoch", "batch_in_epoch") if k in require and not missing
               and (isinstance(meta[k], bool) or not isinstance(meta[k], int))]
    if not isinstance(meta, dict) or missing or not_int:
        what = (f"a JSON {type(meta).__name__}" if not isinstance(meta, dict) else
                f"no {', '.join(missing)}" if missing else f"{not_int[0]} is {meta[not_int[0]]!r}")
        raise UserError(f"training state {path / 'state.json'} is damaged ({what}); resume from another step "
                        "directory (--resume DIR) or start afresh with --overwrite")
    f = path / "state.safetensors"
    if not f.is_file():
        raise UserError(f"training state tensors not found: {f} (the checkpoint is incomplete)")
    try:
        tensors = load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"training state {f} is corrupted: {e}") from None
    try:
        return unflatten(meta, tensors)
    except KeyError as e:
        raise UserError(f"training state {path} is inconsistent (missing tensor {e})") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"training state {path / 'state.json'} is damaged ({type(e).__name__}: {e})") from None

