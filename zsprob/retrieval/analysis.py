"""Uncertainty analyses of a probabilistic retrieval model (PCME++ Fig. 5-6, PCME Fig. 6-7), and the names
of the files an evaluation writes (:data:`FILES`; torch-free, so the command line reads them at once).

R@1 per uncertainty decile (:func:`uncertainty_deciles`), the most / least uncertain queries as a markdown
page (:func:`uncertain_queries_page`), sigma^2 as inputs are erased or masked (:func:`corruption_sweep`), plots.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

import numpy as np

#: what an evaluation writes beside its metrics JSON, by its key in the result's "files": the table, and for
#: probabilistic models the uncertainty analyses (the last three on SynthWorld only)
FILES = {"table": "table.md", "deciles_png": "uncertainty_deciles.png", "deciles_md": "uncertainty_deciles.md",
         "uncertain_queries": "uncertain_queries.md", "groups_png": "uncertainty_groups.png",
         "ambiguity_png": "uncertainty_vs_ambiguity.png", "corruption_png": "corruption.png"}
#: the folder of the uncertain-queries page's thumbnails
THUMBS = "thumbs"


def spearman(x, y) -> dict[str, float]:
    """Spearman rank correlation (scipy) as ``{"rho", "p", "n"}``; NaN when undefined."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return {"rho": float("nan"), "p": float("nan"), "n": int(ok.sum())}
    r = spearmanr(x[ok], y[ok])
    return {"rho": float(r.statistic), "p": float(r.pvalue), "n": int(ok.sum())}


