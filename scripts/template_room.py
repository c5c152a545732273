#!/usr/bin/env python
"""How much room a text tower leaves for prompt selection on SynthWorld, and every strategy against all 80.

For each text tower (``bow``: the demo's bag of words; ``mlp`` / ``transformer``: the word mixers of
``zsprob.models.word_mixer``, recipe ``configs/synthetic_tiny_sigma_interact.yaml``) and seed, the demo's
PCME++ recipe (``configs/synthetic_tiny_sigma.yaml``) is pretrained at the demo's quick budget (300 steps x
batch 128, one thread) on the world's pretraining shards; then, on ``classify/eval``:

* the room: top-1 of every single template (80 classifiers), their SD, and the share of (image,
  template) pairs whose single-template prediction equals the all-80 prediction;
* all-80 top-1 with its binomial SE, and the tower's all-80 hits paired against the bag's (same images,
  same seed);
* every ``--compare`` strategy (``zsprob.zeroshot.classify.compare_on_features``, the library call behind
  ``zsprob zeroshot --compare``): its paired difference vs all 80 (paired bootstrap ci95, exact McNemar),
  per seed and pooled over seeds (the per-image hits of the seeds concatenated), with the MDE.

Nothing is chosen on the evaluation split: the towers, recipe and budget are fixed beforehand, prompts are
chosen by each strategy's own rule (its labels, if any, from ``classify/select``). The evaluation labels
serve the measurements only. Writes ``OUT/room.json`` and ``OUT/room.md`` (and per-model ``compare.json``).

Commands (docs/zeroshot.md, "A world where the template can matter"):

    zsprob data synthetic --out sw --preset quick --num-classify-eval 100 --seed 0
    nice python scripts/template_room.py --world sw --runs runs_room --out room \
        --towers bow,mlp,transformer --seeds 0,1,2 --train
    # measure only what is trained (a missing run is listed as missing):
    nice python scripts/template_room.py --world sw --runs runs_room --out room --towers bow,mlp --seeds 0,1
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = {"bow": ("synthetic_tiny_sigma.yaml", []),
          "mlp": ("synthetic_tiny_sigma_interact.yaml", []),
          "transformer": ("synthetic_tiny_sigma_interact.yaml",
                          ["--set", "model.overrides.open_clip_cfg.text_cfg.mixer=transformer"]),
          "bigram": ("synthetic_tiny_sigma_interact.yaml",
                     ["--set", "model.overrides.open_clip_cfg.text_cfg.mixer=bigram"])}


def run_dir(runs: Path, tower: str, seed: int) -> Path:
    return runs / f"{tower}_s{seed}"


def train(world: Path, runs: Path, tower: str, seed: int, steps: int, batch: int) -> float | None:
    """Pretrain one model with the CLI (skipped when it exists); returns the seconds it took."""
    out = run_dir(runs, tower, seed)
    if (out / "model" / "zsprob.json").is_file():
        return None
    recipe, extra = RECIPE[tower]
    cmd = ["nice", sys.executable, "-m", "zsprob", "pretrain", "--config", str(ROOT / "configs" / recipe),
           "--data", "synthetic", "--shards", str(world / "pretrain"), "--method", "pcmepp", "--out", str(out),
           "--steps", str(steps), "--batch-size", str(batch), "--seed", str(seed), "--workers", "0",
           "--threads", "1", *extra]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.time() - t0


def room(bank, feats, all_selection) -> dict:
    """Single-template top-1 (80 classifiers), their spread, agreement with the all-80 prediction, and the
    mean cosine between two classes' all-80 text vectors (how far apart the tower keeps the class prompts)."""
    import torch
    import torch.nn.functional as F

    from zsprob.zeroshot.metrics import class_scores

    x = F.normalize(feats.mu.float(), dim=-1)
    per_template = torch.einsum("nd,ctd->ntc", x, bank.mu_normed.float()).argmax(2)        # [N, T]
    all80 = class_scores(feats.mu, None, all_selection, "cosine").argmax(1)                  # [N]
    labels = torch.as_tensor(feats.labels).long()
    top1 = 100.0 * (per_template == labels[:, None]).double().mean(0)                        # [T]
    cls = F.normalize(bank.mu_normed.float().mean(1), dim=-1)                              # [C, D] all-80
    cos = cls @ cls.T
    c = cos.shape[0]
    return {"class_cosine": float((cos.sum() - cos.diagonal().sum()) / (c * (c - 1))),  # label-free spread
            "single_top1": {t: float(v) for t, v in zip(bank.templates, top1)},
            "min": float(top1.min()), "max": float(top1.max()), "mean": float(top1.mean()),
            "sd": float(top1.std(unbiased=True)),
            "agreement": float((per_template == all80[:, None]).double().mean())}


