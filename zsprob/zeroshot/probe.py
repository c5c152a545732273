"""The label-using baselines on frozen image embeddings: CLIP's linear probe and Tip-Adapter.

Both read only the labelled images of a training split (``zsprob probe``: the dataset's train or selection
split; ``zeroshot --compare``: the selection split the label-using prompt strategies read) and classify
L2-normalised image means. The linear probe is scikit-learn's ``LogisticRegression`` (L-BFGS, multinomial,
L2): its inverse regularisation C is swept on a validation split held out of the labelled images, then the
probe is refit on all of them at the chosen C (CLIP's protocol, Radford et al. 2021, appendix A.3). A k-shot
probe draws k images per class per seed, and its validation images are up to min(k, 4) further images of each
class, as in CoOp's few-shot protocol. When no image is left over, C stays at scikit-learn's default of 1.0,
and the result says so. Tip-Adapter (Zhang et al., ECCV 2022) is training-free: it adds, to the zero-shot
logits, alpha times each class's sum of exp(-beta (1 - cos(x, shot))) over its labelled shots. alpha and
beta are chosen on the shots, leave-one-out: each shot is scored by the cache of the others. Tip-Adapter's
fine-tuned variant (Tip-Adapter-F) is not built.
"""
from __future__ import annotations

import warnings

import numpy as np

from zsprob.errors import UserError

#: the inverse regularisation strengths swept (10^-2 .. 10^4, half decades)
C_GRID = tuple(float(c) for c in np.logspace(-2, 4, 13))
VAL_PER_CLASS = 4       # k-shot: at most min(k, 4) validation images per class
FULL_VAL_SHARE = 0.2    # full probe: the share of each class held out to choose C
SHOTS = (1, 2, 4, 8, 16)
TIP_ALPHAS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
TIP_BETAS = (1.0, 2.0, 3.5, 5.5, 8.0, 12.0)
#: the protocol facts of a label-using baseline in ``--compare`` (the keys every strategy's audit carries)
SELECT_AUDIT = {"reads_eval_labels": False, "transductive": False, "label_split": "selection split"}


def unit_rows(x) -> np.ndarray:
    """float64 rows scaled to unit length (the cosine geometry zero-shot classification uses)."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def class_counts(labels, classnames, split: str) -> np.ndarray:
    """Images per class of a labelled split; one line when a class has none."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(classnames))
    empty = [classnames[c] for c in np.flatnonzero(counts == 0)]
    if empty:
        raise UserError(f"the {split} has no image of class {empty[0]!r} ({len(empty)} of {len(classnames)} classes "
                        "have none); a probe needs labelled images of every class")
    return counts


def draw_shots(labels, k: int, seed: int, classnames, split: str = "training split"):
    """(train, validation) indices: per class, k images drawn with ``seed`` and up to min(k, 4) more."""
    y = np.asarray(labels, dtype=np.int64)
    counts = class_counts(y, classnames, split)
    if counts.min() < k:
        c = int(counts.argmin())
        raise UserError(f"{k} shots per class, but class {classnames[c]!r} of the {split} has {counts[c]} images; "
                        f"choose --shots at most {counts.min()}")
    rng = np.random.default_rng([int(seed), int(k)])
    train, val = [], []
    for c in range(len(classnames)):
        idx = rng.permutation(np.flatnonzero(y == c))
        train.append(idx[:k])
        val.append(idx[k:k + min(k, VAL_PER_CLASS)])
    return np.concatenate(train), np.concatenate(val)


def hold_out(labels, classnames, seed: int = 0, share: float = FULL_VAL_SHARE, split: str = "training split"):
    """(train, validation) indices of the full probe: ``share`` of each class (rounded down, at least one of a
    class with two images or more) held out."""
    y = np.asarray(labels, dtype=np.int64)
    class_counts(y, classnames, split)
    rng = np.random.default_rng(int(seed))
    train, val = [], []
    for c in range(len(classnames)):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_val = max(1, int(share * len(idx))) if len(idx) >= 2 else 0
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.concatenate(train), np.concatenate(val)


def _fit(x, y, C: float, tol: float = 1e-4):
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model = LogisticRegression(C=C, max_iter=1000, tol=tol).fit(x, y)
    model.converged_ = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    return model


def probe_scores(model, x, n_classes: int) -> np.ndarray:
    """[N, n_classes] log-probabilities of a fitted probe (-inf for a class it never saw)."""
    out = np.full((len(x), n_classes), -np.inf)
    out[:, model.classes_] = model.predict_log_proba(x)
    return out


