"""``zsprob reproduce``: check a recipe's inputs, run its commands as resumable steps, and put the paper's figures
beside the measured ones (reproduce.json and reproduce.md).

The steps run through :func:`zsprob.report.pipeline.run_steps` (a finished step is skipped on a rerun). With
``smoke`` the same steps run on the real-format miniatures of :mod:`zsprob.reproduce.miniature` with a tiny
model and a few steps, and every output says it is a smoke run.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from zsprob.errors import UserError
from zsprob.models import catalogue
from zsprob.report.pipeline import Step, run_steps
from zsprob.reproduce.recipes import (DATA, OFFICIAL_ROW, PREPARE, PROLIP, RECIPES, TABLE1, TABLE6, TRAIN_ROW,
                                      data_path)
from zsprob.utils.paths import configs_dir

#: the smoke runs' stand-ins: the model, and the options that keep a training step small
SMOKE_MODEL = ["--model", catalogue.SMOKE_MODEL, "--pretrained", "null"]
SMOKE_TRAIN = ["--steps", "2", "--batch-size", "4", "--workers", "0", "--no-progress"]


@dataclass
class Context:
    recipe: str
    data: Path
    out: Path
    variant: str
    pretrained: str | None
    seeds: int
    smoke: bool


def get_recipe(name: str):
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)} (zsprob reproduce --list)")
    return RECIPES[name]


def check_inputs(ctx: Context) -> None:
    """One line naming the first missing or malformed input and the manual section that prepares it."""
    recipe = get_recipe(ctx.recipe)
    if recipe.unsupported:
        raise UserError(f"recipe {recipe.name} cannot run: {recipe.unsupported}")
    if recipe.variants and ctx.variant not in recipe.variants:
        raise UserError(f"recipe {recipe.name} has variants {', '.join(recipe.variants)}, not {ctx.variant!r}")
    if ctx.smoke:
        return
    if recipe.needs_pretrained and not ctx.pretrained:
        raise UserError(f"recipe {recipe.name} needs --pretrained (the published weights of {ctx.variant}; "
                        "README 'Published models' says where to get them)")
    if ctx.pretrained and not Path(ctx.pretrained).exists():
        raise UserError(f"--pretrained {ctx.pretrained} does not exist")
    for kind in recipe.data:
        path = data_path(ctx.data, kind)
        if not path.exists():
            raise UserError(f"recipe {recipe.name} needs {path} ({DATA[kind][1]}); prepare it as {PREPARE} say")
        if kind == "coco":
            _check_json(path)
        if kind == "redcaps" and not any(path.glob("*.tar")):
            raise UserError(f"{path} holds no .tar shards ({DATA[kind][1]}); prepare it as {PREPARE} say")


def _check_json(path: Path) -> None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path} is not a readable Karpathy JSON ({e}); prepare COCO as {PREPARE} say") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise UserError(f"{path} has no 'images' list: not the Karpathy dataset_coco.json ({PREPARE})")


# ----------------------------------------------------------------------------- the commands of each recipe

def _model(ctx: Context, name: str) -> list[str]:
    """The model options of an evaluation: the published weights, or the miniature's tiny checkpoint."""
    if ctx.smoke:
        return ["--checkpoint", str(ctx.data / "model")]
    return ["--model", name, "--pretrained", str(ctx.pretrained)]


def _eval_coco(ctx: Context, name: str, model: list[str], out: Path) -> Step:
    args = ["eval", "coco", *model, "--root", str(data_path(ctx.data, "coco").parent), "--workers", "0",
            "--out", str(out / "metrics.json")]
    return Step(name, f"evaluate on COCO ({name})", args, [out / "metrics.json"])


