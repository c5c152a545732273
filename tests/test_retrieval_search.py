"""Exact CSD search: augmented nearest-neighbour search == brute-force CSD ranking."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from zsprob.errors import UserError
from zsprob.prob import score
from zsprob.retrieval import search as S
from zsprob.retrieval.metrics import topk_ranking


def gallery(n=3000, nq=64, d=16, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(n, d)).astype(np.float32)
    # sigma varies a lot across items, so CSD and mean-only rankings differ
    glv = (rng.uniform(-4, 0, size=(n, 1)) + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    q = rng.normal(size=(nq, d)).astype(np.float32)
    qlv = rng.uniform(-3, 0, size=(nq, d)).astype(np.float32)
    return g, glv, q, qlv


def reference(q, qlv, g, glv, k):
    """Exact ranking straight from zsprob.prob.score('csd') in float64."""
    s = score("csd", torch.from_numpy(q).double(), torch.from_numpy(qlv).double(),
              torch.from_numpy(g).double(), torch.from_numpy(glv).double())
    idx = topk_ranking(s, k)
    return (-s.gather(1, idx)).numpy(), idx.numpy()


def test_augmented_vectors_reproduce_csd_exactly():
    g, glv, q, qlv = gallery(n=50, nq=7)
    csd = -score("csd", *(torch.from_numpy(x).double() for x in (q, qlv, g, glv))).numpy()
    ip = S.augment_queries(q, "ip").astype(np.float64) @ S.augment_gallery(g, glv, "ip").astype(np.float64).T
    np.testing.assert_allclose(S.to_csd(ip, q, qlv, "ip"), csd, rtol=1e-5, atol=1e-4)
    a, b = S.augment_queries(q, "l2").astype(np.float64), S.augment_gallery(g, glv, "l2").astype(np.float64)
    l2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(S.to_csd(l2, q, qlv, "l2"), csd, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind,metric", [("flat", "ip"), ("flat", "l2"), ("torch", "ip"), ("torch", "l2")])
def test_exact_indexes_equal_brute_force_csd_ranking(kind, metric):
    g, glv, q, qlv = gallery()
    k = 10
    ref_csd, ref_idx = reference(q, qlv, g, glv, k)
    res = S.build_index(g, glv, kind=kind, metric=metric, ids=np.arange(len(g)) + 7).search(q, qlv, k)
    np.testing.assert_allclose(res.csd, ref_csd, rtol=1e-5, atol=1e-4)
    # identical rankings wherever float32 rounding cannot swap neighbours
    gaps = np.diff(ref_csd, axis=1)
    clear = np.concatenate([gaps[:, :1] > 1e-3, (gaps[:, 1:] > 1e-3) & (gaps[:, :-1] > 1e-3)], 1)
    clear = np.concatenate([clear, gaps[:, -1:] > 1e-3], 1)
    assert clear.mean() > 0.9
    assert np.array_equal(res.index[clear], ref_idx[clear])
    assert np.array_equal(res.ids, res.index + 7)
    assert S.recall_at_k(res.index, ref_idx) >= 0.999
    # the zsprob.prob reference path used by the benchmarks agrees too
    bv, bi = S.brute_force_csd(q, qlv, g, glv, k)
    assert S.recall_at_k(bi, ref_idx) >= 0.999


def test_mean_only_ranking_differs_and_rerank_with_all_candidates_is_exact():
    g, glv, q, qlv = gallery()
    _, ref_idx = reference(q, qlv, g, glv, 10)
    mean_only = S.build_index(g, None, kind="flat", metric="l2").search(q, None, 10)
    assert S.recall_at_k(mean_only.index, ref_idx) < 0.8  # sigma matters for this gallery
    full = S.MeanRerankIndex(g, glv, kind="flat", candidates=len(g)).search(q, qlv, 10)
    assert S.recall_at_k(full.index, ref_idx) >= 0.999
    few = S.MeanRerankIndex(g, glv, kind="flat", candidates=20).search(q, qlv, 10)
    assert S.recall_at_k(few.index, ref_idx) < S.recall_at_k(full.index, ref_idx)


def test_deterministic_embeddings_search_by_mean_distance():
    g, _, q, _ = gallery(n=500)
    res = S.build_index(g, None, kind="flat").search(q, None, 5)
    ref = topk_ranking(score("mean", torch.from_numpy(q), None, torch.from_numpy(g), None), 5).numpy()
    assert S.recall_at_k(res.index, ref) >= 0.999


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf", "torch"])
def test_save_load_roundtrip(tmp_path, kind):
    g, glv, q, qlv = gallery(n=2000)
    idx = S.build_index(g, glv, kind=kind, ids=np.arange(len(g)) * 3, nlist=16, nprobe=4)
    before = idx.search(q, qlv, 5)
    idx.save(tmp_path / "i")
    again = S.load_index(tmp_path / "i")
    after = again.search(q, qlv, 5)
    assert again.kind == kind and again.params == idx.params
    assert np.array_equal(before.ids, after.ids)
    np.testing.assert_allclose(before.csd, after.csd)


def test_approximate_l2_indexes_have_high_recall():
    g, glv, q, qlv = gallery(n=4000)
    _, ref = reference(q, qlv, g, glv, 10)
    hnsw = S.build_index(g, glv, kind="hnsw", ef_search=128).search(q, qlv, 10)
    ivf = S.build_index(g, glv, kind="ivf", nlist=32, nprobe=16).search(q, qlv, 10)
    assert S.recall_at_k(hnsw.index, ref) >= 0.95
    assert S.recall_at_k(ivf.index, ref) >= 0.9


def test_k_larger_than_gallery_pads():
    g, glv, q, qlv = gallery(n=4, nq=2)
    res = S.build_index(g, glv, kind="torch").search(q, qlv, 6)
    assert res.ids.shape == (2, 6) and (res.ids[:, 4:] == -1).all() and np.isinf(res.csd[:, 4:]).all()


def test_errors(tmp_path, monkeypatch):
    g, glv, q, qlv = gallery(n=20, nq=2)
    with pytest.raises(UserError, match="unknown index kind"):
        S.build_index(g, glv, kind="lsh")
    with pytest.raises(UserError, match="expects dimension"):
        S.build_index(g, glv).search(q[:, :5], None, 3)
    with pytest.raises(UserError, match="logvar has shape"):
        S.build_index(g, glv[:, :3])
    with pytest.raises(UserError, match="index directory not found"):
        S.load_index(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        S.load_index(tmp_path / "bad")
    monkeypatch.setitem(sys.modules, "faiss", None)  # as if faiss-cpu were not installed
    with pytest.raises(UserError, match="pip install faiss-cpu"):
        S.build_index(g, glv, kind="hnsw")
    assert S.build_index(g, glv, kind="torch").search(q, qlv, 3).ids.shape == (2, 3)  # torch path needs no FAISS
