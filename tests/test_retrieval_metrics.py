"""Retrieval metrics: tensor code vs brute-force Python definitions and vs eccv_caption."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zsprob.retrieval import metrics as M


def given_scores(s: torch.Tensor) -> SimpleNamespace:
    """An image x caption matrix as evaluate_scores reads it (what PairScores holds: i2t and its transpose)."""
    from zsprob.retrieval.scoring import transposed

    return SimpleNamespace(i2t=s, t2i=transposed(s))


def brute_rank(scores_row):
    # descending score, ties by lower index (a stable sort)
    return sorted(range(len(scores_row)), key=lambda j: (-float(scores_row[j]), j))


def brute_metrics(scores, pos_lists, ks=(1, 5, 10)):
    out = {f"r@{k}": [] for k in ks}
    out["rprecision"], out["map_at_r"] = [], []
    for q, pos in enumerate(pos_lists):
        if not pos:
            continue
        pos = set(pos)
        order = brute_rank(scores[q])
        for k in ks:
            out[f"r@{k}"].append(1.0 if set(order[:k]) & pos else 0.0)
        R = len(pos)
        out["rprecision"].append(len(set(order[:R]) & pos) / R)
        precs = [len(set(order[:r]) & pos) / r if order[r - 1] in pos else 0.0 for r in range(1, R + 1)]
        out["map_at_r"].append(float(np.mean(precs)))
    return {k: float(np.mean(v)) for k, v in out.items()}


def random_case(seed, nq=37, ng=53, integer=False):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 6, size=(nq, ng)).astype(np.float32) if integer else rng.normal(size=(nq, ng)).astype(np.float32)
    pos = [sorted(rng.choice(ng, size=rng.integers(0, 9), replace=False).tolist()) for _ in range(nq)]
    return torch.from_numpy(scores), pos


@pytest.mark.parametrize("seed,integer", [(0, False), (1, True), (2, True), (3, False)])
def test_rank_metrics_match_brute_force(seed, integer):
    scores, pos = random_case(seed, integer=integer)
    expected = brute_metrics(scores.numpy(), pos)
    csr = M.positives_from_lists(pos, scores.shape[1])
    got = M.rank_metrics(scores, csr, chunk_size=7).mean()  # several chunks
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k
    # the one-shot path on shared top-L lists gives the same numbers
    ranked = M.rank_lists(scores, np.arange(scores.shape[0]), 20)
    got2 = M.metrics_from_ranking(ranked, csr).mean()
    for k, v in expected.items():
        assert got2[k] == pytest.approx(v, abs=1e-12), k


def test_topk_ranking_is_a_stable_sort_even_across_the_cut():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    assert M.topk_ranking(scores, 2).tolist() == [[1, 2], [0, 1]]
    assert M.topk_ranking(scores, 4).tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    rng = np.random.default_rng(0)
    s = torch.from_numpy(rng.integers(0, 4, size=(50, 30)).astype(np.float32))
    for k in (1, 3, 10, 30):
        ref = torch.stack([torch.tensor(brute_rank(r)[:k]) for r in s.numpy()])
        assert torch.equal(M.topk_ranking(s, k), ref)


def test_queries_without_positives_are_skipped_and_short_lists_rejected():
    scores = torch.randn(4, 10)
    pos = [[1], [], [2, 3], []]
    qm = M.rank_metrics(scores, M.positives_from_lists(pos, 10))
    assert qm.queries.tolist() == [0, 2]
    assert len(qm.values["r@1"]) == 2
    hits = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        M.metrics_from_hits(hits, torch.tensor([1, 5]))


def test_coco_folds_rank_within_each_fold():
    from zsprob.retrieval.benchmarks import RetrievalTask
    from zsprob.retrieval.evaluate import fold_metrics

    rng = np.random.default_rng(3)
    n_img, per = 20, 5
    cap_img = np.repeat(np.arange(n_img), per)
    scores = torch.from_numpy(rng.normal(size=(n_img, n_img * per)).astype(np.float32))
    pos = M.positives_from_assignment(cap_img, n_img)
    folds = M.coco_folds(np.arange(n_img * per), cap_img, n_folds=5)
    assert [f[0].tolist() for f in folds][1] == [4, 5, 6, 7]
    task = RetrievalTask("toy", np.arange(n_img), np.arange(n_img * per), cap_img, folds=folds)
    got = {d: {k: v / 100 for k, v in m.items()}
           for d, m in fold_metrics(given_scores(scores), task, ks=(1, 2)).items() if d in ("i2t", "t2i")}
    # brute force: rank inside each fold only
    exp = {"i2t": {"r@1": [], "r@2": []}, "t2i": {"r@1": [], "r@2": []}}
    for imgs, caps in folds:
        sub = scores.numpy()[np.ix_(imgs, caps)]
        lists_i = [[j for j, c in enumerate(caps) if cap_img[c] == i] for i in imgs]
        lists_t = [[list(imgs).index(cap_img[c])] for c in caps]
        bi = brute_metrics(sub, lists_i, ks=(1, 2))
        bt = brute_metrics(sub.T, lists_t, ks=(1, 2))
        for k in ("r@1", "r@2"):
            exp["i2t"][k].append(bi[k])
            exp["t2i"][k].append(bt[k])
    for d in exp:
        for k in exp[d]:
            assert got[d][k] == pytest.approx(np.mean(exp[d][k]), abs=1e-12)
    # in-fold ranking differs from global ranking: a global R@1 computed on the 5K-style matrix is lower
    glob = M.rank_metrics(scores, pos, r_metrics=False, ks=(1,)).mean()["r@1"]
    assert glob <= got["i2t"]["r@1"] + 1e-12


def test_plausible_positives_hamming():
    rng = np.random.default_rng(0)
    img = (rng.random((30, 8)) < 0.3).astype(np.int8)
    img[0] = 0  # an unlabeled image
    cap_img = rng.integers(0, 30, size=70)
    cap = img[cap_img]
    for z in (0, 1, 2):
        pm = M.plausible_positives(img, cap, z).toarray()
        for i in range(30):
            for c in range(70):
                ham = int(np.abs(img[i] - cap[c]).sum())
                exp = ham <= z and img[i].any() and cap[c].any()
                assert pm[i, c] == exp


def test_matches_eccv_caption_functions_on_small_dicts():
    """eccv_caption's own metric functions on id dictionaries give our numbers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from eccv_caption._metrics import compute_eccv_metrics, compute_r_at_k
    scores, pos = random_case(11, nq=60, ng=80)
    pos = [p if p else [0] for p in pos]
    csr = M.positives_from_lists(pos, 80)
    ranked = M.rank_lists(scores, np.arange(60), 30)
    ours = M.metrics_from_ranking(ranked, csr).mean()
    qids = 1000 + np.arange(60) * 7  # arbitrary ids
    gids = 50000 + np.arange(80) * 3
    target = {int(qids[q]): gids[ranked[q].numpy()].tolist() for q in range(60)}
    gts = {int(qids[q]): gids[np.array(p)].tolist() for q, p in enumerate(pos)}
    e = compute_eccv_metrics(target, gts)
    assert ours["map_at_r"] == pytest.approx(e["eccv_map_at_r"], abs=1e-12)
    assert ours["rprecision"] == pytest.approx(e["eccv_rprecision"], abs=1e-12)
    assert ours["r@1"] == pytest.approx(e["eccv_r1"], abs=1e-12)
    for k in (1, 5, 10):
        assert ours[f"r@{k}"] == pytest.approx(compute_r_at_k(target, gts, K=k), abs=1e-12)


