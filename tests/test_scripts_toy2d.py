"""scripts/toy2d.py (PCME++ App. A.2): a reduced run, in a subprocess as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "toy2d.py"


@pytest.mark.slow
def test_toy2d_reduced_run_csd_separates_uncertain_points_more_than_wd(tmp_path):
    out = tmp_path / "toy.png"
    r = subprocess.run([sys.executable, str(SCRIPT), "--per-class", "100", "--confusing", "30", "--epochs", "200",
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.is_file() and out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    figures = json.loads(out.with_suffix(".json").read_text())
    assert figures["csd"]["ratio"] > figures["wd"]["ratio"]
    assert figures["csd"]["ratio"] > 1.3  # 1.64x vs 1.19x (WD) seen with this seed; 60 epochs are too few to separate
    assert "| csd |" in r.stdout and "| wd |" in r.stdout


def test_toy2d_rejects_bad_sizes(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--confusing", "600", "--out", str(tmp_path / "t.png")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    assert r.returncode == 2 and "toy2d:" in r.stderr and not (tmp_path / "t.png").exists()
