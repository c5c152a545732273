#!/usr/bin/env python
"""PCME++ App. A.2: a 2-D toy where CSD learns which points are uncertain and 2-Wasserstein does not.

Setup (PCME++ App. A.2): three classes, a centroid drawn at random for each (here N(0, I) in 2-D);
500 points per class, mu = centroid + 0.1 N(0, I); 150 of each class's points are "confusing":
they belong to a random one of two classes (class k or k + 1 mod 3) -- the label is redrawn every
time the point is seen ("observed as either red or green randomly" during training, as the
project page puts it), which is what makes them uncertain; log sigma ~ U(-1.5, 1.5), one value
per point shared by both dimensions ("log sigma of each sample", and Fig. 2 draws one size per
point); ``--sigma-shape diagonal`` gives each dimension its own sigma (the earlier default).
Every point's (mu, log sigma) is a free parameter optimised directly with the PCME++ objective
(Eq. 2 with learnable a, b, plus ``zsprob.prob.PCMEPPLoss``'s default pseudo-positive and VIB
weights) by Adam (lr 0.02, 500 epochs, batch 128). The free parameter is log sigma, as App. A.2
writes it (Adam is not invariant to the 2x of log sigma^2 = 2 log sigma); ``--sigma-param logvar``
optimises log sigma^2 instead (this script's earlier behaviour). A mini-batch is matched against
itself, every pair including a point with itself (the official loss called with the same batch
on both sides); points i and j are a positive pair when their current labels agree.
``distance="csd"`` is PCME++; ``"wd"`` the 2-Wasserstein ablation. The paper reports mean sigma^2
uncertain / certain = 1.82 (CSD) and 1.04 (WD).

Options that vary what the paper leaves open (defaults as above): ``--diagonal exclude`` (no
self-pairs), ``--labels once`` (a confusing point's label drawn once, not per visit),
``--pp-alpha 0 --vib-beta 0`` (Eq. 2 alone), ``--fixed-ab`` (a = b = 5 not learned),
``--sigma-shape diagonal`` (a log sigma per dimension).

    python scripts/toy2d.py --out toy2d.png
    python scripts/toy2d.py --seeds 10 --out toy2d.png   # seeds 0-9, mean +- SE (docs/findings.md)
    python scripts/toy2d.py --epochs 100 --out toy2d_e100.png   # nearest the paper's figures (docs/findings.md)
    python scripts/toy2d.py --epochs 100 --per-class 200   # a quick run

Prints, per seed and distance, the mean sigma^2 (per dimension) of certain and uncertain points and
their ratio (and the ratio of geometric means, for reference), and with ``--seeds N`` the ratios'
mean +- SE over the seeds; writes one PNG (the first seed; two panels: points coloured by class, a
circle of radius sigma around each) and a JSON of the figures beside it.
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


def _offdiagonal_loss(criterion, mu: torch.Tensor, logvar: torch.Tensor, matched: torch.Tensor) -> torch.Tensor:
    """PCMEPPLoss's objective on a batch matched against itself, without the pairs (i, i)."""
    from zsprob.prob.losses import pseudo_positive_targets, vib_kl

    bce = torch.nn.functional.binary_cross_entropy_with_logits
    n = len(mu)
    logits = -criterion.scale * criterion.pairwise_distance(mu, logvar, mu, logvar) + criterion.shift
    off = ~torch.eye(n, dtype=torch.bool)
    rows = [(logits[off].view(n, n - 1), matched[off].view(n, n - 1)),              # i2t
            (logits.t()[off].view(n, n - 1), matched.t()[off].view(n, n - 1))]      # t2i
    loss = sum(bce(lg, tg) for lg, tg in rows)
    if criterion.pp_alpha:
        loss = loss + criterion.pp_alpha * sum(bce(lg, pseudo_positive_targets(lg, tg)[0]) for lg, tg in rows)
    if criterion.vib_beta:  # image and text side are the same points
        loss = loss + criterion.vib_beta * 2 * vib_kl(mu, logvar)
    return loss


