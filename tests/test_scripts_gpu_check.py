"""scripts/gpu_check.py, the one prepared GPU check: its CPU quick run (as CI runs it, so the script
cannot rot) writes every section with status ok or skipped-with-reason, every equality flag true,
every figure with a unit, and the Markdown table; ``--device cuda`` without a GPU is one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
SECTIONS = ("versions", "losses", "forward", "train_steps", "bf16", "throughput", "evaluation", "degrade")
EQUALITY = ("losses", "forward", "train_steps", "bf16", "evaluation", "degrade")


def _run(*args, timeout=900, extra_env=None):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), **(extra_env or {})}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_cpu_quick_run_writes_every_section_ok_and_equal(tmp_path):
    out = tmp_path / "gc"
    # a large budget: on a loaded CI machine a section must not be skipped for time
    r = _run("--device", "cpu", "--quick", "--out", out, "--budget-s", 3000)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["device"] == "cpu" and doc["quick"] is True
    sections = doc["sections"]
    assert set(SECTIONS) <= set(sections), sorted(sections)
    for name in SECTIONS:
        rec = sections[name]
        assert rec["status"] in ("ok", "skipped"), (name, rec.get("error"), rec.get("traceback"))
        if rec["status"] == "skipped":
            assert rec.get("reason"), name
        for skipped in rec.get("skipped", []):
            assert skipped["what"] and skipped["reason"], (name, skipped)
        for f in rec.get("figures", []):
            assert f["unit"] is not None and (f["value"] is None or f["unit"] != ""), (name, f)
    for name in EQUALITY:
        rec = sections[name]
        flags = [f["pass"] for f in rec["figures"] if f["pass"] is not None]
        assert flags and all(flags) and rec["equal"] is True, (name, [f for f in rec["figures"] if f["pass"] is False])
    # what each section must have measured
    losses = {f["name"].split()[0] for f in sections["losses"]["figures"]}
    assert {"PCMEPPLoss", "InfoNCELoss", "ProLIPLoss", "CSD"} <= losses
    steps = [f for f in sections["train_steps"]["figures"] if f["name"].startswith("step ")]
    assert len(steps) == 3
    runs = sections["throughput"]["runs"]
    for name in ("zsprob infonce", "zsprob pcmepp"):
        assert runs[name]["median_sps"] > 0 and runs[name]["flops_per_step"] > 0, runs[name]
        assert runs[name]["opt_step_ms"] > 0 and "host_syncs_per_step" in runs[name], runs[name]
    whats = {s["what"] for s in sections["throughput"]["skipped"]}
    assert "MFU" in whats and any("sync_debug_mode" in w for w in whats)  # CUDA-only parts, with reasons
    if "open_clip_train infonce" not in runs:
        assert "open_clip_train" in whats
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# zsprob GPU check: CPU") and "| losses | ok |" in md and "samples/s" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    r = _run("--device", "cuda", "--out", tmp_path / "gc", timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check.py: error:") and "CUDA" in lines[0], r.stderr
    assert not (tmp_path / "gc").exists()


def _script(name: str):
    import importlib
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_rankings_that_differ_only_among_exact_ties_count_as_the_same():
    gc = _script("gpu_check")
    g = torch.Generator().manual_seed(0)
    img = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64) - 2]
    cap = [torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64) - 2]
    cap = [torch.cat([c, c[:1]]) for c in cap]  # caption 4 repeats caption 0 exactly
    emb = img + cap
    from zsprob.prob.distances import csd
    ranked = csd(*img, *cap).argsort(dim=1)[:, :3]
    swapped = ranked.clone()
    swapped[ranked == 0], swapped[ranked == 4] = 4, 0  # the tied pair in the other order
    assert gc.same_up_to_ties(swapped, ranked, emb, captions_first=False).all()
    other = csd(*img, *cap).argsort(dim=1, descending=True)[:, :3]  # a real disagreement: the farthest three
    assert not gc.same_up_to_ties(other, ranked, emb, captions_first=False).any()


def test_fp16_losses_are_judged_only_until_the_scaler_skips():
    gc = _script("gpu_check")
    w = {"a": torch.ones(2)}
    fp32 = {"losses": [2.0, 1.5, 1.2]}
    clean = {"losses": [2.01, 1.49, 1.21], "skipped": [0, 0, 0], "loss_scales": [65536.0] * 3, "weights": w}
    assert all(f["pass"] in (True, None) for f in gc.fp16_figures(clean, fp32))
    skip = {"losses": [2.01, 1.9, 1.2], "skipped": [1, 1, 1], "loss_scales": [32768.0] * 3, "weights": w}
    figs = gc.fp16_figures(skip, fp32)
    step = [f for f in figs if f["name"].startswith("step ")]
    assert [f["pass"] for f in step] == [True, None, None]  # step 2 after a skipped update: reported only
    bad = {"losses": [2.01, 9.0, 1.2], "skipped": [0, 0, 0], "loss_scales": [65536.0] * 3,
           "weights": {"a": torch.tensor([float("nan")])}}
    assert [f["pass"] for f in gc.fp16_figures(bad, fp32) if f["pass"] is not None].count(False) == 2


def test_a_sync_warning_names_the_line_that_made_the_call_not_the_counter():
    import warnings

    bt = _script("bench_train")
    from zsprob.utils.host_sync import HostSyncCounter

    def caller():
        return torch.tensor(torch.ones(1))  # torch warns from C++ about copy-constructing
    with bt.warnings_with_sites() as log, HostSyncCounter():
        caller()
    assert log and log[0].filename.endswith("host_sync.py")  # what torch's own record names
    assert log[0].site.split(":")[0].endswith("test_scripts_gpu_check.py") and "host_sync" not in log[0].site
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with bt.warnings_with_sites():
            pass
        warnings.warn("after")
    assert [str(w.message) for w in outer] == ["after"]  # the hook is gone once the block ends
