"""The open_clip / Hugging Face model directory, read side: ``open_clip_config.json`` and a zsprob export in it.

An open_clip model directory holds ``open_clip_config.json`` (``model_cfg``, ``preprocess_cfg``), a
weights file and, for a Hugging Face tokenizer, its files. This module reads the config
(:func:`read_config`, :func:`pretrained_cfg`) and, of a zsprob export, the ``zsprob`` section open_clip
ignores: the checkpoint metadata and the two weights files' sizes and hashes (:func:`export_section`,
:func:`read_export_tensors`). Writing it is :mod:`zsprob.models.export`'s job.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.checkpoint import sha256_file

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
    """The parsed ``open_clip_config.json`` in the directory ``path``, or None when there is none.
    A file that is not JSON, or has no ``model_cfg`` object, is a UserError."""
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
    """The preprocessing of a model directory's config as an open_clip pretrained cfg (the keys
    :func:`open_clip.transform.merge_preprocess_dict` reads), plus ``model_cfg``."""
    pre = {k: v for k, v in (doc.get("preprocess_cfg") or {}).items() if k in PREPROCESS_KEYS and v is not None}
    return {**pre, "model_cfg": doc["model_cfg"]}


def export_section(path: str | os.PathLike) -> dict | None:
    """The ``zsprob`` section of a zsprob export directory ``path``, or None when ``path`` holds no
    ``open_clip_config.json`` or one without that section."""
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
    """The checkpoint metadata of an export (as ``zsprob.json`` would hold it), its tokenizer directory
    pointing at the export's own tokenizer files when it carries them."""
    meta = json.loads(json.dumps(sec["meta"]))
    d = Path(path).expanduser()
    if meta["config"].get("tokenizer_dir") is not None:
        meta["config"]["tokenizer_dir"] = str(d.resolve())
    return meta


def _checked_file(d: Path, info: dict, verify: bool) -> Path:
    """The weights file an export lists, its size (and with ``verify`` SHA-256) checked."""
    f = d / str(info.get("file", ""))
    if not f.is_file():
        raise UserError(f"zsprob export {d}: weights file missing: {f}")
    if "bytes" in info and f.stat().st_size != int(info["bytes"]):
        raise UserError(f"zsprob export {d}: {f.name} is truncated or was overwritten ({f.stat().st_size} bytes, "
                        f"{info['bytes']} expected)")
    if verify and info.get("sha256") and sha256_file(f) != info["sha256"]:
        raise UserError(f"zsprob export {d}: {f.name} is corrupted (SHA-256 mismatch with {CONFIG_NAME})")
    return f


def _load(f: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(f), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
        raise UserError(f"cannot read {f}: {type(e).__name__}: {e}") from None


def read_export_tensors(path: str | os.PathLike, sec: dict, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every model tensor of an export under ProbCLIP's names: the open_clip weights as ``clip.*``,
    the heads file's tensors as they are."""
    d = Path(path).expanduser()
    files = sec["files"]
    tensors = {CLIP_PREFIX + k: v for k, v in _load(_checked_file(d, files.get("open_clip", {}), verify)).items()}
    if files.get("sigma") is not None:
        tensors.update(_load(_checked_file(d, files["sigma"], verify)))
    return tensors


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "SIGMA_NAME", "EXPORT_FORMAT", "EXPORT_VERSION", "CLIP_PREFIX",
           "config_path", "read_config", "pretrained_cfg", "export_section", "export_meta", "read_export_tensors"]
