"""scripts/compare_reports.py end to end: two demo-shaped report.json files, figure by figure."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "compare_reports.py"

REPORT = {
    "zsprob_version": "0.1.0", "created": "2026-11-26 10:00:00", "wall_seconds": 301.2,
    "settings": {"steps": 300, "quick": True}, "steps": {"pretrain pcmepp": 120.5}, "steps_seconds_total": 290.1,
    "resumed_steps": [],
    "training": {"pcmepp": {"steps": 300, "loss_start": -10.5, "loss_end": -25.25, "samples_per_s": 310.0,
                            "wall_s": 120.0}},
    "zeroshot": {"pcmepp": {"rows": [{"name": "all", "top1": 28.2}, {"name": "auto", "top1": 30.4}],
                            "files": {"json": "/tmp/demo/zeroshot/pcmepp/compare.json"}}},
    "retrieval": {"pcmepp": {"i2t": {"r@1": 33.666666666666664}, "rho": float("nan"),
                             "table": "/tmp/demo/retrieval/pcmepp/table.md"}},
    "checks": {"retrieval_pcmepp_above_chance": True},
    "check_evidence": {"retrieval_pcmepp_above_chance": "R@1 i2t 33.7% vs chance 0.33%; rule: > 3x chance"},
}


def _run(tmp_path, before, after, *args):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(before))
    b.write_text(json.dumps(after))
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), *args], capture_output=True, text=True,
                          timeout=60)


def test_timings_and_paths_are_left_out(tmp_path):
    after = copy.deepcopy(REPORT)
    after.update(created="2026-11-27 09:00:00", wall_seconds=999.0, steps={"pretrain pcmepp": 1.0},
                 steps_seconds_total=1.0, resumed_steps=["data"])
    after["training"]["pcmepp"].update(samples_per_s=1.0, wall_s=2.0)
    after["zeroshot"]["pcmepp"]["files"] = {"json": "/elsewhere/compare.json"}
    after["retrieval"]["pcmepp"]["table"] = "/elsewhere/table.md"
    r = _run(tmp_path, REPORT, after)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 not identical" in r.stdout and "DIFFERS" not in r.stdout


def test_a_figure_that_moved_is_printed_with_both_values_and_the_tolerance_decides(tmp_path):
    after = copy.deepcopy(REPORT)
    after["training"]["pcmepp"]["loss_end"] = -25.25 * (1 + 2e-4)
    after["check_evidence"]["retrieval_pcmepp_above_chance"] = "R@1 i2t 33.8% vs chance 0.33%; rule: > 3x chance"
    r = _run(tmp_path, REPORT, after)
    assert r.returncode == 1
    line = next(x for x in r.stdout.splitlines() if "training/pcmepp/loss_end" in x)
    assert line.startswith("DIFFERS") and "-25.25 -> -25.255" in line and "relative 0.0002" in line
    assert "training/pcmepp/steps" not in r.stdout  # a step count equal in both is a figure, not a timing
    evidence = next(x for x in r.stdout.splitlines() if "check_evidence/" in x)
    assert "relative 0.00296" in evidence  # 33.7 -> 33.8, the numbers inside the text
    assert _run(tmp_path, REPORT, after, "--rtol", "1e-4").returncode == 1
    relaxed = _run(tmp_path, REPORT, after, "--rtol", "3e-3")
    assert relaxed.returncode == 0 and "0 beyond rtol 0.003" in relaxed.stdout
    assert "within   training/pcmepp/loss_end" in relaxed.stdout


def test_changed_words_a_missing_figure_and_a_flipped_check_differ_at_any_tolerance(tmp_path):
    after = copy.deepcopy(REPORT)
    after["zeroshot"]["pcmepp"]["rows"][1]["name"] = "top-k"
    del after["retrieval"]["pcmepp"]["i2t"]["r@1"]
    after["checks"]["retrieval_pcmepp_above_chance"] = False
    r = _run(tmp_path, REPORT, after, "--rtol", "1")
    assert r.returncode == 1
    assert 'zeroshot/pcmepp/rows[auto]/top1: 30.4 -> (absent)' in r.stdout  # rows are matched by name
    assert 'zeroshot/pcmepp/rows[top-k]/name: (absent) -> "top-k"' in r.stdout
    assert "retrieval/pcmepp/i2t/r@1: 33.666666666666664 -> (absent)" in r.stdout
    assert "checks/retrieval_pcmepp_above_chance: true -> false" in r.stdout
    assert "retrieval/pcmepp/rho" not in r.stdout  # NaN equals NaN


def test_an_unreadable_report_is_one_line(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "broken.json"), str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not JSON" in r.stderr


def test_rows_are_matched_by_name_and_added_figures_can_be_allowed(tmp_path):
    """A report that gained a strategy row in the middle and a new field: the other rows still
    compare with their namesakes; --allow-added counts the new figures instead of failing on them."""
    after = copy.deepcopy(REPORT)
    after["zeroshot"]["pcmepp"]["rows"].insert(1, {"name": "carprt", "top1": 29.0})
    after["zeroshot"]["pcmepp"]["mde"] = 1.4
    r = _run(tmp_path, REPORT, after)
    assert r.returncode == 1 and "rows[carprt]/top1: (absent) -> 29.0" in r.stdout
    assert "rows[auto]" not in r.stdout
    allowed = _run(tmp_path, REPORT, after, "--allow-added")
    assert allowed.returncode == 0, allowed.stdout
    assert "0 not identical" in allowed.stdout and "3 only in the second report" in allowed.stdout
    after["zeroshot"]["pcmepp"]["rows"][0]["top1"] = 28.3  # a changed figure still differs
    assert _run(tmp_path, REPORT, after, "--allow-added").returncode == 1
