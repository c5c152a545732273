"""The learning probes in experiments/ run end to end (tiny sizes) and reject bad options with exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "probe_contrastive.py"


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--text", "bow", "--captions", "shape", "--center", "batchnorm"],
                                   ["--text-lr-mult", "0", "--image-tower", "model"]])
def test_probe_contrastive_runs(extra):
    r = _run("--steps", 2, "--batch-size", 8, "--num-pretrain", 32, "--num-eval", 60, "--threads", 1, *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1].startswith("init: zero-shot") and lines[-1].startswith("end: zero-shot")
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert [ln.split("|")[1].strip() for ln in rows] == ["1", "2"]
    cosine = float(rows[-1].split("|")[6])
    assert -1.0 <= cosine <= 1.0


def test_probe_contrastive_bad_options():
    r = _run("--steps", 2, "--batch-size", 64, "--num-pretrain", 32)
    assert r.returncode == 2 and r.stderr.startswith("probe_contrastive: error:") and r.stderr.count("\n") == 1
    r = _run("--text-lr-mult", -1)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
