"""Selective prediction (zsprob.utils.selective) against hand computations in float64: the risk-coverage
curve and AURC of a small case, ties broken by expectation, the oracle's E-AURC of 0, AUROC as the
Mann-Whitney count, accuracy at a coverage, the seeded bootstrap and its paired differences."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from zsprob.utils.selective import (aurc, risk_coverage, selective_metrics, selective_report, sigma_confidence,
                                    softmax_confidences)


def test_risk_coverage_and_aurc_of_a_small_case():
    correct, conf = [1, 0, 1, 1], [0.9, 0.8, 0.7, 0.1]
    coverage, risk = risk_coverage(correct, conf)
    assert coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk == pytest.approx([0.0, 1 / 2, 1 / 3, 1 / 4], abs=1e-15)
    assert aurc(correct, conf) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 4) / 4, abs=1e-15)


def test_ties_are_broken_by_expectation():
    """A tie's risk is the mean over every order of it: a constant score has a random order's AURC."""
    correct, conf = np.array([1, 0, 1, 0, 1]), np.array([0.5, 0.5, 0.5, 0.9, 0.9])
    orders = []
    for tie_a in itertools.permutations([3, 4]):
        for tie_b in itertools.permutations([0, 1, 2]):
            kept = ~correct[list(tie_a + tie_b)].astype(bool)
            orders.append(np.cumsum(kept) / np.arange(1, 6))
    assert risk_coverage(correct, conf)[1] == pytest.approx(np.mean(orders, axis=0), abs=1e-15)
    assert risk_coverage(correct, np.zeros(5))[1] == pytest.approx([0.4] * 5)


def test_metrics_against_hand_counts():
    g = np.random.default_rng(0)
    correct = g.random(200) < 0.6
    conf = correct + g.normal(0, 1.0, 200)
    m = selective_metrics(correct, conf)
    wrong, right = conf[~correct], conf[correct]
    pairs = (wrong[:, None] < right[None, :]).sum() + 0.5 * (wrong[:, None] == right[None, :]).sum()
    assert m["auroc"] == pytest.approx(pairs / (len(wrong) * len(right)), abs=1e-12)
    kept = np.argsort(-conf)[:160]
    assert m["acc_at_80"] == pytest.approx(correct[kept].mean(), abs=1e-12)
    oracle = selective_metrics(correct, correct.astype(float))
    assert oracle["eaurc"] == pytest.approx(0.0, abs=1e-15) and oracle["auroc"] == 1.0
    assert m["eaurc"] > 0 and m["aurc"] == pytest.approx(oracle["aurc"] + m["eaurc"], abs=1e-15)


def test_the_bootstrap_is_seeded_and_paired():
    g = np.random.default_rng(1)
    correct = g.random(150) < 0.5
    scores = {"msp": correct + g.normal(0, 1, 150), "other": g.normal(0, 1, 150)}
    a = selective_report(correct, scores, n_boot=60, seed=3)
    assert a == selective_report(correct, scores, n_boot=60, seed=3)
    e = a["scores"]["other"]
    lo, hi = e["auroc"]["ci95"]
    assert lo <= e["auroc"]["value"] <= hi and 0.35 < e["auroc"]["value"] < 0.65  # a random score: ~0.5
    d = e["minus_msp"]["auroc"]
    assert d["value"] == pytest.approx(e["auroc"]["value"] - a["scores"]["msp"]["auroc"]["value"])
    assert d["ci95"][1] < 0  # the informative baseline beats noise, on the same resamples
    assert "minus_msp" not in a["scores"]["msp"] and len(e["curve"]["coverage"]) == 50


def test_zeroshot_confidences_by_hand():
    scores = torch.tensor([[0.2, 0.1, -0.1], [0.0, 0.3, 0.29]], dtype=torch.float64)
    logvar_img = torch.log(torch.tensor([[0.5, 0.5], [1.0, 2.0]]))
    logvar_cls = torch.log(torch.tensor([[1.0, 1.0], [0.1, 0.1], [3.0, 3.0]]))
    c = {**softmax_confidences(scores, 10.0), "image_sigma2": sigma_confidence(logvar_img),
         "class_sigma2": sigma_confidence(logvar_cls)[scores.argmax(1).numpy()]}
    p = np.exp(10 * scores.numpy())
    p /= p.sum(1, keepdims=True)
    assert c["msp"] == pytest.approx(p.max(1)) and c["entropy"] == pytest.approx((p * np.log(p)).sum(1))
    assert c["margin"] == pytest.approx(np.sort(p, 1)[:, -1] - np.sort(p, 1)[:, -2])
    assert c["image_sigma2"] == pytest.approx([-1.0, -3.0]) and c["class_sigma2"] == pytest.approx([-2.0, -0.2])


def test_retrieval_block_reads_each_querys_row_and_its_r_at_1():
    """``zsprob eval``'s block: per direction, the queries of the recall benchmark, R@1 as correctness, the
    row's softmax baselines, its top-1 score and the query's sigma^2."""
    import types

    from zsprob.retrieval.evaluate import selective_block
    g = torch.Generator().manual_seed(0)
    i2t = torch.randn(6, 10, generator=g)
    scores = types.SimpleNamespace(i2t=i2t, t2i=i2t.T.contiguous())
    emb = types.SimpleNamespace(image_logvar=torch.randn(6, 3, generator=g), caption_logvar=torch.randn(10, 3))
    hits = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    per_query = {"i2t": {"queries": np.arange(6), "r@1": hits}}
    block = selective_block(scores, per_query, emb, logit_scale=5.0, n_boot=20)["i2t"]
    assert block["n"] == 6 and block["accuracy"] == 0.5
    top1 = i2t.max(1).values.double().numpy()
    wrong, right = top1[hits == 0], top1[hits > 0]
    assert block["scores"]["top1_score"]["auroc"]["value"] == pytest.approx(
        (wrong[:, None] < right[None, :]).mean(), abs=1e-12)
    sigma = emb.image_logvar.double().exp().sum(1).numpy()
    assert block["scores"]["query_sigma2"]["aurc"]["value"] == pytest.approx(
        selective_metrics(hits > 0, -sigma)["aurc"], abs=1e-12)