def test_pair_scores_and_chunked_topk_use_prob_score():
    from zsprob.prob import score
    from zsprob.retrieval.scoring import PairScores, chunked_topk, score_matrix

    g = torch.Generator().manual_seed(0)
    a, la = torch.randn(23, 6, generator=g), torch.randn(23, 6, generator=g) - 1
    b, lb = torch.randn(71, 6, generator=g), torch.randn(71, 6, generator=g) - 1
    full = score("csd", a, la, b, lb)
    ps = PairScores("csd", a, la, b, lb, chunk_size=5)
    torch.testing.assert_close(ps.i2t, full)
    torch.testing.assert_close(ps.t2i, full.T, rtol=1e-5, atol=1e-5)
    v, i = chunked_topk("csd", a, la, b, lb, 7, query_chunk=4, gallery_chunk=16)
    ref_v, ref_i = full.topk(7, dim=1)
    torch.testing.assert_close(v, ref_v)
    assert torch.equal(i, ref_i)
    # MC: one sampled image x caption matrix serves both directions (same numbers), reproducible by seed
    mc = PairScores("mc", a, la, b, lb, chunk_size=8, seed=3)
    assert torch.equal(mc.t2i, mc.i2t.T.contiguous())
    torch.testing.assert_close(score_matrix("mc", a, la, b, lb, chunk_size=8, seed=3), mc.i2t)
    assert (mc.i2t >= 0).all() and (mc.i2t <= 1).all()


