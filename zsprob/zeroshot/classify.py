"""Zero-shot classification runners: ``--compare`` over every strategy, tables, plots, selection files.

:func:`compare_strategies` / :func:`compare_on_features` score every prompt strategy of
:mod:`zsprob.zeroshot.selection` on one set of cached image embeddings and write the table and
plots (matplotlib); :func:`run_selection` and :func:`zeroshot_eval` are the library functions behind
``zsprob select-prompts`` and ``zsprob zeroshot``; :func:`save_selection` / :func:`load_selection`
read and write selection.json. The image features and their cache live in
:mod:`zsprob.zeroshot.features`, the scores, metrics and diagnostics in
:mod:`zsprob.zeroshot.metrics` (both re-exported here).

Honesty: only ``oracle`` / ``oracle-global`` ever receive evaluation labels; ZPE and BPRW
receive the evaluation images without labels (both papers are transductive that way). What each
strategy reads, and so what is encoded for it, is its entry in
:mod:`zsprob.zeroshot.strategy_registry`; ``run_strategy`` hands a strategy nothing else.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from zsprob.errors import UserError
from zsprob.zeroshot.calibration import calibration_table, model_logit_scales, row_calibration
from zsprob.zeroshot.features import DATASET_KINDS, ImageFeatures, encode_split, load_split  # noqa: F401
from zsprob.zeroshot.metrics import (COLLAPSE_COSINE, SCORES, class_scores, class_separation,  # noqa: F401
                                     evaluate_scores, evaluate_selection, prompt_quality_diagnostic,
                                     separation_warning, top1_hits, topk_curve)
from zsprob.zeroshot.options import parse_k_grid, strategy_from_topk  # noqa: F401  (re-exported)
from zsprob.zeroshot.paired import detectable_effect_summary, paired_stats
from zsprob.zeroshot.strategy_registry import (SELECTION_LABELS, UNLABELLED_IMAGES, check_shots_split,
                                               compare_order, get_strategy, shots_source)


# ----------------------------------------------------------------------------- selection I/O

def model_info(model, model_id: str, checkpoint=None, name=None, pretrained=None) -> dict:
    return {"id": model_id, "checkpoint": None if checkpoint is None else str(checkpoint),
            "name": name or getattr(model, "name", None), "pretrained": pretrained,
            "deterministic": bool(getattr(model, "deterministic", False)),
            "embed_dim": getattr(model, "embed_dim", None)}


def save_selection(selection, path, *, model: dict | None = None, data: dict | None = None) -> Path:
    from zsprob.utils.io import atomic_write_json

    return atomic_write_json(path, selection.to_dict(model=model, data=data))


def check_selection_classes(selected, dataset, source) -> None:
    """A selection's classes must be the dataset's, in its order (case, spaces and underscores aside): a
    renamed or reordered class would score every image against another class's prompts. Datasets whose
    classes are ids that share no name with the selection (ImageNet wnids) are matched by position."""
    from zsprob.data.classification import class_key

    ours, theirs = [class_key(str(c)) for c in selected], [class_key(str(c)) for c in dataset]
    if ours == theirs or not set(ours) & set(theirs):
        return
    wrong = [(i, a, b) for i, (a, b, x, y) in enumerate(zip(selected, dataset, ours, theirs)) if x != y]
    i, a, b = wrong[0]
    raise UserError(f"{source} does not hold the dataset's classes in its order: class {i} is {a!r} there and {b!r} "
                    f"in the dataset ({len(wrong)} of {len(dataset)} differ); run zsprob select-prompts on this dataset")


def _check_class_count(classnames, dataset: str, ev) -> None:
    """One line when a --classes file names another number of classes than the evaluation split has (a
    folder dataset matches names to its folders instead, in :func:`prepare`)."""
    if classnames is None or dataset == "folder":
        return
    from zsprob.zeroshot.prompts import load_classnames

    n_names, n_eval = len(load_classnames(classnames)), len(load_split(*ev).classnames)
    if n_names != n_eval:
        raise UserError(f"--classes {classnames} names {n_names} classes, the dataset has {n_eval}: give one name per "
                        "class, in the dataset's order")


def load_selection(path):
    from zsprob.utils.io import read_json
    from zsprob.zeroshot.selection import Selection

    return Selection.from_dict(read_json(path, "selection file"), source=str(path))


# ----------------------------------------------------------------------------- compare

def _fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}"


def _paired_cells(paired: dict | None) -> list[str]:
    if not paired:
        return ["-", "-"]
    low, high = paired["ci95"]
    return [f"{paired['diff']:+.2f} [{low:+.2f}, {high:+.2f}]", f"{paired['mcnemar_p']:.3g}"]


def _eval_labels_cell(r: dict) -> str:
    if not r.get("uses_eval_labels"):
        return "no"
    return "YES (eval shots)" if get_strategy(r["name"]).shots else "YES (oracle)"


def format_table(rows: list[dict]) -> str:
    head = ["strategy", "top-1", "vs all [95% CI]", "McNemar p", "top-5", "per-class", "eval labels",
            "transductive", "labels from", "data used", "K (mean)"]
    lines = [head]
    for r in rows:
        audit = ["yes" if r.get("transductive") else "no", r.get("label_split") or "-"]
        if r.get("skipped"):
            lines.append([r["label"], "skipped", "", "", "", "", "", *audit, r["skipped"], ""])
            continue
        m = r["metrics"]
        lines.append([r["label"], _fmt(m["top1"]), *_paired_cells(r.get("paired_vs_all")), _fmt(m["top5"]),
                      _fmt(m["mean_per_class"]), _eval_labels_cell(r), *audit,
                      r.get("data_used", ""), _fmt(r.get("k_mean"), 1) if r.get("k_mean") is not None else "-"])
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


def _compare_row(name, bank, eval_feats, select, given: dict, score: str, unc_weight: float = 0.5):
    """One ``--compare`` row: ``(row, selection or None, per-image hits or None)``."""
    from zsprob.zeroshot.selection import NeedsSigma, run_strategy

    entry = get_strategy(name)
    audit = entry.audit(given["shots_split"])
    if SELECTION_LABELS in entry.needs and select is None and not (entry.shots and given["shots_split"] == "eval"):
        return {"name": name, "label": name, "skipped": "no labelled selection split", **audit}, None, None
    try:
        t0 = time.perf_counter()
        sel = run_strategy(name, bank, select=select, pool=eval_feats.feats,  # the pool: images without labels
                           eval_=(eval_feats.feats, eval_feats.labels) if audit["reads_eval_labels"] else None,
                           **given)
        secs = time.perf_counter() - t0
    except NeedsSigma:
        return {"name": name, "label": name, "skipped": "needs sigma^2 (deterministic model)", **audit}, None, None
    row_score = score if (score == "cosine" or sel.class_logvar is not None) else "cosine"
    metrics = evaluate_selection(sel, eval_feats, score=row_score, unc_weight=unc_weight)
    row = {"name": name, "label": sel.label, "metrics": metrics, "uses_eval_labels": sel.uses_eval_labels, **audit,
           "data_used": sel.info.get("data_used", "none (text only)"), "seconds": secs,
           "info": {k: v for k, v in sel.info.items() if not k.endswith("curve")}}
    if sel.k is not None:
        row["k_mean"] = sum(sel.k) / len(sel.k)
        row["k_per_class"] = dict(zip(sel.classnames, sel.k))
    return row, sel, top1_hits(sel, eval_feats, row_score, unc_weight)


def compare_on_features(bank, eval_feats: ImageFeatures, select_feats: ImageFeatures | None = None, *,
                        out_dir=None, k_values=None, score: str = "cosine", strategies: Sequence[str] | None = None,
                        model: dict | None = None, title: str = "", threshold_c: float = 1.0,
                        write_selections: bool = True, shots: int | None = None, shots_split: str = "select",
                        allow_eval_shots: bool = False, logit_scales: dict | None = None,
                        unc_weight: float = 0.5) -> dict:
    """Every strategy on one prompt bank and one set of image embeddings; the table and figures.

    Returns ``{"rows": [...], "table": str, "curves": {...}, "files": {...}, "deterministic": bool}``.
    Each row: ``name``, ``label``, ``metrics`` (see :func:`evaluate_scores`), ``uses_eval_labels``, the
    registry's protocol facts (``reads_eval_labels``, ``transductive``, ``label_split``), ``data_used``,
    ``paired_vs_all`` (:mod:`zsprob.zeroshot.paired`), ``k_mean`` / ``k_hist`` for hard selections, or
    ``skipped`` with the reason; scored rows also get :func:`row_calibration`'s fields (``logit_scales``:
    :func:`model_logit_scales`, default CLIP's 100). ``shots`` / ``shots_split`` / ``allow_eval_shots``:
    the few-shot strategies' shots (see :func:`zsprob.zeroshot.selection.run_strategy`). ``unc_weight``:
    the weight of sigma^2 under ``score="unc"`` (:func:`zsprob.zeroshot.metrics.class_scores`).
    """
    from zsprob.zeroshot.selection import select_all

    check_shots_split(shots_split, allow_eval_shots)
    strategies = list(strategies or compare_order())
    select = None if select_feats is None else (select_feats.feats, select_feats.labels)
    given = {"k_values": k_values, "threshold_c": threshold_c, "shots": shots, "shots_split": shots_split,
             "allow_eval_shots": allow_eval_shots, "pool_data": f"unlabelled evaluation images ({len(eval_feats)})",
             "select_data": "selection split labels" if select_feats is None else
             f"selection split labels ({len(select_feats)} images)"}
    rows, selections, hits = [], {}, {}
    for name in strategies:
        row, sel, row_hits = _compare_row(name, bank, eval_feats, select, given, score, unc_weight)
        rows.append(row)
        if sel is not None:
            selections[name], hits[name] = sel, row_hits
            row.update(row_calibration(sel, eval_feats, select_feats, score=score, logit_scales=logit_scales,
                                       unc_weight=unc_weight))
    reference = hits["all"] if "all" in hits else top1_hits(select_all(bank), eval_feats, "cosine")
    for row in rows:
        if not row.get("skipped"):
            row["paired_vs_all"] = paired_stats(hits[row["name"]], reference)
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
              "diagnostic_eval_labels": diagnostic,
              "min_detectable_effect": detectable_effect_summary(rows, len(eval_feats)),
              **({"unc_weight": unc_weight} if score == "unc" else {})}
    result["table"] = format_table(rows) + "\n\n" + calibration_table(rows)
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


def build_bank(model, names, *, templates=None, class_prompts=None, cache_dir=None, model_id=None, device=None,
               progress: bool = True, precision: str = "fp32"):
    """The prompt bank: every class x template (``templates``, default the 80 CLIP templates), or each
    class's own pool from a CuPL-style ``class_prompts`` JSON file (:mod:`zsprob.zeroshot.pools`)."""
    from zsprob.zeroshot.prompts import build_prompt_bank, load_templates

    if class_prompts is None:
        return build_prompt_bank(model, names, load_templates(templates), cache_dir=cache_dir, model_id=model_id,
                                 device=device, progress=progress, precision=precision)
    from zsprob.zeroshot.pools import build_pool_bank

    if templates is not None:
        raise UserError("--class-prompts gives each class its own prompts; it does not take --templates")
    return build_pool_bank(model, names, class_prompts, cache_dir=cache_dir, model_id=model_id, device=device,
                           progress=progress, precision=precision)


