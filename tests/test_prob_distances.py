"""zsprob.prob.distances against direct per-element formulas, Monte Carlo, and properties."""
from __future__ import annotations

import math
import os

import pytest
import torch

from zsprob import UserError
from zsprob.prob import distances as D


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def gaussians(n, m, d, seed=0, dtype=torch.float64, spread=0.7):
    g = torch.Generator().manual_seed(seed)
    mu_a = torch.randn(n, d, generator=g, dtype=dtype)
    mu_b = torch.randn(m, d, generator=g, dtype=dtype)
    lv_a = spread * torch.randn(n, d, generator=g, dtype=dtype)
    lv_b = spread * torch.randn(m, d, generator=g, dtype=dtype)
    return mu_a, lv_a, mu_b, lv_b


# direct per-element formulas: [N, 1, D] against [1, M, D], summed over D
def direct(name, mu_a, lv_a, mu_b, lv_b):
    m1, m2 = mu_a[:, None], mu_b[None]
    v1, v2 = lv_a.exp()[:, None], lv_b.exp()[None]
    s1, s2 = v1.sqrt(), v2.sqrt()
    dm2 = (m1 - m2) ** 2
    if name == "csd":
        return (dm2 + v1 + v2).sum(-1)
    if name == "w2":
        return (dm2 + (s1 - s2) ** 2).sum(-1)
    if name == "w2var":
        return (dm2 + (v1 - v2) ** 2).sum(-1)
    if name == "kl":
        return 0.5 * (torch.log(v2 / v1) + v1 / v2 + dm2 / v2 - 1).sum(-1)
    if name == "kl_reverse":
        return 0.5 * (torch.log(v1 / v2) + v2 / v1 + dm2 / v1 - 1).sum(-1)
    if name == "elk":
        return 0.5 * (dm2 / (v1 + v2) + torch.log(v1 + v2)).sum(-1)
    if name == "bhattacharyya":
        return (0.25 * dm2 / (v1 + v2) + 0.5 * torch.log((v1 + v2) / (2 * s1 * s2))).sum(-1)
    if name == "sq_euclidean":
        return dm2.sum(-1)
    raise KeyError(name)


CLOSED = {
    "csd": lambda *x: D.csd(*x),
    "w2": lambda *x: D.wasserstein2(*x),
    "w2var": lambda *x: D.wasserstein2(*x, form="var"),
    "kl": lambda *x: D.kl(*x),
    "kl_reverse": lambda *x: D.kl_reverse(*x),
    "elk": lambda *x: D.elk(*x),
    "bhattacharyya": lambda *x: D.bhattacharyya(*x),
    "sq_euclidean": lambda ma, la, mb, lb: D.sq_euclidean(ma, mb),
}


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_closed_forms_match_direct_formula(name):
    x = gaussians(5, 7, 6, seed=1)
    got = CLOSED[name](*x)
    assert got.shape == (5, 7) and got.dtype == torch.float64
    torch.testing.assert_close(got, direct(name, *x), rtol=1e-10, atol=1e-10)


def test_derived_kl_family_and_cosine():
    x = gaussians(4, 6, 5, seed=2)
    kl, kr = direct("kl", *x), direct("kl_reverse", *x)
    torch.testing.assert_close(D.min_kl(*x), torch.minimum(kl, kr))
    torch.testing.assert_close(D.js(*x), 0.5 * (kl + kr))
    ma, _, mb, _ = x
    cos = torch.stack([torch.stack([torch.dot(a, b) / (a.norm() * b.norm()) for b in mb]) for a in ma])
    torch.testing.assert_close(D.cosine(ma, mb), cos)
    torch.testing.assert_close(D.wasserstein2(*x, squared=False), (direct("w2", *x) + 1e-12).sqrt())


def test_row_blocking_does_not_change_results():
    x = gaussians(9, 5, 4, seed=3)
    for fn in (D.elk, D.bhattacharyya):
        torch.testing.assert_close(fn(*x, chunk_elements=7), fn(*x))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    big = D.mc_match_prob(*x, n_samples=4, generator=g1)
    small = D.mc_match_prob(*x, n_samples=4, generator=g2, chunk_size=20)  # blocks of 1 row x 1 col
    torch.testing.assert_close(small, big)


