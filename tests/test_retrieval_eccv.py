"""COCO evaluation vs the official eccv_caption implementation on its real 5,000 x 25,000 id sets."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from zsprob.retrieval import metrics as M
from zsprob.retrieval.coco import eccv_metrics, official_test_ids, task_for_embeddings
from zsprob.retrieval.embeddings import Embeddings
from zsprob.retrieval.evaluate import evaluate_rankings, evaluate_scores
from zsprob.retrieval.scoring import PairScores

LIST_LEN = 300  # eccv_caption's 1K recall filters these lists to the fold (see NOTES.md)


def synthetic_official_embeddings(d=32, seed=0, noise=1.2):
    """Random embeddings on the official ids: captions are noisy copies of their image."""
    img_ids, cap_ids = official_test_ids()
    m = eccv_metrics()
    where = {int(x): i for i, x in enumerate(img_ids)}
    cap_img = np.array([where[m.coco_gts["t2i"][int(c)][0]] for c in cap_ids])
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(len(img_ids), d, generator=g)
    cap = img[torch.from_numpy(cap_img)] + noise * torch.randn(len(cap_ids), d, generator=g)
    lv_i = torch.randn(len(img_ids), d, generator=g) * 0.5 - 1
    lv_c = torch.randn(len(cap_ids), d, generator=g) * 0.5 - 1
    # shuffle the caption order so the mapping through ids is exercised
    perm = torch.randperm(len(cap_ids), generator=g).numpy()
    return Embeddings(img_ids, cap_ids[perm], img, cap[perm], lv_i, lv_c[perm], caption_image=None)


@pytest.mark.slow
def test_identical_to_eccv_caption_compute_all_metrics():
    emb, task = task_for_embeddings(synthetic_official_embeddings())
    assert task.n_images == 5000 and task.n_captions == 25000
    ps = PairScores("csd", emb.image_mu, emb.image_logvar, emb.caption_mu, emb.caption_logvar)
    ours = evaluate_scores(ps, task).metrics

    # the same rankings as id lists, for eccv_caption
    ri = M.rank_lists(ps.i2t, np.arange(5000), LIST_LEN).numpy()
    rt = M.rank_lists(ps.t2i, np.arange(25000), LIST_LEN).numpy()
    i2t = {int(emb.image_ids[q]): emb.caption_ids[ri[q]].tolist() for q in range(5000)}
    t2i = {int(emb.caption_ids[q]): emb.image_ids[rt[q]].tolist() for q in range(25000)}
    # precondition for eccv_caption's filtered 1K recall to equal exact in-fold ranking:
    # every truncated list holds at least 10 items of the query's fold
    fold_img = np.zeros(5000, dtype=int)
    fold_cap = np.zeros(25000, dtype=int)
    for f, (imgs, caps) in enumerate(task.folds):
        fold_img[imgs], fold_cap[caps] = f, f
    assert ((fold_cap[ri] == fold_img[:, None]).sum(1) >= 10).all()
    assert ((fold_img[rt] == fold_cap[:, None]).sum(1) >= 10).all()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = eccv_metrics().compute_all_metrics(
            i2t, t2i, target_metrics=("coco_1k_recalls", "coco_5k_recalls", "cxc_recalls", "eccv_r1",
                                      "eccv_map_at_r", "eccv_rprecision"), Ks=(1, 5, 10), verbose=False)
    pairs = []
    for d in ("i2t", "t2i"):
        for k in (1, 5, 10):
            pairs += [(ours["coco_1k"][d][f"r@{k}"], ref[f"coco_1k_r{k}"][d]),
                      (ours["coco_5k"][d][f"r@{k}"], ref[f"coco_5k_r{k}"][d]),
                      (ours["cxc"][d][f"r@{k}"], ref[f"cxc_r{k}"][d])]
        pairs += [(ours["eccv"][d]["map_at_r"], ref["eccv_map_at_r"][d]),
                  (ours["eccv"][d]["rprecision"], ref["eccv_rprecision"][d]),
                  (ours["eccv"][d]["r@1"], ref["eccv_r1"][d])]
    for a, b in pairs:
        assert abs(a - 100.0 * b) < 1e-9, (a, 100 * b)
    # the same metrics straight from the ranked lists that eccv_caption was given
    from_lists = evaluate_rankings(ri, rt, task)
    for bench in ("coco_1k", "coco_5k", "cxc", "eccv"):
        for d in ("i2t", "t2i"):
            assert from_lists[bench][d] == pytest.approx(ours[bench][d], abs=1e-9), (bench, d)
    # non-trivial operating point (not all 0 / 100)
    assert 5 < ours["coco_5k"]["i2t"]["r@1"] < 95 and 1 < ours["eccv"]["i2t"]["map_at_r"] < 90
    assert ours["eccv"]["i2t"]["n_queries"] == 1261 and ours["eccv"]["t2i"]["n_queries"] == 1332
    assert ours["cxc"]["t2i"]["n_queries"] == 24972


def test_official_subset_drops_extra_captions_and_reorders():
    emb = synthetic_official_embeddings(d=4)
    extra = Embeddings(np.concatenate([emb.image_ids, [1]]), np.concatenate([emb.caption_ids, [7, 8]]),
                       torch.cat([emb.image_mu, torch.zeros(1, 4)]), torch.cat([emb.caption_mu, torch.zeros(2, 4)]))
    sub, task = task_for_embeddings(extra)
    _, off_cap = official_test_ids()
    assert np.array_equal(sub.caption_ids, off_cap) and len(sub.image_ids) == 5000
    # folds are eccv_caption's: contiguous chunks of its caption order, 1,000 images each
    assert [len(f[0]) for f in task.folds] == [1000] * 5 and [len(f[1]) for f in task.folds] == [5000] * 5
    assert set(task.folds[0][1].tolist()) == set(range(5000))
    names = [s.name for s in task.sets]
    assert names == ["coco_5k", "cxc", "eccv"]
