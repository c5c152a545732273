"""COCO benchmarks: COCO 1K / 5K, CxC, ECCV Caption and PMRP, wired to the official ground truth.

``eccv_caption`` gives the ground truth keyed by official COCO ids, and the 1K folds (five contiguous chunks of
its ``coco_ids`` order); this module maps those ids to embedding rows / columns as sparse positives. PMRP
(PCME) uses 80-class instance labels when the data set has them.
"""
from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np

from zsprob.errors import UserError
from zsprob.retrieval import metrics as M
from zsprob.retrieval.embeddings import Embeddings, encode_split
from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
from zsprob.retrieval.scoring import mc_score_options

PMRP_ZETAS = (0, 1, 2)


@lru_cache(maxsize=1)
def eccv_metrics():
    """``eccv_caption.Metrics()`` (loaded once; it reads ~2 MB of JSON shipped in the package)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import eccv_caption
        except ImportError as e:  # pragma: no cover - a dependency
            raise UserError("COCO CxC / ECCV Caption evaluation needs the eccv_caption package "
                            "(pip install eccv_caption)") from e
        return eccv_caption.Metrics()


def official_test_ids() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 image ids and 25,000 caption ids of COCO 5K test in eccv_caption's caption order (images in
    order of first appearance there), so each 1K fold is a contiguous block of rows and columns."""
    m = eccv_metrics()
    caps = np.asarray(m.coco_ids, dtype=np.int64)
    seen: dict[int, None] = {}
    for c in caps:
        seen.setdefault(int(m.coco_gts["t2i"][int(c)][0]), None)
    return np.fromiter(seen, dtype=np.int64, count=len(seen)), caps