def test_symmetries_and_asymmetry_of_kl():
    a = gaussians(4, 6, 5, seed=4)
    b = (a[2], a[3], a[0], a[1])
    for fn in (D.csd, D.wasserstein2, D.js, D.min_kl, D.elk, D.bhattacharyya):
        torch.testing.assert_close(fn(*a), fn(*b).t())
    torch.testing.assert_close(D.sq_euclidean(a[0], a[2]), D.sq_euclidean(a[2], a[0]).t())
    torch.testing.assert_close(D.kl_reverse(*a), D.kl(*b).t())
    assert not torch.allclose(D.kl(*a), D.kl(*b).t())
    # self-distances: KL, JS, W2, Bhattacharyya vanish; CSD is 2 ||sigma^2||_1 (PCME++ Sec. 2.2)
    mu, lv = a[0], a[1]
    for fn in (D.kl, D.js, D.wasserstein2, D.bhattacharyya):
        assert fn(mu, lv, mu, lv).diagonal().abs().max() < 1e-10
    torch.testing.assert_close(D.csd(mu, lv, mu, lv).diagonal(), 2 * lv.exp().sum(-1))


def test_reduction_to_euclidean_as_sigma_vanishes():
    mu_a, _, mu_b, _ = gaussians(4, 5, 3, seed=5)
    tiny = torch.full_like(mu_a, -40.0), torch.full_like(mu_b, -40.0)
    e2 = direct("sq_euclidean", mu_a, tiny[0], mu_b, tiny[1])
    torch.testing.assert_close(D.csd(mu_a, tiny[0], mu_b, tiny[1]), e2)
    torch.testing.assert_close(D.wasserstein2(mu_a, tiny[0], mu_b, tiny[1]), e2)
    torch.testing.assert_close(D.wasserstein2(mu_a, tiny[0], mu_b, tiny[1], form="var"), e2)
    g = torch.Generator().manual_seed(0)
    torch.testing.assert_close(D.mc_avg_l2(mu_a, tiny[0], mu_b, tiny[1], generator=g), e2.sqrt())
    torch.testing.assert_close(D.mc_match_prob(mu_a, tiny[0], mu_b, tiny[1], a=3.0, b=1.0, generator=g),
                               torch.sigmoid(-3.0 * e2.sqrt() + 1.0))
    # equal small variances v: 2 v KL -> ||mu_a - mu_b||^2, 4 v (ELK - D/2 log 2v) -> the same
    v = 1e-6
    lv = math.log(v)
    la, lb = torch.full_like(mu_a, lv), torch.full_like(mu_b, lv)
    torch.testing.assert_close(2 * v * D.kl(mu_a, la, mu_b, lb), e2)
    torch.testing.assert_close(4 * v * (D.elk(mu_a, la, mu_b, lb) - 0.5 * 3 * math.log(2 * v)), e2)


def test_expectations_against_monte_carlo():
    """CSD = E||Za - Zb||^2 (PCME++ Eq. 1); the MC match probability / average L2 agree with an
    independent sample estimate of E sigmoid(-a||Za - Zb|| + b) and E||Za - Zb||."""
    mu_a, lv_a, mu_b, lv_b = gaussians(3, 4, 8, seed=6)
    g = torch.Generator().manual_seed(7)
    k = 20000
    za = mu_a[:, None] + (0.5 * lv_a).exp()[:, None] * torch.randn(3, k, 8, generator=g, dtype=torch.float64)
    zb = mu_b[:, None] + (0.5 * lv_b).exp()[:, None] * torch.randn(4, k, 8, generator=g, dtype=torch.float64)
    diff = za[:, None] - zb[None]  # [3, 4, k, 8] paired samples
    sq = (diff ** 2).sum(-1)
    l2 = sq.sqrt()
    a, b = 0.7, 2.0
    sig = torch.sigmoid(-a * l2 + b)
    j = 200
    for name, est, samples, own in (
            ("csd", D.csd(mu_a, lv_a, mu_b, lv_b), sq, 0),
            ("avg_l2", D.mc_avg_l2(mu_a, lv_a, mu_b, lv_b, n_samples=j, generator=g), l2, j),
            ("match_prob", D.mc_match_prob(mu_a, lv_a, mu_b, lv_b, a=a, b=b, n_samples=j, generator=g), sig, j)):
        mean, std = samples.mean(-1), samples.std(-1)
        # reference error + the function's own MC error (J samples per side: at most std * sqrt(2 / J))
        se = (std ** 2 / k + (2 * std ** 2 / own if own else 0)).sqrt()
        z = ((est - mean) / se).abs()
        assert z.max() < 4.5, (name, z)
    # and the estimates are informative: the tolerance is far smaller than the spread of values
    assert (se < 0.3 * mean.std()).all()