def train(toy: dict, distance: str, *, epochs: int = 500, batch_size: int = 128, lr: float = 0.02,
          seed: int = 0, sigma_param: str = "logsigma", pp_alpha: float = 0.1, vib_beta: float = 1e-4,
          diagonal: bool = True, labels: str = "per-visit", learn_ab: bool = True,
          sigma_shape: str = "isotropic") -> dict:
    """Optimise every point's (mu, log sigma) with the PCME++ loss under ``distance``; returns the result."""
    from zsprob.prob import PCMEPPLoss

    gen = torch.Generator().manual_seed(seed + 1)
    mu = torch.nn.Parameter(toy["mu"].clone())
    # the free parameter: log sigma (App. A.2) or log sigma^2; the loss always sees log sigma^2
    factor = {"logsigma": 2.0, "logvar": 1.0}[sigma_param]
    # isotropic: one log sigma per point (the first of make_toy's two draws), used for both dimensions
    init = toy["logvar"] if sigma_shape == "diagonal" else toy["logvar"][:, :1]
    free = torch.nn.Parameter(init.clone() / factor)
    criterion = PCMEPPLoss(distance=distance, pp_alpha=pp_alpha, vib_beta=vib_beta)
    criterion.requires_grad_(learn_ab)
    optimizer = torch.optim.Adam([mu, free, *(criterion.parameters() if learn_ab else [])], lr=lr)
    n_points = len(mu)
    if labels == "once":
        coin = torch.rand(n_points, generator=gen) < 0.5
        drawn = torch.where(coin, toy["label"], toy["other"])
    for _ in range(epochs):
        for batch in torch.randperm(n_points, generator=gen).split(batch_size):
            if labels == "once":
                current = drawn[batch]
            else:
                coin = torch.rand(len(batch), generator=gen) < 0.5
                current = torch.where(coin, toy["label"][batch], toy["other"][batch])
            matched = (current[:, None] == current[None, :]).float()
            logvar = (factor * free[batch]).expand(-1, 2)
            if diagonal:
                loss, _ = criterion(mu[batch], logvar, mu[batch], logvar, matched)
            else:
                loss = _offdiagonal_loss(criterion, mu[batch], logvar, matched)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    logvar = (factor * free).detach().expand(-1, 2)
    sigma2 = logvar.exp().mean(1)
    certain = float(sigma2[~toy["uncertain"]].mean())
    uncertain = float(sigma2[toy["uncertain"]].mean())
    log_sigma2 = sigma2.log()
    geo = float((log_sigma2[toy["uncertain"]].mean() - log_sigma2[~toy["uncertain"]].mean()).exp())
    return {"distance": distance, "mean_sigma2_certain": certain, "mean_sigma2_uncertain": uncertain,
            "ratio": uncertain / certain, "ratio_geometric": geo, "a": float(criterion.scale.detach()),
            "b": float(criterion.shift.detach()), "mu": mu.detach(), "logvar": logvar}


def plot(toy: dict, results: list[dict], path, seed: int = 0) -> Path:
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
        ax.set_title(f"{res['distance'].upper()}, seed {seed}: mean sigma^2 uncertain / certain = {res['ratio']:.2f}x",
                     fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=500)
    parser.add_argument("--confusing", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="run seeds --seed ... --seed + N - 1 and print the ratios' mean +- SE over them")
    parser.add_argument("--sigma-param", choices=("logsigma", "logvar"), default="logsigma",
                        help="free parameter: log sigma (App. A.2) or log sigma^2 (the earlier default)")
    parser.add_argument("--pp-alpha", type=float, default=0.1, help="pseudo-positive weight (0: off)")
    parser.add_argument("--vib-beta", type=float, default=1e-4, help="VIB weight (0: off)")
    parser.add_argument("--diagonal", choices=("include", "exclude"), default="include",
                        help="whether a point is paired with itself in the batch")
    parser.add_argument("--labels", choices=("per-visit", "once"), default="per-visit",
                        help="a confusing point's label: redrawn every time it is seen, or drawn once")
    parser.add_argument("--fixed-ab", action="store_true", help="keep a = b = 5 fixed instead of learning them")
    parser.add_argument("--sigma-shape", choices=("isotropic", "diagonal"), default="isotropic",
                        help="one log sigma per point shared by both dimensions (App. A.2), or one per "
                             "dimension (the earlier default)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default="toy2d.png", help="PNG path; a JSON of the figures goes beside it")
    args = parser.parse_args(argv)
    if not 0 < args.confusing < args.per_class or args.epochs < 1 or args.batch_size < 2 or args.seeds < 1:
        print("toy2d: need 0 < --confusing < --per-class, --epochs >= 1, --batch-size >= 2, --seeds >= 1",
              file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    keys = ("mean_sigma2_certain", "mean_sigma2_uncertain", "ratio", "ratio_geometric", "a", "b")
    print("| seed | distance | mean sigma^2 certain | mean sigma^2 uncertain | uncertain / certain | "
          "geometric-mean ratio |")
    print("|---|---|---|---|---|---|")
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        torch.manual_seed(seed)
        toy = make_toy(args.per_class, args.confusing, seed)
        results = [train(toy, name, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=seed,
                         sigma_param=args.sigma_param, pp_alpha=args.pp_alpha, vib_beta=args.vib_beta,
                         diagonal=args.diagonal == "include", labels=args.labels, learn_ab=not args.fixed_ab,
                         sigma_shape=args.sigma_shape)
                   for name in DISTANCES]
        for res in results:
            print(f"| {seed} | {res['distance']} | {res['mean_sigma2_certain']:.4g} | "
                  f"{res['mean_sigma2_uncertain']:.4g} | {res['ratio']:.3f}x | {res['ratio_geometric']:.3f}x |",
                  flush=True)
        if not runs:
            png = plot(toy, results, args.out, seed)  # the figure shows the first seed
        runs.append({"seed": seed, **{res["distance"]: {k: res[k] for k in keys} for res in results}})
    summary = dict(runs[0])
    summary.pop("seed")
    if len(runs) > 1:
        summary["seeds"] = runs
        summary["over_seeds"] = {}
        for name in DISTANCES:
            ratios = np.array([run[name]["ratio"] for run in runs])
            se = float(ratios.std(ddof=1) / math.sqrt(len(ratios)))
            summary["over_seeds"][name] = {"mean_ratio": float(ratios.mean()), "se": se, "n": len(ratios)}
            print(f"{name}: uncertain / certain {ratios.mean():.3f}x +- {se:.3f} (mean +- SE over {len(ratios)} seeds)")
    else:
        print("one seed: the ratios vary from seed to seed; --seeds N prints their mean +- SE over N seeds")
    summary["setup"] = vars(args)
    Path(png).with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {png} and {Path(png).with_suffix('.json')}")
    return 0 if all(math.isfinite(run[name]["ratio"]) for run in runs for name in DISTANCES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
