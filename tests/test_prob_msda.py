"""zsprob.prob.msda: which images are mixed, how, and the soft targets, for the paper-text modes
(PCME++ Sec. 2.4) and the official mode (naver-ai/pcmepp's per-image Mixup / CutMix)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from zsprob import UserError
from zsprob.prob import PCMEPPLoss, mix_batch
from zsprob.prob.msda import check_config, mix_batch_official, official_targets, smooth_targets


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
        mix_batch(torch.zeros(4, 8))


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


# ----------------------------------------------------------------------------- official mode

def test_official_targets_by_hand():
    """Row 0 mixed with lambda 0.3 (partner 3), s = 0.1: own 0.3 * 0.9 + 0.7 * 0.1 = 0.34,
    partner 0.3 * 0.1 + 0.7 * 0.9 = 0.66, others s; unmixed rows 1 - s on the diagonal."""
    lam = torch.tensor([0.3, 1.0, 1.0, 1.0], dtype=torch.float64)
    expected = torch.tensor([[0.34, 0.1, 0.1, 0.66],
                             [0.1, 0.9, 0.1, 0.1],
                             [0.1, 0.1, 0.9, 0.1],
                             [0.1, 0.1, 0.1, 0.9]])
    torch.testing.assert_close(official_targets(lam, 0.1), expected)
    torch.testing.assert_close(official_targets(lam, 0.0)[0], torch.tensor([0.3, 0.0, 0.0, 0.7]))


def test_label_smoothing_values():
    m = smooth_targets(torch.eye(5), 1e-4)
    assert m.diagonal().tolist() == pytest.approx([1 - 1e-4] * 5)
    assert m[~torch.eye(5, dtype=torch.bool)].tolist() == pytest.approx([1e-4] * 20)


def _expected_official_row(b, i, lam, s):
    """Float64 row i of the official targets, entry by entry."""
    row = np.full(b, s)
    j = b - 1 - i
    if lam == 1.0:
        row[i] = 1 - s
    else:
        row[i] = lam * (1 - s) + (1 - lam) * s
        row[j] = lam * s + (1 - lam) * (1 - s)
    return row


def test_official_mixed_pixels_and_targets():
    b, s = 16, 1e-4
    x = constant_images(b, 3, 20, 24)
    before = x.clone()
    seen = {True: 0, False: 0}
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        out, matched, info = mix_batch_official(x, ratio=0.5, smoothing=s, generator=g, return_info=True)
        assert torch.equal(x, before)
        lam_of = dict(zip(info["index"], info["lam"]))
        for i in range(b):
            j = b - 1 - i
            lam = lam_of.get(i, 1.0)
            np.testing.assert_allclose(matched[i].double().numpy(), _expected_official_row(b, i, lam, s),
                                       rtol=0, atol=1e-7)
            if i not in lam_of:
                assert torch.equal(out[i], x[i])
                continue
            cut = info["cutmix"][info["index"].index(i)]
            seen[cut] += 1
            if not cut:
                torch.testing.assert_close(out[i], lam * x[i] + (1 - lam) * x[j])
            else:  # lambda = pixel share kept from image i; the box comes from the partner B-1-i
                from_i = (out[i] == i + 1).double().mean().item()
                from_j = (out[i] == j + 1).double().mean().item()
                assert from_i == pytest.approx(lam, abs=1e-9) and from_i + from_j == pytest.approx(1.0)
    assert seen[True] > 0 and seen[False] > 0


def test_official_selection_shares_lambda_and_determinism():
    b, batches = 16, 400
    x = constant_images(b, 1, 8, 8)
    a = mix_batch_official(x, generator=torch.Generator().manual_seed(5), return_info=True)
    c = mix_batch_official(x, generator=torch.Generator().manual_seed(5), return_info=True)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) and a[2] == c[2]
    g = torch.Generator().manual_seed(6)
    mixed = cutmix = 0
    mixup_lams = []
    for _ in range(batches):
        _, _, info = mix_batch_official(x, ratio=0.25, generator=g, return_info=True)
        mixed += len(info["index"])
        cutmix += sum(info["cutmix"])
        mixup_lams += [lam for lam, cut in zip(info["lam"], info["cutmix"]) if not cut]
    n = b * batches  # per image with probability 0.25; CutMix for half of the mixed ones
    assert abs(mixed / n - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n)
    assert abs(cutmix / mixed - 0.5) < 4 * np.sqrt(0.25 / mixed)
    assert stats.kstest(np.array(mixup_lams), stats.beta(2, 2).cdf).pvalue > 1e-3


def test_official_odd_batch_and_errors():
    x = constant_images(5, 1, 4, 4)
    out, matched, info = mix_batch_official(x, ratio=1.0, smoothing=0.0, generator=torch.Generator().manual_seed(0),
                                            return_info=True)
    assert 2 not in info["index"] and torch.equal(out[2], x[2]) and matched[2].tolist() == [0, 0, 1, 0, 0]
    assert sorted(info["index"]) == [0, 1, 3, 4]
    out, matched = mix_batch(x, mode="official", ratio=0.0)
    torch.testing.assert_close(matched, smooth_targets(torch.eye(5), 1e-4))
    ok = dict(enabled=True, mode="official", alpha=2.0)
    check_config(**ok)
    check_config(**{**ok, "enabled": False, "alpha": 0.0})  # alpha is read only when MSDA is on
    for key, value, message in (("mode", "mosaic", "unknown msda.mode"), ("alpha", 0.0, "msda.alpha must be > 0")):
        with pytest.raises(UserError, match=message):
            check_config(**{**ok, key: value})
    # the shares are refused where the config enters (the schema), before any batch is mixed
    from zsprob.train.defaults import resolve_config
    for key, value in (("ratio", 1.2), ("ratio", 1.5), ("switch_prob", -0.1), ("smoothing", 2.0),
                       ("label_smoothing", -0.1), ("label_smoothing", 1.1)):
        with pytest.raises(UserError, match=f"msda.{key} must be"):
            resolve_config({"msda": {key: value}})