def prepare(model, root, dataset: str = "synthetic", *, select_root=None, templates=None, classnames=None,
            cache_dir=None, model_id: str | None = None, batch_size: int = 256, device=None,
            progress: bool = True, need_select: bool = True, num_workers: int = 0, precision: str = "fp32",
            class_prompts=None):
    """Bank + evaluation features (+ selection features) for ``model`` on a dataset, all cached."""
    from zsprob.models.fingerprint import model_fingerprint
    from zsprob.zeroshot.prompts import load_classnames

    if model_id is None:
        model_id = model_fingerprint(model)
    ev, se = _resolve_splits(dataset, root, select_root)
    if dataset == "synthetic" and select_root is None:
        sel_dir = Path(root) / "classify" / "select"
        if not sel_dir.is_dir():
            se = None
    enc = {"device": device, "num_workers": num_workers, "precision": precision}
    eval_feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                              progress=progress, **enc)
    select_feats = None
    if se is not None and need_select:
        select_feats = encode_split(model, *se, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                                    progress=progress, **enc)
        if list(select_feats.classnames) != list(eval_feats.classnames):
            raise UserError("the selection split's classes differ from the evaluation split's classes")
    names = load_classnames(classnames) if classnames is not None else list(eval_feats.classnames)
    if classnames is not None and dataset == "folder":
        names = _align_to_folders(names, classnames, eval_feats.classnames)
    if len(names) != len(eval_feats.classnames):
        raise UserError(f"class-name file has {len(names)} names but the dataset has "
                        f"{len(eval_feats.classnames)} classes")
    bank = build_bank(model, names, templates=templates, class_prompts=class_prompts, cache_dir=cache_dir,
                      model_id=model_id, device=device, progress=progress, precision=precision)
    # the bank's class names are the prompt words; features carry the same order
    eval_feats.classnames = list(bank.classnames)
    if select_feats is not None:
        select_feats.classnames = list(bank.classnames)
    return bank, eval_feats, select_feats, model_id