def test_mc_functions_are_reproducible_and_bounded():
    x = gaussians(6, 5, 4, seed=8, dtype=torch.float32)
    p1 = D.mc_match_prob(*x, generator=torch.Generator().manual_seed(1))
    p2 = D.mc_match_prob(*x, generator=torch.Generator().manual_seed(1))
    assert torch.equal(p1, p2) and ((p1 > 0) & (p1 < 1)).all()
    assert (D.mc_avg_l2(*x, generator=torch.Generator().manual_seed(1)) ** 2 <= D.csd(*x) * 1.5).all()


@pytest.mark.parametrize("name", ["csd", "w2", "w2var_sqrt", "kl", "kl_reverse", "min_kl", "js", "elk",
                                  "bhattacharyya", "sq_euclidean", "cosine", "mc_match_prob", "mc_avg_l2"])
def test_gradcheck_float64(name):
    x = [t.clone().requires_grad_(True) for t in gaussians(3, 4, 3, seed=9, spread=0.3)]
    fns = {
        "csd": D.csd, "kl": D.kl, "kl_reverse": D.kl_reverse, "min_kl": D.min_kl, "js": D.js,
        "w2": D.wasserstein2,
        "w2var_sqrt": lambda *t: D.wasserstein2(*t, form="var", squared=False),
        "elk": lambda *t: D.elk(*t, chunk_elements=10),
        "bhattacharyya": lambda *t: D.bhattacharyya(*t, chunk_elements=10),
        "sq_euclidean": lambda ma, la, mb, lb: D.sq_euclidean(ma, mb),
        "cosine": lambda ma, la, mb, lb: D.cosine(ma, mb),
        "mc_match_prob": lambda *t: D.mc_match_prob(*t, a=2.0, b=1.0, n_samples=3, chunk_size=20,
                                                    generator=torch.Generator().manual_seed(3)),
        "mc_avg_l2": lambda *t: D.mc_avg_l2(*t, n_samples=3, generator=torch.Generator().manual_seed(3)),
    }
    assert torch.autograd.gradcheck(fns[name], tuple(x), eps=1e-6, atol=1e-5)


def test_dtypes_low_precision_is_computed_in_float32():
    x32 = gaussians(4, 5, 8, seed=10, dtype=torch.float32)
    xb = [t.to(torch.bfloat16) for t in x32]
    out = D.csd(*xb)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, D.csd(*[t.float() for t in xb]))
    assert D.kl(*xb).dtype == torch.float32 and D.sq_euclidean(xb[0], xb[2]).dtype == torch.float32
    assert D.csd(*[t.double() for t in x32]).dtype == torch.float64


def test_uncertainty_kinds():
    lv = torch.tensor([[0.0, math.log(4.0)], [math.log(0.25), math.log(0.25)]])
    torch.testing.assert_close(D.uncertainty(lv), torch.tensor([5.0, 0.5]))
    torch.testing.assert_close(D.uncertainty(lv, "logdet"), torch.tensor([math.log(4.0), 2 * math.log(0.25)]))
    torch.testing.assert_close(D.uncertainty(lv, "geomean"), torch.tensor([math.sqrt(2.0), 0.5]))
    with pytest.raises(UserError):
        D.uncertainty(lv, "entropy")


