"""scripts/gpu_check.py, the one prepared GPU check: its CPU quick run (as CI runs it, so the script
cannot rot) writes every section with status ok or skipped-with-reason, every equality flag true,
every figure with a unit, the fp16 steps through the CPU stand-in, open_clip_train's baseline for real
(required in CI), and the Markdown table; a run killed part way, or a failing baseline, keeps every figure
measured before; ``--plan`` runs nothing and prints every section with its estimates; ``--device cuda``
without a GPU is one line, exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
SECTIONS = ("versions", "losses", "forward", "train_steps", "bf16", "throughput", "evaluation", "degrade")
EQUALITY = ("losses", "forward", "train_steps", "bf16", "evaluation", "degrade")
BASELINE = "open_clip_train infonce"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])}


def _run(*args, timeout=900, extra_env=None):
    env = {**_env(), **(extra_env or {})}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One CPU quick run, as CI runs it (open_clip_train's webdataset 0.2.86 from $ZSPROB_WDS0286)."""
    out = tmp_path_factory.mktemp("gc")
    # a large budget: on a loaded CI machine a section must not be skipped for time
    r = _run("--device", "cpu", "--quick", "--out", out, "--budget-s", 3000)
    return r, out


@pytest.mark.slow
def test_cpu_quick_run_writes_every_section_ok_and_equal(quick_run):
    r, out = quick_run
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
    assert r.returncode == 0, r.stderr[-3000:]
    for name in EQUALITY:
        rec = sections[name]
        flags = [f["pass"] for f in rec["figures"] if f["pass"] is not None]
        assert flags and all(flags) and rec["equal"] is True, (name, [f for f in rec["figures"] if f["pass"] is False])
    # what each section must have measured
    losses = {f["name"].split()[0] for f in sections["losses"]["figures"]}
    assert {"PCMEPPLoss", "InfoNCELoss", "ProLIPLoss", "CSD"} <= losses
    steps = [f for f in sections["train_steps"]["figures"] if f["name"].startswith("step ")]
    assert len(steps) == 3
    # the CUDA-only fp16 steps, rehearsed: a scaler ran on the CPU and step 1 was judged against fp32
    fp16 = {f["name"]: f for f in sections["bf16"]["figures"] if "fp16 stand-in" in f["name"]}
    assert fp16["fp16 stand-in: a GradScaler ran (loss scale logged every step)"]["pass"] is True, fp16
    assert [f["pass"] for n, f in fp16.items() if n.startswith("step 1 ")] == [True], fp16
    runs = sections["throughput"]["runs"]
    for name in ("zsprob infonce", "zsprob pcmepp"):
        assert runs[name]["status"] == "ok" and runs[name]["median_sps"] > 0, runs[name]
        assert runs[name]["flops_per_step"] > 0 and runs[name]["opt_step_ms"] > 0, runs[name]
        assert "host_syncs_per_step" in runs[name], runs[name]
    whats = {s["what"] for s in sections["throughput"]["skipped"]}
    assert "MFU" in whats and any("sync_debug_mode" in w for w in whats)  # CUDA-only parts, with reasons
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# zsprob GPU check: CPU") and "| losses | ok |" in md and "samples/s" in md


@pytest.mark.slow
def test_open_clip_trainers_baseline_ran_for_real_on_the_cpu(quick_run):
    """CI installs the baseline's needs (the ``bench`` extra, webdataset 0.2.86 in $ZSPROB_WDS0286) and
    must run it; elsewhere a missing install is a skip that says what to install."""
    _, out = quick_run
    tp = json.loads((out / "gpu_check.json").read_text())["sections"]["throughput"]
    if BASELINE not in tp["runs"]:
        why = next(s["reason"] for s in tp["skipped"] if s["what"] == "open_clip_train")
        assert not os.environ.get("CI"), f"open_clip_train's baseline was skipped in CI: {why}"
        pytest.skip(f"open_clip_train's baseline not installed here ({why}): pip install -e '.[bench]' and "
                    "pip install --no-deps --target DIR webdataset==0.2.86, ZSPROB_WDS0286=DIR")
    oc = tp["runs"][BASELINE]
    assert oc["status"] == "ok" and oc["median_sps"] > 0 and oc["steps_measured"] >= 1, oc
    names = [f["name"] for f in tp["figures"]]
    assert "zsprob infonce / open_clip_train" in names and "zsprob pcmepp / open_clip_train" in names