def measure(world: Path, run: Path, out: Path) -> tuple[dict, dict]:
    """(summary, per-strategy hits) of one trained model."""
    from zsprob.models import load_for_inference
    from zsprob.zeroshot.calibration import model_logit_scales
    from zsprob.zeroshot.classify import compare_on_features, prepare
    from zsprob.zeroshot.metrics import top1_hits

    model = load_for_inference(run / "model")
    bank, ev, se, mid = prepare(model, root=world, dataset="synthetic", cache_dir=out / "cache", progress=False)
    res = compare_on_features(bank, ev, se, out_dir=out, model={"id": mid, "checkpoint": str(run / "model")},
                              write_selections=False, logit_scales=model_logit_scales(model))
    hits = {name: top1_hits(sel, ev, "cosine").numpy() for name, sel in res["selections"].items()}
    rows = [{k: r.get(k) for k in ("name", "label", "reads_eval_labels", "transductive", "label_split", "skipped")}
            | ({"top1": r["metrics"]["top1"], "paired_vs_all": r["paired_vs_all"]} if not r.get("skipped") else {})
            for r in res["rows"]]
    all80 = next(r["top1"] for r in rows if r["name"] == "all")
    n = len(ev)
    # all-80 on the labelled selection split: what a choice between towers may look at (never the evaluation split)
    select_all80 = None if se is None else \
        100.0 * float(top1_hits(res["selections"]["all"], se, "cosine").double().mean())
    return {"n_eval": n, "n_select": None if se is None else len(se), "select_all80_top1": select_all80,
            "room": room(bank, ev, res["selections"]["all"]),
            "all80_top1": all80, "all80_se": math.sqrt(all80 * (100.0 - all80) / n), "rows": rows,
            "min_detectable_effect": res["min_detectable_effect"]}, hits


def label_free(row: dict) -> bool:
    """No labels of any split, no unlabelled evaluation images."""
    return not row.get("reads_eval_labels") and not row.get("transductive") and row.get("label_split") is None


def pooled(per_seed_hits: list[dict], name: str, reference: list) -> dict | None:
    import numpy as np

    from zsprob.zeroshot.paired import paired_stats

    if any(name not in h for h in per_seed_hits):
        return None
    return paired_stats(np.concatenate([h[name] for h in per_seed_hits]), np.concatenate(reference))


def _mean_se(values: list[float]) -> dict:
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")
    return {"mean": m, "se": sd / math.sqrt(len(values)), "values": values}


def summarise(tower: str, models: dict, hits: dict, bow_hits: dict) -> dict:
    """One tower over its seeds: room, all-80 (and vs the bag's all-80), every strategy pooled and per seed."""
    seeds = sorted(models)
    per = [models[s] for s in seeds]
    out = {"seeds": seeds, "room_sd": _mean_se([m["room"]["sd"] for m in per]),
           "agreement": _mean_se([m["room"]["agreement"] for m in per]),
           "class_cosine": _mean_se([m["room"]["class_cosine"] for m in per]),
           "single_min": min(m["room"]["min"] for m in per), "single_max": max(m["room"]["max"] for m in per),
           "all80_top1": _mean_se([m["all80_top1"] for m in per]),
           "select_all80_top1": [m.get("select_all80_top1") for m in per],
           "all80_binomial_se": [m["all80_se"] for m in per]}
    common = [s for s in seeds if s in bow_hits]
    if tower != "bow" and common:
        out["all80_vs_bow"] = pooled([{"all": hits[s]["all"]} for s in common], "all",
                                     [bow_hits[s]["all"] for s in common]) | {"seeds": common}
    strategies = {}
    for row in per[0]["rows"]:
        name = row["name"]
        entry = {k: row.get(k) for k in ("label", "reads_eval_labels", "transductive", "label_split")}
        entry["label_free_non_transductive"] = label_free(row)
        entry["per_seed"] = {s: ({"top1": r["top1"], **{k: r["paired_vs_all"][k] for k in
                                                         ("diff", "ci95", "mcnemar_p", "mde")}}
                                 if "paired_vs_all" in r else {"skipped": r.get("skipped")})
                             for s in seeds for r in models[s]["rows"] if r["name"] == name}
        p = pooled([hits[s] for s in seeds], name, [hits[s]["all"] for s in seeds])
        entry["pooled"] = None if p is None else {k: p[k] for k in ("diff", "ci95", "mcnemar_p", "mde", "n")}
        strategies[name] = entry
    out["strategies"] = strategies
    free = [(e["pooled"]["diff"], n) for n, e in strategies.items()
            if e["label_free_non_transductive"] and e["pooled"] and n != "all"]
    out["best_label_free"] = max(free) if free else None
    if tower != "bow" and common:  # what a user choosing a tower asks: this tower's prompt rows against the bag's all-80
        out["label_free_vs_bow_all80"] = {
            n: {k: p[k] for k in ("diff", "ci95", "mcnemar_p", "mde", "n")}
            for n, e in strategies.items() if e["label_free_non_transductive"] or n == "all"
            for p in [pooled([hits[s] for s in common], n, [bow_hits[s]["all"] for s in common])] if p is not None}
    out["label_free_ci_excludes_0"] = [n for n, e in strategies.items() if e["label_free_non_transductive"]
                                       and e["pooled"] and n != "all" and (e["pooled"]["ci95"][0] > 0
                                                                           or e["pooled"]["ci95"][1] < 0)]
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ci(c) -> str:
    return f"[{c[0]:+.2f}, {c[1]:+.2f}]"