def official_subset(image_ids: np.ndarray, caption_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Indices selecting the official 5K test images and 25K captions (in eccv_caption's order) from the
    given ids, or None when the ids do not contain the whole official set."""
    off_img, off_cap = official_test_ids()
    img_pos = {int(x): i for i, x in enumerate(image_ids)}
    cap_pos = {int(x): i for i, x in enumerate(caption_ids)}
    if not all(int(x) in img_pos for x in off_img) or not all(int(x) in cap_pos for x in off_cap):
        return None
    return (np.array([img_pos[int(x)] for x in off_img], dtype=np.int64),
            np.array([cap_pos[int(x)] for x in off_cap], dtype=np.int64))


def _gts_to_csr(gts: dict, q_index: dict, g_index: dict, n_q: int, n_g: int):
    """CSR positives, the query rows, and R per row counting ground-truth items outside the gallery."""
    lists = [[] for _ in range(n_q)]
    queries = []
    n_pos = np.zeros(n_q, dtype=np.int64)
    for qid, items in gts.items():
        qi = q_index.get(int(qid))
        if qi is None:
            continue
        queries.append(qi)
        lists[qi] = [g_index[int(x)] for x in items if int(x) in g_index]
        n_pos[qi] = len(set(int(x) for x in items))
    return M.positives_from_lists(lists, n_g), np.array(sorted(queries), dtype=np.int64), n_pos


def coco_task(image_ids: np.ndarray, caption_ids: np.ndarray, caption_image: np.ndarray | None = None, *,
              instance_labels: np.ndarray | None = None, official: bool | None = None,
              zetas=PMRP_ZETAS) -> RetrievalTask:
    """Ground truth of a COCO-style test set: eccv_caption's COCO 5K / CxC / ECCV and folds when ``official``
    (default: the ids are exactly the official 5K x 25K set); otherwise positives from ``caption_image`` and,
    with 5,000 images, the 1K folds from the caption order (as in the Karpathy split files)."""
    image_ids = np.asarray(image_ids, dtype=np.int64)
    caption_ids = np.asarray(caption_ids, dtype=np.int64)
    off_img, off_cap = official_test_ids()
    is_official = (len(image_ids) == len(off_img) and len(caption_ids) == len(off_cap)
                   and set(image_ids.tolist()) == set(off_img.tolist())
                   and set(caption_ids.tolist()) == set(off_cap.tolist()))
    if official is None:
        official = is_official
    if official and not is_official:
        raise UserError("the embeddings are not the official COCO 5K test set (5,000 image ids and eccv_caption's "
                        "25,000 caption ids); select them with zsprob.retrieval.coco.official_subset")
    n_img, n_cap = len(image_ids), len(caption_ids)
    img_index = {int(x): i for i, x in enumerate(image_ids)}
    cap_index = {int(x): i for i, x in enumerate(caption_ids)}
    notes = []
    if official:
        m = eccv_metrics()
        coco_i2t, _, _ = _gts_to_csr(m.coco_gts["i2t"], img_index, cap_index, n_img, n_cap)
        cap_img = np.full(n_cap, -1, dtype=np.int64)
        for cid, iids in m.coco_gts["t2i"].items():
            cap_img[cap_index[int(cid)]] = img_index[int(iids[0])]
        if caption_image is not None and not np.array_equal(np.asarray(caption_image), cap_img):
            raise UserError("caption_image in the embeddings disagrees with eccv_caption's COCO ground truth")
        caption_image = cap_img
        sets = [BenchmarkSet("coco_5k", coco_i2t, M.sp.csr_matrix(coco_i2t.T))]
        for name, gts in (("cxc", m.cxc_gts), ("eccv", m.eccv_gts)):
            i2t, qi, ni = _gts_to_csr(gts["i2t"], img_index, cap_index, n_img, n_cap)
            t2i, qt, nt = _gts_to_csr(gts["t2i"], cap_index, img_index, n_cap, n_img)
            sets.append(BenchmarkSet(name, i2t, t2i, kind="recall" if name == "cxc" else "precision",
                                     i2t_queries=qi, t2i_queries=qt, i2t_n_pos=ni, t2i_n_pos=nt))
            outside = int(ni.sum() - i2t.nnz + nt.sum() - t2i.nnz)
            if outside:
                notes.append(f"{name}: {outside} ground-truth items lie outside the 5K x 25K gallery; as in "
                             "eccv_caption they count in R (R-Precision, mAP@R) but can never be retrieved")
        order = np.array([cap_index[int(c)] for c in m.coco_ids], dtype=np.int64)
        folds = M.coco_folds(order, caption_image)
        notes.append("ground truth: eccv_caption (COCO 5K, CxC, ECCV Caption); 1K folds: eccv_caption coco_ids order, "
                     "ranked exactly within each fold")
    else:
        if caption_image is None:
            raise UserError("these ids are not the official COCO 5K test set, so the embeddings need caption_image "
                            "(each caption's image index) to define the positives")
        caption_image = np.asarray(caption_image, dtype=np.int64)
        pos = M.positives_from_assignment(caption_image, n_img)
        sets = [BenchmarkSet("coco_5k" if n_img == 5000 else "coco", pos, M.sp.csr_matrix(pos.T))]
        folds = M.coco_folds(np.arange(n_cap), caption_image) if n_img == 5000 else None
        notes.append("not the official 5K test ids: CxC and ECCV Caption skipped; positives from caption_image")
        if folds is not None and any(len(f[0]) != 1000 for f in folds):
            folds = None
            notes.append("1K folds skipped: caption order does not give 1,000 images per fold")
    if instance_labels is not None:
        labels = np.asarray(instance_labels)
        cap_labels = labels[caption_image]
        for z in zetas:
            pm = M.plausible_positives(labels, cap_labels, z)
            sets.append(BenchmarkSet(f"pmrp_zeta{z}", pm, M.sp.csr_matrix(pm.T), kind="rprecision"))
        n_unl = int((labels.sum(1) == 0).sum())
        notes.append(f"PMRP: {n_unl} images without instance labels are neither queries nor positives")
    return RetrievalTask(name="coco", image_ids=image_ids, caption_ids=caption_ids,
                         caption_image=np.asarray(caption_image, dtype=np.int64), sets=sets, folds=folds, notes=notes)


def task_for_embeddings(emb: Embeddings,
                        instance_labels: np.ndarray | None = None) -> tuple[Embeddings, RetrievalTask]:
    """The official 5K subset and its task when the embeddings contain it (extra captions, e.g. the 25,010
    Karpathy test captions, are dropped), else the ids as given."""
    sub = official_subset(emb.image_ids, emb.caption_ids)
    if sub is not None:
        ii, ci = sub
        if len(ii) != len(emb.image_ids) or len(ci) != len(emb.caption_ids) or not (
                np.array_equal(ii, np.arange(len(ii))) and np.array_equal(ci, np.arange(len(ci)))):
            emb = emb.select(ii, ci)
            if instance_labels is not None:
                instance_labels = np.asarray(instance_labels)[ii]
        task = coco_task(emb.image_ids, emb.caption_ids, emb.caption_image, instance_labels=instance_labels,
                         official=True)
        emb.caption_image = task.caption_image
        return emb, task
    return emb, coco_task(emb.image_ids, emb.caption_ids, emb.caption_image, instance_labels=instance_labels,
                          official=False)


def refuse_unreadable_images(paths, split: str) -> None:
    """One line when an image of the split is missing, not an image, or cut short: a benchmark split is
    scored whole, so nothing is skipped (training on COCO replaces such images and counts them instead)."""
    from zsprob.data.classification import readable_images

    _, bad = readable_images([Path(p) for p in paths])
    if bad:
        path, why = bad[0]
        raise UserError(f"{len(bad)} of {len(paths)} images of the {split} split cannot be read "
                        f"(e.g. {path}: {why}); a benchmark is scored on every image: restore them")


class CocoValSelection:
    """Model selection by validation RSUM, as PCME++'s engine keeps its best epoch: an evaluation hook
    ``hook(model, step) -> {"val_rsum", "val_best_rsum"}`` that embeds the Karpathy ``split`` and, when its
    RSUM (1K folds for 5,000 images) beats the best so far, writes ``out_dir/model-best`` and ``best.json``.
    The split is parsed and its images checked when the hook is built, before training starts."""

    def __init__(self, root, out_dir, *, split: str = "val", karpathy_json=None, batch_size: int = 128,
                 score: str = "csd", method: str | None = None, dataset: str = "coco"):
        from zsprob.data.flickr import karpathy_captions

        self.root, self.out_dir, self.split = root, Path(out_dir), split
        self.karpathy_json, self.batch_size, self.score, self.method = karpathy_json, batch_size, score, method
        self.best = float("-inf")
        self._ds = karpathy_captions(dataset, root, split, karpathy_json, official_ids=False, instances=False)
        refuse_unreadable_images(self._ds.image_paths, split)

    def __call__(self, model, step: int) -> dict:
        from zsprob.models import save
        from zsprob.retrieval.evaluate import evaluate_embeddings, summary_row
        from zsprob.utils.io import atomic_write_json

        device = next(model.parameters()).device
        emb, task = task_for_embeddings(encode_split(model, self._ds, batch_size=self.batch_size, device=device))
        score = self.score if emb.has_sigma else "cosine"
        row = summary_row(evaluate_embeddings(emb, task, score=score).metrics)
        rsum = float(row.get("RSUM", row.get("RSUM (5K)", float("nan"))))
        if rsum > self.best:
            self.best = rsum
            save(model, self.out_dir / "model-best",
                 extra={"method": self.method, "step": int(step), "val_rsum": rsum})
            atomic_write_json(self.out_dir / "best.json", {"step": int(step), "val_rsum": rsum, "split": self.split})
        return {"val_rsum": rsum, "val_best_rsum": self.best}


def evaluate_coco(model=None, root=None, split: str = "test", score: str = "csd", out_dir=None, *,
                  embeddings=None, instance_labels=None, batch_size: int = 128, device=None, num_workers: int = 0,
                  analyses: bool = True, progress: bool = True, save_embeddings=None, karpathy_json=None,
                  label: str = "model", metrics_file: str = "metrics.json", precision: str = "fp32",
                  dataset=None) -> dict:
    """COCO evaluation of a model on ``root``'s ``split`` (or on an already parsed ``dataset``, e.g. Flickr30k's,
    scored as the set "coco") or of precomputed ``embeddings`` (an :class:`Embeddings` or an ``.npz`` path);
    ``save_embeddings`` (``.npz``) keeps what the model computed. Returns ``{"metrics", "summary", "table",
    "uncertainty", "files"}``; with ``out_dir`` writes the metrics, the table and the uncertainty analyses."""
    from zsprob.data.coco import CocoCaptions
    from zsprob.retrieval.analysis import FILES, report_uncertainty
    from zsprob.retrieval.embeddings import load_embeddings
    from zsprob.retrieval.evaluate import evaluate_embeddings, format_table, summary_row
    from zsprob.utils.io import atomic_write_json, atomic_write_text

    ds = None
    if embeddings is not None:
        emb = load_embeddings(embeddings) if isinstance(embeddings, (str, Path)) else embeddings
    else:
        ds = dataset if dataset is not None else CocoCaptions(root, split=split, karpathy_json=karpathy_json)
        refuse_unreadable_images(ds.image_paths, split)
        emb = encode_split(model, ds, batch_size=batch_size, device=device, progress=progress,
                           num_workers=num_workers, precision=precision)
        if instance_labels is None and getattr(ds, "instance_labels", None) is not None:
            instance_labels = np.asarray(ds.instance_labels)
        if save_embeddings:
            emb.save(save_embeddings)
    sub = official_subset(emb.image_ids, emb.caption_ids)
    emb, task = task_for_embeddings(emb, instance_labels)
    mc = mc_score_options(model) if score == "mc" else {}
    from zsprob.models.logit_scale import model_logit_scale
    scale = model_logit_scale(model, score)[0] if model is not None else None
    res = evaluate_embeddings(emb, task, score=score, keep_top=5 if analyses else 0, progress=progress, device=device,
                              logit_scale=scale, **mc)
    out = {"metrics": res.metrics, "summary": summary_row(res.metrics), "selective": res.selective,
           "table": format_table(res.metrics, label=label), "uncertainty": None, "files": {}}
    if analyses and emb.has_sigma:
        paths = captions = None
        if ds is not None:
            ii, ci = sub if sub is not None else (np.arange(len(ds.image_paths)), np.arange(len(ds.captions)))
            paths = [ds.image_paths[i] for i in ii]
            captions = [ds.captions[c] for c in ci]
        unc = report_uncertainty(emb, res, task, out_dir, image_paths=paths, captions=captions)
        out["uncertainty"] = unc["deciles"]
        out["files"].update(unc["files"])
    if out_dir is not None:
        out_dir = Path(out_dir)
        from zsprob.models.fingerprint import model_identity
        made_with = {} if model is None else {"model": model_identity(model)}  # embeddings: no model here
        out["files"]["metrics"] = str(atomic_write_json(out_dir / metrics_file, {
            **made_with, "metrics": out["metrics"], "summary": out["summary"], "uncertainty": out["uncertainty"],
            "selective": out["selective"]}))
        out["files"]["table"] = str(atomic_write_text(out_dir / FILES["table"], out["table"]))
    return out


def _as_id_array(values: list, direction: str, what: str) -> np.ndarray:
    """``values`` (ints, or strings of ints as JSON keys are) as an int64 array; floats, booleans and
    other strings are one :class:`UserError` line rather than truncated (3.7 -> 3) into another item."""
    try:
        arr = np.asarray(values)
    except ValueError as e:  # ragged nesting
        raise UserError(f"{direction}: {what} must be integers ({e})") from None
    if arr.ndim == 1 and arr.dtype.kind in "iuU":  # strings: JSON keys
        try:
            return arr.astype(np.int64)
        except (ValueError, OverflowError):
            pass
    example = next((v for v in values if not isinstance(v, (int, np.integer)) or isinstance(v, bool)), values[0])
    raise UserError(f"{direction}: {what} must be integers, got {example!r}")


def _lists_by_query(lists: dict, direction: str) -> dict[int, object]:
    """{query id (int): ranked list}; two keys naming the same id ("7" and "07") are an error."""
    keys = list(lists)
    if not keys:
        return {}
    qids = _as_id_array(keys, direction, "query ids")
    by_id = dict(zip(qids.tolist(), lists.values()))
    if len(by_id) < len(keys):
        seen: dict[int, object] = {}
        for key, q in zip(keys, qids.tolist()):
            if q in seen:
                raise UserError(f"{direction}: query {q} has two ranked lists (keys {seen[q]!r} and {key!r})")
            seen[q] = key
    return by_id


def _flatten_lists(rows: list, direction: str, query_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranked lists as one int64 array of ids and each list's length."""
    for q, r in zip(query_ids, rows):
        if not isinstance(r, (list, tuple, np.ndarray)):
            raise UserError(f"{direction}: each query needs a list of integer ids, best first; query {int(q)} "
                            f"has {type(r).__name__} {str(r)[:40]!r}")
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = [x for r in rows for x in r]
    ids = _as_id_array(flat, direction, "ranked ids") if flat else np.zeros(0, dtype=np.int64)
    return ids, lengths


def _refuse_repeats(idx: np.ndarray, lengths: np.ndarray, query_ids: np.ndarray, gallery_ids: np.ndarray,
                    direction: str) -> None:
    """A list naming an item twice is refused: a repeated positive would count as another hit. ``idx``: the
    lists' gallery indices, one after another (``lengths`` each)."""
    n_g = len(gallery_ids)
    keys = np.sort(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths) * n_g + idx)
    repeat = keys[1:] == keys[:-1]
    if repeat.any():
        key = int(keys[1:][repeat][0])
        n_lists = len(np.unique(keys[1:][repeat] // n_g))
        raise UserError(f"{direction}: the ranked list of query {int(query_ids[key // n_g])} holds id "
                        f"{int(gallery_ids[key % n_g])} more than once ({n_lists} of {len(lengths)} lists repeat "
                        "an id); a ranking names each item once")


def _id_lists_to_array(lists: dict, query_ids: np.ndarray, gallery_ids: np.ndarray,
                       direction: str) -> tuple[np.ndarray, int]:
    """{query id: [gallery ids, best first]} -> [n_queries, L] gallery indices in the order of ``query_ids``
    (L: the shortest of their lists; other queries ignored), and the longest list's length."""
    by_id = _lists_by_query(lists, direction)
    missing = [int(q) for q in query_ids if int(q) not in by_id]
    if missing:
        raise UserError(f"{direction}: {len(missing)} of the {len(query_ids)} official query ids have no ranked list "
                        f"(e.g. {missing[0]})")
    flat, lengths = _flatten_lists([by_id[int(q)] for q in query_ids], direction, query_ids)
    order = np.argsort(gallery_ids)
    idx = order[np.searchsorted(gallery_ids[order], flat).clip(max=len(gallery_ids) - 1)]
    bad = gallery_ids[idx] != flat
    if bad.any():
        raise UserError(f"{direction}: {int(bad.sum())} ranked ids are not in the official gallery "
                        f"(e.g. {int(flat[bad][0])})")
    _refuse_repeats(idx, lengths, query_ids, gallery_ids, direction)
    L = int(lengths.min()) if len(lengths) else 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return idx[starts[:, None] + np.arange(L)[None, :]], int(lengths.max()) if len(lengths) else 0


def evaluate_coco_rankings(i2t: dict, t2i: dict, *, ks=M.DEFAULT_KS) -> dict:
    """COCO 1K/5K, CxC and ECCV Caption metrics of ranked id lists on the official 5K test ids, cut to the
    shortest list: ``i2t`` {image id: [caption ids, best first]}, ``t2i`` {caption id: [image ids]}.
    Returns ``{"metrics", "summary", "table", "notes"}``."""
    from zsprob.retrieval.evaluate import evaluate_rankings, format_table, summary_row

    img_ids, cap_ids = official_test_ids()
    task = coco_task(img_ids, cap_ids, official=True)
    ri, li = _id_lists_to_array(i2t, img_ids, cap_ids, "i2t")
    rt, lt = _id_lists_to_array(t2i, cap_ids, img_ids, "t2i")
    notes = [n.replace("ranked exactly within each fold", "each list's items of the query's fold, in order")
             for n in task.notes]
    for d, arr, longest in (("i2t", ri, li), ("t2i", rt, lt)):
        if arr.shape[1] < longest:
            notes.append(f"{d}: lists cut to the shortest one ({arr.shape[1]} of up to {longest} items)")
    try:
        metrics = evaluate_rankings(ri, rt, task, ks=ks)
    except ValueError as e:
        raise UserError(str(e)) from None
    return {"metrics": metrics, "summary": summary_row(metrics), "table": format_table(metrics, label="rankings"),
            "notes": notes}
