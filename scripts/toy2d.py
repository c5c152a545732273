#!/usr/bin/env python
"""PCME++ App. A.2: a 2-D toy where CSD learns which points are uncertain and 2-Wasserstein does not.

Setup (PCME++ App. A.2): three classes, a centroid drawn at random for each (here N(0, I) in 2-D);
500 points per class, mu = centroid + 0.1 N(0, I); 150 of each class's points are "confusing":
they belong to a random one of two classes (class k or k + 1 mod 3) -- the label is redrawn every
time the point is seen, which is what makes them uncertain; initial log sigma ~ U(-1.5, 1.5).
Every point's (mu, log sigma^2) is a free parameter optimised directly with the PCME++ objective
(Eq. 2, ``zsprob.prob.PCMEPPLoss`` with its default pseudo-positive and VIB weights and learnable
a, b) by Adam (lr 0.02, 500 epochs, batch 128). A mini-batch is matched against itself: points i and
j are a positive pair when their current labels agree. ``distance="csd"`` is PCME++; ``"wd"`` the
2-Wasserstein ablation. The paper reports mean sigma^2 uncertain / certain = 1.82 (CSD) and 1.04 (WD).

    python scripts/toy2d.py --out toy2d.png
    python scripts/toy2d.py --epochs 100 --per-class 200   # a quick run

Prints, per distance, the mean sigma^2 (per dimension) of certain and uncertain points and their
ratio; writes one PNG (two panels: points coloured by class, a circle of radius sigma around each).
torch does the optimisation, zsprob.prob the loss, matplotlib the figure.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

N_CLASSES = 3
DISTANCES = ("csd", "wd")


def make_toy(per_class: int = 500, confusing: int = 150, seed: int = 0) -> dict:
    """Points (mu, log sigma^2 init), their class and, for confusing points, the second class."""
    gen = torch.Generator().manual_seed(seed)
    centroids = torch.randn(N_CLASSES, 2, generator=gen)
    labels = torch.arange(N_CLASSES).repeat_interleave(per_class)
    mu = centroids[labels] + 0.1 * torch.randn(len(labels), 2, generator=gen)
    log_sigma = torch.empty(len(labels), 2).uniform_(-1.5, 1.5, generator=gen)
    uncertain = torch.zeros(len(labels), dtype=torch.bool)
    for k in range(N_CLASSES):
        uncertain[k * per_class:k * per_class + confusing] = True
    other = torch.where(uncertain, (labels + 1) % N_CLASSES, labels)
    return {"mu": mu, "logvar": 2 * log_sigma, "label": labels, "other": other, "uncertain": uncertain,
            "centroids": centroids}


def train(toy: dict, distance: str, *, epochs: int = 500, batch_size: int = 128, lr: float = 0.02,
          seed: int = 0) -> dict:
    """Optimise every point's (mu, logvar) with the PCME++ loss under ``distance``; returns the result."""
    from zsprob.prob import PCMEPPLoss

    gen = torch.Generator().manual_seed(seed + 1)
    mu = torch.nn.Parameter(toy["mu"].clone())
    logvar = torch.nn.Parameter(toy["logvar"].clone())
    criterion = PCMEPPLoss(distance=distance)
    optimizer = torch.optim.Adam([mu, logvar, *criterion.parameters()], lr=lr)
    n_points = len(mu)
    for _ in range(epochs):
        for batch in torch.randperm(n_points, generator=gen).split(batch_size):
            coin = torch.rand(len(batch), generator=gen) < 0.5
            labels = torch.where(coin, toy["label"][batch], toy["other"][batch])
            matched = (labels[:, None] == labels[None, :]).float()
            loss, _ = criterion(mu[batch], logvar[batch], mu[batch], logvar[batch], matched)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    sigma2 = logvar.detach().exp().mean(1)
    certain = float(sigma2[~toy["uncertain"]].mean())
    uncertain = float(sigma2[toy["uncertain"]].mean())
    return {"distance": distance, "mean_sigma2_certain": certain, "mean_sigma2_uncertain": uncertain,
            "ratio": uncertain / certain, "mu": mu.detach(), "logvar": logvar.detach()}


def plot(toy: dict, results: list[dict], path) -> Path:
    from matplotlib.patches import Circle

    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 5), dpi=110)
    colours = np.array(["C3", "C1", "C2"])
    for ax, res in zip(np.atleast_1d(axes), results):
        mu, sigma = res["mu"].numpy(), (0.5 * res["logvar"]).exp().mean(1).numpy()
        for i in range(len(mu)):
            colour = "0.35" if toy["uncertain"][i] else colours[int(toy["label"][i])]
            ax.add_patch(Circle(mu[i], sigma[i], fill=False, lw=0.3, alpha=0.25, color=colour))
        ax.scatter(mu[:, 0], mu[:, 1], s=3, c=[("0.2" if u else colours[int(k)])
                                               for u, k in zip(toy["uncertain"], toy["label"])])
        ax.set_aspect("equal")
        ax.autoscale_view()
        ax.set_title(f"{res['distance'].upper()}: mean sigma^2 uncertain / certain = {res['ratio']:.2f}x", fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=500)
    parser.add_argument("--confusing", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="toy2d.png", help="PNG path; a JSON of the figures goes beside it")
    args = parser.parse_args(argv)
    if not 0 < args.confusing < args.per_class or args.epochs < 1 or args.batch_size < 2:
        print("toy2d: need 0 < --confusing < --per-class, --epochs >= 1, --batch-size >= 2", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    toy = make_toy(args.per_class, args.confusing, args.seed)
    results = [train(toy, name, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
               for name in DISTANCES]
    print("| distance | mean sigma^2 certain | mean sigma^2 uncertain | uncertain / certain |")
    print("|---|---|---|---|")
    for res in results:
        print(f"| {res['distance']} | {res['mean_sigma2_certain']:.4g} | {res['mean_sigma2_uncertain']:.4g} | "
              f"{res['ratio']:.3f}x |")
    png = plot(toy, results, args.out)
    summary = {res["distance"]: {k: res[k] for k in ("mean_sigma2_certain", "mean_sigma2_uncertain", "ratio")}
               for res in results}
    summary["setup"] = vars(args)
    Path(png).with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {png} and {Path(png).with_suffix('.json')}")
    return 0 if all(math.isfinite(res["ratio"]) for res in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
