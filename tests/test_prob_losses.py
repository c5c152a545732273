"""zsprob.prob.losses: PCME++ against the paper's pseudo-code, pseudo-positives on hand-made cases,
soft targets and the BCE gradient, distributed-form equivalence, and the other objectives
against direct formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zsprob import UserError
from zsprob.prob import (
    InfoNCELoss, MuOnlyLoss, PCMELoss, PCMEPPLoss, ProbTripletLoss, TripletLoss, create_loss,
    needs_sigma, pseudo_positive_targets,
)
from prob_reference import pcmepp_pseudocode_loss
from zsprob.prob import jwae
from zsprob.prob.pairs import hinge_rows


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def batch(n=6, d=5, seed=0, dtype=torch.float64, grad=True, m=None):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    t = [torch.randn(n, d, generator=g, dtype=dtype) * 0.5, torch.randn(n, d, generator=g, dtype=dtype) * 0.5 - 1,
         torch.randn(m, d, generator=g, dtype=dtype) * 0.5, torch.randn(m, d, generator=g, dtype=dtype) * 0.5 - 1]
    return [x.requires_grad_(grad) for x in t]


def soft_matched(n, dtype=torch.float64):
    m = torch.eye(n, dtype=dtype)
    m[1, 1], m[1, 3] = 0.7, 0.3   # a mixed image (MSDA)
    m[4, 4], m[4, 0] = 0.45, 0.55  # the partner's caption weighs more
    m[2, 5] = 1.0                 # a second positive caption
    return m


# ----------------------------------------------------------------------------- PCME++ vs pseudo-code

@pytest.mark.parametrize("matched_kind", ["identity", "soft"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pcmepp_equals_pseudocode_with_both_directions(matched_kind, dtype):
    x = batch(dtype=dtype)
    matched = None if matched_kind == "identity" else soft_matched(6, dtype)
    crit = PCMEPPLoss(init_scale=0.8, init_shift=2.0)  # scales where pseudo-positives occur
    loss, stats = crit(*x, matched)
    ref = pcmepp_pseudocode_loss(*x, matched, a=crit.scale, b=crit.shift, alpha=0.1, beta=1e-4)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss.to(dtype), ref, rtol=tol, atol=tol)
    assert int(stats["n_pseudo_positives"]) > 0
    # the official code's "2 x i2t" shortcut gives the same main term
    torch.testing.assert_close(stats["match_i2t"], stats["match_t2i"])
    g = torch.autograd.grad(loss, x + [crit.scale, crit.shift])
    g_ref = torch.autograd.grad(ref, x + [crit.scale, crit.shift])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=max(tol, 1e-9) * 100, atol=max(tol, 1e-9) * 10)


def test_pcmepp_defaults_and_stats():
    crit = PCMEPPLoss()
    assert crit.scale.item() == 5.0 and crit.shift.item() == 5.0
    assert crit.pp_alpha == 0.1 and crit.vib_beta == 1e-4 and crit.distance == "csd"
    x = batch(dtype=torch.float32)
    loss, stats = crit(*x)
    for k in ("loss", "match_i2t", "match_t2i", "pp_match_i2t", "pp_match_t2i", "vib_img", "vib_txt",
              "scale", "shift", "img_sigma2", "txt_sigma2", "n_pseudo_positives"):
        assert k in stats, k
    torch.testing.assert_close(stats["img_sigma2"], x[1].detach().exp().mean())
    torch.testing.assert_close(stats["vib_img"], -0.5 * (1 + x[1] - x[0] ** 2 - x[1].exp()).mean().detach())
    ref = pcmepp_pseudocode_loss(*x)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_pseudo_positive_selection_hand_made():
    """1-D means, negligible sigma: distances are squared differences of positions."""
    img = torch.tensor([[0.0], [10.0], [20.0]])
    txt = torch.tensor([[3.0], [10.5], [1.0]])
    tiny = torch.full((3, 1), -30.0)
    crit = PCMEPPLoss(init_scale=0.01, init_shift=0.0, vib_beta=0.0)
    logits = crit.logits(img, tiny, txt, tiny)
    eye = torch.eye(3)
    t_i2t, c_i2t = pseudo_positive_targets(logits, eye)
    # image 0: caption 2 (d=1) is closer than its own caption 0 (d=9); image 2: captions 0, 1 closer
    assert t_i2t.tolist() == [[1, 0, 1], [0, 1, 0], [1, 1, 1]] and int(c_i2t) == 3
    t_t2i, c_t2i = pseudo_positive_targets(logits.t(), eye)
    # caption 2 (at 1): images 0 (d=1) and 1 (d=81) are closer than its image 2 (d=361)
    assert t_t2i.tolist() == [[1, 0, 0], [0, 1, 0], [1, 1, 1]] and int(c_t2i) == 2
    loss, stats = crit(img, tiny, txt, tiny)
    assert int(stats["n_pseudo_positives"]) == 5
    bce = F.binary_cross_entropy_with_logits
    torch.testing.assert_close(stats["pp_match_i2t"], bce(logits, t_i2t))
    torch.testing.assert_close(stats["pp_match_t2i"], bce(logits.t(), t_t2i))
    torch.testing.assert_close(loss, 2 * bce(logits, eye) + 0.1 * (bce(logits, t_i2t) + bce(logits.t(), t_t2i)))
    # soft row: pseudo-positives take the ground truth's (largest) label, other labels stay
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    t_soft, _ = pseudo_positive_targets(logits, soft)
    assert torch.allclose(t_soft[0], torch.tensor([0.7, 0.3, 0.7]))


def test_soft_targets_are_plain_bce():
    x = batch()
    m = soft_matched(6)
    crit = PCMEPPLoss(pp_alpha=0.0, vib_beta=0.0)
    loss, _ = crit(*x, m)
    mu_d = ((x[0][:, None] - x[2][None]) ** 2).sum(-1)
    l = -5.0 * (mu_d + x[1].exp().sum(-1)[:, None] + x[3].exp().sum(-1)[None]) + 5.0
    manual = -(m * F.logsigmoid(l) + (1 - m) * F.logsigmoid(-l)).mean()
    torch.testing.assert_close(loss, 2 * manual)


def _pair_grad_wrt_logit(m: float, logit: float):
    """dL/dl of one image-text pair, L = BCE(l, m) per direction (pp and VIB off).

    l is controlled exactly: 1-D means at distance 0, tiny sigma, a = 1, b = logit; dl/db = 1 and
    both directions count, so dL/dl = 0.5 dL/db. Checked by autograd and a central difference."""
    mu, lv = torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), -60.0, dtype=torch.float64)
    crit = PCMEPPLoss(init_scale=1.0, init_shift=logit, pp_alpha=0.0, vib_beta=0.0).double()
    matched = torch.tensor([[m]], dtype=torch.float64)
    loss, _ = crit(mu, lv, mu, lv, matched)
    (g,) = torch.autograd.grad(loss, crit.shift)
    h = 1e-5
    with torch.no_grad():
        crit.shift += h
        lp = crit(mu, lv, mu, lv, matched)[0]
        crit.shift -= 2 * h
        lm = crit(mu, lv, mu, lv, matched)[0]
    fd = (lp - lm) / (2 * h)
    torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-8)
    return 0.5 * float(g)


@pytest.mark.parametrize("m", [0.0, 0.25, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("logit", [-6.0, -1.0, 0.0, 2.0, 8.0])
def test_bce_gradient_formula_soft_labels(m, logit):
    """PCME++ Sec. 2.3-2.4: dL/dl for a pair with (soft) label m is sigmoid(l) - m exactly."""
    g = _pair_grad_wrt_logit(m, logit)
    assert g == pytest.approx(1.0 / (1.0 + math.exp(-logit)) - m, abs=1e-9)


def test_saturation_and_what_pp_and_msda_change():
    # a confident positive saturates: almost no gradient
    assert abs(_pair_grad_wrt_logit(1.0, 8.0)) < 1e-3
    # a confident false negative (m = 0, sigmoid(l) ~ 1) is pushed apart with gradient ~ 1 ...
    assert _pair_grad_wrt_logit(0.0, 8.0) == pytest.approx(1.0, abs=1e-3)
    # ... a pseudo-positive relabelled to 1 stops being pushed, and an MSDA soft label
    # lambda leaves 1 - lambda (not lambda as Sec. 2.4 prints: its expression is not dL/dl of Eq. 2)
    assert abs(_pair_grad_wrt_logit(1.0, 8.0)) < 1e-3
    assert _pair_grad_wrt_logit(0.7, 8.0) == pytest.approx(0.3, abs=1e-3)
    printed = (1 - 0.5) - (1 - 2 * 0.5) * 0.5  # Sec. 2.4 at lambda = 0.5, l = 0
    assert printed == 0.5 and abs(_pair_grad_wrt_logit(0.5, 0.0)) < 1e-9


def test_vib_guard_skips_exploding_term():
    x = batch(dtype=torch.float32)
    big_lv = torch.full_like(x[1], 12.0)  # exp(12) ~ 1.6e5: VIB ~ 8e4 > 1e4
    crit = PCMEPPLoss()
    loss, stats = crit(x[0], big_lv, x[2], x[3])
    ref = pcmepp_pseudocode_loss(x[0], big_lv, x[2], x[3], beta=0.0) + 1e-4 * (0 + stats["vib_txt"])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert stats["vib_img"].item() == 0.0 and stats["vib_guard_trips"].item() == 1.0  # the image term tripped
    big_lv.requires_grad_(True)
    crit(x[0], big_lv, x[2], x[3])[0].backward()
    assert torch.isfinite(big_lv.grad).all()


def test_vib_guard_decides_on_the_device():
    from zsprob.utils.host_sync import HostSyncCounter

    x = batch(dtype=torch.float32)
    with HostSyncCounter() as counter:
        PCMEPPLoss()(x[0], torch.full_like(x[1], 12.0), x[2], x[3])
    assert counter.total == 0, counter.where


def test_wd_ablation_and_mu_only_distances():
    x = batch()
    l_wd, _ = PCMEPPLoss(distance="wd", pp_alpha=0.0, vib_beta=0.0)(*x)
    sd = lambda lv: (0.5 * lv).exp()
    w2 = ((x[0][:, None] - x[2][None]) ** 2).sum(-1) + ((sd(x[1])[:, None] - sd(x[3])[None]) ** 2).sum(-1)
    eye = torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(l_wd, 2 * F.binary_cross_entropy_with_logits(-5 * w2 + 5, eye))
    l_mu, stats = MuOnlyLoss(pp_alpha=0.0)(x[0], None, x[2], None)
    e2 = ((x[0][:, None] - x[2][None]) ** 2).sum(-1)
    torch.testing.assert_close(l_mu, 2 * F.binary_cross_entropy_with_logits(-5 * e2 + 5, eye))
    assert "vib_img" not in stats
    with pytest.raises(UserError):
        PCMEPPLoss(distance="kl")


def test_match_sigma_detach_keeps_the_match_loss_off_sigma():
    """match_sigma "detach": the same value and mean gradients as PCME++, and the log-variances get
    only the VIB term's gradient (float64 pseudo-code reference)."""
    x = batch()
    plain, _ = PCMEPPLoss(pp_alpha=0.1, vib_beta=1e-2)(*x)
    detached_loss = PCMEPPLoss(pp_alpha=0.1, vib_beta=1e-2, match_sigma="detach")
    value, _ = detached_loss(*x)
    torch.testing.assert_close(value, plain)
    torch.testing.assert_close(value, pcmepp_pseudocode_loss(*x, alpha=0.1, beta=1e-2))
    g_plain = torch.autograd.grad(plain, x)
    g_det = torch.autograd.grad(value, x)
    for k in (0, 2):                                                 # means: unchanged
        torch.testing.assert_close(g_det[k], g_plain[k])
    from zsprob.prob.losses import vib_kl
    for k, (mu, lv) in ((1, (x[0], x[1])), (3, (x[2], x[3]))):       # log-variances: VIB's gradient alone
        torch.testing.assert_close(g_det[k], torch.autograd.grad(1e-2 * vib_kl(mu, lv), lv)[0])
        assert not torch.allclose(g_det[k], g_plain[k])
    with pytest.raises(UserError):
        PCMEPPLoss(match_sigma="frozen")


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_caption_nll_is_the_gaussian_likelihood_of_the_matched_images(path, monkeypatch):
    """The caption term against torch.distributions.Normal in float64 (soft targets, a row without a
    match), its minimiser (the mean squared residual), and its gradient: caption log-variances only.
    Both paths: the CPU's (kept rows indexed after a free host read) and the accelerator's (chosen on
    the device), which must agree; with no matched row at all the term is 0 with a zero gradient."""
    from zsprob.prob.losses import caption_nll
    from zsprob.utils import host_sync
    if path == "accelerator":
        monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())

    g = torch.Generator().manual_seed(5)
    img, txt = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    lv = torch.randn(5, 4, generator=g, dtype=torch.float64)
    targets = torch.zeros(5, 6, dtype=torch.float64)
    targets[0, 0] = targets[1, 1] = targets[3, 3] = targets[4, 5] = 1.0
    targets[1, 2], targets[3, 3] = 0.5, 0.3  # caption 1: two images 2:1; caption 2: none
    normal = torch.distributions.Normal(txt, (0.5 * lv).exp())
    per_row = []
    for t in (0, 1, 3, 4):
        w = targets[t] / targets[t].sum()
        per_row.append(sum(-w[j] * normal.log_prob(img[j])[t].sum() for j in range(6) if w[j] > 0))
    want = torch.stack(per_row).mean() - 0.5 * 4 * math.log(2 * math.pi)
    torch.testing.assert_close(caption_nll(targets, img, txt, lv), want, rtol=1e-12, atol=1e-12)
    # one image per caption: the minimiser over log sigma^2 is log of the squared residual
    best = (img[:5] - txt).square().log().requires_grad_(True)
    grad, = torch.autograd.grad(caption_nll(torch.eye(5, 6, dtype=torch.float64), img, txt, best), best)
    assert grad.abs().max() < 1e-12
    none = lv.clone().requires_grad_(True)
    value = caption_nll(torch.zeros(5, 6, dtype=torch.float64), img, txt, none)
    grad, = torch.autograd.grad(value, none)
    assert value.item() == 0.0 and grad.abs().max() == 0.0
    # scale k: the Gaussian N(mu_t, k sigma_t^2), so the minimiser is the squared residual / k
    wide = torch.distributions.Normal(txt, (0.5 * lv).exp() * math.sqrt(4.0))
    want4 = torch.stack([-wide.log_prob(img[t]).sum(-1)[t] for t in range(5)]).mean() - 0.5 * 4 * math.log(2 * math.pi)
    torch.testing.assert_close(caption_nll(torch.eye(5, 6, dtype=torch.float64), img, txt, lv, 4.0),
                               want4 - 0.5 * 4 * math.log(4.0), rtol=1e-12, atol=1e-12)
    shrunk = (best.detach() - math.log(4.0)).requires_grad_(True)
    grad, = torch.autograd.grad(caption_nll(torch.eye(5, 6, dtype=torch.float64), img, txt, shrunk, 4.0), shrunk)
    assert grad.abs().max() < 1e-12
    # in the loss: means enter as constants, only the caption log-variances move; 0 switches it off
    x = batch()
    base, _ = PCMEPPLoss(distance="mu", vib_beta=0.0)(*x)
    value, stats = PCMEPPLoss(distance="mu", vib_beta=0.0, caption_nll_alpha=0.5)(*x)
    torch.testing.assert_close(value, base + 0.5 * caption_nll(torch.eye(len(x[0]), dtype=torch.float64),
                                                               x[0], x[2], x[3]))
    assert "caption_nll" in stats
    g_base, g_nll = (torch.autograd.grad(v, x, allow_unused=True) for v in (base, value))
    for k in (0, 2):
        torch.testing.assert_close(g_nll[k], g_base[k])
    assert g_nll[1] is None or not g_nll[1].any()
    assert g_nll[3] is not None and g_nll[3].abs().sum() > 0
    for bad in (-1, float("nan"), "x"):
        with pytest.raises(UserError, match="caption_nll_alpha"):
            PCMEPPLoss(caption_nll_alpha=bad)
    for bad in (0, -2, float("inf"), "x"):
        with pytest.raises(UserError, match="caption_nll_scale must be a number > 0"):
            PCMEPPLoss(caption_nll_scale=bad)
    scaled, _ = PCMEPPLoss(distance="mu", vib_beta=0.0, caption_nll_alpha=0.5, caption_nll_scale=4.0)(*x)
    torch.testing.assert_close(scaled, base + 0.5 * caption_nll(torch.eye(len(x[0]), dtype=torch.float64),
                                                                x[0], x[2], x[3], 4.0))


