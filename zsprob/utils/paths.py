"""Where zsprob's shipped resources live (prompts/ and configs/ beside the package, or under
``ZSPROB_HOME``), what marks a training run's directory (:data:`RUN_MARKERS`) and a checkpoint's file names.
"""
from __future__ import annotations

import os
from pathlib import Path


#: what a `zsprob pretrain` / `finetune` run directory holds at its top: reusing it needs --resume or
#: --overwrite (zsprob.train.resilience), and `zsprob demo` refuses it as its --out (zsprob.report.demo)
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", "model")
#: a zsprob checkpoint directory's two files (zsprob.models.checkpoint; declared here, where no torch is imported)
CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINT_META = "zsprob.json"
CHECKPOINT_FILES = (CHECKPOINT_WEIGHTS, CHECKPOINT_META)


def project_root() -> Path:
    env = os.environ.get("ZSPROB_HOME")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2]


def prompts_dir() -> Path:
    return project_root() / "prompts"


def configs_dir() -> Path:
    return project_root() / "configs"


def model_configs_dir() -> Path:
    return configs_dir() / "models"


def resolve_resource(path: str | os.PathLike, folder: Path) -> Path:
    """A user path if it exists, else the same name inside a shipped folder."""
    p = Path(path)
    if p.exists():
        return p
    q = folder / p
    if q.exists():
        return q
    q = folder / p.name
    return q if q.exists() else p
