"""PCME's official form (naver-ai/pcme ``MCSoftContrastiveLoss``) against a float64 reference
written from the official code's formulas, the model's log-sigma parametrisation, and the
spherical covariance shapes (Pishdad et al.)."""
from __future__ import annotations

import math

import pytest
import torch

from zsprob import UserError
from zsprob.prob import PCMELoss, create_loss


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def _batch(n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu_i = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    mu_t = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    lv_i = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.3 - 3
    lv_t = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.3 - 3
    return [t.requires_grad_(True) for t in (mu_i, lv_i, mu_t, lv_t)]


def official_reference(mu_i, lv_i, mu_t, lv_t, eps_i, eps_t, a, b, vib_beta):
    """The official code's steps, one pair at a time: log sigma = logvar / 2, samples
    mu + exp(log sigma) eps, distances sqrt(sum d^2 + 1e-6), p = e^l / (e^l + e^-l) per sample
    pair, NLL = -log mean p (matched) or -log mean (1 - p), summed over all pairs and both
    directions; KL -0.5 sum(1 + log sigma - mean_j(z)^2 - exp(log sigma)) per modality."""
    ls_i, ls_t = 0.5 * lv_i, 0.5 * lv_t
    zi = mu_i[:, None] + ls_i.exp()[:, None] * eps_i
    zt = mu_t[:, None] + ls_t.exp()[:, None] * eps_t
    n = zi.shape[0]
    total = zi.new_zeros(())
    for anchors, cands in ((zi, zt), (zt, zi)):
        for i in range(n):
            for j in range(n):
                d = ((anchors[i][None, :, :] - cands[j][:, None, :]) ** 2).sum(-1).add(1e-6).sqrt().reshape(-1)
                logit = -a * d + b
                p = logit.exp() / (logit.exp() + (-logit).exp())
                total = total - (p.mean() if i == j else (1 - p).mean()).log()
    kl = sum(-0.5 * (1 + ls - z.mean(dim=1) ** 2 - ls.exp()).sum() for z, ls in ((zi, ls_i), (zt, ls_t)))
    return total + vib_beta * kl


def test_official_form_equals_reference_value_and_gradients():
    n, d, J = 4, 3, 5
    x = _batch(n, d)
    crit = PCMELoss(n_samples=J, init_scale=4.0, init_shift=2.0, vib_beta=1e-2).double()
    loss, stats = crit(*x, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    eps_i = torch.randn(n, J, d, generator=g, dtype=torch.float64)
    eps_t = torch.randn(n, J, d, generator=g, dtype=torch.float64)
    ref = official_reference(*x, eps_i, eps_t, crit.scale, crit.shift, 1e-2)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    ga = torch.autograd.grad(loss, x + [crit.scale, crit.shift])
    gb = torch.autograd.grad(ref, x + [crit.scale, crit.shift])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-8, atol=1e-10)
    assert stats["match_i2t"] > 0 and torch.isclose(stats["match_i2t"], stats["match_t2i"])


def test_official_defaults_and_zsprob_form_differ_as_documented():
    off, zs = PCMELoss(), PCMELoss(form="zsprob")
    assert (off.scale.item(), off.shift.item(), off.n_samples) == (15.0, 15.0, 7)
    assert (zs.scale.item(), zs.shift.item()) == (5.0, 5.0)
    x = _batch(3, 4, seed=1)
    mc = dict(n_samples=2, init_scale=3.0, init_shift=1.0, vib_beta=0.0)
    lo, so = PCMELoss(**mc).double()(*x, generator=torch.Generator().manual_seed(0))
    lz, sz = PCMELoss(form="zsprob", **mc).double()(*x, generator=torch.Generator().manual_seed(0))
    assert not torch.isclose(lo / 9, lz / 2)  # sigmoid(2 l) vs sigmoid(l): not just the sum vs the mean
    with pytest.raises(UserError):
        create_loss("pcme", form="paper")


def test_official_uniformity_draws_with_replacement():
    n, d, J = 3, 2, 2
    x = _batch(n, d, seed=2)
    crit = PCMELoss(n_samples=J, vib_beta=0.0, uniform_weight=1.0, uniform_max_samples=5).double()
    gen = torch.Generator().manual_seed(3)
    _, stats = crit(*x, generator=gen)
    g = torch.Generator().manual_seed(3)
    eps_i = torch.randn(n, J, d, generator=g, dtype=torch.float64)
    eps_t = torch.randn(n, J, d, generator=g, dtype=torch.float64)
    z = torch.cat([(x[0][:, None] + (0.5 * x[1]).exp()[:, None] * eps_i).reshape(-1, d),
                   (x[2][:, None] + (0.5 * x[3]).exp()[:, None] * eps_t).reshape(-1, d)])
    z = z[torch.randint(z.shape[0], (5,), generator=g)]
    ref = torch.pdist(z, p=2).pow(2).mul(-2).exp().mean().log()  # the official uniform_loss
    torch.testing.assert_close(stats["uniformity"], ref)


def test_pcme_method_builds_a_log_sigma_model_and_trains():
    """--method pcme: the head predicts log sigma (logvar = 2 x head output); a few steps lower the loss."""
    from zsprob.train.build import build_loss, build_model
    from zsprob.train.defaults import resolve_config
    cfg = resolve_config({"method": "pcme", "model": {"name": "zsprob-tiny", "embed_dim": 16}})
    model = build_model(cfg)
    assert model.sigma_param == "logsigma" and model.config["sigma_param"] == "logsigma"
    raw = torch.randn(2, 16)
    torch.testing.assert_close(model._shape_sigma(raw, "image"), 2 * raw)
    cfg_z = resolve_config({"method": "pcme", "loss": {"pcme": {"form": "zsprob"}}, "model": {"name": "zsprob-tiny"}})
    assert build_model(cfg_z).sigma_param == "logvar"
    assert isinstance(build_loss(cfg), PCMELoss) and build_loss(cfg).form == "official"


@pytest.mark.parametrize("shape", ["spherical_mean", "spherical_one"])
def test_spherical_shapes_give_one_sigma_per_embedding(shape):
    from zsprob.models import create_model
    model = create_model("zsprob-tiny", embed_dim=16, sigma_shape=shape, seed=0).eval()
    raw = torch.randn(3, 16, dtype=torch.float32)
    out = model._shape_sigma(raw, "text")
    assert torch.allclose(out, out[:, :1].expand_as(out))
    if shape == "spherical_mean":  # the paper's spherical-avgpool: the average of the D variances
        torch.testing.assert_close(out[:, 0].double().exp(), raw.double().exp().mean(dim=-1), rtol=1e-6, atol=1e-7)
    else:  # the one-value readout starts as the mean of the D log-variances
        torch.testing.assert_close(out[:, 0], raw.mean(dim=-1), rtol=1e-6, atol=1e-6)
    tokens = model.tokenizer(["a red star", "two blue circles"])
    mu, lv = model.encode_text(tokens)
    assert lv.shape == mu.shape and torch.allclose(lv, lv[:, :1].expand_as(lv))
    if shape == "spherical_one":  # the readout is trained: gradients reach it, it is not a backbone param
        lv.sum().backward()
        assert model.sigma_readout["text"].weight.grad is not None
        info = model.param_info()
        assert info["sigma_readout.text.weight"]["tower"] == "text" and not info["sigma_readout.text.weight"]["backbone"]
    with pytest.raises(UserError):
        create_model("zsprob-tiny", sigma_shape="ball")


def test_sigma_shape_round_trips_through_a_checkpoint(tmp_path):
    from zsprob.models import create_model, load, save
    model = create_model("zsprob-tiny", embed_dim=16, sigma_shape="spherical_one", sigma_param="logsigma", seed=0)
    with torch.no_grad():
        model.sigma_readout["image"].bias.fill_(0.25)
    save(model, tmp_path / "m")
    back = load(tmp_path / "m")
    assert (back.sigma_shape, back.sigma_param) == ("spherical_one", "logsigma")
    torch.testing.assert_close(back.sigma_readout["image"].bias, torch.tensor([0.25]))
    assert math.isfinite(float(back.sigma_readout["image"].weight.detach().sum()))


def test_mc_evaluation_uses_the_learned_a_b_j_and_form(tmp_path):
    """A --method pcme checkpoint carries a, b, J and the loss form to the "mc" score."""
    from zsprob.models import load
    from zsprob.prob.distances import mc_match_prob
    from zsprob.retrieval.scoring import mc_score_options
    from zsprob.train.build import build_loss, build_model
    from zsprob.train.defaults import resolve_config
    from zsprob.train.checkpoints import save_model
    from zsprob.train.step import ContrastiveStep
    cfg = resolve_config({"method": "pcme", "model": {"name": "zsprob-tiny", "embed_dim": 16},
                          "loss": {"pcme": {"n_samples": 4}}})
    step = ContrastiveStep(build_model(cfg), build_loss(cfg))
    with torch.no_grad():
        step.loss.scale.fill_(12.5)
        step.loss.shift.fill_(3.0)
    save_model(step, tmp_path / "m", cfg, 1)
    opts = mc_score_options(load(tmp_path / "m"))
    assert opts == {"a": 12.5, "b": 3.0, "n_samples": 4, "slope": 2.0}
    assert mc_score_options(step.model) == {}  # not a checkpoint: the fixed defaults
    x = _batch(3, 4, seed=5)
    got = mc_match_prob(*[t.detach() for t in x], generator=torch.Generator().manual_seed(1), **opts)
    g = torch.Generator().manual_seed(1)
    za = x[0].detach()[:, None] + (0.5 * x[1].detach()).exp()[:, None] * torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    zb = x[2].detach()[:, None] + (0.5 * x[3].detach()).exp()[:, None] * torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    d = ((za[:, :, None, None] - zb[None, None]) ** 2).sum(-1).add(1e-12).sqrt()
    logit = -12.5 * d + 3.0
    ref = (logit.exp() / (logit.exp() + (-logit).exp())).mean(dim=(1, 3))
    torch.testing.assert_close(got, ref)