def test_image_nll_is_the_caption_term_with_the_roles_swapped():
    """The image likelihood term: the image's Gaussian explains its captions' means; image
    log-variances only move, soft targets follow the i2t rows, and bad weights are one line."""
    from zsprob.prob.losses import caption_nll

    x, m = batch(n=8), block_soft(8)
    base, _ = PCMEPPLoss(distance="mu", vib_beta=0.0)(*x, m)
    value, stats = PCMEPPLoss(distance="mu", vib_beta=0.0, image_nll_alpha=0.5, image_nll_scale=2.0)(*x, m)
    # image row i against caption columns: the i2t targets are the rows of the match matrix
    mu_i, lv_i, mu_t = x[0], x[1], x[2]
    per_row = []
    for i in range(len(mu_i)):
        w = m[i] / m[i].sum()
        normal = torch.distributions.Normal(mu_i[i], (0.5 * lv_i[i]).exp() * math.sqrt(2.0))
        per_row.append(sum(-w[j] * normal.log_prob(mu_t[j]).sum() for j in range(len(mu_t)) if w[j] > 0))
    d = mu_i.shape[1]
    want = torch.stack(per_row).mean() - 0.5 * d * math.log(2 * math.pi) - 0.5 * d * math.log(2.0)
    torch.testing.assert_close(value, base + 0.5 * want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(caption_nll(m, mu_t, mu_i, lv_i, 2.0), want, rtol=1e-10, atol=1e-10)
    assert "image_nll" in stats and "caption_nll" not in stats
    g_base, g_nll = (torch.autograd.grad(v, x, allow_unused=True) for v in (base, value))
    for k in (0, 2):  # the means: unchanged
        torch.testing.assert_close(g_nll[k], g_base[k])
    assert g_nll[3] is None or not g_nll[3].any()  # the caption log-variances: untouched
    assert g_nll[1] is not None and g_nll[1].abs().sum() > 0
    for bad in (-1, float("nan"), "x"):
        with pytest.raises(UserError, match="image_nll_alpha"):
            PCMEPPLoss(image_nll_alpha=bad)
    for bad in (0, -2, float("inf")):
        with pytest.raises(UserError, match="image_nll_scale must be a number > 0"):
            PCMEPPLoss(image_nll_scale=bad)
    assert "image_nll_alpha=0.5" in repr(PCMEPPLoss(image_nll_alpha=0.5))


def test_low_precision_inputs():
    x = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in batch(dtype=torch.float32)]
    loss, _ = PCMEPPLoss()(*x)
    assert loss.dtype == torch.float32
    loss.backward()
    assert x[0].grad is not None and x[0].grad.dtype == torch.bfloat16 and torch.isfinite(x[0].grad.float()).all()


