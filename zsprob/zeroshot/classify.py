"""Zero-shot classification: the library calls behind ``zsprob select-prompts`` and ``zsprob zeroshot``.

Every entry point takes one :class:`~zsprob.zeroshot.options.ZeroShotRequest` (or its fields as keywords):
:func:`run_selection` (one strategy), :func:`zeroshot_eval` (one prompt set), :func:`compare_strategies`
(every strategy, through :func:`compare_on_features` on cached image embeddings; matplotlib plots). Splits
are checked against the class names before anything is encoded; the registry entry says what is encoded."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from zsprob.errors import UserError
from zsprob.utils.selective import selective_table
from zsprob.zeroshot.calibration import calibration_table, model_logit_scales, row_calibration
from zsprob.zeroshot.features import ImageFeatures, Split, encode_split
from zsprob.zeroshot.metrics import (class_separation, evaluate_selection, prompt_quality_diagnostic, top1_hits,
                                     topk_curve)
from zsprob.zeroshot.options import COMPARE_FILES, ZeroShotRequest, as_request, parse_k_grid
from zsprob.zeroshot.paired import detectable_effect_summary, paired_stats
from zsprob.zeroshot.strategy_registry import SELECTION_LABELS, UNLABELLED_IMAGES, compare_order, get_strategy

#: the evaluation and labelled selection splits by their names inside a root (other kinds: the root itself)
SPLIT_NAMES = {"synthetic": ("eval", "select"), "imagenet": ("val", "train")}


# ----------------------------------------------------------------------------- selection I/O

def save_selection(selection, path, *, model: dict | None = None, data: dict | None = None) -> Path:
    from zsprob.utils.io import atomic_write_json

    return atomic_write_json(path, selection.to_dict(model=model, data=data))


def load_selection(path):
    from zsprob.utils.io import read_json
    from zsprob.zeroshot.selection_base import Selection

    return Selection.from_dict(read_json(path, "selection file"), source=str(path))


def check_selection_classes(selected, dataset, source) -> None:
    """Refuse a selection whose classes are not the dataset's, by name and in its order (case, spaces and
    underscores aside): a selection is never mapped to other classes by position."""
    from zsprob.data.classification import class_key

    if len(selected) != len(dataset):
        raise UserError(f"{source} has {len(selected)} classes, the dataset {len(dataset)}; run zsprob "
                        "select-prompts on this dataset")
    ours, theirs = [class_key(str(c)) for c in selected], [class_key(str(c)) for c in dataset]
    if ours == theirs:
        return
    wrong = [(i, a, b) for i, (a, b, x, y) in enumerate(zip(selected, dataset, ours, theirs)) if x != y]
    i, a, b = wrong[0]
    raise UserError(f"{source} does not hold the dataset's classes in its order: class {i} is {a!r} there and "
                    f"{b!r} in the dataset ({len(wrong)} of {len(dataset)} differ); run zsprob select-prompts on "
                    "this dataset")


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
    """The markdown table of ``--compare``'s rows."""
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
                      r.get("data_used", ""), _fmt(r.get("k_mean"), 1)])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def _plots(out_dir: Path, curves: dict, selections: dict, title: str) -> dict:
    from zsprob.report.plots import pyplot

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
        files["accuracy_vs_topk"] = _finish(fig, ax, "number of most certain prompts kept per class (same K for "
                                            "all classes)", "top-1 accuracy (%)", title, out_dir / COMPARE_FILES[2])
    hist = {n: s.k for n, s in selections.items() if n in ("auto", "oracle") and s.k is not None}
    if hist:
        T = max(len(s.templates) for s in selections.values())
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        bins = range(1, T + 2)
        for i, (n, ks) in enumerate(hist.items()):
            ax.hist(ks, bins=bins, alpha=0.6, label=selections[n].label, color=f"C{i + 2}", align="left")
        files["per_class_k_hist"] = _finish(fig, ax, "K chosen per class (most certain prompts kept)",
                                            "number of classes", title, out_dir / COMPARE_FILES[3])
    return files


