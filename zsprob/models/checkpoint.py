"""The checkpoint format: a directory with ``model.safetensors`` + ``zsprob.json`` (config, method, step,
version, ``extra``, the weights' size and SHA-256); never pickled. Each file is written atomically, the
JSON last, and reading checks size and hash. Imports nothing from the package.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zsprob.errors import UserError
from zsprob.utils.io import sha256_file
from zsprob.utils.paths import CHECKPOINT_META as META_NAME, CHECKPOINT_WEIGHTS as WEIGHTS_NAME
FORMAT = "zsprob-checkpoint"
FORMAT_VERSION = 1
EXTRA_PREFIX = "extra_tensors."


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory of ``path`` (the directory itself, or a file inside it)."""
    p = Path(path)
    if p.is_file() and p.name in (WEIGHTS_NAME, META_NAME):
        return p.parent
    return p


def save(model, path: str | os.PathLike, extra: dict | None = None, *,
         extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` to the directory ``path`` (created if needed); returns the directory. ``extra``: a JSON
    dict for zsprob.json (``method`` and ``step`` also at its top level); ``extra_tensors``: named tensors
    (e.g. a loss's scale and shift) stored beside the weights (:func:`load_extra_tensors`)."""
    from safetensors.torch import save_file

    import zsprob
    from zsprob.utils.io import atomic_write, atomic_write_json

    d = Path(path)
    if d.exists() and not d.is_dir():
        raise UserError(f"checkpoint path exists and is not a directory: {d}")
    d.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # DDP / accelerate wrappers
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    for k, v in (extra_tensors or {}).items():
        tensors[EXTRA_PREFIX + k] = torch.as_tensor(v).detach().to("cpu").contiguous()
    # break shared storage (safetensors refuses aliasing tensors)
    seen: set[int] = set()
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        if ptr in seen:
            tensors[k] = v.clone()
        seen.add(ptr)

    atomic_write(d / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    wpath = d / WEIGHTS_NAME
    extra = dict(extra or {})
    cfg = dict(model.config)
    tokenizer = _copy_tokenizer(tokenizer_directory(model), d / TOKENIZER_DIR)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zsprob_version": zsprob.__version__,
        "name": model.name,
        "embed_dim": model.embed_dim,
        "sigma_depth": model.sigma_depth,
        "sigma_init": model.sigma_init,
        "pooling": model.pooling,
        "deterministic": model.deterministic,
        "var_bounds": list(model.var_bounds) if model.var_bounds is not None else None,
        "method": extra.get("method"),
        "step": extra.get("step"),
        "config": cfg,
        "extra": extra,
        "weights": {"file": WEIGHTS_NAME, "bytes": wpath.stat().st_size, "sha256": sha256_file(wpath),
                    "num_tensors": len(tensors)},
        "tokenizer": tokenizer,
    }
    atomic_write_json(d / META_NAME, meta)
    return d


#: the folder in a checkpoint that holds a copy of its Hugging Face tokenizer (as transformers saves one)
TOKENIZER_DIR = "tokenizer"


def tokenizer_directory(model) -> str | None:
    """The local Hugging Face tokenizer directory the model reads (a loaded checkpoint's own copy), or None."""
    return getattr(getattr(model, "tokenizer", None), "directory", None) or model.config.get("tokenizer_dir")


def _copy_tokenizer(source, into: Path) -> dict | None:
    """Copy the files of a local tokenizer directory into the checkpoint: {file: sha256}, or None (no directory)."""
    from zsprob.utils.io import atomic_write_bytes

    if not source or not Path(source).is_dir():
        return None
    if Path(source).resolve() != into.resolve():
        for f in sorted(Path(source).iterdir()):
            if f.is_file():
                atomic_write_bytes(into / f.name, f.read_bytes())
    return _tokenizer_hashes(into)


def _tokenizer_hashes(d: Path) -> dict:
    return {f.name: sha256_file(f) for f in sorted(d.iterdir()) if f.is_file()}


def saved_tokenizer(d: Path, meta: dict) -> str | None:
    """The checkpoint's own copy of its tokenizer (None when it was saved without one), checked against the
    hashes recorded at saving: a changed file is one line, not a silently different tokenization."""
    recorded = meta.get("tokenizer")
    if not recorded:
        return None
    found = _tokenizer_hashes(d / TOKENIZER_DIR) if (d / TOKENIZER_DIR).is_dir() else {}
    changed = sorted(name for name in set(recorded) | set(found) if recorded.get(name) != found.get(name))
    if changed:
        raise UserError(f"checkpoint {d}: its tokenizer files differ from those saved with it ({', '.join(changed)} "
                        f"in {d / TOKENIZER_DIR}); restore them")
    return str(d / TOKENIZER_DIR)


def load_meta(path: str | os.PathLike) -> dict:
    """The parsed ``zsprob.json`` of a checkpoint directory (UserError if missing / malformed)."""
    from zsprob.utils.io import read_json

    d = checkpoint_dir(path)
    if not d.exists():
        raise UserError(f"checkpoint not found: {d}")
    if not d.is_dir():
        raise UserError(f"not a zsprob checkpoint directory: {d} (expected a folder with {META_NAME} and "
                        f"{WEIGHTS_NAME})")
    meta = read_json(d / META_NAME, what="zsprob checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "config" not in meta:
        raise UserError(f"{d / META_NAME} is not zsprob checkpoint metadata (format {FORMAT!r} expected)")
    for key, kind, what in (("config", dict, "object"), ("weights", dict, "object"),
                            ("format_version", int, "integer")):
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise UserError(f"{d / META_NAME} is damaged: {key!r} must be a JSON {what}, got {meta[key]!r:.60}")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise UserError(f"checkpoint {d} has format version {meta.get('format_version')}; this zsprob reads "
                        f"up to {FORMAT_VERSION} (upgrade zsprob)")
    return meta


def read_weights(f: Path, info: dict, verify: bool, what: str, listed_in: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``f`` on the CPU, after checking its size and, with ``verify``, its
    SHA-256 against ``info`` (as ``listed_in`` records them); ``what`` names the file in the errors."""
    from safetensors.torch import load_file

    if not f.is_file():
        raise UserError(f"{what} missing: {f}")
    if "bytes" in info and f.stat().st_size != int(info["bytes"]):
        raise UserError(f"{what} {f} are truncated or were overwritten: {f.stat().st_size} bytes, "
                        f"{info['bytes']} expected")
    if verify and info.get("sha256") and sha256_file(f) != info["sha256"]:
        raise UserError(f"{what} {f} are corrupted (SHA-256 mismatch with {listed_in})")
    try:
        return load_file(str(f), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
        raise UserError(f"cannot read {what} {f}: {type(e).__name__}: {e}") from None


def read_tensors(d: Path, meta: dict, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``d`` (model weights and ``EXTRA_PREFIX`` tensors), checked."""
    info = meta.get("weights", {})
    return read_weights(d / info.get("file", WEIGHTS_NAME), info, verify, "checkpoint weights", META_NAME)


def load_extra_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``extra_tensors`` saved with :func:`save`."""
    d = checkpoint_dir(path)
    meta = load_meta(d)
    tensors = read_tensors(d, meta, verify=False)
    return {k[len(EXTRA_PREFIX):]: v for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is (or lies in) a zsprob checkpoint directory."""
    d = checkpoint_dir(path)
    return d.is_dir() and (d / META_NAME).is_file()
