"""`zsprob demo`: the whole mission on SynthWorld, offline, on a CPU, with a report.

The demo is nothing but the real commands a user would type, chained and made resumable by
:mod:`zsprob.report.pipeline`:

1. ``zsprob data synthetic``                    generate SynthWorld (shards, classify, retrieval)
2. ``zsprob pretrain --method pcmepp``          the probabilistic model (configs/synthetic_tiny_sigma.yaml)
3. ``zsprob pretrain --method infonce``         the deterministic CLIP-style baseline
4. ``zsprob select-prompts --topk auto``        prompts chosen on classify/select, never on eval labels
5. ``zsprob zeroshot synthetic --prompts``      zero-shot with that selection
6. ``zsprob zeroshot synthetic --compare``      every prompt strategy, both models
7. ``zsprob eval synthetic``                    retrieval + uncertainty analyses, both models
8. with ``--all-methods``: ``zsprob pretrain``, ``zsprob eval synthetic`` and ``zsprob zeroshot
   synthetic --compare`` for the other objectives (PCME++ as officially trained, ProLIP, PCME,
   prob-triplet) on the same model, data, budget and seed, for the report's method table

then :func:`zsprob.report.demo_report.build_report` reads the JSON each command wrote and writes
``OUT/report.md`` (plots embedded) and ``OUT/report.json`` (the same figures).

SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 stop the demo cleanly: the running step gets the signal (a
pretraining writes a checkpoint), the demo waits for it, kills whatever is left of it and exits with
one line (``zsprob: pre-empted: demo stopped during step ...``), 143 (130 for SIGINT); the same
command resumes (see :mod:`zsprob.report.pipeline`).
"""
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
    """Sizes of one demo run. ``quick`` is for tests and CI (about 5 minutes on 2 cores)."""

    preset: str = "default"  # SynthWorld size preset of `zsprob data synthetic`
    steps: int = 900  # pretraining steps per model (115k samples: where zero-shot gets well above chance)
    batch_size: int = 128
    seed: int = 0
    workers: int = 1  # data loader workers during pretraining
    threads: int | None = None  # torch CPU threads (None: torch's default)
    all_methods: bool = False  # also train and evaluate DEMO_EXTRA_RUNS for the method table

    @classmethod
    def make(cls, quick: bool, **overrides) -> "DemoSettings":
        # quick: 38k samples per model, where retrieval is far above chance and PCME++ zero-shot
        # about twice chance (measured 4.7 min; fewer steps leave zero-shot at chance)
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
        ck = out / "runs" / m / "model"
        steps.append(Step(f"zeroshot-compare-{m}", f"Zero-shot: every prompt strategy ({m})",
                          ["zeroshot", "synthetic", "--checkpoint", str(ck), "--root", str(data),
                           "--select-root", str(data), "--compare", "--out", str(zs / m / "compare.json")],
                          outputs=[zs / m / "compare.json"]))
    for m in DEMO_MODELS:
        ck = out / "runs" / m / "model"
        rd = out / "retrieval" / m
        steps.append(Step(f"eval-{m}", f"Retrieval and uncertainty analyses ({m})",
                          ["eval", "synthetic", "--checkpoint", str(ck), "--root", str(data),
                           "--score", "csd" if m == "pcmepp" else "cosine", "--out", str(rd / "metrics.json")],
                          outputs=[rd / "metrics.json"]))
    if s.all_methods:  # after the main steps: turning it on for an existing OUT only adds steps
        for name, (recipe, method, extra) in DEMO_EXTRA_RUNS.items():
            md = out / "methods" / name
            steps.append(_pretrain_step(name, recipe, method, extra, data, md / "run", s))
            steps.append(Step(f"eval-{name}", f"Retrieval and uncertainty validity ({name})",
                              ["eval", "synthetic", "--checkpoint", str(md / "run" / "model"), "--root", str(data),
                               "--score", "csd", "--no-corruption", "--out", str(md / "retrieval" / "metrics.json")],
                              outputs=[md / "retrieval" / "metrics.json"]))
            steps.append(Step(f"zeroshot-compare-{name}", f"Zero-shot: every prompt strategy ({name})",
                              ["zeroshot", "synthetic", "--checkpoint", str(md / "run" / "model"), "--root", str(data),
                               "--select-root", str(data), "--compare", "--out", str(md / "compare.json")],
                              outputs=[md / "compare.json"]))
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
