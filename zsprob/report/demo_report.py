"""The demo report: OUT/report.md (plots embedded) and OUT/report.json (the same figures).

It reads what the demo's commands wrote (training metrics and summaries, zero-shot and retrieval
JSON and their PNGs), draws the training curves and recomputes nothing; its checks come from
:mod:`zsprob.report.demo_checks`.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from zsprob import __version__
from zsprob.report.demo_checks import dig, run_checks
from zsprob.report.demo_runs import DEMO_EXTRA_RUNS, RECIPES
from zsprob.report.plots import training_curves
from zsprob.utils.io import atomic_write_json, atomic_write_text, read_jsonl

METHOD_LABEL = {"pcmepp": "PCME++", "infonce": "InfoNCE"}
#: row names of the method table (``--all-methods``)
TABLE_LABEL = {"infonce": "InfoNCE", "pcmepp": "PCME++, the demo's recipe",
               "pcmepp-official": "PCME++, official objective", "prolip": "ProLIP", "pcme": "PCME",
               "prob-triplet": "prob-triplet (Pishdad et al.)"}


def _load(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _rel(out: Path, p: str | Path | None) -> str | None:
    """``p`` relative to ``out`` when it names a file that exists, else None."""
    if not p or not Path(p).exists():
        return None
    return os.path.relpath(Path(p).resolve(), out.resolve())


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _training(out: Path, method: str) -> dict:
    run = out / "runs" / method
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("loss") is not None]
    summ = _load(run / "summary.json") or {}
    k = min(3, len(rows) // 2)  # the mean of the first and last 3 log records, never overlapping (short runs)
    first = rows[:k]
    last = rows[-k:] if k else []
    mean = lambda rs, k: (sum(r[k] for r in rs) / len(rs)) if rs and all(k in r for r in rs) else None  # noqa: E731
    rec = {"steps": summ.get("steps"), "batch_size": summ.get("global_batch_size"),
           "loss_start": mean(first, "loss"), "loss_end": mean(last, "loss"),
           "samples_per_s": summ.get("samples_per_s"), "wall_s": summ.get("wall_s")}
    B = rec["batch_size"]
    if method == "pcmepp" and B and B > 1:
        # Matching every pair to the base rate 1/B gives a BCE of H(1/B) per direction: a PCME++ match
        # loss at that value means the model has learnt nothing pair-specific (a collapse worth
        # flagging). The match terms alone are compared: the total also holds VIB and the occlusion term.
        pb = 1.0 / B
        rec["base_rate_loss"] = 2 * (-pb * math.log(pb) - (1 - pb) * math.log(1 - pb))
        match = [{"match": r["match_i2t"] + r["match_t2i"]} for r in last if "match_i2t" in r and "match_t2i" in r]
        rec["match_loss_end"] = mean(match, "match") if len(match) == len(last) else rec["loss_end"]
    if rows and "img_sigma2" in rows[-1]:
        rec["img_sigma2_end"] = rows[-1]["img_sigma2"]
        rec["txt_sigma2_end"] = rows[-1].get("txt_sigma2")
    return rec


def _zeroshot(path: Path) -> dict | None:
    """The figures of one `zeroshot synthetic --compare` JSON (None when it is missing)."""
    d = _load(path)
    if not d:
        return None
    rows = []
    for r in d.get("rows", []):
        m = r.get("metrics", {})
        rows.append({"name": r.get("name"), "label": r.get("label"),
                     **{k: m.get(k) for k in ("top1", "top5", "mean_per_class")},
                     "uses_eval_labels": bool(r.get("uses_eval_labels", "oracle" in str(r.get("name")))),
                     **{k: r.get(k) for k in ("data_used", "k_mean", "paired_vs_all", "ece", "nll", "temperature",
                                              "ece_at_t", "nll_at_t")}})
    by = {r["name"]: r for r in rows}
    res = {"rows": rows, "n_classes": len(d.get("classes", [])), "n_eval": d.get("n_eval"),
           "min_detectable_effect": d.get("min_detectable_effect") or {},
           "n_select": d.get("n_select"), "deterministic": d.get("deterministic"), "files": d.get("files", {}),
           "table": d.get("table"), "class_separation": d.get("class_separation")}
    if res["n_classes"]:
        res["chance_top1"] = 100.0 / res["n_classes"]
    for name in ("auto", "fusion", "poe"):
        if dig(by, name, "top1") is not None and dig(by, "all", "top1") is not None:
            res[f"gain_{name}_over_all"] = by[name]["top1"] - by["all"]["top1"]
    return res


def _retrieval(path: Path) -> dict | None:
    """The figures of one `eval synthetic` metrics.json (None when it is missing)."""
    d = _load(path)
    if not d:
        return None
    m = d.get("metrics", {})
    cap, pl = m.get("caption", {}), m.get("plausible", {})
    res = {"score": m.get("setup", {}).get("score"), "n_images": m.get("setup", {}).get("n_images"),
           "n_captions": m.get("setup", {}).get("n_captions"),
           "i2t": cap.get("i2t"), "t2i": cap.get("t2i"), "rsum": cap.get("rsum"),
           "pm_i2t": pl.get("i2t"), "pm_t2i": pl.get("t2i"), "summary": d.get("summary"),
           "files": d.get("files", {}), "uncertainty_validity": d.get("uncertainty_validity"),
           "validity_table": d.get("validity_table"), "selective": d.get("selective")}
    if res["n_images"] and res["n_captions"]:
        # chance R@1: i2t has 5 positives among all captions, t2i one among all images
        res["chance_r1_i2t"] = 100.0 * 5 / res["n_captions"]
        res["chance_r1_t2i"] = 100.0 / res["n_images"]
    unc = d.get("uncertainty")
    if unc:
        gt = unc.get("ground_truth", {})
        dec = unc.get("deciles", {})
        res["uncertainty"] = {
            "spearman_text_uncertainty_vs_ambiguity": dig(gt, "text_uncertainty_vs_ambiguity", "rho"),
            "spearman_image_uncertainty_vs_num_objects": dig(gt, "image_uncertainty_vs_num_objects", "rho"),
            "image_uncertainty_by_condition": {k: v.get("mean") for k, v in
                                               (gt.get("image_uncertainty_by_condition") or {}).items()},
            "image_uncertainty_by_num_objects": {k: v.get("mean") for k, v in
                                                 (gt.get("image_uncertainty_by_num_objects") or {}).items()},
            "deciles": {q: {"spearman": dig(v, "spearman", "rho") if isinstance(v.get("spearman"), dict)
                            else v.get("spearman"),
                            "r1": [b.get("r1") for b in v.get("bins", [])],
                            "neg_sr2": dig(v, "sr2", "neg_sr2")} for q, v in dec.items()},
            "corruption_spearman_image": dig(unc, "corruption", "spearman_image", "rho"),
            "corruption_spearman_text": dig(unc, "corruption", "spearman_text", "rho"),
        }
    return res


def _method_row(rt: dict | None, zs: dict | None) -> dict | None:
    """One row of the method table from the :func:`_retrieval` and :func:`_zeroshot` figures of a run."""
    if not rt:
        return None
    row: dict[str, Any] = {"score": rt["score"], "i2t_r1": dig(rt, "i2t", "r@1"), "t2i_r1": dig(rt, "t2i", "r@1")}
    uv = rt.get("uncertainty_validity")
    if uv:
        overall = dig(uv, "text_ambiguity", "overall") or {}
        counted = [b for b in (dig(uv, "text_ambiguity", "by_word_count") or {}).values() if b.get("counts")]
        cq = dig(uv, "deciles", "caption queries") or {}
        r1 = cq.get("r1") or []
        row.update({"spearman": overall.get("rho"), "spearman_ci": [overall.get("lo"), overall.get("hi")],
                    "bins_positive": sum(1 for b in counted if b["rho"] > 0), "bins_counted": len(counted),
                    "inclusion": dig(uv, "inclusion", "inclusion", "accuracy"),
                    "inclusion_sigma": dig(uv, "inclusion", "sigma", "accuracy"),
                    "conditions_more_uncertain": dig(uv, "image_conditions", "more_uncertain"),
                    "conditions": dig(uv, "image_conditions", "of"),
                    "caption_decile_r1": [r1[0], r1[-1]] if r1 else None,
                    "caption_decile_spearman": dig(cq, "spearman_bins", "rho")})
    if zs:
        top1 = {r["name"]: r["top1"] for r in zs["rows"] if not r["uses_eval_labels"]}
        row["zeroshot_all"] = top1.get("all")
        others = [(v, k) for k, v in top1.items() if k != "all" and v is not None]
        if others and row["zeroshot_all"] is not None:
            v, k = max(others)
            row["best_label_free"] = {"name": k, "gain": round(v - row["zeroshot_all"], 2)}
    return row


def _methods(out: Path, report: dict) -> dict:
    """The method table: InfoNCE and the demo's PCME++ (from ``report``), then every OUT/methods/NAME run
    of ``--all-methods``."""
    rows = {m: _method_row(report["retrieval"].get(m), report["zeroshot"].get(m)) for m in ("infonce", "pcmepp")}
    root = out / "methods"
    found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    for name in [n for n in DEMO_EXTRA_RUNS if n in found] + [n for n in found if n not in DEMO_EXTRA_RUNS]:
        rows[name] = _method_row(_retrieval(root / name / "retrieval" / "metrics.json"),
                                 _zeroshot(root / name / "compare.json"))
    return {k: v for k, v in rows.items() if v}


def _methods_markdown(r: dict) -> list[str]:
    other = {name: " ".join([f"--config configs/{recipe}", "--method", method] + extra)
             for name, (recipe, method, extra) in DEMO_EXTRA_RUNS.items()}
    recipes = (r["settings"] or {}).get("recipes") or RECIPES
    L = ["## 5. Every objective on the same budget\n",
         "Same model, data, steps, batch and seed; test split; retrieval ranked by CSD (InfoNCE: cosine). "
         "Bins: caption word-count bins with >= 100 captions; inclusion: exact inclusion pairs, the method's "
         "inclusion test / the plain sigma comparison; conditions: degraded-image conditions whose mean "
         "uncertainty exceeds normal images'. Strategies: `zsprob zeroshot synthetic --compare`, without "
         "evaluation labels.\n",
         "| method | recipe | Spearman(text u, ambiguity) [95% CI] | bins > 0 | inclusion % (test / sigma) | "
         "conditions > normal | t2i R@1, most -> least certain decile (Spearman) | i2t / t2i R@1 | "
         "zero-shot all-80 | best label-free strategy - all-80 |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in r["methods"].items():
        label = TABLE_LABEL.get(name, name)
        recipe = f"`configs/{recipes[name]}`" if name in recipes else (f"`{other[name]}`" if name in other else "")
        if row.get("spearman") is not None:
            lo, hi = row["spearman_ci"]
            sp = f"{row['spearman']:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            bins = f"{row['bins_positive']}/{row['bins_counted']}"
            inc = f"{_f(100 * row['inclusion'])} / {_f(100 * row['inclusion_sigma'])}"
            cond = f"{row['conditions_more_uncertain']}/{row['conditions']}"
            d = row.get("caption_decile_r1")
            rho = row.get("caption_decile_spearman")
            dec = (f"{_f(d[0])} -> {_f(d[1])} ({'-' if rho is None else f'{rho:+.2f}'})" if d else "-")
        else:
            sp, bins, inc, cond, dec = "(no sigma)", "", "", "", ""
        best = row.get("best_label_free")
        best_s = f"{best['gain']:+.1f} ({best['name']})" if best else "-"
        L.append(f"| {label} | {recipe} | {sp} | {bins} | {inc} | {cond} | {dec} | {_f(row['i2t_r1'])} / "
                 f"{_f(row['t2i_r1'], 2)} | {_f(row.get('zeroshot_all'))} | {best_s} |")
    L.append("\nOne seed per row; SE of i2t R@1 and zero-shot about 1.4 points at n = 1,000. Several seeds: "
             "docs/findings.md.\n")
    return L


def build_report(out: str | Path, settings: dict | None = None, timings: dict | None = None,
                 wall_seconds: float | None = None) -> dict:
    """Assemble OUT/report.md and OUT/report.json from the outputs of the demo's commands."""
    out = Path(out)
    methods = [m for m in METHOD_LABEL if (out / "runs" / m).exists()]
    manifest = _load(out / "data" / "manifest.json") or {}
    curves = training_curves({METHOD_LABEL[m]: out / "runs" / m / "metrics.jsonl" for m in methods},
                             out / "figures" / "training_curves.png",
                             keys=(("loss", "training loss"), ("img_sigma2", "mean image sigma^2 (PCME++)"),
                                   ("txt_sigma2", "mean text sigma^2 (PCME++)")),
                             title="Pretraining on SynthWorld shards")
    selected = _load(out / "zeroshot" / "selected.json")
    report: dict[str, Any] = {
        "zsprob_version": __version__, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": settings or {}, "wall_seconds": wall_seconds,
        "steps": {k: round(v["seconds"], 1) for k, v in (timings or {}).items()},
        # the steps' own recorded times, also of steps finished by an earlier (resumed) invocation
        "steps_seconds_total": round(sum(v["seconds"] for v in (timings or {}).values()), 1) if timings else None,
        "resumed_steps": sorted(k for k, v in (timings or {}).items() if v.get("skipped")),
        "world": {k: manifest.get(k) for k in ("seed", "image_size", "counts", "classes") if k in manifest},
        "training": {m: _training(out, m) for m in methods},
        "zeroshot": {m: _zeroshot(out / "zeroshot" / m / "compare.json") for m in methods},
        "retrieval": {m: _retrieval(out / "retrieval" / m / "metrics.json") for m in methods},
    }
    if (out / "methods").is_dir():
        report["methods"] = _methods(out, report)
    if selected:
        report["zeroshot_selected"] = {"top1": dig(selected, "metrics", "top1"),
                                       "top5": dig(selected, "metrics", "top5"),
                                       "strategy": dig(selected, "selection", "label"),
                                       "uses_eval_labels": dig(selected, "selection", "uses_eval_labels")}
    report["checks"], report["check_evidence"] = run_checks(report)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", _markdown(out, report, curves))
    return report