def _risk_coverage_plot(report: dict, path: Path, title: str) -> str:
    """The risk-coverage curve of each confidence score of one row's selective-prediction report."""
    from zsprob.report.plots import pyplot

    fig, ax = pyplot().subplots(figsize=(5.5, 3.5))
    for i, (name, entry) in enumerate(report["scores"].items()):
        curve = entry["curve"]
        ax.plot(curve["coverage"], [100 * r for r in curve["risk"]], color=f"C{i}",
                label=f"{name} (AURC {entry['aurc']['value']:.3f})")
    ax.axhline(100 * (1 - report["accuracy"]), ls=":", color="gray", lw=1, label="keep every prediction")
    return _finish(fig, ax, "coverage (share of the most confident predictions kept)", "error among kept (%)",
                   f"{title}: all-80, which score to trust", path)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> str:
    from zsprob.report.plots import save_figure

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return str(save_figure(fig, path, dpi=120))


def _compare_row(name, bank, eval_feats, select, request: ZeroShotRequest, data: dict):
    """One ``--compare`` row: ``(row, selection or None, per-image hits or None)``."""
    from zsprob.zeroshot.selection import run_strategy
    from zsprob.zeroshot.selection_base import NeedsSigma

    entry = get_strategy(name)
    audit = entry.audit(request.shots_split)
    if SELECTION_LABELS in entry.needs and select is None and not entry.eval_shots(request.shots_split):
        return {"name": name, "label": name, "skipped": "no labelled selection split", **audit}, None, None
    try:
        t0 = time.perf_counter()
        sel = run_strategy(name, bank, request, select=select, pool=eval_feats.feats,  # the pool: images, no labels
                           eval_=(eval_feats.feats, eval_feats.labels) if audit["reads_eval_labels"] else None, **data)
        secs = time.perf_counter() - t0
    except NeedsSigma:
        return {"name": name, "label": name, "skipped": "needs sigma^2 (deterministic model)", **audit}, None, None
    except UserError as e:  # this strategy's data falls short (e.g. a class without shots); the others still run
        return {"name": name, "label": name, "skipped": str(e), **audit}, None, None
    score = request.score if sel.class_logvar is not None else "cosine"
    metrics = evaluate_selection(sel, eval_feats, score=score, unc_weight=request.unc_weight)
    row = {"name": name, "label": sel.label, "metrics": metrics, "uses_eval_labels": sel.uses_eval_labels, **audit,
           "data_used": sel.info.get("data_used", "none (text only)"), "seconds": secs,
           "info": {k: v for k, v in sel.info.items() if not k.endswith("curve")}}
    if sel.k is not None:
        row["k_mean"] = sum(sel.k) / len(sel.k)
        row["k_per_class"] = dict(zip(sel.classnames, sel.k))
    return row, sel, top1_hits(sel, eval_feats, score, request.unc_weight)


