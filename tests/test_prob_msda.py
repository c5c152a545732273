"""zsprob.prob.msda.mix_batch: which images are mixed, how, and the soft targets (PCME++ Sec. 2.4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from zsprob import UserError
from zsprob.prob import PCMEPPLoss, mix_batch


def constant_images(b=16, c=3, h=20, w=24):
    """Image i is filled with the value i + 1: every pixel tells where it came from."""
    return torch.arange(1, b + 1, dtype=torch.float32).view(b, 1, 1, 1).expand(b, c, h, w).clone()


@pytest.mark.parametrize("mode", ["mixup", "cutmix"])
def test_mixed_rows_and_soft_targets(mode):
    x = constant_images()
    before = x.clone()
    out, matched, info = mix_batch(x, mode=mode, generator=torch.Generator().manual_seed(0), return_info=True)
    assert torch.equal(x, before)  # the input is not modified
    assert info["mode"] == mode and len(info["index"]) == 4  # 25% of 16
    mixed = set(info["index"])
    for r in range(16):
        if r not in mixed:
            assert torch.equal(out[r], x[r]) and matched[r].tolist() == torch.eye(16)[r].tolist()
    torch.testing.assert_close(matched.sum(1), torch.ones(16))
    for i, j, lam in zip(info["index"], info["partner"], info["lam"]):
        assert i != j and 0 < lam < 1 or mode == "cutmix"
        assert matched[i, i] == pytest.approx(lam) and matched[i, j] == pytest.approx(1 - lam)
        if mode == "mixup":
            torch.testing.assert_close(out[i], lam * x[i] + (1 - lam) * x[j])
        else:
            # lambda is the pixel fraction actually kept from image i (box clipped at the border)
            from_i = (out[i, 0] == i + 1).float().mean().item()
            from_j = (out[i, 0] == j + 1).float().mean().item()
            assert from_i == pytest.approx(lam, abs=1e-6) and from_i + from_j == pytest.approx(1.0)


def test_random_mode_lambda_distribution_and_determinism():
    x = constant_images(8, 1, 4, 4)
    a = mix_batch(x, generator=torch.Generator().manual_seed(3), return_info=True)
    b = mix_batch(x, generator=torch.Generator().manual_seed(3), return_info=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    g = torch.Generator().manual_seed(4)
    modes, lams = set(), []
    for _ in range(300):
        _, _, info = mix_batch(x, ratio=0.5, mode="random", generator=g, return_info=True)
        modes.add(info["mode"])
    for _ in range(200):
        lams += mix_batch(x, ratio=1.0, mode="mixup", generator=g, return_info=True)[2]["lam"]
    assert modes == {"mixup", "cutmix"}
    # lambda ~ Beta(2, 2): mean 1/2, variance 1/20
    assert stats.kstest(np.array(lams), stats.beta(2, 2).cdf).pvalue > 1e-3
    assert abs(np.mean(lams) - 0.5) < 0.02 and abs(np.var(lams) - 0.05) < 0.01


def test_edge_cases_and_errors():
    one = constant_images(1)
    out, m = mix_batch(one)
    assert torch.equal(out, one) and m.tolist() == [[1.0]]
    out, m = mix_batch(constant_images(4), ratio=0.0)
    assert torch.equal(m, torch.eye(4))
    with pytest.raises(UserError):
        mix_batch(constant_images(4), mode="mosaic")
    with pytest.raises(UserError):
        mix_batch(torch.zeros(4, 8))
    with pytest.raises(UserError):
        mix_batch(constant_images(4), ratio=1.5)


def test_targets_feed_the_loss_and_reach_the_mixed_pair():
    """With MSDA targets, the partner caption of a mixed image is pulled (m = 1 - lambda > 0)."""
    g = torch.Generator().manual_seed(1)
    x = constant_images(8, 1, 4, 4)
    _, matched, info = mix_batch(x, ratio=0.25, mode="mixup", generator=g, return_info=True)
    torch.manual_seed(0)
    mu_i, mu_t = torch.randn(8, 4), torch.randn(8, 4)
    lv = torch.full((8, 4), -3.0)
    lv_i = lv.clone().requires_grad_(True)
    crit = PCMEPPLoss(pp_alpha=0.0, vib_beta=0.0)
    loss_soft, _ = crit(mu_i, lv_i, mu_t, lv, matched)
    loss_hard, _ = crit(mu_i, lv_i, mu_t, lv)
    i, j, lam = info["index"][0], info["partner"][0], info["lam"][0]
    logits = crit.logits(mu_i, lv, mu_t, lv).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    # the soft loss differs from the hard one exactly by the relabelled entries (both directions)
    diff = 0.0
    for r, c, m in ((i, i, lam), (i, j, 1 - lam), (info["index"][1], info["index"][1], info["lam"][1]),
                    (info["index"][1], info["partner"][1], 1 - info["lam"][1])):
        hard = 1.0 if r == c else 0.0
        diff += (bce(logits[r, c], torch.tensor(m)) - bce(logits[r, c], torch.tensor(hard))).item()
    assert (loss_soft - loss_hard).item() == pytest.approx(2 * diff / 64, rel=1e-4, abs=1e-7)
