"""scripts/toy2d.py (PCME++ App. A.2): a reduced run, in a subprocess as a user runs it, and the
mechanism (redrawn labels make the confusing points uncertain) checked in-process."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "toy2d.py"
# 120 points, one batch per epoch: each point gets 400 updates (a few seconds in all)
SMALL = {"per_class": 40, "confusing": 12, "epochs": 400}


def _run(*args, timeout=120):
    """The script in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})


def _load_script():
    spec = importlib.util.spec_from_file_location("toy2d_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy2d_reduced_run_csd_separates_uncertain_points_more_than_wd(tmp_path):
    out = tmp_path / "toy.png"
    r = _run("--per-class", SMALL["per_class"], "--confusing", SMALL["confusing"], "--epochs", SMALL["epochs"],
             "--seeds", 2, "--out", out, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.is_file() and out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    figures = json.loads(out.with_suffix(".json").read_text())
    assert figures["setup"]["sigma_param"] == "logsigma" and figures["setup"]["labels"] == "per-visit"
    assert figures["setup"]["sigma_shape"] == "isotropic"
    # seed 0 gave 2.41x (CSD) vs 1.08x (WD); seeds 1, 2: 2.37x vs 1.05x, 2.64x vs 1.12x
    assert figures["csd"]["ratio"] > 1.4
    assert figures["csd"]["ratio"] > figures["wd"]["ratio"] + 0.3
    assert all(math.isfinite(figures[d]["ratio_geometric"]) for d in ("csd", "wd"))
    assert "| 0 | csd |" in r.stdout and "| 1 | wd |" in r.stdout
    # --seeds 2: the top level is the first seed, then every seed and the mean +- SE over them
    assert [run["seed"] for run in figures["seeds"]] == [0, 1]
    assert figures["seeds"][0]["csd"] == figures["csd"]
    for d in ("csd", "wd"):
        ratios = [run[d]["ratio"] for run in figures["seeds"]]
        summary = figures["over_seeds"][d]
        assert summary["n"] == 2 and math.isclose(summary["mean_ratio"], sum(ratios) / 2)
        assert math.isclose(summary["se"], abs(ratios[0] - ratios[1]) / 2)   # sd / sqrt(2) for two values
        assert f"{d}: uncertain / certain {summary['mean_ratio']:.3f}x" in r.stdout
    assert "one seed:" not in r.stdout


def test_toy2d_labels_drawn_once_leave_nothing_uncertain():
    """The uncertainty comes from the per-visit redraw: with each label drawn once, a confusing point
    is an ordinary point of a random class and CSD's ratio falls to about 1 (1.04x seen vs 2.41x)."""
    toy2d = _load_script()
    torch.set_num_threads(1)
    toy = toy2d.make_toy(SMALL["per_class"], SMALL["confusing"], seed=0)
    per_visit = toy2d.train(toy, "csd", epochs=SMALL["epochs"], labels="per-visit")["ratio"]
    once = toy2d.train(toy, "csd", epochs=SMALL["epochs"], labels="once")["ratio"]
    assert per_visit > 1.4 and once < 1.25, (per_visit, once)


def test_toy2d_options_for_the_open_choices_run():
    toy2d = _load_script()
    toy = toy2d.make_toy(20, 6, seed=0)
    for kwargs in ({"diagonal": False}, {"sigma_param": "logvar"}, {"learn_ab": False},
                   {"pp_alpha": 0.0, "vib_beta": 0.0, "diagonal": False}, {"sigma_shape": "diagonal"}):
        res = toy2d.train(toy, "wd", epochs=3, **kwargs)
        assert math.isfinite(res["ratio"]), kwargs
        # isotropic (the default): one sigma per point, the same in both dimensions
        same = bool((res["logvar"][:, 0] == res["logvar"][:, 1]).all())
        assert same == (kwargs.get("sigma_shape", "isotropic") == "isotropic"), kwargs
        if not kwargs.get("learn_ab", True):
            assert res["a"] == 5.0 and res["b"] == 5.0


def test_toy2d_rejects_bad_sizes(tmp_path):
    for bad in (["--confusing", "600"], ["--seeds", "0"]):
        r = _run(*bad, "--out", tmp_path / "t.png")
        assert r.returncode == 2 and "toy2d:" in r.stderr and not (tmp_path / "t.png").exists(), bad


def test_toy2d_one_seed_says_how_to_get_the_spread(tmp_path):
    out = tmp_path / "one.png"
    r = _run("--per-class", 20, "--confusing", 6, "--epochs", 2, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "one seed:" in r.stdout and "--seeds N" in r.stdout
    figures = json.loads(out.with_suffix(".json").read_text())
    assert "seeds" not in figures and "over_seeds" not in figures and figures["setup"]["seeds"] == 1
