"""Read an official checkpoint into a flat ``{name: tensor}`` dict, without unpickling code.

A safetensors file, a PyTorch file (``weights_only``; a trainer's ``munch.Munch`` hyper-parameters read
as an ``OrderedDict``), a Hugging Face model directory, or a Lightning checkpoint's ``state_dict``
(a DistributedDataParallel ``module.`` prefix stripped). Any other Python object is refused.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch

from zsprob.errors import UserError

WEIGHT_FILES = ("model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin",
                "open_clip_pytorch_model.bin")
STATE_DICT_KEYS = ("state_dict", "model", "module")  # where trainer checkpoints keep the weights
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def weights_file(path: str | os.PathLike) -> Path:
    """The weight file itself, or the one inside a Hugging Face model directory."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if not path.is_dir():
        raise UserError(f"official checkpoint not found: {path}")
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    raise UserError(f"no weights in directory {path} (expected one of {', '.join(WEIGHT_FILES)})")


def read_hf_config(path: str | os.PathLike) -> dict | None:
    """``config.json`` of a Hugging Face model directory (or beside a weight file), if any."""
    path = Path(path).expanduser()
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {config}: {e}") from None


# attribute-dict classes that trainer checkpoints pickle in their hyper-parameters (PCME++'s config is a
# munch.Munch); they are read as collections.OrderedDict (items kept), so no code from the file's world runs
CONFIG_DICT_CLASSES = ("munch.Munch", "munch.DefaultMunch", "easydict.EasyDict")


def _torch_file(path: Path) -> dict:
    import warnings

    with warnings.catch_warnings():  # torch's notes on the file's pickle protocol: the one line below says enough
        warnings.simplefilter("ignore", UserWarning)
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception:  # noqa: BLE001 - not a zip checkpoint: torch.load reports it below
            unsafe = set()
        stand_ins = [(OrderedDict, name) for name in sorted(unsafe & set(CONFIG_DICT_CLASSES))]
        try:
            with torch.serialization.safe_globals(stand_ins):
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - the file is the user's
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot read {path} without unpickling code ({first}); if the file is from a source "
                            "you trust, save its weights alone: torch.save(torch.load(FILE, weights_only=False)"
                            "['state_dict'], 'weights.pt')") from None


def _unwrap(obj, path: Path) -> dict:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            if isinstance(obj.get(key), dict):
                return _unwrap(obj[key], path)
    raise UserError(f"{path} holds no state dict (a dict of tensors, or one under "
                    f"{' / '.join(repr(k) for k in STATE_DICT_KEYS)})")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Flat ``{name: tensor}`` of an official checkpoint file or directory."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(file))
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot read safetensors file {file}: {e}") from None
    elif file.suffix in TORCH_SUFFIXES:
        state = _unwrap(_torch_file(file), file)
    else:
        raise UserError(f"unknown checkpoint format {file.suffix!r} for {file} (.safetensors, "
                        f"{', '.join(TORCH_SUFFIXES)} or a Hugging Face model directory)")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)
