"""PMRP on the COCO 1K folds (PCME's headline table): in-fold ranking and plausible positives,
against a direct float64 computation."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from zsprob.retrieval import metrics as M
from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
from zsprob.retrieval.embeddings import Embeddings
from zsprob.retrieval.evaluate import evaluate_embeddings, format_table


def _task(rng, n_img=30, per=5, n_folds=3):
    n_cap = n_img * per
    cap_img = np.repeat(np.arange(n_img), per)
    labels = (rng.random((n_img, 6)) < 0.35).astype(np.int64)
    labels[0] = 0  # an image without labels: neither a query nor a positive
    sets = [BenchmarkSet("coco_5k", M.positives_from_assignment(cap_img, n_img),
                         sp.csr_matrix(M.positives_from_assignment(cap_img, n_img).T))]
    for z in (0, 1):
        pm = M.plausible_positives(labels, labels[cap_img], z)
        sets.append(BenchmarkSet(f"pmrp_zeta{z}", pm, sp.csr_matrix(pm.T), kind="rprecision"))
    order = np.concatenate([np.flatnonzero(cap_img == i) for i in rng.permutation(n_img)])  # scattered folds
    folds = M.coco_folds(order, cap_img, n_folds=n_folds)
    return RetrievalTask("toy", np.arange(n_img), np.arange(n_cap), cap_img, sets, folds=folds), labels


def _rprecision(scores: np.ndarray, pos: np.ndarray) -> float:
    vals = []
    for q in range(scores.shape[0]):
        r = int(pos[q].sum())
        if r == 0:
            continue
        top = np.argsort(-scores[q], kind="stable")[:r]
        vals.append(pos[q, top].sum() / r)
    return float(np.mean(vals))


def test_pmrp_on_1k_folds_equals_in_fold_reference():
    rng = np.random.default_rng(0)
    task, labels = _task(rng)
    d = 8
    img = torch.from_numpy(rng.standard_normal((task.n_images, d)))
    cap = img[torch.from_numpy(task.caption_image)] + 0.8 * torch.from_numpy(rng.standard_normal((task.n_captions, d)))
    emb = Embeddings(task.image_ids, task.caption_ids, img.float(), cap.float(), caption_image=task.caption_image)
    res = evaluate_embeddings(emb, task, score="cosine")
    got = res.metrics["pmrp_1k"]
    assert got["n_folds"] == 3
    imgn = torch.nn.functional.normalize(img, dim=-1).numpy()
    capn = torch.nn.functional.normalize(cap, dim=-1).numpy()
    for z in (0, 1):
        pm = M.plausible_positives(labels, labels[task.caption_image], z).toarray()
        ref = {"i2t": [], "t2i": []}
        for imgs, caps in task.folds:
            s = imgn[imgs] @ capn[caps].T
            ref["i2t"].append(_rprecision(s, pm[imgs][:, caps]))
            ref["t2i"].append(_rprecision(s.T, pm[imgs][:, caps].T))
        for direction in ("i2t", "t2i"):
            assert abs(got[direction][f"zeta{z}"] - 100 * np.mean(ref[direction])) < 1e-9
    # the 1K figure differs from the 5K one (ranked against the whole gallery) and is printed
    assert got["i2t"]["zeta0"] != res.metrics["pmrp"]["i2t"]["zeta0"]
    assert "PMRP 1K" in format_table(res.metrics) and "pmrp_1k" in format_table(res.metrics)