def compare_on_features(bank, eval_feats: ImageFeatures, select_feats: ImageFeatures | None = None,
                        request: ZeroShotRequest | None = None, *, strategies=None, out_dir=None,
                        model: dict | None = None, title: str = "", write_selections: bool = True,
                        logit_scales: dict | None = None, label_baselines: bool = True,
                        image_conditions: list[str] | None = None, **fields) -> dict:
    """Every strategy (``strategies``, default the ``--compare`` order) on one prompt bank and one set of
    image embeddings, with the options of ``request`` (or its fields as keywords); with ``out_dir``, writes
    :data:`~zsprob.zeroshot.options.COMPARE_FILES` there. Returns ``{"rows", "table", "curves", "files", ...}``:
    a row per strategy with its metrics, protocol facts, paired test against ``all`` and calibration, or
    ``skipped`` with the reason; with ``label_baselines``, then the linear probe and Tip-Adapter trained on the
    selection split's labels (:mod:`zsprob.zeroshot.probe`). ``image_conditions`` (one name per evaluation
    image, e.g. SynthWorld's rendering conditions) adds the selective-prediction breakdown by condition."""
    from zsprob.zeroshot.selection import select_all

    request = as_request(request, **fields)
    score, k_values = request.score, request.k_values
    select = None if select_feats is None else (select_feats.feats, select_feats.labels)
    data = {"pool_data": f"unlabelled evaluation images ({len(eval_feats)})",
            "select_data": "selection split labels" if select_feats is None else
            f"selection split labels ({len(select_feats)} images)"}
    rows, selections, hits = [], {}, {}
    for name in strategies or compare_order():
        row, sel, row_hits = _compare_row(name, bank, eval_feats, select, request, data)
        rows.append(row)
        if sel is not None:
            selections[name], hits[name] = sel, row_hits
            row.update(row_calibration(sel, eval_feats, select_feats, score=score, logit_scales=logit_scales,
                                       unc_weight=request.unc_weight))
    all_classifier = selections["all"] if "all" in selections else select_all(bank)  # CLIP's classifier
    if label_baselines:
        for row, row_hits in _label_baselines(all_classifier, eval_feats, select_feats, logit_scales):
            rows.append(row)
            hits[row["name"]] = row_hits
    reference = hits["all"] if "all" in hits else top1_hits(all_classifier, eval_feats, "cosine")
    for row in rows:
        if not row.get("skipped"):
            row["paired_vs_all"] = paired_stats(hits[row["name"]], reference)
    curves = {}
    if not bank.deterministic:
        curves["eval"] = topk_curve(bank, eval_feats, k_values)
        if select_feats is not None:
            curves["select"] = topk_curve(bank, select_feats, k_values)
        curves["reference"] = {r["name"]: r["metrics"]["top1"] for r in rows if not r.get("skipped")}
    result = {"rows": rows, "curves": curves, "deterministic": bank.deterministic, "score": score,
              "class_separation": class_separation(all_classifier.class_mu, bank.classnames),
              "n_eval": len(eval_feats), "n_select": None if select_feats is None else len(select_feats),
              "classes": list(bank.classnames), "n_templates": bank.num_templates, "model": model or {},
              "diagnostic_eval_labels": prompt_quality_diagnostic(bank, eval_feats, k_values),
              "min_detectable_effect": detectable_effect_summary(rows, len(eval_feats)),
              **({"unc_weight": request.unc_weight} if score == "unc" else {})}
    result["selective"], by_condition = _selective(selections, eval_feats, score, logit_scales, request.unc_weight,
                                                   image_conditions)
    result["table"] = format_table(rows) + "\n\n" + calibration_table(rows) + selective_table(result["selective"])
    if by_condition:
        from zsprob.utils.selective import selective_groups_table

        result["selective_by_condition"] = by_condition
        result["table"] += "".join(f"\n\nBy rendering condition, {name} (does a low score flag the degraded "
                                   f"images?):\n" + selective_groups_table(g) for name, g in by_condition.items())
    result["files"] = {}
    result["selections"] = selections
    if out_dir is not None:
        result["files"] = _write_compare(Path(out_dir), result, title, write_selections)
    return result


def _label_baselines(all_classifier, eval_feats: ImageFeatures, select_feats: ImageFeatures | None,
                     logit_scales: dict | None) -> list:
    """``[(row, hits)]`` of the label-using baselines, or their skipped rows without a selection split."""
    from zsprob.zeroshot.probe import SELECT_AUDIT, label_baseline_rows

    def skipped(why: str) -> list:
        return [({"name": name, "label": name, "skipped": why, **SELECT_AUDIT}, None)
                for name in ("linear-probe", "tip-adapter")]

    if select_feats is None:
        return skipped("no labelled selection split")
    scale = (logit_scales or {}).get("cosine", (100.0, ""))[0]
    try:
        return label_baseline_rows(all_classifier, eval_feats, select_feats, logit_scale=scale)
    except UserError as e:  # e.g. a class without a labelled image: the prompt strategies' rows still stand
        return skipped(str(e))


#: the rows whose predictions get a selective-prediction block: CLIP's all-80 and the flagship auto
SELECTIVE_ROWS = ("all", "auto")


