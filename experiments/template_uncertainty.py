#!/usr/bin/env python
"""Why does ranking the 80 templates by caption uncertainty not beat using all of them on SynthWorld?

Reads the ``diagnostic_eval_labels`` section that ``zsprob zeroshot synthetic --compare`` writes (per
template: the single-template classifier's top-1 on classify/eval and its text uncertainty
||sigma^2||_1 averaged over the classes; an analysis on evaluation labels, which selects nothing) and
splits the templates by what their words mean to SynthWorld:

- ``condition``: names one of SynthWorld's rendering conditions in the words its captions use
  (blurry, pixelated, low resolution, dark, bright, black and white, jpeg, cropped, drawing /
  sketch / doodle, many): a caption of that form is true only of images with that condition;
- ``other known``: every word occurs in SynthWorld's caption vocabulary, no condition;
- ``unseen words``: at least one word the captions never use (itap, graffiti, plushie, ...): a
  bag-of-words tower has never trained that word's vector.

Prints the spread of the single-template top-1 against one binomial standard error of the all-80
classifier (the room any prompt strategy has), then, per group: the number of templates, their mean rank by uncertainty (1 = most certain), mean
single-template top-1, and Spearman(uncertainty, top-1) over all templates with a bootstrap 95%
interval (resampling templates), plus the 10 most certain templates with their group and top-1.

    python experiments/template_uncertainty.py RUN/zs/compare.json --root SW [--checkpoint RUN/model] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import numpy as np

CONDITION_WORDS = ("blurry", "pixelated", "low resolution", "dark", "bright", "black and white", "jpeg",
                   "cropped", "drawing", "sketch", "doodle", "many")


def _words(template: str) -> list[str]:
    return re.findall(r"[a-z]+", template.replace("{}", " ").lower())


def caption_vocabulary(root) -> set[str]:
    """Every word of the retrieval split's captions (test and val; the grammar's whole vocabulary)."""
    data = json.load(open(f"{root}/retrieval/dataset_synthworld.json"))
    return {w for image in data["images"] for sentence in image["sentences"] for w in _words(sentence["raw"])}


def group_of(template: str, vocab: set[str]) -> str:
    text = " ".join(_words(template))
    if any(re.search(rf"\b{re.escape(word)}\b", text) for word in CONDITION_WORDS):
        return "condition"
    return "other known" if all(w in vocab for w in _words(template)) else "unseen words"


def spearman_interval(x, y, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    from scipy.stats import spearmanr
    x, y = np.asarray(x, float), np.asarray(y, float)
    rho = float(spearmanr(x, y).statistic)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(x), len(x))
        if np.ptp(x[idx]) > 0 and np.ptp(y[idx]) > 0:
            boots.append(spearmanr(x[idx], y[idx]).statistic)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return rho, float(lo), float(hi)


def analyse(compare: dict, vocab: set[str]) -> dict:
    diag = compare.get("diagnostic_eval_labels") or {}
    if not diag:
        raise SystemExit("no diagnostic_eval_labels in this compare JSON (a deterministic model?)")
    acc, unc = diag["template_accuracy"], diag["template_mean_uncertainty"]
    templates = list(acc)
    order = sorted(templates, key=lambda t: unc[t])
    rank = {t: i + 1 for i, t in enumerate(order)}
    groups = {}
    for t in templates:
        groups.setdefault(group_of(t, vocab), []).append(t)
    rho, lo, hi = spearman_interval([unc[t] for t in templates], [acc[t] for t in templates])
    top1 = np.array([acc[t] for t in templates])
    n_eval = compare.get("n_eval")
    all80 = next((r["metrics"]["top1"] for r in compare.get("rows", []) if r.get("name") == "all"), None)
    spread = {"min": float(top1.min()), "max": float(top1.max()), "sd": float(top1.std(ddof=1)), "all80": all80,
              "binomial_se": (float(np.sqrt(all80 * (100 - all80) / n_eval)) if all80 is not None and n_eval else None)}
    return {"n_templates": len(templates), "spearman_uncertainty_vs_top1": {"rho": rho, "lo": lo, "hi": hi},
            "single_template_top1": spread,
            "groups": {g: {"n": len(ts), "mean_rank": float(np.mean([rank[t] for t in ts])),
                           "mean_top1": float(np.mean([acc[t] for t in ts])), "templates": ts}
                       for g, ts in sorted(groups.items())},
            "most_certain": [{"template": t, "group": group_of(t, vocab), "top1": acc[t], "uncertainty": unc[t]}
                             for t in order[:10]]}


def prediction_agreement(checkpoint, root) -> dict:
    """How often each single-template classifier predicts what the all-80 classifier predicts on
    classify/eval (cosine of the normalised means, as ``zsprob zeroshot``), and the mean cosine of
    one class's prompt means across templates against that between classes."""
    import torch
    import torch.nn.functional as F

    from zsprob.models import load_for_inference
    from zsprob.zeroshot.classify import prepare

    bank, feats, _, _ = prepare(load_for_inference(checkpoint), root=root, dataset="synthetic", need_select=False,
                                progress=False)
    x = F.normalize(feats.mu.float(), dim=-1)
    per_template = torch.einsum("nd,ctd->ntc", x, bank.mu_normed).argmax(2)           # [N, T]
    all80 = (x @ F.normalize(bank.mu_normed.mean(1), dim=-1).t()).argmax(1)             # [N]
    m = bank.mu_normed                                                                   # [C, T, D]
    within = torch.einsum("ctd,csd->cts", m, m)
    T = m.shape[1]
    within = ((within.sum((1, 2)) - T) / (T * (T - 1))).mean()
    centres = F.normalize(m.mean(1), dim=-1)
    between = centres @ centres.t()
    C = m.shape[0]
    between = (between.sum() - C) / (C * (C - 1))
    return {"agreement_with_all80": float((per_template == all80[:, None]).double().mean()),
            "mean_cosine_within_class": float(within), "mean_cosine_between_classes": float(between)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("compare", help="compare.json of zsprob zeroshot synthetic --compare")
    ap.add_argument("--root", required=True, help="the SynthWorld folder (its captions give the vocabulary)")
    ap.add_argument("--checkpoint", help="also: how often single templates predict what all 80 predict")
    ap.add_argument("--json", help="write the analysis here")
    args = ap.parse_args(argv)
    result = analyse(json.load(open(args.compare)), caption_vocabulary(args.root))
    s = result["spearman_uncertainty_vs_top1"]
    print(f"{result['n_templates']} templates; Spearman(uncertainty, single-template top-1) = {s['rho']:+.2f} "
          f"[{s['lo']:+.2f}, {s['hi']:+.2f}] (negative: the certain templates classify better)")
    t = result["single_template_top1"]
    se = f", one binomial SE of all-80: {t['binomial_se']:.1f}" if t["binomial_se"] is not None else ""
    print(f"single-template top-1: {t['min']:.1f} to {t['max']:.1f} (SD {t['sd']:.2f}); all 80: {t['all80']}{se}")
    print("| group | templates | mean rank by uncertainty (1 = most certain) | mean single-template top-1 |")
    print("|---|---|---|---|")
    for g, r in result["groups"].items():
        print(f"| {g} | {r['n']} | {r['mean_rank']:.1f} | {r['mean_top1']:.1f} |")
    print("\nthe 10 most certain templates:")
    for r in result["most_certain"]:
        print(f"  {r['template']:<40s} {r['group']:<13s} top-1 {r['top1']:.1f}  u {r['uncertainty']:.4f}")
    if args.checkpoint:
        result["agreement"] = a = prediction_agreement(args.checkpoint, args.root)
        print(f"\nsingle-template predictions equal the all-80 prediction for {100 * a['agreement_with_all80']:.1f}% "
              f"of (image, template) pairs; prompt means of one class across templates: mean cosine "
              f"{a['mean_cosine_within_class']:.3f}; class centres: {a['mean_cosine_between_classes']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
