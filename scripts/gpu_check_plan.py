"""The time plan of scripts/gpu_check.py: each section's expected seconds by mode (the budget starts a
section only when its figure fits), the CPU quick run's measured cost, and ``--plan``'s table, so that a
lent session's one call is known to fit before it starts."""
from __future__ import annotations

import json
from pathlib import Path

#: seconds of each section by mode; a section starts only if its figure fits in what is left of the budget.
#: "cuda" (full sizes on one H200): guesses that add up to the 2026-11-28 calls (docs/benchmarks.md): all
#: eight sections 162 s; versions, bf16 and throughput 93 s; evaluation about 41 s. "cuda-quick": guesses.
#: "cpu-quick": wall seconds of a --device cpu --quick run on the project's 2-core CPU (measured, the
#: open_clip baseline and the fp16 stand-in included; CPU_QUICK_MEASURED has its CPU seconds).
ESTIMATE = {"versions": {"cuda": 5, "cuda-quick": 5, "cpu-quick": 3},
            "losses": {"cuda": 3, "cuda-quick": 2, "cpu-quick": 0.1},
            "forward": {"cuda": 8, "cuda-quick": 5, "cpu-quick": 0.5},
            "train_steps": {"cuda": 20, "cuda-quick": 10, "cpu-quick": 1.5},
            "bf16": {"cuda": 20, "cuda-quick": 10, "cpu-quick": 2.5},
            "throughput": {"cuda": 70, "cuda-quick": 40, "cpu-quick": 11},
            "evaluation": {"cuda": 45, "cuda-quick": 15, "cpu-quick": 0.5},
            "degrade": {"cuda": 5, "cuda-quick": 3, "cpu-quick": 0.1}}
#: (wall s, CPU s) of each section in one --device cpu --quick run, 2-core AMD EPYC, torch 2.14.1, 2026-11-28
CPU_QUICK_MEASURED = {"versions": (2.45, 2.43), "losses": (0.03, 0.03), "forward": (0.43, 0.43),
                      "train_steps": (1.29, 1.23), "bf16": (2.32, 2.26), "throughput": (10.22, 10.07),
                      "evaluation": (0.4, 0.39), "degrade": (0.03, 0.03)}
#: one lent session: 900 device-seconds; each call costs about 120 s besides the script (start, transfers,
#: wheel installs, idle: 2026-11-28, 3 calls in 750 device-seconds, 389 s of them in the script)
SESSION_S, CALL_OVERHEAD_S = 900, 120


def mode(args) -> str:
    return f"{args.device}-quick" if args.quick else ("cuda" if args.device == "cuda" else "cpu")


def estimate(name: str, args) -> float:
    """The seconds section ``name`` is expected to take in this mode (full CPU runs: not estimated, 0)."""
    return ESTIMATE[name].get(mode(args), 0)


SECTION_WORK = {
    "versions": lambda s: "versions of python, torch, CUDA, cuDNN, open_clip, ...; the device's name and memory",
    "losses": lambda s: f"PCME++, InfoNCE, ProLIP losses and CSD at N {s.loss_n}, D {s.loss_d}: device float32 vs "
                        "CPU float64, values and input gradients",
    "forward": lambda s: f"{s.model} forward of {s.fwd_batch} images + captions on the CPU and on the device",
    "train_steps": lambda s: f"3 pretrain steps (PCME++, {s.train_model}, batch {s.train_batch}, float32) on the CPU "
                             "and on the device",
    "bf16": lambda s: f"3 steps in bf16 and 3 in fp16 (GradScaler; on the CPU the fp16 stand-in), a bf16 "
                      f"{s.model} forward",
    "throughput": lambda s: f"SynthWorld {s.tp_num_pretrain} images at {s.tp_image_size} px; runs "
                            f"{', '.join(THROUGHPUT_RUNS)}: {s.tp_steps} steps (+5 probe steps for zsprob), batch "
                            f"{s.tp_batch}, {s.tp_precision}, {s.tp_workers} workers",
    "evaluation": lambda s: f"{s.eval_images} images + {5 * s.eval_images} captions encoded on the device, CSD "
                            f"top-{s.eval_k} on the device and the CPU, {s.eval_cpu_images} images on the CPU",
    "degrade": lambda s: "JPEG round trip of 8 (quick) or 64 images on the device vs libjpeg, one degrade_images call"}
THROUGHPUT_RUNS = ("zsprob infonce", "zsprob pcmepp", "open_clip_train infonce")


def previous_sections(path: Path | None) -> dict:
    if path is None:
        return {}
    return json.loads(path.read_text()).get("sections", {})


def plan_text(args, sizes, sections: list[str]) -> str:
    """What a run with these arguments would do, section by section, with its estimated seconds, the
    measured CPU cost of a --device cpu --quick run, and whether one lent session holds it."""
    from bench_train import open_clip_ready
    before = previous_sections(args.plan_from)
    only = set(args.only.split(",")) if args.only else None
    lines = [f"gpu_check plan: --device {args.device}{' --quick' if args.quick else ''}, budget {args.budget_s:g} s "
             "(no section starts past it)", "",
             f"| section | what runs | est. s ({mode(args)}) | CPU quick: wall s / CPU s (measured) "
             + (f"| {args.plan_from.name}: wall s / CPU s " if before else "") + "|",
             "| --- | --- | --- | --- |" + (" --- |" if before else "")]
    total = 0.0
    for name in sections:
        if only is not None and name not in only:
            continue
        need = estimate(name, args)
        fits = total + need <= args.budget_s
        total += need if fits else 0
        wall, cpu = CPU_QUICK_MEASURED.get(name, ("-", "-"))
        row = (f"| {name} | {SECTION_WORK[name](sizes)} | {need:g}{'' if fits else ' (skipped: budget)'} "
               f"| {wall} / {cpu} |")
        if before:
            rec = before.get(name, {})
            row += f" {rec.get('seconds', '-')} / {rec.get('cpu_seconds', '-')} ({rec.get('status', 'not run')}) |"
        lines.append(row)
    why = open_clip_ready(args.wds0286)
    lines += ["", f"open_clip_train baseline here: {'ready' if why is None else 'skipped: ' + why}"
              f" (--wds0286 {args.wds0286})",
              f"estimated script time: {total:.0f} s of the {args.budget_s:g} s budget"]
    if args.device == "cuda":
        call = total + CALL_OVERHEAD_S
        lines.append(f"one device call: about {call:.0f} s ({CALL_OVERHEAD_S} s start, transfers and installs); "
                     f"a {SESSION_S} s session holds {int(SESSION_S // call)} such call(s)"
                     + ("" if call <= SESSION_S else ": TOO LONG, lower --budget-s or use --only"))
    return "\n".join(lines)