def _img(out: Path, path: str | Path | None, alt: str) -> str:
    rel = _rel(out, path)
    return f"![{alt}]({rel})\n" if rel else f"({alt}: not produced)\n"


def _markdown(out: Path, r: dict, curves: Path | None) -> str:
    L: list[str] = []
    _md_header(L, out, r)
    _md_training(L, out, r, curves)
    _md_zeroshot(L, out, r)
    _md_retrieval(L, out, r)
    _md_uncertainty(L, out, r)
    _md_rest(L, out, r)
    return "\n".join(L)


def _md_header(L: list[str], out: Path, r: dict) -> None:
    """The title line and the world's settings."""
    s = r["settings"]
    L.append("# zsprob demo report\n")
    L.append(f"zsprob {r['zsprob_version']}, {r['created']}. Everything below was produced offline on SynthWorld "
             f"by the commands listed at the end ({'quick' if s.get('quick') else 'full'} run"
             + (f", {r['steps_seconds_total'] / 60:.1f} minutes of command time"
                if r.get("steps_seconds_total") else "")
             + (f", {len(r['resumed_steps'])} step(s) finished by an earlier invocation"
                if r.get("resumed_steps") else "")
             + (f", this invocation {r['wall_seconds'] / 60:.1f} minutes wall time" if r.get("wall_seconds") else "")
             + ").\n")
    w = r.get("world", {})
    if w:
        L.append(f"SynthWorld: seed {w.get('seed')}, {w.get('image_size')} px, "
                 f"{len(w.get('classes') or [])} shape classes; counts {json.dumps(w.get('counts'))}.\n")


