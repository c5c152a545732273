"""Zero-shot classification: scoring, metrics, image-embedding cache and ``--compare``.

What the libraries do: images are read by ``zsprob.data.classification`` (folders, ImageNet,
SynthWorld splits) with the model's open_clip ``preprocess_val`` transform, embedded by
``zsprob.models.encode.encode_images``; CSD and the other Gaussian scores come from
``zsprob.prob.score``; plots are matplotlib. zsprob writes here: the class scores
(cosine of means by default), top-1/top-5/per-class accuracy and image-uncertainty bins,
the on-disk cache of image embeddings (safetensors, keyed by model fingerprint + dataset
identity), and :func:`compare_strategies`, which scores every prompt strategy of
:mod:`zsprob.zeroshot.selection` on one set of cached embeddings.

Honesty: only ``oracle`` / ``oracle-global`` ever receive evaluation labels; ZPE and BPRW
receive the evaluation images without labels (both papers are transductive that way).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from zsprob.errors import UserError
from zsprob.zeroshot.options import parse_k_grid, strategy_from_topk  # noqa: F401  (re-exported)

SCORES = ("cosine", "csd", "unc")
DATASET_KINDS = ("imagenet", "synthetic", "folder")
COMPARE_ORDER = ("all", "single", "global", "auto", "threshold", "fusion", "fusion-select", "poe",
                 "bprw", "zpe", "oracle-global", "oracle")


# ----------------------------------------------------------------------------- image features

@dataclass
class ImageFeatures:
    """Cached image embeddings of one split: ``mu`` [N, D], ``logvar`` [N, D] or None, ``labels`` [N]."""

    mu: torch.Tensor
    logvar: torch.Tensor | None
    labels: torch.Tensor
    classnames: list[str]
    source: str = ""
    from_cache: bool = False
    seconds: float = 0.0

    @property
    def feats(self):
        return (self.mu, self.logvar)

    @property
    def uncertainty(self):
        return None if self.logvar is None else self.logvar.exp().sum(-1)

    def __len__(self) -> int:
        return int(self.mu.shape[0])


def load_split(kind: str, root, split: str | None, transform=None):
    """A classification dataset through ``zsprob.data.classification`` (items ``(image, label)``)."""
    if kind not in DATASET_KINDS:
        raise UserError(f"unknown dataset kind {kind!r}; choose from {', '.join(DATASET_KINDS)}")
    from zsprob.data.classification import build_classification_dataset

    return build_classification_dataset(kind, root, split=split, transform=transform)


def _dataset_identity(kind, root, split, ds) -> dict:
    targets = list(getattr(ds, "targets", []))
    h = hashlib.sha256(json.dumps(targets).encode())
    for attr in ("samples", "paths", "image_paths", "files"):
        v = getattr(ds, attr, None)
        if v is not None:
            try:
                h.update(json.dumps([str(p if not isinstance(p, (tuple, list)) else p[0]) for p in v]).encode())
            except TypeError:
                pass
            break
    return {"kind": kind, "root": str(Path(root).resolve()), "split": split, "n": len(ds),
            "classnames": list(ds.classnames), "content": h.hexdigest()[:24]}


def encode_split(model, kind: str, root, split: str | None, *, model_id: str, cache_dir=None,
                 batch_size: int = 256, device=None, num_workers: int = 0, progress: bool = True) -> ImageFeatures:
    """Embed a classification split (cached on disk by model fingerprint + dataset identity)."""
    from zsprob.utils.io import atomic_write, atomic_write_json

    ds = load_split(kind, root, split, transform=getattr(model, "preprocess_val", None))
    if len(ds) == 0:
        raise UserError(f"{kind} split {split or ''} under {root} has no images")
    ident = _dataset_identity(kind, root, split, ds)
    ident["transform"] = repr(getattr(model, "preprocess_val", None))
    key = hashlib.sha256(json.dumps({"model": model_id, **ident}, sort_keys=True).encode()).hexdigest()
    labels = torch.as_tensor(list(ds.targets), dtype=torch.long)
    source = f"{kind}:{root}" + (f":{split}" if split else "")
    stem = Path(cache_dir) / f"images-{key[:24]}" if cache_dir is not None else None
    if stem is not None and stem.with_suffix(".safetensors").is_file():
        try:
            from safetensors.torch import load_file

            meta = json.loads(stem.with_suffix(".json").read_text())
            if meta.get("key") == key:
                t = load_file(str(stem.with_suffix(".safetensors")))
                return ImageFeatures(t["mu"], t.get("logvar"), t["labels"], list(ds.classnames), source,
                                     from_cache=True)
        except Exception:
            pass
    from zsprob.models.encode import encode_images

    t0 = time.perf_counter()
    mu, logvar = encode_images(model, ds, batch_size=batch_size, device=device, num_workers=num_workers,
                               progress=progress)
    secs = time.perf_counter() - t0
    feats = ImageFeatures(mu, logvar, labels, list(ds.classnames), source, seconds=secs)
    if stem is not None:
        from safetensors.torch import save_file

        tensors = {"mu": mu.contiguous(), "labels": labels}
        if logvar is not None:
            tensors["logvar"] = logvar.contiguous()
        atomic_write(stem.with_suffix(".safetensors"), lambda tmp: save_file(tensors, tmp))
        atomic_write_json(stem.with_suffix(".json"), {"key": key, "model_id": model_id, **ident,
                                                      "encode_seconds": secs})
    return feats


# ----------------------------------------------------------------------------- scoring and metrics

def class_scores(img_mu: torch.Tensor, img_logvar: torch.Tensor | None, selection, score: str = "cosine",
                 unc_weight: float = 0.5) -> torch.Tensor:
    """[N, C] similarities (higher = better) between images and the selection's class embeddings.

    ``cosine``: normalised image mean . class vector (the CLIP convention; class vectors of
    ``zpe``/``bprw`` are their papers' un-renormalised weighted sums). ``csd``: negative
    closed-form sampled distance between the image Gaussian and the class Gaussian
    (``zsprob.prob.score('csd')``) on unit-norm means. ``unc``: cosine - unc_weight *
    ||sigma^2_class||_1 (ProLIP's uncertainty-adjusted logits; with unit-norm means and
    ``unc_weight = 0.5`` it ranks classes exactly as CSD does).
    """
    x = F.normalize(img_mu.float(), dim=-1)
    if score == "cosine":
        return x @ selection.class_mu.float().T
    if score not in SCORES:
        raise UserError(f"unknown score {score!r}; choose from {', '.join(SCORES)}")
    if selection.class_logvar is None:
        raise UserError(f"score '{score}' needs class sigma^2; this selection has none (deterministic model)")
    cm = F.normalize(selection.class_mu.float(), dim=-1)
    if score == "unc":
        return x @ cm.T - unc_weight * selection.class_logvar.exp().sum(-1)[None]
    if img_logvar is None:
        raise UserError("score 'csd' needs image sigma^2; the model is deterministic")
    from zsprob.prob import score as prob_score

    return prob_score("csd", x, img_logvar.float(), cm, selection.class_logvar.float())


def evaluate_scores(scores: torch.Tensor, labels: torch.Tensor, classnames: Sequence[str],
                    img_uncertainty: torch.Tensor | None = None, n_bins: int = 10) -> dict:
    """Top-1/top-5 (%), per-class accuracy, and accuracy per image-uncertainty bin (equal counts)."""
    labels = torch.as_tensor(labels).long()
    C = scores.shape[1]
    k5 = min(5, C)
    top = scores.topk(k5, dim=1).indices
    hit1 = top[:, 0] == labels
    hit5 = (top == labels[:, None]).any(1)
    counts = torch.bincount(labels, minlength=C)
    per = torch.zeros(C, dtype=torch.float64).index_add_(0, labels, hit1.double())
    per_class = {name: (100.0 * float(per[c] / counts[c]) if counts[c] > 0 else None)
                 for c, name in enumerate(classnames)}
    present = [v for v in per_class.values() if v is not None]
    out = {"n_images": int(len(labels)), "top1": 100.0 * float(hit1.double().mean()),
           "top5": 100.0 * float(hit5.double().mean()), "top5_k": k5,
           "mean_per_class": float(sum(present) / max(1, len(present))), "per_class": per_class}
    if img_uncertainty is not None and len(labels) >= n_bins:
        order = torch.argsort(img_uncertainty, stable=True)
        bins = []
        for b, idx in enumerate(torch.tensor_split(order, n_bins)):
            u = img_uncertainty[idx]
            bins.append({"bin": b, "n": int(len(idx)), "uncertainty_min": float(u.min()),
                         "uncertainty_max": float(u.max()), "uncertainty_mean": float(u.mean()),
                         "top1": 100.0 * float(hit1[idx].double().mean())})
        out["uncertainty_bins"] = bins
    return out


def evaluate_selection(selection, feats: ImageFeatures, score: str = "cosine", unc_weight: float = 0.5) -> dict:
    if list(selection.classnames) != list(feats.classnames):
        raise UserError("the selection's classes differ from the dataset's classes "
                        f"({len(selection.classnames)} vs {len(feats.classnames)}; first "
                        f"{selection.classnames[:2]} vs {feats.classnames[:2]})")
    s = class_scores(feats.mu, feats.logvar, selection, score=score, unc_weight=unc_weight)
    return evaluate_scores(s, feats.labels, feats.classnames, feats.uncertainty)


def topk_curve(bank, feats: ImageFeatures, k_values=None) -> dict:
    """Accuracy (%) of the same top-K for every class, for each K (PCME++ Fig. C.1a)."""
    from zsprob.zeroshot.selection import default_k_values, topk_score_tensor

    k_values = list(k_values or default_k_values(bank.num_templates))
    S = topk_score_tensor(bank, F.normalize(feats.mu.float(), dim=-1), k_values)
    acc = (S.argmax(1) == feats.labels[:, None]).double().mean(0) * 100
    return {"k": k_values, "top1": [float(v) for v in acc]}


def prompt_quality_diagnostic(bank, feats: ImageFeatures, k_values=None) -> dict:
    """Does text uncertainty track prompt quality? (analysis on labelled images; selects nothing).

    For each template t: the accuracy of the single-template classifier and its uncertainty
    averaged over classes; per class: the recall of each single template. Reports Spearman
    correlations (negative = more certain prompts are better) and the per-class recall of the
    same-top-K classifier for every K (the per-class curves behind the oracle).
    """
    from scipy.stats import spearmanr

    from zsprob.zeroshot.selection import default_k_values, topk_score_tensor

    if bank.deterministic:
        return {}
    x = F.normalize(feats.mu.float(), dim=-1)
    y = feats.labels
    C, T = bank.num_classes, bank.num_templates
    unc = bank.uncertainty
    scores = torch.einsum("nd,ctd->ntc", x, bank.mu_normed)            # [N, T, C]
    hit = (scores.argmax(2) == y[:, None]).double()                     # [N, T]
    acc_t = hit.mean(0) * 100
    counts = torch.bincount(y, minlength=C).double().clamp_min(1)
    recall = torch.zeros(C, T, dtype=torch.float64).index_add_(0, y, hit) / counts[:, None]
    rho_t = spearmanr(unc.mean(0).numpy(), acc_t.numpy()).statistic
    per_class = []
    for c in range(C):
        if recall[c].std() > 0 and unc[c].std() > 0:
            per_class.append(float(spearmanr(unc[c].numpy(), recall[c].numpy()).statistic))
    k_values = list(k_values or default_k_values(T))
    S = topk_score_tensor(bank, x, k_values)
    hitk = (S.argmax(1) == y[:, None]).double()                         # [N, nK]
    rk = torch.zeros(C, len(k_values), dtype=torch.float64).index_add_(0, y, hitk) / counts[:, None]
    order = torch.argsort(unc.mean(0), stable=True)
    return {"uses_eval_labels": True,
            "template_accuracy": {bank.templates[t]: float(acc_t[t]) for t in range(T)},
            "template_mean_uncertainty": {bank.templates[t]: float(unc[:, t].mean()) for t in range(T)},
            "spearman_template_uncertainty_vs_accuracy": float(rho_t),
            "spearman_per_class_uncertainty_vs_recall_mean": (sum(per_class) / len(per_class)) if per_class else None,
            "n_classes_with_negative_rho": sum(1 for r in per_class if r < 0), "n_classes_rho": len(per_class),
            "most_certain_templates": [bank.templates[t] for t in order[:5].tolist()],
            "least_certain_templates": [bank.templates[t] for t in order[-5:].tolist()],
            "uncertainty_relative_spread": float((unc.std(1) / unc.mean(1)).mean()),
            "per_class_recall_vs_k": {"k": k_values,
                                      "recall": {bank.classnames[c]: [float(v) for v in rk[c]] for c in range(C)}}}


COLLAPSE_COSINE = 0.95


def class_separation(class_vectors: torch.Tensor, classnames: Sequence[str],
                     collapse_cosine: float = COLLAPSE_COSINE) -> dict:
    """How far apart the class text embeddings are (label-free; reads no image).

    A text tower that has not learned to tell the class names apart maps every class prompt to
    nearly the same vector; zero-shot accuracy is then near chance whatever the prompts. This
    reports the mean and largest pairwise cosine between the (normalised) class vectors, the
    closest pair, and ``collapsed`` = mean pairwise cosine above ``collapse_cosine``.
    """
    v = F.normalize(class_vectors.float(), dim=-1)
    C = v.shape[0]
    if C < 2:
        return {"n_classes": C, "mean_pairwise_cosine": None, "max_pairwise_cosine": None,
                "closest_pair": None, "collapsed": False}
    sim = v @ v.t()
    off = ~torch.eye(C, dtype=torch.bool)
    vals = sim[off]
    masked = sim.masked_fill(~off, -2.0)
    i, j = divmod(int(masked.argmax()), C)
    mean = float(vals.mean())
    return {"n_classes": C, "mean_pairwise_cosine": mean, "max_pairwise_cosine": float(vals.max()),
            "closest_pair": [classnames[i], classnames[j]], "collapsed": mean > collapse_cosine,
            "collapse_threshold": float(collapse_cosine)}


def separation_warning(sep: dict) -> str | None:
    """One line for the user when the class embeddings have collapsed, else None."""
    if not sep.get("collapsed"):
        return None
    return (f"warning: the class text embeddings are nearly identical (mean pairwise cosine "
            f"{sep['mean_pairwise_cosine']:.3f} > {sep['collapse_threshold']}): this model's text tower does not "
            f"tell these class names apart, so zero-shot accuracy will be near chance for every prompt strategy")


# ----------------------------------------------------------------------------- selection I/O

def model_info(model, model_id: str, checkpoint=None, name=None, pretrained=None) -> dict:
    return {"id": model_id, "checkpoint": None if checkpoint is None else str(checkpoint),
            "name": name or getattr(model, "name", None), "pretrained": pretrained,
            "deterministic": bool(getattr(model, "deterministic", False)),
            "embed_dim": getattr(model, "embed_dim", None)}


def save_selection(selection, path, *, model: dict | None = None, data: dict | None = None) -> Path:
    from zsprob.utils.io import atomic_write_json

    return atomic_write_json(path, selection.to_dict(model=model, data=data))


def load_selection(path):
    from zsprob.utils.io import read_json
    from zsprob.zeroshot.selection import Selection

    return Selection.from_dict(read_json(path, "selection file"), source=str(path))


# ----------------------------------------------------------------------------- compare

def _fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}"


def format_table(rows: list[dict]) -> str:
    head = ["strategy", "top-1", "top-5", "per-class", "eval labels", "data used", "K (mean)"]
    lines = [head]
    for r in rows:
        if r.get("skipped"):
            lines.append([r["label"], "skipped", "", "", "", r["skipped"], ""])
            continue
        m = r["metrics"]
        lines.append([r["label"], _fmt(m["top1"]), _fmt(m["top5"]), _fmt(m["mean_per_class"]),
                      "YES (oracle)" if r["uses_eval_labels"] else "no", r.get("data_used", ""),
                      _fmt(r.get("k_mean"), 1) if r.get("k_mean") is not None else "-"])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(lines[0], widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for row in lines[1:]:
        out.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    return "\n".join(out)


def _plots(out_dir: Path, curves: dict, selections: dict, title: str) -> dict:
    from zsprob.report.plots import pyplot, save_figure

    plt = pyplot()

    files = {}
    if curves.get("eval"):
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.plot(curves["eval"]["k"], curves["eval"]["top1"], label="evaluation split", color="C0")
        if curves.get("select"):
            ax.plot(curves["select"]["k"], curves["select"]["top1"], label="selection split", color="C1",
                    alpha=0.8)
        for name, ls in (("all", "--"), ("auto", ":"), ("fusion", "-.")):
            if name in curves.get("reference", {}):
                ax.axhline(curves["reference"][name], ls=ls, color="gray", lw=1, label=f"{name} (eval)")
        ax.set_xlabel("number of most certain prompts kept per class (same K for all classes)")
        ax.set_ylabel("top-1 accuracy (%)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        files["accuracy_vs_topk"] = str(save_figure(fig, out_dir / "accuracy_vs_topk.png", dpi=120))
    hist = {n: s.k for n, s in selections.items() if n in ("auto", "oracle") and s.k is not None}
    if hist:
        T = max(len(s.templates) for s in selections.values())
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        bins = range(1, T + 2)
        for i, (n, ks) in enumerate(hist.items()):
            ax.hist(ks, bins=bins, alpha=0.6, label=selections[n].label, color=f"C{i + 2}", align="left")
        ax.set_xlabel("K chosen per class (most certain prompts kept)")
        ax.set_ylabel("number of classes")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        files["per_class_k_hist"] = str(save_figure(fig, out_dir / "per_class_k_hist.png", dpi=120))
    return files


def compare_on_features(bank, eval_feats: ImageFeatures, select_feats: ImageFeatures | None = None, *,
                        out_dir=None, k_values=None, score: str = "cosine", strategies: Sequence[str] | None = None,
                        model: dict | None = None, title: str = "", threshold_c: float = 1.0,
                        write_selections: bool = True) -> dict:
    """Every strategy on one prompt bank and one set of image embeddings; the table and figures.

    Returns ``{"rows": [...], "table": str, "curves": {...}, "files": {...}, "deterministic": bool}``.
    Each row: ``name``, ``label``, ``metrics`` (see :func:`evaluate_scores`), ``uses_eval_labels``,
    ``data_used``, ``k_mean`` / ``k_hist`` for hard selections, or ``skipped`` with the reason.
    """
    from zsprob.zeroshot.selection import NeedsSigma, run_strategy, select_all

    strategies = list(strategies or COMPARE_ORDER)
    pool = eval_feats.feats   # unlabelled evaluation images for ZPE / BPRW (labels never passed)
    select = None if select_feats is None else (select_feats.feats, select_feats.labels)
    sel_data = "selection split labels" if select_feats is None else \
        f"selection split labels ({len(select_feats)} images)"
    pool_data = f"unlabelled evaluation images ({len(eval_feats)})"
    rows, selections = [], {}
    for name in strategies:
        if name in ("global", "fusion-select") and select is None:
            rows.append({"name": name, "label": name, "skipped": "no labelled selection split"})
            continue
        try:
            t0 = time.perf_counter()
            sel = run_strategy(name, bank, select=select, pool=pool,
                               eval_=(eval_feats.feats, eval_feats.labels) if name.startswith("oracle") else None,
                               k_values=k_values, threshold_c=threshold_c, select_data=sel_data,
                               pool_data=pool_data)
            secs = time.perf_counter() - t0
        except NeedsSigma as e:
            rows.append({"name": name, "label": name, "skipped": "needs sigma^2 (deterministic model)"})
            continue
        selections[name] = sel
        metrics = evaluate_selection(sel, eval_feats, score=score if (score == "cosine" or
                                                                      sel.class_logvar is not None) else "cosine")
        data_used = sel.info.get("data_used", "none (text only)")
        row = {"name": name, "label": sel.label, "metrics": metrics, "uses_eval_labels": sel.uses_eval_labels,
               "data_used": data_used, "seconds": secs, "info": {k: v for k, v in sel.info.items()
                                                                 if not k.endswith("curve")}}
        if sel.k is not None:
            row["k_mean"] = sum(sel.k) / len(sel.k)
            row["k_per_class"] = dict(zip(sel.classnames, sel.k))
        rows.append(row)
    curves = {}
    if not bank.deterministic:
        curves["eval"] = topk_curve(bank, eval_feats, k_values)
        if select_feats is not None:
            curves["select"] = topk_curve(bank, select_feats, k_values)
        curves["reference"] = {r["name"]: r["metrics"]["top1"] for r in rows if not r.get("skipped")}
    files = {}
    diagnostic = prompt_quality_diagnostic(bank, eval_feats, k_values)
    all_classifier = selections["all"] if "all" in selections else select_all(bank)  # CLIP's classifier
    result = {"rows": rows, "curves": curves, "deterministic": bank.deterministic, "score": score,
              "class_separation": class_separation(all_classifier.class_mu, bank.classnames),
              "n_eval": len(eval_feats), "n_select": None if select_feats is None else len(select_feats),
              "classes": list(bank.classnames), "n_templates": bank.num_templates, "model": model or {},
              "diagnostic_eval_labels": diagnostic}
    result["table"] = format_table(rows)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files.update(_plots(out_dir, curves, selections, title))
        if write_selections:
            for name, sel in selections.items():
                p = save_selection(sel, out_dir / "selections" / f"{name}.json", model=model,
                                   data={"used": sel.info.get("data_used")})
                files[f"selection:{name}"] = str(p)
        from zsprob.utils.io import atomic_write_json, atomic_write_text

        atomic_write_text(out_dir / "compare.md", result["table"] + "\n")
        files["table"] = str(out_dir / "compare.md")
        files["json"] = str(out_dir / "compare.json")
        result["files"] = files
        atomic_write_json(out_dir / "compare.json", result)
    result["files"] = files
    result["selections"] = selections
    return result


def _resolve_splits(dataset: str, root, select_root=None):
    """(eval (kind, root, split), selection (kind, root, split) or None) for a dataset kind."""
    if dataset == "synthetic":
        ev = ("synthetic", root, "eval")
        se = ("synthetic", root, "select") if select_root is None else ("synthetic", select_root, "select")
        return ev, se
    if dataset == "imagenet":
        ev = ("imagenet", root, "val")
        se = None if select_root is None else ("imagenet", select_root, "train")
        return ev, se
    if dataset == "folder":
        return ("folder", root, None), (None if select_root is None else ("folder", select_root, None))
    raise UserError(f"unknown dataset kind {dataset!r}; choose from {', '.join(DATASET_KINDS)}")


def prepare(model, root, dataset: str = "synthetic", *, select_root=None, templates=None, classnames=None,
            cache_dir=None, model_id: str | None = None, batch_size: int = 256, device=None,
            progress: bool = True, need_select: bool = True):
    """Bank + evaluation features (+ selection features) for ``model`` on a dataset, all cached."""
    from zsprob.zeroshot.prompts import build_prompt_bank, load_classnames, load_templates, model_fingerprint

    if model_id is None:
        model_id = model_fingerprint(model)
    ev, se = _resolve_splits(dataset, root, select_root)
    if dataset == "synthetic" and select_root is None:
        sel_dir = Path(root) / "classify" / "select"
        if not sel_dir.is_dir():
            se = None
    eval_feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                              device=device, progress=progress)
    select_feats = None
    if se is not None and need_select:
        select_feats = encode_split(model, *se, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                                    device=device, progress=progress)
        if list(select_feats.classnames) != list(eval_feats.classnames):
            raise UserError("the selection split's classes differ from the evaluation split's classes")
    names = load_classnames(classnames) if classnames is not None else list(eval_feats.classnames)
    if classnames is not None and dataset == "folder":
        names = _align_to_folders(names, classnames, eval_feats.classnames)
    if len(names) != len(eval_feats.classnames):
        raise UserError(f"class-name file has {len(names)} names but the dataset has "
                        f"{len(eval_feats.classnames)} classes")
    tmpl = load_templates(templates)
    bank = build_prompt_bank(model, names, tmpl, cache_dir=cache_dir, model_id=model_id, device=device,
                             progress=progress)
    # the bank's class names are the prompt words; features carry the same order
    eval_feats.classnames = list(bank.classnames)
    if select_feats is not None:
        select_feats.classnames = list(bank.classnames)
    return bank, eval_feats, select_feats, model_id


def compare_strategies(model, root, dataset: str = "synthetic", out_dir=None, *, select_root=None,
                       templates=None, classnames=None, cache_dir=None, k_values=None, score: str = "cosine",
                       batch_size: int = 256, device=None, progress: bool = True, model_id: str | None = None,
                       model_meta: dict | None = None) -> dict:
    """Evaluate every prompt strategy on ``dataset`` at ``root`` in one run (the demo's entry point).

    ``model``: a ``ProbCLIP`` (zsprob checkpoint or plain open_clip through
    ``zsprob.models.load_for_inference``). For SynthWorld, ``root`` is the ``zsprob data
    synthetic`` output: prompts are chosen on ``classify/select`` and scored on
    ``classify/eval``. Writes ``compare.json``, ``compare.md``, ``accuracy_vs_topk.png``,
    ``per_class_k_hist.png`` and ``selections/*.json`` under ``out_dir`` (default
    ``<root>/zeroshot-compare``). Returns the dict of :func:`compare_on_features` plus
    ``timings``.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir) if out_dir is not None else Path(root) / "zeroshot-compare"
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir / "cache"
    bank, ev, se, model_id = prepare(model, root, dataset, select_root=select_root, templates=templates,
                                     classnames=classnames, cache_dir=cache_dir, model_id=model_id,
                                     batch_size=batch_size, device=device, progress=progress)
    meta = dict(model_meta or {})
    meta.setdefault("id", model_id)
    title = f"{dataset} zero-shot, {meta.get('name') or getattr(model, 'name', '')}"
    res = compare_on_features(bank, ev, se, out_dir=out_dir, k_values=k_values, score=score, model=meta,
                              title=title)
    res["timings"] = {"total_seconds": time.perf_counter() - t0, "bank_encode_seconds": bank.encode_seconds,
                      "bank_from_cache": bank.from_cache, "eval_images_from_cache": ev.from_cache}
    res["dataset"] = {"kind": dataset, "root": str(root), "select_root": None if se is None else se.source}
    if "json" in res.get("files", {}):
        from zsprob.utils.io import atomic_write_json

        atomic_write_json(res["files"]["json"], {k: v for k, v in res.items() if k != "selections"})
    return res


# ----------------------------------------------------------------------------- library entry points of the CLI

def _align_to_folders(names: list[str], source, folder_classes) -> list[str]:
    """A user's class names in the folder dataset's label order (by name, else by position)."""
    if folder_classes is None:
        return names
    from zsprob.data.classification import align_classnames

    return align_classnames(list(folder_classes), names, f"class-name file {source}")


def run_selection(model, dataset: str, root=None, *, strategy: str = "auto", k: int | None = None,
                  select_root=None, use_select: bool = True, templates=None, classnames=None, cache_dir=None,
                  k_values=None, threshold_c: float = 1.0, beta: float = 1.0, batch_size: int = 256,
                  device=None, progress: bool = True, model_meta: dict | None = None):
    """Choose prompts with one strategy; returns ``(selection, selection_json_dict)``.

    Reads only what the strategy needs: the labelled selection split (auto / global /
    fusion-select), the unlabelled evaluation images (zpe / bprw), the evaluation labels (oracle).
    """
    from zsprob.zeroshot.prompts import build_prompt_bank, load_classnames, load_templates, model_fingerprint
    from zsprob.zeroshot.selection import STRATEGIES, run_strategy

    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    model_id = model_fingerprint(model)
    ev, se = _resolve_splits(dataset, root if root is not None else ".", select_root)
    if dataset == "synthetic" and select_root is None and root is not None \
            and not (Path(root) / "classify" / "select").is_dir():
        se = None
    needs_select = strategy in ("auto", "global", "fusion-select") and use_select
    needs_pool = strategy in ("zpe", "bprw")
    needs_eval = strategy in ("oracle", "oracle-global")
    if (needs_pool or needs_eval) and root is None:
        raise UserError(f"strategy '{strategy}' needs the evaluation images: pass --root")
    select = pool = eval_ = None
    data = {}
    ev_feats = None
    if needs_select and se is not None:
        sf = encode_split(model, *se, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                          device=device, progress=progress)
        select = (sf.feats, sf.labels)
        data["selection_split"] = {"source": sf.source, "n_images": len(sf), "labels_used": True}
        names_from = sf.classnames
    if needs_pool or needs_eval:
        ev_feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                                device=device, progress=progress)
        if needs_pool:
            pool = ev_feats.feats
            data["unlabelled_images"] = {"source": ev_feats.source, "n_images": len(ev_feats),
                                         "labels_used": False}
        else:
            eval_ = (ev_feats.feats, ev_feats.labels)
            data["evaluation_split"] = {"source": ev_feats.source, "n_images": len(ev_feats),
                                        "labels_used": True}
    if classnames is not None:
        names = load_classnames(classnames)
    elif dataset == "imagenet" and root is None:
        names = load_classnames("imagenet_classnames.txt")
    elif root is not None:
        names = list(ev_feats.classnames) if ev_feats is not None else list(load_split(*ev).classnames)
    else:
        raise UserError("no class names: pass --classes FILE or the dataset --root")
    if classnames is not None and dataset == "folder":
        names = _align_to_folders(names, classnames, sf.classnames if select is not None else
                                  ev_feats.classnames if ev_feats is not None else
                                  load_split(*ev).classnames if root is not None else None)
    if select is not None and len(sf.classnames) != len(names):
        raise UserError(f"the selection split has {len(sf.classnames)} classes but there are {len(names)} "
                        "class names")
    if strategy in ("global", "fusion-select") and select is None:
        raise UserError(f"strategy '{strategy}' needs a labelled selection split (--select-root)")
    bank = build_prompt_bank(model, names, load_templates(templates), cache_dir=cache_dir, model_id=model_id,
                             device=device, progress=progress)
    k_values = parse_k_grid(k_values, bank.num_templates) if isinstance(k_values, str) else k_values
    sel = run_strategy(strategy, bank, k=k, select=select, pool=pool, eval_=eval_, k_values=k_values,
                       threshold_c=threshold_c, beta=beta,
                       select_data=f"selection split labels ({data.get('selection_split', {}).get('source')})",
                       pool_data=f"unlabelled images ({data.get('unlabelled_images', {}).get('source')})")
    if not data:
        data["images"] = "none (text uncertainties only)"
    meta = dict(model_meta or {})
    meta.setdefault("id", model_id)
    doc = sel.to_dict(model=meta, data=data)
    return sel, doc


def zeroshot_eval(model, dataset: str, root, *, prompts=None, strategy: str = "auto", k: int | None = None,
                  select_root=None, templates=None, classnames=None, cache_dir=None, k_values=None,
                  score: str = "cosine", unc_weight: float = 0.5, threshold_c: float = 1.0, beta: float = 1.0,
                  batch_size: int = 256, device=None, progress: bool = True, model_meta: dict | None = None) -> dict:
    """Zero-shot accuracy of one prompt set (a selection.json, or a strategy run now) on a dataset."""
    from zsprob.zeroshot.prompts import model_fingerprint

    model_id = model_fingerprint(model)
    ev, _ = _resolve_splits(dataset, root, select_root)
    if prompts is not None:
        sel = load_selection(prompts)
        from zsprob.utils.io import read_json

        made_with = read_json(prompts, "selection file").get("model", {}).get("id")
        if made_with and made_with != model_id:
            raise UserError(f"{prompts} was made with another model (id {made_with}, this model {model_id}); "
                            "run zsprob select-prompts with this model")
        if sel.class_mu.shape[1] != getattr(model, "embed_dim", sel.class_mu.shape[1]):
            raise UserError(f"{prompts} has embed_dim {sel.class_mu.shape[1]}, the model {model.embed_dim}")
        sel_doc = {"file": str(prompts)}
    else:
        sel, _doc = run_selection(model, dataset, root, strategy=strategy, k=k, select_root=select_root,
                                  templates=templates, classnames=classnames, cache_dir=cache_dir,
                                  k_values=k_values, threshold_c=threshold_c, beta=beta, batch_size=batch_size,
                                  device=device, progress=progress, model_meta=model_meta)
        sel_doc = {"file": None}
    feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size, device=device,
                         progress=progress)
    if len(sel.classnames) != len(feats.classnames):
        raise UserError(f"the selection has {len(sel.classnames)} classes, the dataset {len(feats.classnames)}")
    feats.classnames = list(sel.classnames)
    metrics = evaluate_selection(sel, feats, score=score, unc_weight=unc_weight)
    separation = class_separation(sel.class_mu, sel.classnames)
    sel_doc.update({"strategy": sel.strategy, "label": sel.label, "uses_eval_labels": sel.uses_eval_labels,
                    "k": sel.k, "how": {k_: v for k_, v in sel.info.items() if not k_.endswith("curve")}})
    from zsprob import __version__

    meta = dict(model_meta or {})
    meta.setdefault("id", model_id)
    return {"zsprob_version": __version__, "dataset": {"kind": dataset, "root": str(root), "source": feats.source},
            "model": meta, "score": score, "selection": sel_doc, "metrics": metrics,
            "class_separation": separation,
            "images_from_cache": feats.from_cache}
