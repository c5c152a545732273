"""Retrieval evaluation and uncertainty analyses on SynthWorld's retrieval split.

Scored as ``caption`` (five-caption positives, the COCO protocol) and ``plausible`` (SynthWorld's exact
plausible-match matrix, the ECCV Caption protocol); uncertainty is set against the exact caption ambiguity.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from zsprob.retrieval import analysis as A
from zsprob.retrieval import metrics as M
from zsprob.retrieval.embeddings import Embeddings, encode_split
from zsprob.retrieval.scoring import mc_score_options
from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
from zsprob.retrieval.evaluate import evaluate_embeddings, format_table


def synthetic_task(split) -> RetrievalTask:
    """A :class:`RetrievalTask` from a ``RetrievalSplit``."""
    n_img = len(split.image_paths)
    cap_img = np.asarray(split.caption_image, dtype=np.int64)
    five = M.positives_from_assignment(cap_img, n_img)
    pm = sp.csr_matrix(split.positives, dtype=bool)
    pm = (pm + five).astype(bool).tocsr()  # a caption is always true of its own image
    return RetrievalTask(
        name=f"synthworld-{split.split}", image_ids=np.asarray(split.image_ids, dtype=np.int64),
        caption_ids=np.asarray(split.caption_ids, dtype=np.int64), caption_image=cap_img,
        sets=[BenchmarkSet("caption", five, sp.csr_matrix(five.T)),
              BenchmarkSet("plausible", pm, sp.csr_matrix(pm.T), kind="precision")],
        notes=["caption: five-caption positives (R@K, RSUM); plausible: exact plausible-match positives (mAP@R, R-P)"])


def ground_truth_uncertainty(emb: Embeddings, split) -> dict:
    """Text uncertainty vs caption ambiguity; image uncertainty vs #objects and condition (embeddings with sigma)."""
    u_img, u_cap = emb.uncertainty()
    n_obj = np.array([m.get("num_objects", len(m.get("objects", []))) for m in split.image_meta], dtype=np.float64)
    cond = [m.get("condition", "unknown") for m in split.image_meta]
    normal = np.array([c == "normal" for c in cond])
    return {
        "text_uncertainty_vs_ambiguity": A.spearman(u_cap, split.caption_ambiguity),
        "image_uncertainty_vs_num_objects": A.spearman(u_img, n_obj),
        "image_uncertainty_by_num_objects": A.group_stats(u_img, n_obj.astype(int)),
        "image_uncertainty_by_condition": A.group_stats(u_img, cond),
        "image_uncertainty_normal_vs_other": A.spearman(u_img, (~normal).astype(float)),
        "mean_text_uncertainty": float(u_cap.mean()), "mean_image_uncertainty": float(u_img.mean()),
    }


def _plot_groups(gt: dict, path) -> Path:
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120, gridspec_kw={"width_ratios": [1, 3]})
    for ax, key, xl in ((axes[0], "image_uncertainty_by_num_objects", "number of objects"),
                        (axes[1], "image_uncertainty_by_condition", "condition")):
        g = gt[key]
        names = list(g)
        ax.bar(range(len(names)), [g[k]["mean"] for k in names], yerr=[g[k]["std"] for k in names], capsize=2)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center",
                           fontsize=7)
        ax.set_xlabel(xl)
        ax.set_ylabel("image ||sigma^2||_1")
    return save_figure(fig, path)