def _md_training(L: list[str], out: Path, r: dict, curves: Path | None) -> None:
    """Section 1: the recipes, the training table, warnings and curves."""
    L.append("## 1. Pretraining\n")
    recipes = r["settings"].get("recipes") or {}
    if recipes:
        L.append("Recipes: " + "; ".join(f"{METHOD_LABEL.get(m, m)} `configs/{c}`" for m, c in recipes.items())
                 + " (same model, data, budget and seed; the PCME++ recipe trains the means with the match loss "
                 "and sigma^2 apart, with the occlusion inclusion term and the likelihood terms, a caption's "
                 "Gaussian explaining its images' means and an image's its captions': docs/findings.md).\n")
    L.append("| model | steps x batch | loss (first -> last logs) | samples/s | final mean sigma^2 (image / text) |")
    L.append("|---|---|---|---|---|")
    for m, t in r["training"].items():
        sig = (f"{_f(t.get('img_sigma2_end'), 3)} / {_f(t.get('txt_sigma2_end'), 3)}"
               if "img_sigma2_end" in t else "- (deterministic)")
        L.append(f"| {METHOD_LABEL[m]} | {t.get('steps')} x {t.get('batch_size')} | {_f(t.get('loss_start'), 3)} -> "
                 f"{_f(t.get('loss_end'), 3)} | {_f(t.get('samples_per_s'), 0)} | {sig} |")
    L.append("")
    for m, t in r["training"].items():
        if r["checks"].get(f"training_{m}_beats_base_rate") is False:
            L.append(f"**Warning: the {METHOD_LABEL[m]} match loss ended at {t['match_loss_end']:.4f}, the value "
                     f"of matching every pair to the base rate 1/{t['batch_size']} ({t['base_rate_loss']:.4f}).** "
                     "The model has not learnt pair-specific matches in this budget; its zero-shot and retrieval "
                     "figures below are near chance. Train longer (`--steps`) before reading them.\n")
    L.append(_img(out, curves, "training curves"))
    L.append("Left: training loss per step (thin: raw, thick: moving average; the two losses are on different "
             "scales, InfoNCE is a softmax cross-entropy, PCME++ a pairwise BCE). Middle and right: the mean "
             "variance the PCME++ heads predict for images and captions.\n")