# ----------------------------------------------------------------------------- distributed form

def _split_equivalence(make_crit, n_proc=2, n=4, d=5, matched=None, sigma=True, call_kw=None):
    """Mean over simulated processes (local rows, gathered columns with gradients) == one batch."""
    call_kw = call_kw or {}
    N = n * n_proc
    x = batch(N, d, seed=3)
    if not sigma:
        x[1] = x[3] = None
    leaves = [t for t in x if t is not None]
    crit = make_crit()
    params = [p for p in crit.parameters()]
    single, _ = crit(*x, matched, **call_kw())
    g_single = torch.autograd.grad(single, leaves + params, allow_unused=True)
    losses = []
    for p in range(n_proc):
        s = slice(p * n, (p + 1) * n)
        loc = [None if t is None else t[s] for t in x]
        lp, _ = crit(*loc, matched, all_img=(x[0], x[1]), all_txt=(x[2], x[3]), offset=p * n, **call_kw())
        losses.append(lp)
    avg = torch.stack(losses).mean()
    torch.testing.assert_close(avg, single, rtol=1e-10, atol=1e-12)
    g_split = torch.autograd.grad(avg, leaves + params, allow_unused=True)
    for a, b in zip(g_split, g_single):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def block_soft(N):
    m = torch.eye(N, dtype=torch.float64)
    m[1, 1], m[1, 2] = 0.6, 0.4
    m[6, 6], m[6, 4] = 0.3, 0.7
    return m