@pytest.mark.parametrize("name", ["csd", "mean", "cosine"])
def test_linear_scores_are_one_gemm_equal_to_prob_score(name):
    from zsprob.prob import score
    from zsprob.retrieval.scoring import linear_form, score_matrix, transposed

    g = torch.Generator().manual_seed(1)
    a, la = torch.randn(37, 9, generator=g, dtype=torch.float64), torch.randn(37, 9, generator=g) - 2
    b, lb = torch.randn(53, 9, generator=g, dtype=torch.float64), torch.randn(53, 9, generator=g) - 2
    ref = score(name, a, la, b, lb).float()
    A, B = linear_form(name, a, la, b, lb)
    assert A.dtype == B.dtype == torch.float32 and A.shape[1] == B.shape[1]
    torch.testing.assert_close(A @ B.T, ref, rtol=1e-5, atol=1e-5)
    s = score_matrix(name, a, la, b, lb, chunk_size=7)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(transposed(s, rows=5), s.T.contiguous())
    # a score that needs autograd or is not linear in augmented vectors takes the general path
    assert linear_form("w2", a, la, b, lb) is None
    assert linear_form(name, a.float().requires_grad_(), la, b, lb) is None


def test_pmrp_through_coco_task_matches_brute_force():
    from zsprob.retrieval.coco import coco_task
    from zsprob.retrieval.evaluate import evaluate_scores, format_table

    rng = np.random.default_rng(4)
    n_img = 30
    cap_img = np.repeat(np.arange(n_img), 5)
    labels = (rng.random((n_img, 6)) < 0.35).astype(np.uint8)
    labels[0] = 0  # unlabeled image: neither query nor positive
    task = coco_task(np.arange(n_img) + 1, np.arange(150) + 1, cap_img, instance_labels=labels)
    s = torch.from_numpy(rng.normal(size=(n_img, 150)).astype(np.float32))
    m = evaluate_scores(given_scores(s), task).metrics
    for z in (0, 1, 2):
        lists_i, lists_t = [], []
        for i in range(n_img):
            lists_i.append([c for c in range(150) if labels[i].any() and labels[cap_img[c]].any()
                            and np.abs(labels[i].astype(int) - labels[cap_img[c]]).sum() <= z])
        for c in range(150):
            lists_t.append([i for i in range(n_img) if c in lists_i[i]])
        assert m["pmrp"]["i2t"][f"zeta{z}"] == pytest.approx(100 * brute_metrics(s.numpy(), lists_i)["rprecision"])
        assert m["pmrp"]["t2i"][f"zeta{z}"] == pytest.approx(100 * brute_metrics(s.numpy().T, lists_t)["rprecision"])
    assert m["pmrp"]["i2t"]["mean"] == pytest.approx(np.mean([m["pmrp"]["i2t"][f"zeta{z}"] for z in (0, 1, 2)]))
    assert "PMRP" in format_table(m)