def _detectable_effect_line(z: dict) -> str:
    """What the evaluation set can resolve: the paired columns and the minimum detectable effect."""
    mde = z.get("min_detectable_effect") or {}
    text = ("`vs all` is each strategy's top-1 minus all-80's on the same images, with a paired bootstrap 95% "
            "interval; `McNemar p` is the exact test on the images where the two disagree.")
    if mde:
        text += (f" With {mde['n_images']} evaluation images and a median discordance of "
                 f"{mde['median_discordance']:.3f}, the smallest difference detected with 80% power at alpha 0.05 "
                 f"is {mde['mde_top1_points']:.2f} top-1 points (docs/zeroshot.md gives the formula; "
                 "`zsprob data synthetic --num-classify-eval` makes the set larger).")
    return text + "\n"


def _md_zeroshot(L: list[str], out: Path, r: dict) -> None:
    """Section 2: zero-shot classification and the prompt strategies."""
    L.append("## 2. Zero-shot classification with uncertainty-based prompt selection\n")
    zp = r["zeroshot"].get("pcmepp")
    if zp:
        L.append(f"{zp['n_classes']} classes, {zp['n_eval']} evaluation images (`classify/eval`), "
                 f"{zp['n_select']} labelled selection images (`classify/select`, disjoint from evaluation). "
                 f"Chance top-1: {_f(zp.get('chance_top1'))}%. Prompts: the 80 CLIP ImageNet templates. "
                 "Every strategy except the two marked EVAL LABELS chooses prompts without the evaluation labels.\n")
        for m, z in r["zeroshot"].items():
            sep = dig(z, "class_separation") or {}
            if sep.get("collapsed"):
                L.append(f"**Warning ({METHOD_LABEL[m]}): the class prompts embed almost identically (mean pairwise "
                         f"cosine {sep['mean_pairwise_cosine']:.3f} between the {sep['n_classes']} class vectors; "
                         f"closest: {' / '.join(sep['closest_pair'])}).** The text tower does not tell the shape "
                         "names apart yet, so every prompt strategy below is near chance and their differences are "
                         "noise (docs/findings.md, section \"How the demo's towers were chosen\").\n")
        L.append("### PCME++\n")
        L.append(zp.get("table") or "")
        L.append("")
        L.append(_detectable_effect_line(zp))
        L.append("Calibration: ECE (15 equal-width confidence bins) and NLL of the softmax over classes at the "
                 "model's own logit scale, then at the temperature T that minimises the NLL on the labelled "
                 "selection split (report only: T changes no strategy's prompts; docs/zeroshot.md, Calibration).\n")
        if zp.get("gain_auto_over_all") is not None:
            sign = "+" if zp["gain_auto_over_all"] >= 0 else ""
            L.append(f"**auto vs all-80: {sign}{zp['gain_auto_over_all']:.2f} top-1 points** "
                     f"(auto chooses each class's number of prompts on the selection split, shrunk towards the "
                     f"best global K).\n")
        sel = r.get("zeroshot_selected")
        if sel:
            L.append(f"`zsprob select-prompts --topk auto` followed by `zsprob zeroshot --prompts selection.json`: "
                     f"top-1 {_f(sel['top1'], 2)}%, top-5 {_f(sel['top5'], 2)}% ({sel['strategy']}).\n")
        files = zp.get("files", {})
        L.append(_img(out, files.get("accuracy_vs_topk"), "accuracy vs top-K"))
        L.append("Accuracy when every class keeps its K most certain prompts (PCME++ Fig. C.1, left).\n")
        L.append(_img(out, files.get("per_class_k_hist"), "per-class K histogram"))
        L.append("How many prompts `auto` kept per class (PCME++ Fig. C.1, right).\n")
        if files.get("risk_coverage"):
            L.append(_img(out, files["risk_coverage"], "risk-coverage curves"))
            L.append("Error among the predictions kept when the least confident are set aside, per confidence score "
                     "(all-80; lower is better; the tables above give AURC and AUROC with intervals).\n")
    zi = r["zeroshot"].get("infonce")
    if zi:
        L.append("### InfoNCE baseline (deterministic: strategies that need sigma^2 are skipped)\n")
        L.append(zi.get("table") or "")
        L.append("")