def _train_steps(ctx: Context) -> list[Step]:
    steps = []
    for seed in range(ctx.seeds):
        run = ctx.out / f"seed{seed}"
        args = ["finetune", "coco", "--config", str(configs_dir() / "finetune_coco_vitb32.yaml"),
                "--method", ctx.variant, "--root", str(data_path(ctx.data, "coco").parent), "--seed", str(seed),
                "--out", str(run / "run")]
        if ctx.smoke:
            args += [*SMOKE_MODEL, *SMOKE_TRAIN]
        elif ctx.pretrained:
            args += ["--pretrained", str(ctx.pretrained)]
        steps.append(Step(f"finetune-{seed}", f"fine-tune {ctx.variant}, seed {seed}", args,
                          [run / "run" / "model" / "zsprob.json"]))
        score = ["--score", "cosine"] if ctx.variant == "infonce" else []  # a deterministic model: cosine
        steps.append(_eval_coco(ctx, f"eval-{seed}", ["--checkpoint", str(run / "run" / "model"), *score], run))
    return steps


def _zeroshot(ctx: Context, model: list[str], extra: list[str]) -> Step:
    root = data_path(ctx.data, "imagenet").parent
    args = ["zeroshot", "imagenet", *model, "--root", str(root), "--select-root", str(root), "--compare",
            "--workers", "0", *extra, "--out", str(ctx.out / "zeroshot" / "compare.json")]
    if ctx.smoke:
        args += ["--templates", str(ctx.data / "templates.txt")]
    return Step("zeroshot", "ImageNet zero-shot, every strategy", args, [ctx.out / "zeroshot" / "compare.json"])


def build_steps(ctx: Context) -> list[Step]:
    name = ctx.recipe
    if name == "pcmepp-table1-eval":
        return [_eval_coco(ctx, "eval", _model(ctx, "pcmepp-coco-" + ctx.variant), ctx.out)]
    if name == "pcmepp-table1-clip-zs":
        return [_eval_coco(ctx, "eval", [*_model(ctx, ctx.variant), "--score", "cosine"], ctx.out)]
    if name == "pcmepp-table1-train":
        return _train_steps(ctx)
    if name == "pcmepp-table6":
        run = ctx.out / "pretrain"
        args = ["pretrain", "--config", str(configs_dir() / "pretrain_redcaps_vits16.yaml"), "--data", "redcaps",
                "--shards", str(data_path(ctx.data, "redcaps")), "--out", str(run)]
        args += [*SMOKE_MODEL, *SMOKE_TRAIN] if ctx.smoke else []
        return [Step("pretrain", "pretrain on RedCaps", args, [run / "model" / "zsprob.json"]),
                _zeroshot(ctx, ["--checkpoint", str(run / "model")], [])]
    if name == "prolip-zeroshot":
        return [_zeroshot(ctx, _model(ctx, ctx.variant), ["--shots-split", "eval", "--allow-eval-shots"])]
    raise UserError(f"recipe {name} has no steps")


# ----------------------------------------------------------------------------- paper beside measured

def _verdict(diff, paper, paper_se, measured_se) -> str:
    if diff is None:
        return "not measured on this data" if paper is not None else "no paper figure"
    if paper_se is None:
        return "no SE published"
    spread = 2.0 * math.sqrt(paper_se ** 2 + (measured_se or 0.0) ** 2)
    return "within the paper's spread" if abs(diff) <= spread else "outside the paper's spread"