def compare_strategies(model, root, dataset: str = "synthetic", out_dir=None, *, select_root=None,
                       templates=None, classnames=None, cache_dir=None, k_values=None, score: str = "cosine",
                       batch_size: int = 256, device=None, progress: bool = True, model_id: str | None = None,
                       model_meta: dict | None = None, num_workers: int = 0, precision: str = "fp32",
                       shots: int | None = None, shots_split: str = "select", allow_eval_shots: bool = False,
                       class_prompts=None, unc_weight: float = 0.5) -> dict:
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
                                     batch_size=batch_size, device=device, progress=progress,
                                     num_workers=num_workers, precision=precision, class_prompts=class_prompts)
    meta = dict(model_meta or {})
    meta.setdefault("id", model_id)
    title = f"{dataset} zero-shot, {meta.get('name') or getattr(model, 'name', '')}"
    res = compare_on_features(bank, ev, se, out_dir=out_dir, k_values=k_values, score=score, model=meta,
                              title=title, shots=shots, shots_split=shots_split, allow_eval_shots=allow_eval_shots,
                              logit_scales=model_logit_scales(model), unc_weight=unc_weight)
    res["timings"] = {"total_seconds": time.perf_counter() - t0, "bank_encode_seconds": bank.encode_seconds,
                      "bank_from_cache": bank.from_cache, "eval_images_from_cache": ev.from_cache}
    res["skipped_unreadable_images"] = {"eval": ev.skipped, "select": se.skipped if se is not None else 0}
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
                  device=None, progress: bool = True, model_meta: dict | None = None, num_workers: int = 0,
                  precision: str = "fp32", shots: int | None = None, shots_split: str = "select",
                  allow_eval_shots: bool = False, class_prompts=None):
    """Choose prompts with one strategy; returns ``(selection, selection_json_dict)``.

    Reads only what the strategy needs: the labelled selection split (auto / global /
    fusion-select / bprw-fewshot), the unlabelled evaluation images (zpe / bprw / carprt), the
    evaluation labels (oracle; bprw-fewshot with ``shots_split="eval"`` and ``allow_eval_shots``).
    """
    from zsprob.models.fingerprint import model_fingerprint
    from zsprob.zeroshot.prompts import load_classnames
    from zsprob.zeroshot.selection import run_strategy

    entry = get_strategy(strategy)
    check_shots_split(shots_split, allow_eval_shots)
    audit = entry.audit(shots_split)
    model_id = model_fingerprint(model)
    ev, se = _resolve_splits(dataset, root if root is not None else ".", select_root)
    if dataset == "synthetic" and select_root is None and root is not None \
            and not (Path(root) / "classify" / "select").is_dir():
        se = None
    needs_select = SELECTION_LABELS in entry.reads and use_select and not (entry.shots and shots_split == "eval")
    needs_pool = UNLABELLED_IMAGES in entry.reads
    needs_eval = audit["reads_eval_labels"]
    if (needs_pool or needs_eval) and root is None:
        raise UserError(f"strategy '{strategy}' needs the evaluation images: pass --root")
    select = pool = eval_ = None
    enc = {"device": device, "num_workers": num_workers, "precision": precision}
    data = {}
    ev_feats = None
    if needs_select and se is not None:
        sf = encode_split(model, *se, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                          progress=progress, **enc)
        select = (sf.feats, sf.labels)
        data["selection_split"] = {"source": sf.source, "n_images": len(sf), "labels_used": True}
    if needs_pool or needs_eval:
        ev_feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size,
                                progress=progress, **enc)
        if needs_pool:
            pool = ev_feats.feats
            data["unlabelled_images"] = {"source": ev_feats.source, "n_images": len(ev_feats),
                                         "labels_used": False}
        if needs_eval:
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
    entry.check_data(select=shots_source(entry, shots_split, select, eval_), pool=pool, eval_=eval_)
    bank = build_bank(model, names, templates=templates, class_prompts=class_prompts, cache_dir=cache_dir,
                      model_id=model_id, device=device, progress=progress, precision=precision)
    k_values = parse_k_grid(k_values, bank.num_templates) if isinstance(k_values, str) else k_values
    sel = run_strategy(strategy, bank, k=k, select=select, pool=pool, eval_=eval_, k_values=k_values,
                       threshold_c=threshold_c, beta=beta, shots=shots, shots_split=shots_split,
                       allow_eval_shots=allow_eval_shots,
                       select_data=f"selection split labels ({data.get('selection_split', {}).get('source')})",
                       pool_data=f"unlabelled images ({data.get('unlabelled_images', {}).get('source')})")
    if not data:
        data["images"] = "none (text uncertainties only)"
    meta = dict(model_meta or {})
    meta.setdefault("id", model_id)
    doc = sel.to_dict(model=meta, data=data)
    doc["protocol"] = audit
    return sel, doc