def fit_probe(x, y, n_classes: int, *, val=None, c_grid=C_GRID, tol: float = 1e-4):
    """``(model, info)``: C chosen by validation accuracy over ``c_grid`` (ties, frequent on a few validation
    images: the lower validation log-loss), then the probe refit on train + validation at that C; without
    validation images, C = 1.0."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)
    sweep, losses = [], []
    if val is not None and len(val[1]):
        xv, yv = np.asarray(val[0], dtype=np.float64), np.asarray(val[1], dtype=np.int64)
        for C in c_grid:
            logp = probe_scores(_fit(x, y, C, tol), xv, n_classes)
            sweep.append(float((logp.argmax(1) == yv).mean()))
            losses.append(float(-logp[np.arange(len(yv)), yv].mean()))
        best = float(c_grid[min(range(len(c_grid)), key=lambda i: (-sweep[i], losses[i]))])
        x, y = np.concatenate([x, xv]), np.concatenate([y, yv])
        how = "swept on held-out validation images, then refit on all"
    else:
        best, how = 1.0, "scikit-learn's default (no image left for validation)"
    model = _fit(x, y, best, tol)
    info = {"C": best, "C_chosen_by": how,
            "c_sweep": {"C": list(c_grid), "val_accuracy": sweep, "val_log_loss": losses} if sweep else None,
            "n_train": int(len(y)), "converged": bool(model.converged_)}
    return model, info


def full_probe(x, y, classnames, split: str = "training split"):
    """``(model, info)`` of the probe on every labelled image: C swept on the images :func:`hold_out` sets
    aside, then refit on all of them."""
    tr, va = hold_out(y, classnames, split=split)
    return fit_probe(x[tr], y[tr], len(classnames), val=(x[va], y[va]))


def tip_adapter_scores(zs_logits, x, shots_x, shots_y, n_classes: int, alpha: float, beta: float) -> np.ndarray:
    """Tip-Adapter's logits: zero-shot logits + alpha * sum over each class's shots of exp(-beta (1 - cos))."""
    affinity = np.exp(-beta * (1.0 - unit_rows(x) @ unit_rows(shots_x).T))
    return np.asarray(zs_logits, dtype=np.float64) + alpha * affinity @ np.eye(n_classes)[shots_y]


def tip_adapter_search(zs_logits, shots_x, shots_y, n_classes: int, *, alphas=TIP_ALPHAS, betas=TIP_BETAS) -> dict:
    """alpha and beta by leave-one-out accuracy on the shots (each scored by the others' cache; ties: first in
    grid order)."""
    f = unit_rows(shots_x)
    cos = f @ f.T
    onehot = np.eye(n_classes)[shots_y]
    best = (-1.0, None, None)
    for beta in betas:
        affinity = np.exp(-beta * (1.0 - cos))
        np.fill_diagonal(affinity, 0.0)
        cache = affinity @ onehot
        for alpha in alphas:
            acc = float(((np.asarray(zs_logits) + alpha * cache).argmax(1) == shots_y).mean())
            if acc > best[0]:
                best = (acc, alpha, beta)
    return {"alpha": best[1], "beta": best[2], "loo_accuracy": best[0], "alphas": list(alphas), "betas": list(betas)}


# ----------------------------------------------------------------------------- zsprob probe

def shots_for(counts, shots=None) -> tuple[list[int], list[int]]:
    """(the k values to run, the default ones dropped): ``shots`` given are all kept (:func:`draw_shots` refuses
    one larger than a class); by default :data:`SHOTS` up to the smallest class."""
    if shots is not None:
        return sorted(set(int(k) for k in shots)), []
    smallest = int(np.min(counts))
    return [k for k in SHOTS if k <= smallest], [k for k in SHOTS if k > smallest]


def seed_summary(values) -> dict:
    """Mean over seeds with its standard error and Student-t 95% interval (None for one seed)."""
    from scipy.stats import t

    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return {"mean": mean, "se": None, "ci95": None, "n_seeds": len(v)}
    se = float(v.std(ddof=1) / np.sqrt(len(v)))
    half = float(t.ppf(0.975, len(v) - 1)) * se
    return {"mean": mean, "se": se, "ci95": [mean - half, mean + half], "n_seeds": len(v)}


def _top1(model, x, y, n_classes: int) -> float:
    return 100.0 * float((probe_scores(model, x, n_classes).argmax(1) == y).mean())


def probe_on_features(train, test, *, shots=None, seeds: int = 3) -> dict:
    """The full probe (C held out, then refit) and the k-shot probes (``seeds`` draws per k) trained on ``train``'s
    features and scored on ``test``'s (:class:`~zsprob.zeroshot.features.ImageFeatures`, labels in the same
    class order): ``{"metrics", "probe", "kshot", "shots_dropped"}``."""
    import torch

    from zsprob.zeroshot.metrics import evaluate_scores

    names, n_classes = list(test.classnames), len(test.classnames)
    xs, ys = unit_rows(train.mu), train.labels.numpy()
    xt, yt = unit_rows(test.mu), test.labels.numpy()
    ks, dropped = shots_for(class_counts(ys, names, "training split"), shots)
    model, info = full_probe(xs, ys, names)
    metrics = evaluate_scores(torch.from_numpy(probe_scores(model, xt, n_classes)), test.labels, names,
                              test.uncertainty)
    kshot = {}
    for k in ks:
        runs = []
        for seed in range(seeds):
            tr, va = draw_shots(ys, k, seed, names)
            m, fit = fit_probe(xs[tr], ys[tr], n_classes, val=(xs[va], ys[va]))
            runs.append({"seed": seed, "top1": _top1(m, xt, yt, n_classes), "C": fit["C"],
                         "C_chosen_by": fit["C_chosen_by"], "converged": fit["converged"]})
        kshot[str(k)] = {"top1": seed_summary([r["top1"] for r in runs]), "runs": runs}
    return {"metrics": metrics, "probe": info, "kshot": kshot, "shots_dropped": dropped}


def plot_probe(result: dict, path, title: str = "") -> str:
    """k-shot top-1 (mean over seeds, 95% interval) against k, with the full probe as a line."""
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ks = [int(k) for k in result["kshot"]]
    if ks:
        rows = [result["kshot"][str(k)]["top1"] for k in ks]
        means = [r["mean"] for r in rows]
        err = [[m - (r["ci95"] or [m, m])[0] for m, r in zip(means, rows)],
               [(r["ci95"] or [m, m])[1] - m for m, r in zip(means, rows)]]
        ax.errorbar(ks, means, yerr=err, marker="o", capsize=3, label="k-shot linear probe (95% CI over seeds)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
    ax.axhline(result["metrics"]["top1"], ls="--", color="gray", label="linear probe, all labelled images")
    ax.set_xlabel("labelled images per class (k)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return str(save_figure(fig, path, dpi=120))


# ----------------------------------------------------------------------------- the --compare rows

def label_baseline_rows(all_selection, eval_feats, select_feats, *, logit_scale: float):
    """The ``--compare`` rows of the linear probe and Tip-Adapter, trained on exactly the selection split's
    labelled images (those the label-using prompt strategies read): ``[(row, per-image top-1 hits)]``."""
    import time

    import torch

    from zsprob.zeroshot.metrics import class_scores, evaluate_scores

    names, n_classes = list(eval_feats.classnames), len(eval_feats.classnames)
    xs, ys = unit_rows(select_feats.mu), select_feats.labels.numpy()
    xe = unit_rows(eval_feats.mu)
    common = {"uses_eval_labels": False, **SELECT_AUDIT,
              "data_used": f"selection split labels ({len(ys)} images)"}
    t0 = time.perf_counter()
    model, info = full_probe(xs, ys, names, split="selection split")
    probe = probe_scores(model, xe, n_classes)
    t1 = time.perf_counter()

    def zero_shot(feats):  # CLIP's all-templates classifier, as Tip-Adapter uses it
        return logit_scale * class_scores(feats.mu, None, all_selection, score="cosine").double().numpy()

    tip = tip_adapter_search(zero_shot(select_feats), xs, ys, n_classes)
    tip_logits = tip_adapter_scores(zero_shot(eval_feats), xe, xs, ys, n_classes, tip["alpha"], tip["beta"])
    t2 = time.perf_counter()
    out = []
    for name, label, scores, row_info, secs in (
            ("linear-probe", "linear probe (selection labels)", probe, info, t1 - t0),
            ("tip-adapter", "Tip-Adapter (selection labels)", tip_logits,
             {**tip, "logit_scale": float(logit_scale), "zero_shot": "all (every template)"}, t2 - t1)):
        logits = torch.from_numpy(scores)
        metrics = evaluate_scores(logits, eval_feats.labels, names, eval_feats.uncertainty)
        row = {"name": name, "label": label, "metrics": metrics, **common, "seconds": secs, "info": row_info,
               **_calibration(logits, eval_feats.labels)}
        out.append((row, torch.from_numpy(scores.argmax(1)) == eval_feats.labels.long()))
    return out


def _calibration(logits, labels) -> dict:
    """The calibration fields of a baseline row at T = 1; no temperature is fitted, for the only labelled
    images are those the row was trained on."""
    from zsprob.zeroshot.calibration import ROW_FIELDS, calibration_report

    report = calibration_report(logits, labels)
    report["temperature_role"] = "not fitted: the row is trained on the selection split, the only labelled images"
    return {**{k: report[k] for k in ROW_FIELDS}, "calibration": report}