def _selective(selections: dict, feats: ImageFeatures, score: str, logit_scales: dict | None, unc_weight: float,
               conditions: list[str] | None = None):
    """Per headline row: which confidence score best tells right zero-shot predictions from wrong ones
    (:mod:`zsprob.utils.selective`), at the model's logit scale for ``score``; and with ``conditions``, which
    flags the images of each condition. Returns ``(reports, by condition)``."""
    import torch

    from zsprob.zeroshot.metrics import class_scores
    from zsprob.utils.selective import selective_by_group, selective_report, sigma_confidence, softmax_confidences

    scale = (logit_scales or {}).get(score, (100.0, ""))[0]
    out, by_condition = {}, {}
    for name in (n for n in SELECTIVE_ROWS if n in selections):
        sel = selections[name]
        s = class_scores(feats.mu, feats.logvar, sel, score=score, unc_weight=unc_weight)
        correct = (s.argmax(1) == torch.as_tensor(feats.labels).long()).numpy()
        conf = softmax_confidences(s, scale)
        if score == "csd":  # the predicted class's -CSD: PCME++'s match probability is monotone in it
            conf["top1_score"] = s.max(1).values.double().numpy()
        if feats.logvar is not None:
            conf["image_sigma2"] = sigma_confidence(feats.logvar)
        if sel.class_logvar is not None:  # the predicted class's prompt
            conf["class_sigma2"] = sigma_confidence(sel.class_logvar)[s.argmax(1).numpy()]
        out[name] = selective_report(correct, conf, n_boot=300)
        if conditions is not None and name == "all":  # image sigma^2 is the same for every row
            by_condition[name] = selective_by_group(correct, conf, conditions)
    return out, by_condition


def _write_compare(out_dir: Path, result: dict, title: str = "", write_selections: bool = True) -> dict:
    """Write a ``--compare`` result's figures, selections, compare.md and compare.json; their paths."""
    from zsprob.utils.io import atomic_write_json, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    files = _plots(out_dir, result["curves"], result["selections"], title)
    if result.get("selective", {}).get("all"):
        files["risk_coverage"] = _risk_coverage_plot(result["selective"]["all"], out_dir / COMPARE_FILES[5], title)
    if write_selections:
        for name, sel in result["selections"].items():
            path = save_selection(sel, out_dir / COMPARE_FILES[4] / f"{name}.json", model=result["model"],
                                  data={"used": sel.info.get("data_used")})
            files[f"selection:{name}"] = str(path)
    atomic_write_text(out_dir / COMPARE_FILES[0], result["table"] + "\n")
    files["table"], files["json"] = str(out_dir / COMPARE_FILES[0]), str(out_dir / COMPARE_FILES[1])
    atomic_write_json(out_dir / COMPARE_FILES[1],
                      {**{key: value for key, value in result.items() if key != "selections"}, "files": files})
    return files


# ----------------------------------------------------------------------------- splits, class names, bank

def _splits(request: ZeroShotRequest, model) -> tuple[Split | None, Split | None]:
    """The evaluation split (None without a root) and the labelled selection split (``select_root``, a
    SynthWorld's own ``classify/select``, else None)."""
    transform = getattr(model, "preprocess_val", None)
    kind, root = request.dataset, request.root
    eval_name, select_name = SPLIT_NAMES.get(kind, (None, None))
    ev = None if root is None else Split(kind, root, eval_name, transform)
    if request.select_root is not None:
        return ev, Split(kind, request.select_root, select_name, transform)
    if kind == "synthetic" and root is not None and (Path(root) / "classify" / "select").is_dir():
        return ev, Split(kind, root, select_name, transform)
    return ev, None


def _class_names(request: ZeroShotRequest, reference: Split | None) -> list[str]:
    """The class names prompts are made for, in ``reference``'s label order: ``--classes`` (matched to a
    folder dataset's folders by name), else the split's own."""
    from zsprob.zeroshot.prompts import load_classnames

    names, source = request.classnames, request.sources.get("classnames", "(a list)")
    if names is None:
        if reference is not None:
            return reference.classnames
        if request.dataset == "imagenet":
            return load_classnames("imagenet_classnames.txt")
        raise UserError("no class names: pass --classes FILE or the dataset --root")
    if reference is None:
        return names
    if request.dataset == "folder":
        from zsprob.data.classification import align_classnames

        return align_classnames(reference.classnames, names, f"class-name file {source}")
    if len(names) != len(reference.classnames):
        raise UserError(f"--classes {source} names {len(names)} classes, the dataset has "
                        f"{len(reference.classnames)}: give one name per class, in the dataset's order")
    return names