def neg_sr2(bin_r1) -> dict[str, float]:
    """ProbVLM's calibration figure ``-S R^2`` of R@1 per uncertainty bin (bin 1 = most certain): S =
    Spearman(bin, R@1), R^2 of the line R@1 ~ bin; in [-1, 1], higher is better. ``{"s", "r2", "neg_sr2"}``,
    NaN with fewer than three bins or the same R@1 in each."""
    y = np.asarray(bin_r1, dtype=np.float64)
    x = np.arange(1, len(y) + 1, dtype=np.float64)
    if len(y) < 3 or np.ptp(y) == 0:
        return {"s": float("nan"), "r2": float("nan"), "neg_sr2": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)
    r2 = 1.0 - float(((y - (slope * x + intercept)) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    s = spearman(x, y)["rho"]
    return {"s": s, "r2": r2, "neg_sr2": -s * r2}


def uncertainty_deciles(uncertainty, correct, n_bins: int = 10) -> dict:
    """R@1 in percent (mean of ``correct``) per equal-count bin of ``uncertainty`` by rank (bin 0 = most
    certain): ``{"bins": [{"bin", "lo", "hi", "n", "r1"}], "spearman_bins", "spearman_queries", "sr2"}``."""
    u = np.asarray(uncertainty, dtype=np.float64)
    c = np.asarray(correct, dtype=np.float64)
    order = np.argsort(u, kind="stable")
    bins = []
    for b, idx in enumerate(np.array_split(order, n_bins)):
        if len(idx) == 0:
            continue
        bins.append({"bin": b, "lo": float(u[idx].min()), "hi": float(u[idx].max()), "n": int(len(idx)),
                     "r1": float(100.0 * c[idx].mean())})
    return {"bins": bins,
            "spearman_bins": spearman([b["bin"] for b in bins], [b["r1"] for b in bins]),
            "spearman_queries": spearman(u, c), "sr2": neg_sr2([b["r1"] for b in bins])}


def deciles_table(results: dict[str, dict]) -> str:
    """Markdown table: one column of R@1 per direction (e.g. {"image queries": d, "caption queries": d})."""
    names = list(results)
    n = max(len(r["bins"]) for r in results.values())
    lines = ["| decile (low -> high uncertainty) | " + " | ".join(f"{k} R@1" for k in names) + " |",
             "|---|" + "---|" * len(names)]
    for b in range(n):
        cells = []
        for k in names:
            bb = results[k]["bins"]
            cells.append(f"{bb[b]['r1']:.1f} (u {bb[b]['lo']:.3g}-{bb[b]['hi']:.3g})" if b < len(bb) else "")
        lines.append(f"| {b + 1} | " + " | ".join(cells) + " |")
    lines.append("| Spearman(decile, R@1) | "
                 + " | ".join(f"{results[k]['spearman_bins']['rho']:.3f}" for k in names) + " |")
    lines.append("| Spearman(u, correct) per query | " + " | ".join(
        f"{results[k]['spearman_queries']['rho']:.3f}" for k in names) + " |")
    lines.append("| -SR^2 (ProbVLM; higher = better) | " + " | ".join(
        f"{results[k]['sr2']['neg_sr2']:.3f} (S {results[k]['sr2']['s']:.3f}, R^2 {results[k]['sr2']['r2']:.3f})"
        for k in names) + " |")
    return "\n".join(lines) + "\n"


def plot_deciles(results: dict[str, dict], path, title: str = "R@1 per uncertainty decile") -> Path:
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for name, r in results.items():
        xs = [b["bin"] + 1 for b in r["bins"]]
        ax.plot(xs, [b["r1"] for b in r["bins"]], marker="o",
                label=f"{name} (rho={r['spearman_bins']['rho']:.2f})")
    ax.set_xlabel("uncertainty decile (||sigma^2||_1, 1 = most certain)")
    ax.set_ylabel("R@1 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _thumb(src, out_dir: Path, name: str, size: int = 96) -> str | None:
    """A JPEG thumbnail of ``src`` in ``out_dir``, as a link relative to the page (None if it cannot be read)."""
    from PIL import Image

    try:
        with Image.open(src) as im:
            im = im.convert("RGB")
            im.thumbnail((size, size))
            out_dir.mkdir(parents=True, exist_ok=True)
            p = out_dir / f"{name}.jpg"
            im.save(p, quality=85)
            return f"{out_dir.name}/{p.name}"
    except OSError:
        return None


def uncertain_queries_page(out_dir, *, image_uncertainty, caption_uncertainty, i2t_top, t2i_top,
                           i2t_positives=None, image_paths: Sequence | None = None,
                           captions: Sequence[str] | None = None, image_ids: Sequence[int] | None = None,
                           caption_ids: Sequence[int] | None = None,
                           n: int = 5, top: int = 5, title: str = "Most and least uncertain queries") -> Path:
    """Write ``out_dir/uncertain_queries.md`` (+ thumbnails): for image and caption queries, the ``n`` most
    and least uncertain ones with their top-``top`` items, annotated positives (``i2t_positives`` CSR
    [n_img, n_cap]) checked."""
    out_dir = Path(out_dir)
    thumbs = out_dir / THUMBS
    pos = None if i2t_positives is None else i2t_positives.tocsr()

    def is_pos(i, c):
        return pos is not None and bool(pos[i, c])

    def img_cell(i):
        label = f"image {image_ids[i] if image_ids is not None else i}"
        t = _thumb(image_paths[i], thumbs, f"img{i}") if image_paths is not None else None
        return f"![{label}]({t})<br>{label}" if t else label

    def cap_cell(c):
        txt = captions[c] if captions is not None else f"caption {caption_ids[c] if caption_ids is not None else c}"
        return html.escape(str(txt)).replace("|", "\\|")

    lines = [f"# {title}", "",
             "Uncertainty = ||sigma^2||_1 of the query embedding. A check mark marks an annotated positive; "
             "unmarked items near the top of uncertain queries are often plausible but unannotated matches.", ""]
    i2t_top, t2i_top = np.asarray(i2t_top), np.asarray(t2i_top)
    for label, unc, topl, q_cell, g_cell, pair in (
            ("Image queries", np.asarray(image_uncertainty), i2t_top, img_cell, cap_cell, lambda q, g: is_pos(q, g)),
            ("Caption queries", np.asarray(caption_uncertainty), t2i_top, cap_cell, img_cell,
             lambda q, g: is_pos(g, q))):
        order = np.argsort(unc, kind="stable")
        for which, qs in (("most uncertain", order[::-1][:n]), ("least uncertain", order[:n])):
            lines += [f"## {label}: {which}", "",
                      "| query | uncertainty | " + " | ".join(f"#{r + 1}" for r in range(top)) + " |",
                      "|---|---|" + "---|" * top]
            for q in qs:
                cells = [(("&#10003; " if pair(q, g) else "") + g_cell(g)) for g in topl[q][:top]]
                lines.append(f"| {q_cell(q)} | {unc[q]:.4g} | " + " | ".join(cells) + " |")
            lines.append("")
    out_dir.mkdir(parents=True, exist_ok=True)
    from zsprob.utils.io import atomic_write_text

    return atomic_write_text(out_dir / FILES["uncertain_queries"], "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- corruption
def erase_pixels(img, fraction: float, rng: np.random.Generator, fill: int = 0):
    """A copy of a PIL image with ``fraction`` of its pixels set to ``fill`` (uniformly at random)."""
    from PIL import Image

    a = np.array(img.convert("RGB"))
    h, w = a.shape[:2]
    k = int(round(fraction * h * w))
    if k:
        flat = rng.choice(h * w, size=k, replace=False)
        a.reshape(h * w, 3)[flat] = fill
    return Image.fromarray(a)


def mask_words(caption: str, fraction: float, rng: np.random.Generator) -> str:
    """Erase ``fraction`` of the words of ``caption`` (at least one word is kept)."""
    words = caption.split()
    k = min(int(round(fraction * len(words))), max(0, len(words) - 1))
    if k == 0:
        return caption
    drop = set(rng.choice(len(words), size=k, replace=False).tolist())
    return " ".join(w for i, w in enumerate(words) if i not in drop)


def corruption_sweep(model, images: Sequence, captions: Sequence[str], *,
                     fractions: Sequence[float] = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9), seed: int = 0,
                     batch_size: int = 64, device=None) -> dict:
    """Mean uncertainty of images (PIL images or paths) with erased pixels and captions with masked words:
    ``{"fractions", "image": {"mean_sigma2", "mean_l1"}, "text": {...}, "spearman_image", "spearman_text"}``."""
    import torch

    from zsprob.data.images import open_rgb, to_rgb
    from zsprob.models.encode import encode_images, encode_texts

    pil = [open_rgb(im) if isinstance(im, (str, Path)) else to_rgb(im) for im in images]
    out = {"fractions": [float(f) for f in fractions], "image": {"mean_sigma2": [], "mean_l1": []},
           "text": {"mean_sigma2": [], "mean_l1": []}, "n_images": len(pil), "n_captions": len(captions)}
    for f in fractions:
        rng = np.random.default_rng(seed)
        batch = torch.stack([model.preprocess_val(erase_pixels(im, f, rng)) for im in pil])
        _, image_lv = encode_images(model, batch, batch_size=batch_size, device=device, progress=False)
        rng = np.random.default_rng(seed)
        texts = [mask_words(c, f, rng) for c in captions]
        _, text_lv = encode_texts(model, texts, batch_size=batch_size * 4, device=device, progress=False)
        for key, lv in (("image", image_lv), ("text", text_lv)):
            out[key]["mean_sigma2"].append(float(lv.exp().mean()))
            out[key]["mean_l1"].append(float(lv.exp().sum(1).mean()))
    for key in ("image", "text"):
        out[f"spearman_{key}"] = spearman(out["fractions"], out[key]["mean_sigma2"])
    return out


def plot_corruption(sweep: dict, path) -> Path:
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=120)
    for ax, key, xl in ((axes[0], "image", "fraction of erased pixels"), (axes[1], "text", "fraction of masked words")):
        ax.plot(sweep["fractions"], sweep[key]["mean_sigma2"], marker="o")
        ax.set_xlabel(xl)
        ax.set_ylabel("mean sigma^2")
        ax.set_title(f"{key} (rho={sweep[f'spearman_{key}']['rho']:.2f})")
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def group_stats(values, groups) -> dict[str, dict]:
    """Mean / std / n of ``values`` per group label (e.g. image uncertainty per condition)."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray([str(g) for g in groups])
    out = {}
    for g in sorted(set(groups.tolist()), key=lambda s: (len(s), s)):
        v = values[groups == g]
        out[g] = {"mean": float(v.mean()), "std": float(v.std()), "n": int(len(v))}
    return out


def report_uncertainty(emb, result, task, out_dir=None, *, image_paths=None, captions=None, n_pages: int = 5) -> dict:
    """R@1 per uncertainty decile of ``result`` (an EvalResult; the task's first recall set) for image and
    caption queries, written under ``out_dir`` with the uncertain-queries page (when top lists were kept).
    Returns ``{"deciles": {...}, "files": {...}}`` (embeddings with sigma)."""
    from zsprob.utils.io import atomic_write_text

    u_img, u_cap = emb.uncertainty()
    dec = {}
    for name, d, u in (("image queries", "i2t", u_img), ("caption queries", "t2i", u_cap)):
        pq = result.per_query.get(d)
        if pq is None:
            continue
        dec[name] = uncertainty_deciles(u[pq["queries"]], pq["r@1"])
        dec[name]["benchmark"] = pq["set"]
    files = {}
    if out_dir is not None and dec:
        out_dir = Path(out_dir)
        files["deciles_png"] = str(plot_deciles(dec, out_dir / FILES["deciles_png"]))
        files["deciles_md"] = str(atomic_write_text(out_dir / FILES["deciles_md"], deciles_table(dec)))
        if result.top:
            files["uncertain_queries"] = str(uncertain_queries_page(
                out_dir, image_uncertainty=u_img, caption_uncertainty=u_cap, i2t_top=result.top["i2t"],
                t2i_top=result.top["t2i"], i2t_positives=task.caption_positives(), image_paths=image_paths,
                captions=captions, image_ids=task.image_ids, caption_ids=task.caption_ids, n=n_pages))
    return {"deciles": dec, "files": files}