def _md_retrieval(L: list[str], out: Path, r: dict) -> None:
    """Section 3: the retrieval table."""
    L.append("## 3. Retrieval on the SynthWorld test split\n")
    L.append("R@K use the five captions written for each image as positives (COCO protocol); mAP@R and R-P use "
             "the exact plausible-match positives given by the world's match predicate (ECCV Caption protocol, "
             "but exact). Values in %.\n")
    L.append("| model | score | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | RSUM | PM mAP@R (i2t / t2i) | "
             "PM R-P (i2t / t2i) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    chance = None
    for m, rt in r["retrieval"].items():
        if not rt:
            continue
        i, t, pi, pt = rt["i2t"], rt["t2i"], rt["pm_i2t"] or {}, rt["pm_t2i"] or {}
        L.append(f"| {METHOD_LABEL[m]} | {rt['score']} | {_f(i['r@1'])} | {_f(i['r@5'])} | {_f(i['r@10'])} | "
                 f"{_f(t['r@1'])} | {_f(t['r@5'])} | {_f(t['r@10'])} | {_f(rt['rsum'])} | "
                 f"{_f(pi.get('map_at_r'))} / {_f(pt.get('map_at_r'))} | "
                 f"{_f(pi.get('rprecision'))} / {_f(pt.get('rprecision'))} |")
        chance = (rt.get("chance_r1_i2t"), rt.get("chance_r1_t2i"))
    if chance:
        L.append(f"\nChance R@1: {_f(chance[0], 2)}% (i2t), {_f(chance[1], 2)}% (t2i).\n")
    for m, rt in r["retrieval"].items():
        if rt and rt.get("selective"):
            from zsprob.utils.selective import selective_table

            L.append(f"Which score flags a query whose top-1 item is wrong, {METHOD_LABEL[m]} (AUROC of low "
                     "confidence for an R@1 miss, bootstrap 95% intervals; docs/zeroshot.md, Selective prediction):"
                     + selective_table(rt["selective"], items="queries", right="R@1") + "\n")


def _md_uncertainty(L: list[str], out: Path, r: dict) -> None:
    """Section 4: what the PCME++ uncertainty means."""
    rp = r["retrieval"].get("pcmepp")
    if rp and rp.get("uncertainty"):
        u = rp["uncertainty"]
        files = rp.get("files", {})
        L.append("## 4. What the PCME++ uncertainty means\n")
        L.append(f"- Spearman correlation of caption uncertainty ||sigma^2||_1 with the caption's ground-truth "
                 f"ambiguity (log of the fraction of scenes it is true of; vaguer captions are true of more "
                 f"scenes): **{_f(u['spearman_text_uncertainty_vs_ambiguity'], 3)}**.")
        L.append(f"- Spearman of image uncertainty with the number of objects: "
                 f"{_f(u['spearman_image_uncertainty_vs_num_objects'], 3)}.")
        if u.get("corruption_spearman_image") is not None:
            L.append(f"- Corruption sweep: Spearman of mean image sigma^2 with the fraction of erased pixels "
                     f"{_f(u['corruption_spearman_image'], 3)}, of caption sigma^2 with the fraction of masked "
                     f"words {_f(u['corruption_spearman_text'], 3)}.")
        L.append("")
        L.append(_img(out, files.get("ambiguity_png"), "caption uncertainty vs ambiguity"))
        L.append(_img(out, files.get("deciles_png"), "R@1 per uncertainty decile"))
        L.append("R@1 of image and caption queries grouped into ten bins of their uncertainty (PCME++ Fig. 5): "
                 "a useful uncertainty makes the most uncertain queries the hardest.\n")
        sr2 = {q: d["neg_sr2"] for q, d in (u.get("deciles") or {}).items() if d.get("neg_sr2") is not None}
        if sr2:
            L.append("ProbVLM's calibration figure -SR^2 of these bins (Spearman x R^2 of a line through R@1 per "
                     "bin, negated; 1 = R@1 falls linearly with uncertainty): "
                     + ", ".join(f"{q} {_f(v, 3)}" for q, v in sr2.items()) + ".\n")
        L.append(_img(out, files.get("groups_png"), "image uncertainty by objects and condition"))
        L.append("Mean image uncertainty per number of objects and per rendering condition.\n")
        L.append(_img(out, files.get("corruption_png"), "corruption sweep"))
        L.append("Mean sigma^2 as pixels are erased from images and words masked from captions (PCME Fig. 7).\n")
        page = _rel(out, files.get("uncertain_queries"))
        if page:
            L.append(f"The most and least uncertain queries with what they retrieved: [{page}]({page}).\n")


def _md_rest(L: list[str], out: Path, r: dict) -> None:
    """Other methods, the validity tables, the checks and the commands."""
    if r.get("methods"):
        L.extend(_methods_markdown(r))

    tables = {name: rr["validity_table"] for name, rr in r["retrieval"].items() if rr and rr.get("validity_table")}
    if tables:  # rendered by `zsprob eval synthetic` (zsprob.retrieval.validity) into its metrics.json
        L.append("## Uncertainty validity (SynthWorld exact ground truth)\n")
        L.append("Spearman with bootstrap 95% intervals, accuracies with binomial standard errors "
                 "(`zsprob.retrieval.validity`).\n")
        for name, table in tables.items():
            L.append(f"**{name}**\n")
            L.append(table)
    L.append("## Checks\n")
    L.append("Each computed from the figures above (`zsprob.report.demo_checks`): the models trained and are above "
             "chance, and what this report says about PCME++'s uncertainty holds within its standard errors.\n")
    evidence = r.get("check_evidence") or {}
    for k, v in r["checks"].items():
        L.append(f"- {k}: {'yes' if v else 'NO'}" + (f" ({evidence[k]})" if evidence.get(k) else ""))
    L.append("\n## Commands that produced this report\n")
    L.append("Each step is a plain zsprob command; `zsprob demo --out DIR` skips the steps already done.\n")
    L.append("```")
    for name, secs in r["steps"].items():
        cmd = _load(out / ".steps" / f"{name}.json") or {}
        L.append(f"# {name}: {secs:.0f} s")
        L.append(cmd.get("command", ""))
    L.append("```\n")