def _same_classes(ev: Split | None, se: Split | None) -> None:
    if ev is not None and se is not None and ev.classnames != se.classnames:
        raise UserError("the selection split's classes differ from the evaluation split's classes")


def build_bank(model, names, model_id: str, request: ZeroShotRequest):
    """The prompt bank: every class x template (default the 80 CLIP templates), or each class's own pool."""
    encoding = {"cache_dir": request.cache_dir, "model_id": model_id, "device": request.device,
                "progress": request.progress, "precision": request.precision}
    if request.class_prompts is None:
        from zsprob.zeroshot.prompts import build_prompt_bank

        return build_prompt_bank(model, names, request.templates, **encoding)
    from zsprob.zeroshot.pools import build_pool_bank

    source = request.sources.get("class_prompts")
    return build_pool_bank(model, names, request.class_prompts, **encoding,
                           source=f"class-prompts file {source}" if source else "class prompts")


def prepare(model, request: ZeroShotRequest | None = None, *, need_select: bool = True, **fields):
    """``(bank, eval features, selection features or None, model fingerprint)`` of a request, all cached."""
    from zsprob.models.fingerprint import model_fingerprint

    request = as_request(request, **fields)
    model_id = model_fingerprint(model)
    ev, se = _splits(request, model)
    se = se if need_select else None
    names = _class_names(request, ev)
    _same_classes(ev, se)
    eval_feats = encode_split(model, ev, model_id, request)
    select_feats = None if se is None else encode_split(model, se, model_id, request)
    bank = build_bank(model, names, model_id, request)
    eval_feats.classnames = list(bank.classnames)  # the prompt words, in the features' label order
    if select_feats is not None:
        select_feats.classnames = list(bank.classnames)
    return bank, eval_feats, select_feats, model_id


def compare_strategies(model, request: ZeroShotRequest | None = None, *, out_dir=None, **fields) -> dict:
    """Every prompt strategy on a request's dataset in one run: :func:`compare_on_features` on its encoded
    splits, writing under ``out_dir`` (default ``<root>/zeroshot-compare``, the cache in its ``cache/``
    unless given), plus ``timings``, ``skipped_unreadable_images`` and ``dataset``."""
    t0 = time.perf_counter()
    request = as_request(request, **fields)
    out_dir = Path(out_dir) if out_dir is not None else Path(request.root) / "zeroshot-compare"
    if isinstance(request.k_values, str):
        request = replace(request, k_values=parse_k_grid(request.k_values))
    if request.cache_dir is None:
        request = replace(request, cache_dir=out_dir / "cache")
    bank, ev, se, model_id = prepare(model, request)
    meta = _model_meta(request, model_id)
    title = f"{request.dataset} zero-shot, {meta.get('name') or getattr(model, 'name', '')}"
    res = compare_on_features(bank, ev, se, request, model=meta, logit_scales=model_logit_scales(model),
                              image_conditions=_conditions(request, ev))
    res["timings"] = {"total_seconds": time.perf_counter() - t0, "bank_encode_seconds": bank.encode_seconds,
                      "bank_from_cache": bank.from_cache, "eval_images_from_cache": ev.from_cache}
    res["skipped_unreadable_images"] = {"eval": ev.skipped, "select": se.skipped if se is not None else 0}
    res["dataset"] = {"kind": request.dataset, "root": str(request.root),
                      "select_root": None if se is None else se.source}
    res["files"] = _write_compare(out_dir, res, title)
    return res


def _conditions(request: ZeroShotRequest, feats: ImageFeatures) -> list[str] | None:
    """SynthWorld's rendering condition of each evaluation image (None for other datasets, or for a folder that
    is not a generated world: no breakdown then)."""
    if request.dataset != "synthetic" or feats.paths is None:
        return None
    from zsprob.data.synthworld.readers import classify_conditions

    try:
        return classify_conditions(request.root, SPLIT_NAMES["synthetic"][0], feats.paths)
    except UserError:
        return None


def _model_meta(request: ZeroShotRequest, model_id: str) -> dict:
    """How result files describe the model: the request's ``model_meta`` with the fingerprint as ``id``."""
    meta = {**(request.model_meta or {})}
    meta.setdefault("id", model_id)
    return meta


