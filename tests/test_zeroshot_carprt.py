"""CARPRT and its class-shared counterpart on miniatures checked by hand and against a float64 numpy
re-implementation of the authors' test.py loop; its registry facts (transductive, no labels)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zsprob.zeroshot import selection as S
from zsprob.zeroshot import strategy_registry as SR
from zsprob.zeroshot.carprt import carprt_scores, select_carprt, select_carprt_shared
from zsprob.zeroshot.prompts import PromptBank


def _hand_bank():
    # D = 2; class a's templates both (1, 0); class b's t0 = (0, 1), t1 = (0.6, 0.8)
    mu = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.6, 0.8]]])
    return PromptBank.from_embeddings(mu, None, ["a", "b"], ["t0 {}", "t1 {}"])


def test_carprt_by_hand():
    bank = _hand_bank()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # logit scale 1: t0 sends x1 to a (max 1) and x2 to b (max 1); t1 sends x1 to a (1) and x2 to b (0.8)
    score, counts, shared = carprt_scores(bank, x, logit_scale=1.0)
    assert score.tolist() == [[1.0, 1.0], [1.0, pytest.approx(0.8)]]
    assert counts.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert shared.tolist() == [1.0, pytest.approx(0.9)]
    sel = select_carprt(bank, x, logit_scale=1.0)
    wb = 1.0 / (1.0 + math.exp(-0.2))                           # softmax(1, 0.8)[0]
    assert sel.weights[0].tolist() == pytest.approx([0.5, 0.5])
    assert sel.weights[1].tolist() == pytest.approx([wb, 1 - wb], abs=1e-6)
    # class vector = sum_t w_ct mu_ct (not renormalised)
    assert sel.class_mu[1].tolist() == pytest.approx([0.6 * (1 - wb), wb + 0.8 * (1 - wb)], abs=1e-6)
    assert not sel.normalized and sel.class_logvar is None      # works for a deterministic model
    shared_sel = select_carprt_shared(bank, x, logit_scale=1.0)
    ws = 1.0 / (1.0 + math.exp(-0.1))                           # softmax(1, 0.9)[0]
    assert shared_sel.weights.tolist() == [pytest.approx([ws, 1 - ws], abs=1e-6)] * 2


def _numpy_carprt(text, images, scale, temp):
    """The authors' loop in float64: text [P, C, D] normalised * scale, images [N, D] normalised."""
    P, C, _ = text.shape
    logits = np.einsum("pcd,nd->pcn", text, images)             # [P, C, N]
    best, pred = logits.max(1), logits.argmax(1)                # [P, N]
    sums, counts = np.zeros((P, C)), np.zeros((P, C))
    for p in range(P):
        np.add.at(sums[p], pred[p], best[p])
        np.add.at(counts[p], pred[p], 1)
    w = sums / np.where(counts == 0, 1, counts)
    w = np.exp(w / temp - (w / temp).max(0))
    w = w / w.sum(0)                                            # softmax over prompts, per class
    shared = best.mean(1)
    ws = np.exp(shared / temp - (shared / temp).max())
    return w.T, ws / ws.sum(), np.einsum("pc,pcd->cd", w, text) / scale


@pytest.mark.parametrize("seed,temp", [(0, 1.0), (1, 0.5), (2, 3.0)])
def test_carprt_equals_a_float64_reference_of_the_authors_loop(seed, temp):
    rng = np.random.default_rng(seed)
    C, T, D, N = 4, 5, 6, 23
    mu = rng.normal(size=(C, T, D))
    x = rng.normal(size=(N, D))
    bank = PromptBank.from_embeddings(torch.tensor(mu, dtype=torch.float32), None, [f"c{i}" for i in range(C)],
                                      [f"t{i} {{}}" for i in range(T)])
    text = bank.mu_normed.double().numpy().transpose(1, 0, 2) * 100.0
    images = x / np.linalg.norm(x, axis=1, keepdims=True)
    w_ref, ws_ref, vec_ref = _numpy_carprt(text, images, 100.0, temp)
    sel = select_carprt(bank, torch.tensor(x, dtype=torch.float32), temperature=temp)
    np.testing.assert_allclose(sel.weights.double().numpy(), w_ref, atol=2e-6)
    np.testing.assert_allclose(sel.class_mu.double().numpy(), vec_ref, atol=2e-6)
    shared = select_carprt_shared(bank, torch.tensor(x, dtype=torch.float32), temperature=temp)
    np.testing.assert_allclose(shared.weights.double().numpy(), np.tile(ws_ref, (C, 1)), atol=2e-6)
    # the shared score is the count-weighted mean of the class scores
    score, counts, shared_scores = carprt_scores(bank, torch.tensor(x, dtype=torch.float32))
    assert torch.allclose((score * counts).sum(0) / N, shared_scores, atol=1e-9)


def test_carprt_registry_facts_and_no_labels():
    for name in ("carprt", "carprt-shared"):
        entry = SR.get_strategy(name)
        assert entry.audit() == {"reads_eval_labels": False, "transductive": True, "label_split": None}
        assert not entry.sigma and name in SR.compare_order()
    from test_zeroshot_selection import make_world

    bank, _, ev = make_world(seed=3)
    a = S.run_strategy("carprt", bank, pool=ev.feats, eval_=(ev.feats, ev.labels))
    b = S.run_strategy("carprt", bank, pool=ev.feats, eval_=(ev.feats, ev.labels.flip(0)))
    assert torch.equal(a.weights, b.weights) and not a.uses_eval_labels
    assert torch.allclose(a.weights.sum(1), torch.ones(bank.num_classes))
    with pytest.raises(Exception, match="unlabelled images"):
        S.run_strategy("carprt", bank)
