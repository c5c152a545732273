"""The screened exact evaluation (zsprob.retrieval.screen, zsprob.retrieval.screened) against float64 brute force.

Every decision the screen makes must equal the float64 ranking: ranks of requested items
(with ties broken by the lower index and column ranges), top lists, every benchmark metric,
for bfloat16 and float32 screens, CSD / mean / cosine, and with the two directions in threads.
The error bound itself is checked entry by entry on adversarial data, and a broken bound must
be caught (ScreenBoundError) and answered by the score matrix.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from zsprob.retrieval import metrics as M
from zsprob.retrieval import screen as S
from zsprob.retrieval.evaluate import BenchmarkSet, RetrievalTask, evaluate_scores
from zsprob.retrieval.scoring import PairScores
from zsprob.retrieval.screened import evaluate_screened

DTYPES = (torch.bfloat16, torch.float32)


def gaussians(n, d, rng, scale=1.0, unit=True):
    mu = rng.normal(size=(n, d))
    if unit:
        mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    return torch.from_numpy((scale * mu).astype(np.float32)), torch.from_numpy(
        (rng.normal(size=(n, d)) * 0.5 - 3).astype(np.float32))


def neg_csd64(mu_a, lv_a, mu_b, lv_b, score="csd"):
    """-distance in float64, written out directly (not through the screen's algebra). Cosine is
    the float64 inner product of the float32-normalised means (zsprob.prob.score's definition)."""
    a, b = mu_a.double(), mu_b.double()
    if score == "cosine":
        a = torch.nn.functional.normalize(mu_a, dim=-1, eps=1e-8).double()
        b = torch.nn.functional.normalize(mu_b, dim=-1, eps=1e-8).double()
        return a @ b.T
    d = (a[:, None, :] - b[None, :, :]).pow(2).sum(-1)
    if score == "csd":
        d = d + lv_a.double().exp().sum(1)[:, None] + lv_b.double().exp().sum(1)[None, :]
    return -d


def stable_rank(keys_row: torch.Tensor, col: int) -> int:
    """0-based position of ``col`` in the stable descending order of a float64 row."""
    order = keys_row.argsort(descending=True, stable=True)
    return int(torch.nonzero(order == col)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score", ["csd", "mean", "cosine"])
def test_screen_ranks_equal_float64_ranks(dtype, score):
    rng = np.random.default_rng(0)
    q_mu, q_lv = gaussians(40, 24, rng)
    g_mu, g_lv = gaussians(700, 24, rng, unit=score != "mean")
    g_mu[:40] = q_mu + 0.3 * g_mu[:40]  # some close pairs, so ranks below the caps occur
    g_mu[100], g_lv[100] = g_mu[7], g_lv[7]  # an exact duplicate: a tie broken by the lower index
    g_mu[101] = g_mu[8] * (1 + 2e-7)  # a near-tie, far inside the bfloat16 band
    g_lv[101] = g_lv[8]
    keys = S.LinearKeys.from_score(score, q_mu, q_lv, g_mu, g_lv, dtype=dtype)
    ref = neg_csd64(q_mu, q_lv, g_mu, g_lv, score)
    rows = np.repeat(np.arange(40), 6)
    cols = np.concatenate([[i, 7, 100, 8, 101, rng.integers(700)] for i in range(40)])
    caps = rng.integers(1, 60, size=len(rows))
    caps[::3] = 700  # uncapped: the full rank
    lo = np.zeros(len(rows), dtype=np.int64)
    hi = np.full(len(rows), 700, dtype=np.int64)
    ranged = rng.random(len(rows)) < 0.4  # a column range around the item (a COCO 1K fold)
    lo[ranged] = np.maximum(0, cols[ranged] - rng.integers(1, 300, ranged.sum()))
    hi[ranged] = np.minimum(700, cols[ranged] + rng.integers(1, 300, ranged.sum()))
    st = {}
    got = S.screen_ranks(keys, rows, cols, caps, col_lo=lo, col_hi=hi, group=16, stats=st)
    for p in range(len(rows)):
        r, c = int(rows[p]), int(cols[p])
        sub = ref[r, lo[p]:hi[p]]
        want = min(stable_rank(sub, c - lo[p]), int(caps[p]))
        assert got[p] == want, (p, r, c, caps[p], lo[p], hi[p])
    assert st["requests"] == len(rows) and st["rescored"] > 0  # some decisions needed float64
    assert (got < caps).any() and (got == caps).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_screen_topk_equals_stable_sort(dtype):
    rng = np.random.default_rng(1)
    q_mu, q_lv = gaussians(30, 16, rng)
    g_mu, g_lv = gaussians(400, 16, rng)
    g_mu[50], g_lv[50] = g_mu[3], g_lv[3]
    keys = S.LinearKeys.from_score("csd", q_mu, q_lv, g_mu, g_lv, dtype=dtype)
    ref = neg_csd64(q_mu, q_lv, g_mu, g_lv)
    got = S.screen_topk(keys, 7, group=16)
    want = ref.argsort(dim=1, descending=True, stable=True)[:, :7].numpy()
    np.testing.assert_array_equal(got, want)
    # more items than groups: whole rows, same answer
    np.testing.assert_array_equal(S.screen_topk(keys, 40, group=16), ref.argsort(dim=1, descending=True, stable=True)[:, :40].numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_bound_holds_entrywise_on_adversarial_data(dtype):
    """|out - (key - o)| <= E + rel |out| for every entry: mixed scales, large biases, offsets of
    both signs, non-unit vectors, D not a multiple of anything."""
    rng = np.random.default_rng(2)
    q = torch.from_numpy((rng.normal(size=(64, 77)) * rng.lognormal(0, 2, size=(64, 1))).astype(np.float32))
    g = torch.from_numpy((rng.normal(size=(900, 77)) * rng.lognormal(0, 2, size=(900, 1))).astype(np.float32))
    c = torch.from_numpy(rng.normal(size=900) * 50)
    keys = S.LinearKeys(S.Side(q), S.Side(g), c, 2.0)
    scr = S.Screen(keys, dtype=dtype, group=32)
    o = torch.from_numpy(rng.normal(size=64) * 30)
    parts, o_fold = scr.fold(o)
    rows = torch.arange(64)
    out = scr.gemm(rows, parts).double()[:, :900]
    exact = keys.exact_rows(rows) - o_fold[:, None]
    bound = scr.error(rows, o_fold)[:, None] + scr.rel * out.abs()
    slack = bound - (out - exact).abs()
    assert bool((slack >= 0).all()), float(slack.min())
    # padding columns score far below everything
    assert bool((scr.gemm(rows, parts)[:, 900:].double() < -1e29).all())
    if dtype == torch.bfloat16:
        # on unit vectors the bound is not vacuous: the worst error seen reaches a good part of it
        qn, gn = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(g, dim=1)
        keys = S.LinearKeys(S.Side(qn), S.Side(gn), torch.zeros(900, dtype=torch.float64), 2.0)
        scr = S.Screen(keys, dtype=dtype, group=32)
        parts, o_fold = scr.fold(torch.zeros(64, dtype=torch.float64))
        out = scr.gemm(rows, parts).double()[:, :900]
        err = (out - keys.exact_rows(rows)).abs()
        ratio = err / (scr.error(rows, o_fold)[:, None] + scr.rel * out.abs())
        assert 0.1 < float(ratio.max()) <= 1


def small_task(rng, n_img=60, per=5, folds="contiguous"):
    """COCO-like: 5 captions per image; CxC-like extra positives; ECCV-like precision set with R
    counted partly outside the gallery; a long-R set (ranked on score blocks); 1K-style folds."""
    n_cap = n_img * per
    cap_img = np.repeat(np.arange(n_img), per)
    coco = M.positives_from_assignment(cap_img, n_img)
    extra = sp.random(n_img, n_cap, density=0.01, random_state=3, format="csr").astype(bool)
    cxc = (coco + extra).astype(bool).tocsr()
    ecc = (coco + sp.random(n_img, n_cap, density=0.03, random_state=4, format="csr").astype(bool)).astype(bool).tocsr()
    ecc_q_i = np.sort(rng.choice(n_img, min(40, n_img), replace=False))
    ecc_q_t = np.sort(rng.choice(n_cap, min(120, n_cap), replace=False))
    ecc_t = sp.csr_matrix(ecc.T)
    n_pos_i = np.diff(ecc.indptr) + (rng.random(n_img) < 0.2)  # some positives outside the gallery
    long_i = (sp.random(n_img, n_cap, density=0.9, random_state=5, format="csr") > 0).tocsr()
    sets = [BenchmarkSet("coco_5k", coco, sp.csr_matrix(coco.T)),
            BenchmarkSet("cxc", cxc, sp.csr_matrix(cxc.T)),
            BenchmarkSet("eccv", ecc, ecc_t, kind="precision", i2t_queries=ecc_q_i, t2i_queries=ecc_q_t,
                         i2t_n_pos=n_pos_i),
            BenchmarkSet("pmrp_zeta0", long_i, sp.csr_matrix(long_i.T), kind="rprecision")]
    if folds == "contiguous":
        fl = M.coco_folds(np.arange(n_cap), cap_img, n_folds=3)
    else:  # scattered images per fold, with their captions
        order = np.concatenate([np.flatnonzero(cap_img == i) for i in rng.permutation(n_img)])
        fl = M.coco_folds(order, cap_img, n_folds=3)
    return RetrievalTask("toy", np.arange(n_img), np.arange(n_cap), cap_img, sets, folds=fl)


def assert_same_metrics(got: dict, ref: dict):
    assert got.keys() == ref.keys()
    for bench in ref:
        for key, v in ref[bench].items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    assert got[bench][key][k2] == pytest.approx(v2, abs=1e-10), (bench, key, k2)
            else:
                assert got[bench][key] == pytest.approx(v, abs=1e-10), (bench, key)


@pytest.mark.parametrize("dtype,score,folds,threads", [
    (torch.bfloat16, "csd", "contiguous", 2), (torch.float32, "csd", "scattered", 1),
    (torch.bfloat16, "mean", "scattered", 2), (torch.bfloat16, "cosine", "contiguous", 1)])
def test_evaluate_screened_equals_float64_score_matrix(dtype, score, folds, threads):
    rng = np.random.default_rng(6)
    task = small_task(rng, folds=folds)
    mi, li = gaussians(task.n_images, 32, rng)
    noise, lc = gaussians(task.n_captions, 32, rng)
    mc = mi[torch.from_numpy(task.caption_image)] + 0.9 * noise  # captions near their image
    mc[17], lc[17] = mc[3], lc[3]  # exact ties in both directions
    mi[9], li[9] = mi[2], li[2]
    ref_scores = neg_csd64(mi, li, mc, lc, score)
    ref = evaluate_scores(PairScores.from_matrix(ref_scores), task, keep_top=5)
    st = {}
    got = evaluate_screened(score, mi, li if score == "csd" else None, mc, lc if score == "csd" else None, task,
                              keep_top=5, dtype=dtype, group=8, stats=st, threads=threads)
    assert_same_metrics(got.metrics, ref.metrics)
    for d in ("i2t", "t2i"):
        np.testing.assert_array_equal(got.top[d], ref.top[d])
        np.testing.assert_array_equal(got.per_query[d]["queries"], ref.per_query[d]["queries"])
        np.testing.assert_array_equal(got.per_query[d]["r@1"], ref.per_query[d]["r@1"])
        assert st[d]["requests"] > 0 and st[d]["fallback_rows"] == 0
    # the metrics are non-trivial (neither 0 nor 100 everywhere)
    assert 0 < got.metrics["coco_1k"]["i2t"]["r@1"] < 100 and 0 < got.metrics["eccv"]["t2i"]["map_at_r"] < 100


def test_a_broken_bound_is_caught_and_the_matrix_answers(monkeypatch):
    from zsprob.retrieval.embeddings import Embeddings
    from zsprob.retrieval.evaluate import evaluate_embeddings

    rng = np.random.default_rng(7)
    task = small_task(rng)
    mi, li = gaussians(task.n_images, 32, rng)
    noise, lc = gaussians(task.n_captions, 32, rng)
    mc = mi[torch.from_numpy(task.caption_image)] + 0.9 * noise
    emb = Embeddings(task.image_ids, task.caption_ids, mi, mc, li, lc)
    good = evaluate_embeddings(emb, task)
    assert good.metrics["setup"]["method"].startswith("screen")
    # a bound 1000x too small: the own-item check finds items outside their band
    real = S.Screen.error
    monkeypatch.setattr(S.Screen, "error", lambda self, rows, o: real(self, rows, o) * 1e-3)
    with pytest.raises(S.ScreenBoundError):
        evaluate_screened("csd", mi, li, mc, lc, task, threads=1)
    with pytest.warns(RuntimeWarning, match="score matrix"):
        fallback = evaluate_embeddings(emb, task)
    assert fallback.metrics["setup"]["method"].startswith("matrix")
    matrix = evaluate_embeddings(emb, task, method="matrix")
    assert_same_metrics({k: v for k, v in fallback.metrics.items() if k != "setup"},
                        {k: v for k, v in matrix.metrics.items() if k != "setup"})
    # the screened metrics equal the float32 matrix ones here (no near-ties at float32 resolution)
    assert_same_metrics({k: v for k, v in good.metrics.items() if k != "setup"},
                        {k: v for k, v in matrix.metrics.items() if k != "setup"})


def test_method_choice_and_errors():
    from zsprob.errors import UserError
    from zsprob.retrieval.embeddings import Embeddings
    from zsprob.retrieval.evaluate import evaluate_embeddings, resolve_method

    assert resolve_method("auto", "csd") == "screen"
    assert resolve_method("auto", "w2") == "matrix"
    assert resolve_method("auto", "csd", n_samples=3) == "matrix"
    with pytest.raises(ValueError, match="linear score"):
        resolve_method("screen", "kl")
    rng = np.random.default_rng(8)
    task = small_task(rng, n_img=20)
    mi, li = gaussians(task.n_images, 8, rng)
    mc, lc = gaussians(task.n_captions, 8, rng)
    emb = Embeddings(task.image_ids, task.caption_ids, mi, mc, li, lc)
    with pytest.raises(UserError, match="linear score"):
        evaluate_embeddings(emb, task, score="w2", method="screen")
    with pytest.raises(UserError, match="unknown method"):
        evaluate_embeddings(emb, task, method="fast")
    w2 = evaluate_embeddings(emb, task, score="w2")
    assert w2.metrics["setup"]["method"].startswith("matrix")


def test_parallel_restores_the_thread_count():
    before = torch.get_num_threads()
    seen = S.parallel([torch.get_num_threads, torch.get_num_threads], threads=2)
    assert seen == [1, 1] and torch.get_num_threads() == before
    assert S.parallel([lambda: 1, lambda: 2], threads=1) == [1, 2]


def test_exact_ranks_fallback_and_input_checks():
    rng = np.random.default_rng(9)
    q_mu, q_lv = gaussians(12, 8, rng)
    g_mu, g_lv = gaussians(90, 8, rng)
    g_mu[40], g_lv[40] = g_mu[5], g_lv[5]
    keys = S.LinearKeys.from_score("csd", q_mu, q_lv, g_mu, g_lv)
    ref = neg_csd64(q_mu, q_lv, g_mu, g_lv)
    rows = torch.arange(12).repeat_interleave(3)
    cols = torch.tensor([5, 40, 7] * 12)
    caps = torch.tensor([90, 3, 90] * 12)
    lo, hi = torch.zeros(36, dtype=torch.int64), torch.full((36,), 90)
    lo[2::3], hi[2::3] = 4, 60
    got = S.exact_ranks(keys, rows, cols, caps, keys.exact_pairs(rows, cols), lo, hi)
    for p in range(36):
        sub = ref[rows[p], lo[p]:hi[p]]
        assert int(got[p]) == min(stable_rank(sub, int(cols[p] - lo[p])), int(caps[p]))
    bad = q_mu.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        S.LinearKeys.from_score("csd", bad, q_lv, g_mu, g_lv)
    with pytest.raises(ValueError, match="not linear"):
        S.LinearKeys.from_score("kl", q_mu, q_lv, g_mu, g_lv)
    with pytest.raises(ValueError, match="col_lo <= col < col_hi"):
        S.screen_ranks(keys, [0], [50], [10], col_lo=[0], col_hi=[40])