# ----------------------------------------------------------------------------- one strategy, one prompt set

def _reads(request: ZeroShotRequest, ev: Split | None, se: Split | None) -> tuple[Split | None, Split | None]:
    """(the selection split, the evaluation split) the request's strategy reads (None: not read), its needs
    checked before anything is encoded."""
    entry, shots_split = get_strategy(request.strategy), request.shots_split
    labelled = SELECTION_LABELS in entry.reads and request.use_select and not entry.eval_shots(shots_split)
    select = se if labelled else None
    reads_labels = entry.audit(shots_split)["reads_eval_labels"]
    if (UNLABELLED_IMAGES in entry.reads or reads_labels) and ev is None:
        raise UserError(f"strategy '{request.strategy}' needs the evaluation images: pass --root")
    evaluation = ev if UNLABELLED_IMAGES in entry.reads or reads_labels else None
    entry.check_data(select=entry.shots_source(shots_split, select, evaluation),
                     pool=evaluation if UNLABELLED_IMAGES in entry.reads else None,
                     eval_=evaluation if reads_labels else None)
    return select, evaluation


def _select(model, request: ZeroShotRequest, model_id: str, ev: Split | None, se: Split | None):
    """``(selection, selection.json dict, evaluation features if encoded)`` of the request's strategy."""
    from zsprob.zeroshot.selection import run_strategy

    entry = get_strategy(request.strategy)
    select_split, eval_split = _reads(request, ev, se)
    _same_classes(ev, select_split)
    names = _class_names(request, ev or select_split)
    select = pool = eval_ = ev_feats = None
    data = {}
    if select_split is not None:
        sf = encode_split(model, select_split, model_id, request)
        select = (sf.feats, sf.labels)
        data["selection_split"] = {"source": sf.source, "n_images": len(sf), "labels_used": True}
    if eval_split is not None:
        ev_feats = encode_split(model, eval_split, model_id, request)
        if UNLABELLED_IMAGES in entry.reads:
            pool = ev_feats.feats
            data["unlabelled_images"] = {"source": ev_feats.source, "n_images": len(ev_feats), "labels_used": False}
        if entry.audit(request.shots_split)["reads_eval_labels"]:
            eval_ = (ev_feats.feats, ev_feats.labels)
            data["evaluation_split"] = {"source": ev_feats.source, "n_images": len(ev_feats), "labels_used": True}
    bank = build_bank(model, names, model_id, request)
    if isinstance(request.k_values, str):
        request = replace(request, k_values=parse_k_grid(request.k_values, bank.num_templates))
    sel = run_strategy(request.strategy, bank, request, select=select, pool=pool, eval_=eval_,
                       select_data=f"selection split labels ({data.get('selection_split', {}).get('source')})",
                       pool_data=f"unlabelled images ({data.get('unlabelled_images', {}).get('source')})")
    doc = sel.to_dict(model=_model_meta(request, model_id), data=data or {"images": "none (text uncertainties only)"})
    doc["protocol"] = entry.audit(request.shots_split)
    return sel, doc, ev_feats


def run_selection(model, request: ZeroShotRequest | None = None, **fields):
    """Choose prompts with the request's strategy, reading only the data its registry entry reads; returns
    ``(selection, selection_json_dict)``."""
    from zsprob.models.fingerprint import model_fingerprint

    request = as_request(request, **fields)
    ev, se = _splits(request, model)
    sel, doc, _ = _select(model, request, model_fingerprint(model), ev, se)
    return sel, doc


def _read_selection(request: ZeroShotRequest, model, model_id: str, ev: Split):
    """The request's selection file, refused in one line when another model made it or it holds other classes."""
    from zsprob.models.fingerprint import is_model
    from zsprob.utils.io import read_json
    from zsprob.zeroshot.selection_base import Selection

    prompts = request.prompts
    doc = read_json(prompts, "selection file")
    sel = Selection.from_dict(doc, source=str(prompts))
    made_with = (doc.get("model") or {}).get("id")
    if made_with and not is_model(made_with, model, model_id):
        raise UserError(f"{prompts} was made with another model (id {made_with}, this model {model_id}); "
                        "run zsprob select-prompts with this model")
    if sel.class_mu.shape[1] != getattr(model, "embed_dim", sel.class_mu.shape[1]):
        raise UserError(f"{prompts} has embed_dim {sel.class_mu.shape[1]}, the model {model.embed_dim}")
    check_selection_classes(sel.classnames, ev.classnames, prompts)
    return sel


