"""Shared pytest fixtures. Fixtures generate their data on the fly; nothing is downloaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


def run_cli(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m zsprob ARGS`` in a real subprocess and capture its output."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "zsprob", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli_run():
    return run_cli


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (tiny ops are faster so when the cores are shared); restored after.
    Test modules of small tensor maths opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ tiny training runs, shared
# The towers every training test uses: zsprob-tiny's open_clip ViT and text transformer cut to two
# layers of width 32 at 32 px (model.overrides); with embed_dim 16 a step takes milliseconds.
TINY_TOWERS = {"open_clip_cfg": {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                                "image_size": 32},
                                 "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> Path:
    """A SynthWorld at 32 px with 64 pretraining samples in two shards (read-only for the tests)."""
    from zsprob.data.synthetic import generate
    out = tmp_path_factory.mktemp("sw")
    generate(out, image_size=32, num_pretrain=64, num_classify_select=0, num_classify_eval=0,
             num_retrieval=4, num_retrieval_val=0, shard_size=32, progress=False)
    return out


def tiny_model_args() -> list[str]:
    """`--model` and `--set` arguments selecting zsprob-tiny with TINY_TOWERS on the command line."""
    flow = json.dumps(TINY_TOWERS).replace('"', "")  # a YAML flow mapping
    return ["--model", "zsprob-tiny", "--set", "model.pretrained=null", "--set", "model.embed_dim=16",
            "--set", f"model.overrides={flow}"]


def read_losses(run: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("loss") is not None:
            out[r["step"]] = r["loss"]
    return out