@pytest.mark.parametrize("name,make,sigma,kw", [
    ("pcmepp", lambda: PCMEPPLoss(init_scale=0.8, init_shift=2.0).double(), True, None),
    ("pcmepp-wd", lambda: PCMEPPLoss(distance="wd").double(), True, None),
    ("pcmepp-caption-nll", lambda: PCMEPPLoss(distance="mu", caption_nll_alpha=0.3).double(), True, None),
    ("pcmepp-image-nll", lambda: PCMEPPLoss(distance="mu", image_nll_alpha=0.3, image_nll_scale=3.0).double(),
     True, None),
    ("mu-only", lambda: MuOnlyLoss(init_scale=0.8, init_shift=2.0).double(), False, None),
    ("infonce", lambda: InfoNCELoss().double(), False, None),
    ("triplet", lambda: TripletLoss(), False, None),
    ("triplet-sum", lambda: TripletLoss(hardest=False), False, None),
    ("prob-triplet-kl-semihard", lambda: ProbTripletLoss("kl", negatives="semihard"), True, None),
    ("prob-triplet-w2var", lambda: ProbTripletLoss("w2var"), True, None),
    ("pcme", lambda: PCMELoss(form="zsprob", n_samples=3).double(), True,
     lambda: {"generator": torch.Generator().manual_seed(11)}),
    ("pcme-official", lambda: PCMELoss(n_samples=3, init_scale=1.0, init_shift=0.5, vib_beta=1e-2).double(), True,
     lambda: {"generator": torch.Generator().manual_seed(11)}),
])
@pytest.mark.parametrize("soft", [False, True])
def test_distributed_split_equals_single_batch(name, make, sigma, kw, soft):
    _split_equivalence(make, matched=block_soft(8) if soft else None, sigma=sigma,
                       call_kw=kw or (lambda: {}))