def _line(label: str, paper, paper_se, measured: list[float], row: str) -> dict:
    """One figure: the paper's beside the mean and SE over the runs that measured it (None: not measured)."""
    from zsprob.zeroshot.probe import seed_summary

    runs = [v for v in measured if v is not None]
    over = seed_summary(runs) if runs else {"mean": None, "se": None}
    diff = None if over["mean"] is None or paper is None else over["mean"] - paper
    return {"row": row, "metric": label, "paper": paper, "paper_se": paper_se, "measured": over["mean"],
            "measured_se": over["se"], "n_runs": len(runs), "diff": diff,
            "verdict": _verdict(diff, paper, paper_se, over["se"])}


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def compare_figures(ctx: Context) -> list[dict]:
    """The paper's figures beside the measured ones, one line per (row, metric)."""
    name = ctx.recipe
    if name.startswith("pcmepp-table1"):
        if name == "pcmepp-table1-train":
            backbone, row = "ViT-B-32", TRAIN_ROW[ctx.variant]
            files = [ctx.out / f"seed{s}" / "metrics.json" for s in range(ctx.seeds)]
        else:
            backbone = ctx.variant
            row = OFFICIAL_ROW[backbone] if name.endswith("eval") else "CLIP ZS"
            files = [ctx.out / "metrics.json"]
        summaries = [_read(f).get("summary", {}) for f in files]
        return [_line(label, paper, se, [s.get(label) for s in summaries], f"{backbone} {row}")
                for label, (paper, se) in TABLE1[backbone][row].items()]
    rows = {r["name"]: r for r in _read(ctx.out / "zeroshot" / "compare.json")["rows"]}
    table = TABLE6 if name == "pcmepp-table6" else PROLIP
    out = []
    for what, (strategy, paper) in table.items():
        r = rows.get(strategy, {})
        top1 = None if r.get("skipped") else (r.get("metrics") or {}).get("top1")
        line = _line("ImageNet top-1", paper, None, [top1], f"{strategy}: {what}")
        line["uses_eval_labels"] = bool(r.get("uses_eval_labels") or r.get("reads_eval_labels"))
        out.append(line)
    if name == "pcmepp-table6" and "auto" in rows and not rows["auto"].get("skipped"):
        out.append(_line("ImageNet top-1", None, None, [rows["auto"]["metrics"]["top1"]],
                         "auto: K per class chosen on the held-out train/ images, not the evaluation labels"))
    return out


def _cell(v, nd=2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(doc: dict) -> str:
    smoke = " (SMOKE RUN: miniature data and a tiny model; the measured figures mean nothing)" if doc["smoke"] else ""
    lines = [f"# {doc['recipe']}: {doc['title']}{smoke}", "", f"Paper: {doc['source']}.", ""]
    if doc["recipe"].startswith("pcmepp-table1"):
        lines += ["On data other than the official COCO 5K test set, `zsprob eval coco` measures R@1 / RSUM of the "
                  "whole test split only (the ECCV / CxC / 1K columns need eccv_caption's official ids).", ""]
    lines += ["| row | metric | paper | paper SE | measured | measured SE | runs | diff | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["figures"]:
        lines.append(f"| {r['row']} | {r['metric']} | {_cell(r['paper'])} | {_cell(r['paper_se'], 1)} | "
                     f"{_cell(r['measured'])} | {_cell(r['measured_se'])} | {r['n_runs']} | {_cell(r['diff'])} | "
                     f"{r['verdict']} |")
    return "\n".join(lines) + "\n"


def reproduce(ctx: Context, echo=print) -> dict:
    """Check, run, compare; writes OUT/reproduce.json and OUT/reproduce.md and returns the document."""
    from zsprob import __version__
    from zsprob.utils.io import atomic_write_json, atomic_write_text

    check_inputs(ctx)
    recipe = get_recipe(ctx.recipe)
    if ctx.smoke:
        from zsprob.reproduce.miniature import make_miniatures

        ctx.data = make_miniatures(ctx.out / "miniature", recipe.data)
    steps = build_steps(ctx)
    timings = run_steps(ctx.out, steps, echo=echo, stream=False)
    doc = {"zsprob_version": __version__, "recipe": recipe.name, "title": recipe.title, "source": recipe.source,
           "variant": ctx.variant, "smoke": ctx.smoke, "data_root": str(ctx.data), "pretrained": ctx.pretrained,
           "seeds": ctx.seeds, "figures": compare_figures(ctx), "steps": timings}
    atomic_write_json(ctx.out / "reproduce.json", doc)
    atomic_write_text(ctx.out / "reproduce.md", markdown(doc))
    return doc