def _plot_ambiguity(emb: Embeddings, split, gt: dict, path) -> Path:
    """Scatter of caption uncertainty against ground-truth caption ambiguity, with Spearman's rho."""
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()

    _, u_cap = emb.uncertainty()
    amb = np.asarray(split.caption_ambiguity, dtype=np.float64)
    rho = (gt.get("text_uncertainty_vs_ambiguity") or {}).get("rho", float("nan"))
    fig, ax = plt.subplots(figsize=(5.6, 4.0), dpi=120)
    ax.scatter(amb, u_cap, s=6, alpha=0.35, edgecolors="none")
    # mean uncertainty per ambiguity decile, to show the trend through the cloud
    edges = np.quantile(amb, np.linspace(0, 1, 11))
    idx = np.clip(np.searchsorted(edges, amb, side="right") - 1, 0, 9)
    xs = [amb[idx == b].mean() for b in range(10) if (idx == b).any()]
    ys = [u_cap[idx == b].mean() for b in range(10) if (idx == b).any()]
    ax.plot(xs, ys, "o-", color="C3", lw=2, label="mean per ambiguity decile")
    ax.set_xlabel("caption ambiguity: log fraction of scenes the caption is true of\n(right = vaguer)")
    ax.set_ylabel("caption uncertainty ||sigma^2||_1")
    ax.set_title(f"Text uncertainty vs ground-truth ambiguity (Spearman {rho:.3f})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def evaluate_synthetic(model, root, split: str = "test", score: str = "csd", out_dir=None, *,
                       batch_size: int = 128, device=None, corruption: bool = True, n_corruption: int = 64,
                       progress: bool = False, seed: int = 0, metrics_file: str = "metrics.json",
                       validity: bool = True, n_pairs: int = 1000, n_crops: int = 300, num_workers: int = 0,
                       precision: str = "fp32") -> dict:
    """Evaluate ``model`` on SynthWorld's retrieval ``split`` (root: a SynthWorld folder). Returns ``metrics``
    (percent), ``summary``, ``table``, for probabilistic models ``uncertainty`` (``deciles``, ``ground_truth``,
    ``corruption``) and, with ``validity``, ``uncertainty_validity`` / ``validity_table``; ``files``: what was
    written under ``out_dir``."""
    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.retrieval.evaluate import summary_row
    from zsprob.utils.io import atomic_write_json, atomic_write_text

    rs = load_retrieval_split(root, split)
    out_dir = None if out_dir is None else Path(out_dir)
    emb = encode_split(model, rs, batch_size=batch_size, device=device, progress=progress, num_workers=num_workers,
                       precision=precision)
    task = synthetic_task(rs)
    mc = mc_score_options(model) if score == "mc" else {}
    from zsprob.models.logit_scale import model_logit_scale
    res = evaluate_embeddings(emb, task, score=score, keep_top=5, seed=seed, device=device,
                              logit_scale=model_logit_scale(model, score)[0], **mc)
    out = {"metrics": res.metrics, "summary": summary_row(res.metrics), "selective": res.selective,
           "table": format_table(res.metrics, label=getattr(model, "name", "model")), "files": {}}
    if emb.has_sigma:
        unc = A.report_uncertainty(emb, res, task, out_dir, image_paths=rs.image_paths, captions=rs.captions)
        gt = ground_truth_uncertainty(emb, rs)
        out["uncertainty"] = {"deciles": unc["deciles"], "ground_truth": gt}
        out["files"].update(unc["files"])
        if validity:
            from zsprob.retrieval.validity import uncertainty_validity, validity_table

            out["uncertainty_validity"] = uncertainty_validity(model, rs, emb, unc["deciles"], seed=seed,
                                                               n_pairs=n_pairs, n_crops=n_crops,
                                                               batch_size=batch_size, device=device)
            out["validity_table"] = validity_table(out["uncertainty_validity"], getattr(model, "name", "model"))
        if corruption:
            k = min(n_corruption, len(rs.image_paths))
            sweep = A.corruption_sweep(model, rs.image_paths[:k], rs.captions[: 5 * k : 5], seed=seed,
                                       batch_size=min(64, batch_size), device=device)
            out["uncertainty"]["corruption"] = sweep
        if out_dir is not None:
            out["files"]["groups_png"] = str(_plot_groups(gt, out_dir / A.FILES["groups_png"]))
            out["files"]["ambiguity_png"] = str(_plot_ambiguity(emb, rs, gt, out_dir / A.FILES["ambiguity_png"]))
            if corruption:
                out["files"]["corruption_png"] = str(A.plot_corruption(sweep, out_dir / A.FILES["corruption_png"]))
    else:
        out["uncertainty"] = None
        out["uncertainty_validity"] = None
    if out_dir is not None:
        out["files"]["table"] = str(atomic_write_text(out_dir / A.FILES["table"], out["table"]))
        out["files"]["metrics"] = str(out_dir / metrics_file)
        from zsprob.models.fingerprint import model_identity
        atomic_write_json(out_dir / metrics_file, {"model": model_identity(model),
                                                   "metrics": out["metrics"], "summary": out["summary"],
                                                   "selective": out["selective"],
                                                   "uncertainty": out["uncertainty"],
                                                   "uncertainty_validity": out.get("uncertainty_validity"),
                                                   "validity_table": out.get("validity_table"),
                                                   "files": out["files"]})
    return out