def test_bad_distributed_arguments():
    x = batch(4)
    with pytest.raises(ValueError):
        PCMEPPLoss()(*x, all_img=(x[0], x[1]))
    with pytest.raises(ValueError):
        PCMEPPLoss()(*x, torch.eye(5, dtype=torch.float64))
    with pytest.raises(ValueError):
        PCMEPPLoss()(*x, all_img=(x[0], x[1]), all_txt=(x[2], x[3]), offset=2)
    with pytest.raises(ValueError):
        PCMEPPLoss()(x[0], None, x[2], None)


# ----------------------------------------------------------------------------- PCME

def test_pcme_matches_direct_monte_carlo_formula():
    x = batch(5, 4)
    m = torch.eye(5, dtype=torch.float64)
    m[0, 0], m[0, 1] = 0.6, 0.4
    J = 4
    crit = PCMELoss(form="zsprob", n_samples=J, init_scale=1.5, init_shift=0.5, vib_beta=1e-3).double()
    loss, stats = crit(*x, m, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    eps_i = torch.randn(5, J, 4, generator=g, dtype=torch.float64)
    eps_t = torch.randn(5, J, 4, generator=g, dtype=torch.float64)
    zi = x[0][:, None] + (0.5 * x[1]).exp()[:, None] * eps_i
    zt = x[2][:, None] + (0.5 * x[3]).exp()[:, None] * eps_t
    dist = ((zi[:, :, None, None] - zt[None, None]) ** 2).sum(-1).add(1e-12).sqrt()  # [5, J, 5, J]
    p = torch.sigmoid(-1.5 * dist + 0.5).mean(dim=(1, 3))
    nll = -(m * p.log() + (1 - m) * (1 - p).log()).mean()
    vib = sum(-0.5 * (1 + lv - mu ** 2 - lv.exp()).mean() for mu, lv in ((x[0], x[1]), (x[2], x[3])))
    torch.testing.assert_close(loss, 2 * nll + 1e-3 * vib)
    # blocks with checkpointing give the same value and gradients
    small = PCMELoss(form="zsprob", n_samples=J, init_scale=1.5, init_shift=0.5, vib_beta=1e-3, chunk_elements=20).double()
    l2, _ = small(*x, m, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(l2, loss)
    ga = torch.autograd.grad(loss, x + [crit.scale])
    gb = torch.autograd.grad(l2, x + [small.scale])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


def test_pcme_uniformity_regulariser():
    x = batch(3, 2)
    crit = PCMELoss(form="zsprob", n_samples=2, vib_beta=0.0, uniform_weight=1.0).double()
    _, stats = crit(*x, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    eps_i = torch.randn(3, 2, 2, generator=g, dtype=torch.float64)
    eps_t = torch.randn(3, 2, 2, generator=g, dtype=torch.float64)
    z = torch.cat([(x[0][:, None] + (0.5 * x[1]).exp()[:, None] * eps_i).reshape(-1, 2),
                   (x[2][:, None] + (0.5 * x[3]).exp()[:, None] * eps_t).reshape(-1, 2)])
    d2 = torch.cdist(z, z) ** 2
    off = ~torch.eye(12, dtype=torch.bool)
    torch.testing.assert_close(stats["uniformity"], torch.exp(-2 * d2[off]).mean().log())


# ----------------------------------------------------------------------------- InfoNCE, triplets

def test_infonce_is_clip_loss_with_clamped_scale():
    x = batch(5, 4)
    crit = InfoNCELoss().double()
    loss, stats = crit(x[0], None, x[2], None)
    s = (1 / 0.07) * F.normalize(x[0], dim=-1) @ F.normalize(x[2], dim=-1).t()
    t = torch.arange(5)
    torch.testing.assert_close(loss, 0.5 * (F.cross_entropy(s, t) + F.cross_entropy(s.t(), t)))
    clamped = InfoNCELoss(init_temperature=0.001)
    assert float(clamped(x[0], None, x[2], None)[1]["logit_scale"]) == pytest.approx(100.0)


def test_triplet_matches_vsepp_loops():
    x = batch(5, 4)
    a, b = F.normalize(x[0].detach(), dim=-1), F.normalize(x[2].detach(), dim=-1)
    S = a @ b.t()
    hard = summ = 0.0
    for i in range(5):
        ci = [max(0.0, 0.2 + float(S[i, j] - S[i, i])) for j in range(5) if j != i]
        ri = [max(0.0, 0.2 + float(S[j, i] - S[i, i])) for j in range(5) if j != i]
        hard += max(ci) + max(ri)
        summ += sum(ci) + sum(ri)
    assert TripletLoss()(x[0], None, x[2], None)[0].item() == pytest.approx(hard / 5)
    assert TripletLoss(hardest=False)(x[0], None, x[2], None)[0].item() == pytest.approx(summ / 5)


def test_hinge_negative_mining_hand_made():
    sim = torch.tensor([[0.5, 0.9, 0.4, 0.1]])
    t = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert float(hinge_rows(sim, t, 0.2, "hardest")) == pytest.approx(0.6)
    assert float(hinge_rows(sim, t, 0.2, "semihard")) == pytest.approx(0.1)  # 0.4: below the positive
    assert float(hinge_rows(sim, t, 0.2, "all")) == pytest.approx(0.7)
    # a soft partner label (MSDA) is not a negative
    t2 = torch.tensor([[0.7, 0.3, 0.0, 0.0]])
    assert float(hinge_rows(sim, t2, 0.2, "hardest")) == pytest.approx(0.1)


def test_prob_triplet_similarities_and_bounds():
    x = batch(4, 3)
    lv_img = x[1].detach().clone()
    lv_img[0, 0] = 5.0  # variance e^5 > 10: clamped to 10
    crit = ProbTripletLoss("kl", var_bounds=(0.1, 10.0))
    sim = crit.sim(x[0], lv_img, x[2], x[3])
    v1 = lv_img.clamp(math.log(0.1), math.log(10.0)).exp()[:, None]
    v2 = x[3].clamp(math.log(0.1), math.log(10.0)).exp()[None]
    kl = 0.5 * (torch.log(v2 / v1) + v1 / v2 + (x[0][:, None] - x[2][None]) ** 2 / v2 - 1).sum(-1)
    torch.testing.assert_close(sim, -kl)
    w2 = ProbTripletLoss("w2", var_bounds=None).sim(*x)
    sd1, sd2 = (0.5 * x[1]).exp()[:, None], (0.5 * x[3]).exp()[None]
    torch.testing.assert_close(w2, -(((x[0][:, None] - x[2][None]) ** 2 + (sd1 - sd2) ** 2).sum(-1) + 1e-12).sqrt())
    loss, _ = ProbTripletLoss("minkl")(*x)
    loss.backward()
    assert torch.isfinite(x[0].grad).all()


# ----------------------------------------------------------------------------- factory

def test_create_loss_and_needs_sigma():
    assert isinstance(create_loss("pcmepp"), PCMEPPLoss)
    assert create_loss("PCME++", distance="wd").distance == "wd"
    assert isinstance(create_loss("pcme", n_samples=3), PCMELoss)
    assert isinstance(create_loss("infonce"), InfoNCELoss)
    assert isinstance(create_loss("triplet", hardest=False), TripletLoss)
    assert isinstance(create_loss("prob_triplet", similarity="w2"), ProbTripletLoss)
    assert isinstance(create_loss("mu-only"), MuOnlyLoss)
    assert [needs_sigma(m) for m in ("pcmepp", "pcme", "prob-triplet", "infonce", "triplet", "mu-only")] == \
        [True, True, True, False, False, False]
    with pytest.raises(UserError, match="unknown loss"):
        create_loss("arcface")
    with pytest.raises(UserError, match="bad options"):
        create_loss("pcmepp", temperature=3)


# ----------------------------------------------------------------------------- jWAE

def test_jwae_terms():
    g = torch.Generator().manual_seed(0)
    x, xr = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    assert float(jwae.reconstruction_loss(x, xr, "l1")) == pytest.approx(float((x - xr).abs().sum(1).mean()), rel=1e-6)
    assert float(jwae.reconstruction_loss(x, xr, "l2")) == pytest.approx(float((x - xr).norm(dim=1).mean()), rel=1e-5)
    assert float(jwae.reconstruction_loss(x, xr, "mse")) == pytest.approx(float(F.mse_loss(x, xr)), rel=1e-6)
    zi, zt = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    assert float(jwae.mse_alignment(zi, zt)) == pytest.approx(float(((zi - zt) ** 2).sum(1).mean()), rel=1e-6)
    mh = jwae.max_margin_alignment(zi, zt, margin=0.2, negatives="all")
    assert float(mh) == pytest.approx(float(TripletLoss(hardest=False)(zi, None, zt, None)[0]), rel=1e-6)
    assert jwae.JWAE_PRESETS["jwae-mse"]["lambda3"] == 0.2 and jwae.JWAE_PRESETS["jwae-mh"]["lambda2"] == 0.005


def test_jwae_adversarial_prior_learns_to_separate_and_pushes_codes():
    torch.manual_seed(0)
    obj = jwae.JWAEObjective(latent_dim=2, preset="jwae-mse")
    g = torch.Generator().manual_seed(1)
    codes = torch.randn(64, 2, generator=g) * 0.3 + 3.0  # far from N(0, I)
    params = list(obj.discriminator.parameters())
    for _ in range(40):  # plain gradient descent (torch.optim's first step is slow to import)
        d_loss, _ = obj.discriminator_terms(codes, codes, generator=g)
        grads = torch.autograd.grad(d_loss, params)
        with torch.no_grad():
            for p, gr in zip(params, grads):
                p -= 0.2 * gr
    with torch.no_grad():
        acc = (obj.discriminator(codes).argmax(1) == 0).float().mean()
    assert acc > 0.9 and d_loss.item() < 0.3
    z = codes.clone().requires_grad_(True)
    gen = jwae.generator_loss(obj.discriminator, z)
    gen.backward()
    # moving codes against the generator gradient brings them towards the prior (the origin)
    assert float((z.grad * z.detach()).sum()) > 0
    loss, stats = obj.generator_terms((torch.randn(64, 6), torch.randn(64, 6), z.detach()),
                                      (torch.randn(64, 4), torch.randn(64, 4), z.detach()))
    assert {"rec_img", "rec_txt", "adv_img", "adv_txt", "align", "gen_loss"} <= set(stats)
    with pytest.raises(UserError):
        jwae.JWAEObjective(2, preset="jwae-x")