def test_score_names_signs_and_errors():
    x = gaussians(3, 4, 5, seed=11, dtype=torch.float32)
    assert set(D.SCORE_NAMES) == {"csd", "mean", "cosine", "w2", "kl", "minkl", "js", "elk", "bhattacharyya", "mc"}
    torch.testing.assert_close(D.score("csd", *x), -D.csd(*x))
    torch.testing.assert_close(D.score("kl", *x), -D.kl(*x))
    torch.testing.assert_close(D.score("minkl", *x), -D.min_kl(*x))
    torch.testing.assert_close(D.score("w2", *x, form="var"), -D.wasserstein2(*x, form="var"))
    torch.testing.assert_close(D.score("mean", x[0], None, x[2], None), -D.sq_euclidean(x[0], x[2]))
    torch.testing.assert_close(D.score("cosine", x[0], None, x[2], None), D.cosine(x[0], x[2]))
    for name in D.SCORE_NAMES:
        s = D.score(name, *x, **({"generator": torch.Generator().manual_seed(0)} if name == "mc" else {}))
        assert s.shape == (3, 4) and torch.isfinite(s).all()
        # the matching pair scores best when b is a slightly perturbed copy of a
        mu, lv = x[0], x[1]
        s_self = D.score(name, mu, lv, mu + 0.01, lv, **({"n_samples": 30} if name == "mc" else {}))
        if name not in ("mc", "elk"):  # ELK / MC also reward small variance, not only closeness
            assert (s_self.argmax(1) == torch.arange(3)).all(), name
    with pytest.raises(UserError):
        D.score("hamming", *x)
    with pytest.raises(UserError):
        D.score("csd", x[0], None, x[2], None)


def _peak_bytes(fn):
    """Peak RSS increase of fn (VmHWM after resetting it through /proc/self/clear_refs)."""
    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_closed_forms_never_build_an_n_by_m_by_d_tensor():
    x = gaussians(384, 384, 192, seed=12, dtype=torch.float32)
    nmd = 384 * 384 * 192 * 4  # 108 MiB if broadcast; the matmul forms need a few [N, M] (0.6 MiB)
    # (ELK / Bhattacharyya are row-blocked instead: their size is set by chunk_elements)
    for fn in (D.csd, D.kl, D.js, D.min_kl, D.wasserstein2):
        fn(*x)  # warm-up: first calls initialise BLAS buffers
        peak = _peak_bytes(lambda: fn(*x))
        assert peak < nmd / 4, (fn, peak / 2 ** 20)


def _inclusion_reference(mu_1, lv_1, mu_2, lv_2, eps):
    """ProLIP's per-dimension inclusion score written out with math, one scalar at a time."""
    out = []
    for row in range(len(mu_1)):
        total = 0.0
        for k in range(len(mu_1[row])):
            m1, l1, m2, l2 = (float(mu_1[row][k]), float(lv_1[row][k]), float(mu_2[row][k]), float(lv_2[row][k]))
            w1, w2 = math.exp(eps - l1), math.exp(eps - l2)
            a = w1 + w2 / 2
            b = 2 * m1 * w1 + m2 * w2
            c = m1 * m1 * w1 + m2 * m2 * w2 / 2
            total += -2 * l1 - l2 - math.log(a) / 2 + b * b / (4 * a) - c
        out.append(total / len(mu_1[row]))
    return torch.tensor(out, dtype=torch.float64)


def test_inclusion_test_matches_scalar_reference_and_orders_nested_gaussians():
    g = torch.Generator().manual_seed(3)
    mu_1, mu_2 = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    lv_1, lv_2 = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    for eps in (-10.0, 0.0):
        got = D.inclusion_test(mu_1, lv_1, mu_2, lv_2, eps=eps)
        assert torch.allclose(got, _inclusion_reference(mu_1, lv_1, mu_2, lv_2, eps), rtol=1e-12, atol=1e-12)
        logit = D.inclusion_logit(mu_1, lv_1, mu_2, lv_2, eps=eps)
        assert torch.allclose(logit, -D.inclusion_logit(mu_2, lv_2, mu_1, lv_1, eps=eps))
    # a narrow Gaussian at the centre of a broad one is the included one, whatever the scale
    centre = torch.zeros(1, 4, dtype=torch.float64)
    narrow, broad = torch.full((1, 4), -3.0, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64)
    assert D.inclusion_logit(centre, narrow, centre, broad).item() > 0
    assert D.inclusion_logit(centre, broad, centre, narrow).item() < 0
    # float32 inputs are computed in float32 and agree with float64
    got32 = D.inclusion_test(mu_1.float(), lv_1.float(), mu_2.float(), lv_2.float())
    assert got32.dtype == torch.float32
    assert torch.allclose(got32.double(), D.inclusion_test(mu_1, lv_1, mu_2, lv_2), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        D.inclusion_test(mu_1, lv_1, mu_2[:, :3], lv_2[:, :3])