def zeroshot_eval(model, request: ZeroShotRequest | None = None, **fields) -> dict:
    """Zero-shot accuracy of one prompt set (the request's selection file, or its strategy run now)."""
    from zsprob import __version__
    from zsprob.models.fingerprint import model_fingerprint

    request = as_request(request, **fields)
    model_id = model_fingerprint(model)
    ev, se = _splits(request, model)
    feats = None
    if request.prompts is not None:
        sel = _read_selection(request, model, model_id, ev)
        sel_doc = {"file": str(request.prompts)}
    else:
        sel, doc, feats = _select(model, request, model_id, ev, se)
        sel_doc = {"file": None, "protocol": doc["protocol"]}
    if feats is None:
        feats = encode_split(model, ev, model_id, request)
    feats.classnames = list(sel.classnames)
    score, unc_weight = request.score, request.unc_weight
    metrics = evaluate_selection(sel, feats, score=score, unc_weight=unc_weight)
    sel_doc.update({"strategy": sel.strategy, "label": sel.label, "uses_eval_labels": sel.uses_eval_labels,
                    "k": sel.k, "how": {k_: v for k_, v in sel.info.items() if not k_.endswith("curve")}})
    dataset = {"kind": request.dataset, "root": str(request.root), "source": feats.source,
               "skipped_unreadable_images": feats.skipped}
    return {"zsprob_version": __version__, "dataset": dataset, "model": _model_meta(request, model_id),
            "score": score, **({"unc_weight": unc_weight} if score == "unc" else {}), "selection": sel_doc,
            "metrics": metrics, "class_separation": class_separation(sel.class_mu, sel.classnames),
            "images_from_cache": feats.from_cache}


# ----------------------------------------------------------------------------- linear probe

def run_probe(model, request: ZeroShotRequest | None = None, *, shots=None, seeds: int = 3, **fields) -> dict:
    """``zsprob probe``: the linear probe (:mod:`zsprob.zeroshot.probe`) on the request's labelled training split
    (its selection split: ``select_root``, a SynthWorld's classify/select, ImageNet's train/ beside val/), full
    and k-shot, scored on its evaluation split; the k values are checked before anything is encoded."""
    from zsprob import __version__
    from zsprob.models.fingerprint import model_fingerprint
    from zsprob.zeroshot.probe import class_counts, draw_shots, probe_on_features, shots_for

    request = as_request(request, **fields)
    if request.dataset == "imagenet" and request.select_root is None:
        request = replace(request, select_root=request.root)
    ev, tr = _splits(request, model)
    if tr is None:
        raise UserError("a linear probe needs labelled training images: pass --train-root (a folder per class)")
    _same_classes(ev, tr)
    targets = list(tr.dataset.targets)
    ks, _ = shots_for(class_counts(targets, tr.classnames, "training split"), shots)
    if ks:
        draw_shots(targets, max(ks), 0, tr.classnames)  # k larger than a class: one line, before encoding
    model_id = model_fingerprint(model)
    train, test = encode_split(model, tr, model_id, request), encode_split(model, ev, model_id, request)
    result = probe_on_features(train, test, shots=shots, seeds=seeds)
    protocol = {"features": "L2-normalised image means", "classifier": "scikit-learn LogisticRegression (L-BFGS)",
                "full": "C swept on 20% of each class held out, then refit on all training images",
                "kshot": "k images per class per seed; C swept on up to min(k, 4) more per class", "seeds": seeds,
                "reads_eval_labels": False, "labels_from": tr.source}
    dataset = {"kind": request.dataset, "root": str(request.root), "source": test.source, "train_source": train.source,
               "n_train": len(train), "skipped_unreadable_images": {"eval": test.skipped, "train": train.skipped}}
    return {"zsprob_version": __version__, "dataset": dataset, "model": _model_meta(request, model_id),
            "protocol": protocol, **result, "images_from_cache": test.from_cache and train.from_cache}