def markdown(result: dict) -> str:
    lines = ["| tower | seeds | single-template top-1 SD | agreement with all-80 | single min-max | all-80 top-1 "
             "(mean ± SE over seeds) | all-80 vs bag, pooled [95% CI] | best label-free non-transductive - all-80 "
             "| class-prompt cosine |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tower, s in result["towers"].items():
        vs = s.get("all80_vs_bow")
        vs = f"{vs['diff']:+.2f} {_ci(vs['ci95'])}, p={vs['mcnemar_p']:.3f}" if vs else "-"
        best = f"{s['best_label_free'][0]:+.2f} ({s['best_label_free'][1]})" if s["best_label_free"] else "-"
        lines.append(f"| {tower} | {','.join(map(str, s['seeds']))} | {s['room_sd']['mean']:.2f} | "
                     f"{100 * s['agreement']['mean']:.1f}% | {s['single_min']:.1f}-{s['single_max']:.1f} | "
                     f"{s['all80_top1']['mean']:.2f} ± {s['all80_top1']['se']:.2f} | {vs} | {best} | "
                     f"{s['class_cosine']['mean']:.3f} |")
    for tower, s in result["towers"].items():
        lines += ["", f"**{tower}**: every strategy minus all-80, pooled over seeds {s['seeds']} "
                      f"(N = {next(iter(s['strategies'].values()))['pooled']['n']}) and per seed", "",
                  "| strategy | label-free, non-transductive | pooled diff [95% CI] | McNemar p | MDE "
                  "| per seed: diff [95% CI] |",
                  "|---|---|---|---|---|---|"]
        for name, e in s["strategies"].items():
            if name == "all" or e["pooled"] is None:
                continue
            p = e["pooled"]
            seeds = "; ".join(f"{v['diff']:+.1f} {_ci(v['ci95'])}" if "diff" in v else "skipped"
                              for v in e["per_seed"].values())
            lines.append(f"| {name} | {'yes' if e['label_free_non_transductive'] else 'no'} | "
                         f"{p['diff']:+.2f} {_ci(p['ci95'])} | {p['mcnemar_p']:.3f} | {p['mde']:.2f} | {seeds} |")
    for tower, s in result["towers"].items():
        vs = s.get("label_free_vs_bow_all80")
        if not vs:
            continue
        lines += ["", f"**{tower}**: its label-free, non-transductive rows minus the bag's all-80, pooled over the "
                      f"seeds both have (N = {next(iter(vs.values()))['n']})", "",
                  "| strategy | diff [95% CI] | McNemar p |", "|---|---|---|"]
        lines += [f"| {name} | {p['diff']:+.2f} {_ci(p['ci95'])} | {p['mcnemar_p']:.3f} |" for name, p in vs.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", required=True, type=Path, help="a `zsprob data synthetic` output")
    ap.add_argument("--runs", required=True, type=Path, help="run directories TOWER_sSEED")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--towers", default="bow,mlp")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--train", action="store_true", help="pretrain the missing runs first")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    towers, seeds = a.towers.split(","), [int(s) for s in a.seeds.split(",")]
    unknown = set(towers) - set(RECIPE)
    if unknown:
        ap.error(f"unknown towers {sorted(unknown)}; choose from {', '.join(RECIPE)}")
    timings = {}
    if a.train:
        for seed in seeds:
            for tower in towers:
                timings[f"{tower}_s{seed}"] = train(a.world, a.runs, tower, seed, a.steps, a.batch_size)
    models, hits, missing = {}, {}, []
    for tower in towers:
        for seed in seeds:
            run = run_dir(a.runs, tower, seed)
            if not (run / "model" / "zsprob.json").is_file():
                missing.append(run.name)
                continue
            summary, h = measure(a.world, run, a.out / run.name)
            models.setdefault(tower, {})[seed], hits.setdefault(tower, {})[seed] = summary, h
            print(f"{run.name}: all-80 {summary['all80_top1']:.2f} (selection split {_fmt(summary['select_all80_top1'])}), "
                  f"room SD {summary['room']['sd']:.2f}, agreement {100 * summary['room']['agreement']:.1f}%",
                  flush=True)
    result = {"world": str(a.world), "runs": str(a.runs), "steps": a.steps, "batch_size": a.batch_size,
              "missing": missing, "train_seconds": timings, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "towers": {t: summarise(t, models[t], hits[t], hits.get("bow", {})) for t in towers if t in models},
              "per_model": {f"{t}_s{s}": m for t in models for s, m in models[t].items()}}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "room.json").write_text(json.dumps(result, indent=1, default=str))
    (a.out / "room.md").write_text(markdown(result))
    print(markdown(result))
    if missing:
        print(f"missing runs: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
