"""Training curves from metrics.jsonl logs, drawn by matplotlib (Agg backend) into PNG files."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from zsprob.utils.io import read_jsonl


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int | None = None) -> Path:
    """tight_layout, write ``fig`` to ``path`` (parents created) as PNG, close it; returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi if dpi is not None else "figure")
    pyplot().close(fig)
    return path


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def training_curves(runs: Mapping[str, str | Path], out_png: str | Path,
                    keys: Sequence[tuple[str, str]] = (("loss", "training loss"),),
                    title: str = "Training curves") -> Path | None:
    """One panel per (metrics key, label), one line per run (label -> metrics.jsonl path); a loss panel whose
    values are all positive is drawn on a log scale. None when no run logged any of ``keys``."""
    plt = pyplot()
    data = {name: [r for r in read_jsonl(p) if "step" in r] for name, p in runs.items()}
    panels = [(k, lbl) for k, lbl in keys if any(k in r for rows in data.values() for r in rows)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        allpos = True
        for name, rows in data.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
                   and math.isfinite(r[key])]
            if not pts:
                continue
            xs, ys = zip(*pts)
            allpos &= min(ys) > 0
            w = max(1, len(ys) // 30)
            ax.plot(xs, ys, alpha=0.25, lw=0.8)
            ax.plot(xs, smooth(ys, w), lw=1.8, label=name, color=ax.lines[-1].get_color())
        if allpos and key.startswith("loss"):
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, out_png, dpi=110)