def _script(name: str):
    import importlib
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.slow
def test_a_failing_baseline_is_recorded_beside_every_other_figure(tmp_path, monkeypatch):
    gc, bt = _script("gpu_check"), _script("bench_train")

    def planted(*args, **kwargs):
        raise RuntimeError("open_clip run failed (exit 1): planted")
    monkeypatch.setattr(bt, "open_clip_ready", lambda wds0286: None)
    monkeypatch.setattr(bt, "run_open_clip", planted)
    threads = torch.get_num_threads()
    try:
        rc = gc.main(["--device", "cpu", "--quick", "--only", "losses,throughput", "--out", str(tmp_path),
                      "--budget-s", "3000"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 1  # a failed run fails the check, after its report is written
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["losses"]["status"] == "ok" and sections["losses"]["equal"] is True
    tp = sections["throughput"]
    assert tp["status"] == "error" and "planted" in tp["error"]
    assert tp["runs"][BASELINE] == {"status": "error", "error": "RuntimeError: open_clip run failed (exit 1): planted"}
    names = [f["name"] for f in tp["figures"]]
    for run in ("zsprob infonce", "zsprob pcmepp"):
        assert tp["runs"][run]["status"] == "ok" and tp["runs"][run]["median_sps"] > 0, tp["runs"][run]
        assert "host_syncs_per_step" in tp["runs"][run]
        for what in ("median samples/s", "optimizer step", "host syncs per steady step (HostSyncCounter)",
                     "model FLOPs per step"):
            assert f"{run}: {what}" in names, (run, what, names)
    assert f"{BASELINE}: failed" in names
    assert "| throughput | error |" in (tmp_path / "gpu_check.md").read_text()


HANGING_RUN = """
import sys, time
sys.path.insert(0, sys.argv[1])
import gpu_check as gc

def section_hang(c):
    c.figures().append(gc.figure("measured before the stop", 1.5, "s"))
    print("HANGING", flush=True)
    time.sleep(300)

gc.SECTIONS.append(("hang", section_hang))
gc.ESTIMATE["hang"] = {"cpu-quick": 0}
sys.exit(gc.main(sys.argv[2:]))
"""


def _assert_kept(out: Path, hang_status: str) -> None:
    doc = json.loads((out / "gpu_check.json").read_text())
    losses, hang = doc["sections"]["losses"], doc["sections"]["hang"]
    assert losses["status"] == "ok" and losses["equal"] is True and len(losses["figures"]) == 8
    assert [f["name"] for f in hang["figures"]] == ["measured before the stop"] and hang["status"] == hang_status
    assert "measured before the stop" in (out / "gpu_check.md").read_text()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_run_killed_part_way_keeps_every_figure_measured_so_far(tmp_path):
    """SIGKILL (an out-of-memory kill, a hard time limit) in a section's middle: the report on disk parses
    and holds the finished section and the figure the section in flight had made."""
    env = {**_env(), "TMPDIR": str(tmp_path / "tmp")}  # the killed run cannot remove its temporary folder
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HANGING_RUN, str(SCRIPT.parent), "--device", "cpu", "--quick",
                             "--only", "losses,hang", "--out", str(tmp_path / "gc")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("HANGING"):
                break
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate()
    _assert_kept(tmp_path / "gc", "running")


def test_sigterm_in_a_section_records_it_interrupted_and_exits_143(tmp_path, monkeypatch):
    gc = _script("gpu_check")

    def section_stop(c):
        c.figures().append(gc.figure("measured before the stop", 1.5, "s"))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises SystemExit(143) here
        raise AssertionError("not reached")
    monkeypatch.setattr(gc, "SECTIONS", [*gc.SECTIONS, ("hang", section_stop)])
    monkeypatch.setitem(gc.ESTIMATE, "hang", {"cpu-quick": 0})
    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            gc.main(["--device", "cpu", "--quick", "--only", "losses,hang", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) is handler  # put back
    _assert_kept(tmp_path, "interrupted")


def test_plan_prints_every_section_and_run_with_estimates_and_runs_nothing(tmp_path, capsys):
    gc = _script("gpu_check")
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"sections": {"losses": {"status": "ok", "seconds": 4.25, "cpu_seconds": 3.5}}}))
    assert gc.main(["--plan", "--device", "cuda", "--out", str(tmp_path / "gc"), "--plan-from", str(earlier)]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "gc").exists()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert set(SECTIONS) <= set(rows)
    assert all(str(gc.ESTIMATE[name]["cuda"]) in rows[name].split("|")[3] for name in SECTIONS)
    assert "4.25 / 3.5 (ok)" in rows["losses"] and "not run" in rows["degrade"]
    assert "ViT-B-16" in rows["forward"] and "batch 256" in rows["throughput"]
    assert all(run in rows["throughput"] for run in gc.THROUGHPUT_RUNS)
    total = sum(gc.ESTIMATE[name]["cuda"] for name in SECTIONS)
    assert f"estimated script time: {total:.0f} s" in text and "session holds" in text
    gc.main(["--plan", "--device", "cuda", "--budget-s", "30", "--only", "versions,throughput"])
    text = capsys.readouterr().out
    assert "(skipped: budget)" in text and "| losses |" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    r = _run("--device", "cuda", "--out", tmp_path / "gc", timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check.py: error:") and "CUDA" in lines[0], r.stderr
    assert not (tmp_path / "gc").exists()


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