def test_evaluate_rankings_equals_evaluate_scores_and_rejects_short_lists():
    from zsprob.retrieval.coco import coco_task
    from zsprob.retrieval.evaluate import evaluate_rankings, evaluate_scores

    rng = np.random.default_rng(5)
    n_img = 30
    cap_img = np.repeat(np.arange(n_img), 5)
    labels = (rng.random((n_img, 6)) < 0.35).astype(np.uint8)
    task = coco_task(np.arange(n_img) + 1, np.arange(150) + 1, cap_img, instance_labels=labels)
    order = np.concatenate([np.flatnonzero(cap_img == i) for i in rng.permutation(n_img)])
    task.folds = M.coco_folds(order, cap_img, n_folds=3)  # 10 scattered images per fold, with their captions
    cap_img_t = torch.from_numpy(cap_img)
    s = torch.from_numpy(rng.normal(size=(n_img, 150)).astype(np.float32))
    s[cap_img_t, torch.arange(150)] += 1.5  # a non-trivial operating point
    # image 0's fold and caption 0's fold rank last globally (a uniform shift keeps the in-fold order),
    # so their in-fold items lie beyond any short prefix of the lists
    f_img = next(f for f in task.folds if 0 in f[0])
    s[0, torch.from_numpy(f_img[1])] -= 100.0
    f_cap = next(f for f in task.folds if 0 in f[1])
    s[torch.from_numpy(f_cap[0]), 0] -= 100.0
    ps = given_scores(s)
    ref = evaluate_scores(ps, task, ks=(1, 2, 5)).metrics
    full_i = M.rank_lists(ps.i2t, np.arange(n_img), 150)
    full_t = M.rank_lists(ps.t2i, np.arange(150), n_img)
    got = evaluate_rankings(full_i, full_t, task, ks=(1, 2, 5))
    assert got.keys() == ref.keys()
    for bench in ref:
        for d in ("i2t", "t2i"):
            for key, v in ref[bench][d].items():
                assert got[bench][d][key] == pytest.approx(v, abs=1e-12), (bench, d, key)
    assert 0 < ref["coco_1k"]["i2t"]["r@1"] < 100 and ref["coco_1k"]["i2t"]["r@1"] != ref["coco"]["i2t"]["r@1"]
    # PMRP needs lists as long as its largest positive set
    with pytest.raises(ValueError, match="pmrp"):
        evaluate_rankings(full_i[:, :20], full_t, task, ks=(1, 2, 5))
    # COCO 1K from truncated lists: exact while each list holds max(ks) items of its fold, else an error
    plain = coco_task(np.arange(n_img) + 1, np.arange(150) + 1, cap_img)
    plain.folds = task.folds
    ref_p = evaluate_scores(ps, plain, ks=(1, 2, 5)).metrics
    need_i = int(max(np.flatnonzero(np.isin(full_i[q].numpy(), plain.folds[f][1]))[4]
                     for f, (imgs, _) in enumerate(plain.folds) for q in imgs)) + 1
    got_p = evaluate_rankings(full_i[:, :need_i], full_t, plain, ks=(1, 2, 5))
    assert got_p["coco_1k"] == ref_p["coco_1k"]
    with pytest.raises(ValueError, match="fold"):
        evaluate_rankings(full_i[:, :need_i - 1], full_t, plain, ks=(1, 2, 5))
    with pytest.raises(ValueError, match="outside"):
        evaluate_rankings(full_i + 1, full_t, plain, ks=(1, 2, 5))
