"""The open_clip model directory, read side: ``open_clip_config.json`` and the ``zsprob`` section a zsprob
export adds to it (checkpoint metadata, the weights files' sizes and hashes), which open_clip ignores.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.checkpoint import read_weights

CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
SIGMA_NAME = "zsprob_sigma_heads.safetensors"
EXPORT_FORMAT = "zsprob-open_clip-export"
EXPORT_VERSION = 1
#: the prefix of the mean path's tensors inside a ProbCLIP (the wrapped open_clip model)
CLIP_PREFIX = "clip."
#: the preprocessing keys open_clip's ``PreprocessCfg`` has
PREPROCESS_KEYS = ("size", "mode", "mean", "std", "interpolation", "resize_mode", "fill_color")


def config_path(path: str | os.PathLike) -> Path | None:
    """``open_clip_config.json`` of the directory ``path``, or None (a file path, or a directory without one)."""
    cfg = Path(path).expanduser() / CONFIG_NAME
    return cfg if cfg.is_file() else None


def read_config(path: str | os.PathLike) -> dict | None:
    """The parsed ``open_clip_config.json`` in the directory ``path``, or None; UserError if malformed."""
    cfg = config_path(path)
    if cfg is None:
        return None
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_cfg"), dict):
        raise UserError(f"{cfg} has no 'model_cfg' object (open_clip's model directory format)")
    pre = doc.get("preprocess_cfg", {})
    if not isinstance(pre, dict):
        raise UserError(f"{cfg}: 'preprocess_cfg' must be an object, got {type(pre).__name__}")
    return doc


def pretrained_cfg(doc: dict) -> dict:
    """A model directory's config as an open_clip pretrained cfg: the preprocessing keys plus ``model_cfg``."""
    pre = {k: v for k, v in (doc.get("preprocess_cfg") or {}).items() if k in PREPROCESS_KEYS and v is not None}
    return {**pre, "model_cfg": doc["model_cfg"]}


def export_section(path: str | os.PathLike) -> dict | None:
    """The ``zsprob`` section of the export directory ``path``, or None when its config (if any) has none."""
    doc = read_config(path)
    if doc is None or "zsprob" not in doc:
        return None
    sec = doc["zsprob"]
    where = config_path(path)
    if not isinstance(sec, dict) or sec.get("format") != EXPORT_FORMAT or not isinstance(sec.get("meta"), dict) \
            or "config" not in sec["meta"] or not isinstance(sec.get("files"), dict):
        raise UserError(f"{where}: the 'zsprob' section is not a zsprob export ({EXPORT_FORMAT!r} with meta and files)")
    if int(sec.get("format_version", 0)) > EXPORT_VERSION:
        raise UserError(f"{where}: zsprob export format version {sec.get('format_version')}; this zsprob reads up "
                        f"to {EXPORT_VERSION} (upgrade zsprob)")
    return sec


def export_meta(path: str | os.PathLike, sec: dict) -> dict:
    """An export's checkpoint metadata (as ``zsprob.json`` holds it), its tokenizer directory the export's own."""
    meta = json.loads(json.dumps(sec["meta"]))
    d = Path(path).expanduser()
    if meta["config"].get("tokenizer_dir") is not None:
        meta["config"]["tokenizer_dir"] = str(d.resolve())
    return meta


def _read(d: Path, info: dict, verify: bool) -> dict[str, torch.Tensor]:
    return read_weights(d / str(info.get("file", "")), info, verify, "zsprob export weights", CONFIG_NAME)


def read_export_tensors(path: str | os.PathLike, sec: dict, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every model tensor of an export under ProbCLIP's names (the open_clip weights as ``clip.*``), checked."""
    d = Path(path).expanduser()
    files = sec["files"]
    tensors = {CLIP_PREFIX + k: v for k, v in _read(d, files.get("open_clip", {}), verify).items()}
    if files.get("sigma") is not None:
        tensors.update(_read(d, files["sigma"], verify))
    return tensors