def zeroshot_eval(model, dataset: str, root, *, prompts=None, strategy: str = "auto", k: int | None = None,
                  select_root=None, templates=None, classnames=None, cache_dir=None, k_values=None,
                  score: str = "cosine", unc_weight: float = 0.5, threshold_c: float = 1.0, beta: float = 1.0,
                  batch_size: int = 256, device=None, progress: bool = True, model_meta: dict | None = None,
                  num_workers: int = 0, precision: str = "fp32", shots: int | None = None,
                  shots_split: str = "select", allow_eval_shots: bool = False, class_prompts=None) -> dict:
    """Zero-shot accuracy of one prompt set (a selection.json, or a strategy run now) on a dataset."""
    from zsprob.models.fingerprint import is_model, model_fingerprint

    model_id = model_fingerprint(model)
    ev, _ = _resolve_splits(dataset, root, select_root)
    if prompts is not None and class_prompts is not None:
        raise UserError("--prompts is a finished selection; --class-prompts chooses prompts, give one of them")
    if prompts is not None:
        sel = load_selection(prompts)
        from zsprob.utils.io import read_json

        made_with = read_json(prompts, "selection file").get("model", {}).get("id")
        if made_with and not is_model(made_with, model, model_id):
            raise UserError(f"{prompts} was made with another model (id {made_with}, this model {model_id}); "
                            "run zsprob select-prompts with this model")
        if sel.class_mu.shape[1] != getattr(model, "embed_dim", sel.class_mu.shape[1]):
            raise UserError(f"{prompts} has embed_dim {sel.class_mu.shape[1]}, the model {model.embed_dim}")
        check_selection_classes(sel.classnames, load_split(*ev).classnames, prompts)  # before any image is encoded
        sel_doc = {"file": str(prompts)}
    else:
        _check_class_count(classnames, dataset, ev)  # before any image or prompt is encoded
        sel, _doc = run_selection(model, dataset, root, strategy=strategy, k=k, select_root=select_root,
                                  templates=templates, classnames=classnames, cache_dir=cache_dir,
                                  k_values=k_values, threshold_c=threshold_c, beta=beta, batch_size=batch_size,
                                  device=device, progress=progress, model_meta=model_meta,
                                  num_workers=num_workers, precision=precision, shots=shots,
                                  shots_split=shots_split, allow_eval_shots=allow_eval_shots,
                                  class_prompts=class_prompts)
        sel_doc = {"file": None, "protocol": _doc["protocol"]}
    feats = encode_split(model, *ev, model_id=model_id, cache_dir=cache_dir, batch_size=batch_size, device=device,
                         progress=progress, num_workers=num_workers, precision=precision)
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
    return {"zsprob_version": __version__, "dataset": {"kind": dataset, "root": str(root), "source": feats.source,
                                                               "skipped_unreadable_images": feats.skipped},
            "model": meta, "score": score, **({"unc_weight": unc_weight} if score == "unc" else {}),
            "selection": sel_doc, "metrics": metrics,
            "class_separation": separation,
            "images_from_cache": feats.from_cache}
