"""`zsprob demo`: the whole mission on SynthWorld, offline, on a CPU, with a report.

The demo is the real commands a user would type (:func:`plan`: generate SynthWorld, pretrain PCME++ and an
InfoNCE baseline, select prompts, classify zero-shot, evaluate retrieval; ``--all-methods``: the other
objectives too), chained and made resumable by :mod:`zsprob.report.pipeline`; then
:func:`zsprob.report.demo_report.build_report` writes OUT/report.md and OUT/report.json."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from zsprob.errors import UserError
from zsprob.report.demo_runs import DEMO_EXTRA_RUNS, DEMO_MODELS, RECIPES
from zsprob.report.pipeline import Step, StopGuard, run_steps
from zsprob.utils.paths import RUN_MARKERS, configs_dir


@dataclass
class DemoSettings:
    """Sizes of one demo run; ``quick`` is the small one of tests and CI."""

    preset: str = "default"  # SynthWorld size preset of `zsprob data synthetic`
    steps: int = 900  # pretraining steps per model
    batch_size: int = 128
    seed: int = 0
    workers: int = 1  # data loader workers during pretraining
    threads: int | None = None  # torch CPU threads (None: torch's default)
    all_methods: bool = False  # also train and evaluate DEMO_EXTRA_RUNS for the method table

    @classmethod
    def make(cls, quick: bool, **overrides) -> "DemoSettings":
        # quick: the fewest steps at which PCME++ zero-shot leaves chance (docs/demo.md, the budgets)
        base = cls(preset="quick", steps=300, batch_size=128) if quick else cls()
        for k, v in overrides.items():
            if v is not None:
                setattr(base, k, v)
        return base


def _pretrain_step(name: str, recipe: str, method: str, extra: list[str], data: Path, run_dir: Path,
                   s: DemoSettings) -> Step:
    args = ["pretrain", "--config", str(configs_dir() / recipe), "--data", "synthetic",
            "--shards", str(data / "pretrain"), "--method", method, "--out", str(run_dir),
            "--steps", str(s.steps), "--batch-size", str(s.batch_size), "--seed", str(s.seed),
            "--workers", str(s.workers)] + list(extra)
    if s.threads:
        args += ["--threads", str(s.threads)]
    return Step(f"pretrain-{name}", f"Pretrain {name} ({s.steps} steps x {s.batch_size})", args,
                outputs=[run_dir / "model" / "zsprob.json", run_dir / "metrics.jsonl"],
                # interrupted: continue ("auto": one killed before its first checkpoint starts afresh);
                # finished with other arguments, or after an upstream step re-ran: replace the old run
                resume_args=["--resume", "auto"], fresh_args=["--overwrite"], started_marker=run_dir / "config.yaml")


def _compare_step(name: str, checkpoint: Path, data: Path, out_json: Path) -> Step:
    return Step(f"zeroshot-compare-{name}", f"Zero-shot: every prompt strategy ({name})",
                ["zeroshot", "synthetic", "--checkpoint", str(checkpoint), "--root", str(data),
                 "--select-root", str(data), "--compare", "--out", str(out_json)], outputs=[out_json])


def _eval_step(name: str, title: str, checkpoint: Path, data: Path, score: str, out_json: Path, extra=()) -> Step:
    return Step(f"eval-{name}", f"{title} ({name})",
                ["eval", "synthetic", "--checkpoint", str(checkpoint), "--root", str(data), "--score", score,
                 *extra, "--out", str(out_json)], outputs=[out_json])


def plan(out: Path, s: DemoSettings) -> list[Step]:
    """The demo's steps, as the commands a user would run by hand."""
    out = Path(out)
    data = out / "data"
    steps = [Step("data", "Generate SynthWorld",
                  ["data", "synthetic", "--out", str(data), "--preset", s.preset, "--seed", str(s.seed),
                   "--workers", "2", "--preview"],
                  outputs=[data / "manifest.json", data / "preview.png"])]
    for m in DEMO_MODELS:
        steps.append(_pretrain_step(m, RECIPES[m], m, [], data, out / "runs" / m, s))
    pcme = out / "runs" / "pcmepp" / "model"
    zs = out / "zeroshot"
    steps.append(Step("select-prompts", "Select prompts by text uncertainty (--topk auto, selection split only)",
                      ["select-prompts", "--checkpoint", str(pcme), "--dataset", "synthetic", "--root", str(data),
                       "--select-root", str(data), "--topk", "auto", "--out", str(zs / "selection.json")],
                      outputs=[zs / "selection.json"]))
    steps.append(Step("zeroshot-selected", "Zero-shot classification with the selected prompts",
                      ["zeroshot", "synthetic", "--checkpoint", str(pcme), "--root", str(data),
                       "--prompts", str(zs / "selection.json"), "--out", str(zs / "selected.json")],
                      outputs=[zs / "selected.json"]))
    for m in DEMO_MODELS:
        steps.append(_compare_step(m, out / "runs" / m / "model", data, zs / m / "compare.json"))
    for m in DEMO_MODELS:
        steps.append(_eval_step(m, "Retrieval and uncertainty analyses", out / "runs" / m / "model", data,
                                "csd" if m == "pcmepp" else "cosine", out / "retrieval" / m / "metrics.json"))
    if s.all_methods:  # after the main steps: turning it on for an existing OUT only adds steps
        for name, (recipe, method, extra) in DEMO_EXTRA_RUNS.items():
            md = out / "methods" / name
            steps.append(_pretrain_step(name, recipe, method, extra, data, md / "run", s))
            steps.append(_eval_step(name, "Retrieval and uncertainty validity", md / "run" / "model", data, "csd",
                                    md / "retrieval" / "metrics.json", extra=["--no-corruption"]))
            steps.append(_compare_step(name, md / "run" / "model", data, md / "compare.json"))
    return steps


def refuse_other_runs(out: Path) -> None:
    """One line when ``out`` holds a training run rather than a demo (its steps would be written among the
    run's files); a demo's own directory (``.steps/``) resumes."""
    found = [name for name in RUN_MARKERS if (out / name).exists()]
    if found and not (out / ".steps").is_dir():
        raise UserError(f"--out {out} holds a training run ({', '.join(found)}), not a demo; choose another --out")


def run_demo(out: str | Path = "demo_out", quick: bool = False, echo: Callable[[str], None] = print,
             **overrides) -> dict:
    """Run (or resume) the demo into ``out``; return the report's figures (report.json)."""
    from zsprob.report.demo_report import build_report

    out = Path(out)
    refuse_other_runs(out)
    out.mkdir(parents=True, exist_ok=True)
    s = DemoSettings.make(quick, **overrides)
    t0 = time.time()
    echo(f"zsprob demo -> {out} ({'quick' if quick else 'full'}: SynthWorld preset {s.preset}, "
         f"{s.steps} pretraining steps x {s.batch_size} per model)")
    with StopGuard() as guard:  # a stop signal: passed on to the running step, then one line (Preempted)
        timings = run_steps(out, plan(out, s), echo=echo)
        echo("Writing the report")
        report = build_report(out, settings=asdict(s) | {"quick": quick, "recipes": dict(RECIPES)},
                              timings=timings, wall_seconds=time.time() - t0)
        guard.check("while writing the report")
    echo(f"report: {out / 'report.md'}  (its numbers as JSON: {out / 'report.json'})")
    return report
