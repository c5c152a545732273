"""Print the selective-prediction and label-baseline tables of docs/findings.md from the outputs of several seeds.

Usage: python experiments/selective_seeds.py DIR [SEED ...], where DIR holds zsS/compare.json (zeroshot
--compare), evS/metrics.json (eval synthetic) and prS/results.json (probe) per seed S (the journal,
2026-11-29, gives the commands).
"""
import json
import sys
from pathlib import Path

import numpy as np

R = Path(sys.argv[1])
seeds = [int(a) for a in sys.argv[2:]] or [0, 1, 2]

def load(p):
    return json.loads(Path(p).read_text())


def auroc_cells(rep: dict) -> str:
    """Each score's AUROC of a selective-prediction report, with its paired difference against msp."""
    cells = []
    for name, e in rep["scores"].items():
        d = e.get("minus_msp", {}).get("auroc")
        diff = "" if d is None else f" ({d['value']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}])"
        cells.append(f"{name} {e['auroc']['value']:.3f}{diff}")
    return "; ".join(cells)

print("## zero-shot selective (row all): AUROC(wrong) and minus msp [95% CI]")
for s in seeds:
    c = load(R / f"zs{s}" / "compare.json")
    for row in ("all", "auto"):
        rep = c["selective"].get(row)
        if not rep:
            continue
        print(f"seed {s} {row} acc {100*rep['accuracy']:.1f}: " + auroc_cells(rep))
print("\n## retrieval selective (test split): AUROC(R@1 miss) and minus msp")
for s in seeds:
    m = load(R / f"ev{s}" / "metrics.json")
    sel = m.get("selective") or {}
    for direction, rep in sel.items():
        print(f"seed {s} {direction} R@1 {100*rep['accuracy']:.1f}: " + auroc_cells(rep))
print("\n## label-using rows: top-1 and paired vs all [95% CI]")
names = ["all", "global", "auto", "fusion-select", "bprw-fewshot", "linear-probe", "tip-adapter"]
table = {n: [] for n in names}
for s in seeds:
    c = load(R / f"zs{s}" / "compare.json")
    rows = {r["name"]: r for r in c["rows"]}
    line = []
    for n in names:
        r = rows.get(n)
        if r is None or r.get("skipped"):
            line.append(f"{n} -")
            continue
        table[n].append(r["metrics"]["top1"])
        p = r.get("paired_vs_all") or {}
        ci = f"[{p['ci95'][0]:+.1f}, {p['ci95'][1]:+.1f}]"
        line.append(f"{n} {r['metrics']['top1']:.1f} ({p.get('diff', 0):+.1f} {ci})")
    print(f"seed {s}: " + "; ".join(line))
for n, v in table.items():
    if v:
        v = np.array(v)
        se = v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
        print(f"mean {n}: {v.mean():.2f} (SE {se:.2f}, n={len(v)})")
print("\n## zsprob probe (k-shot)")
for s in seeds:
    p = R / f"pr{s}" / "results.json"
    if p.exists():
        r = load(p)
        ks = "; ".join(f"{k}-shot {v['top1']['mean']:.1f} [{v['top1']['ci95'][0]:.1f}, {v['top1']['ci95'][1]:.1f}]"
                       for k, v in r["kshot"].items())
        print(f"seed {s}: full {r['metrics']['top1']:.1f} (C={r['probe']['C']:g}); {ks}")

print("\n## by rendering condition (all-80): AUROC of low confidence vs normal images, per seed")
conds = {}
for s in seeds:
    groups = load(R / f"zs{s}" / "compare.json").get("selective_by_condition", {}).get("all", {}).get("groups", {})
    for name, e in groups.items():
        d = conds.setdefault(name, {"acc": [], "image_sigma2": [], "msp": []})
        d["acc"].append(100 * e["accuracy"])
        for score in ("image_sigma2", "msp"):
            if score in e.get("scores", {}):
                d[score].append(e["scores"][score]["auroc_vs_reference"]["value"])
for name, d in conds.items():
    cells = "  ".join(f"{k} {' / '.join(f'{v:.2f}' for v in d[k])}" for k in ("image_sigma2", "msp") if d[k])
    print(f"{name:16s} accuracy {np.mean(d['acc']):.0f}%  {cells}")
