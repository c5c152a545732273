"""ProLIP's objective (zsprob.prob.prolip) against float64 references written from the paper's
equations, gradcheck, the simulated 2-process split, soft targets; the masking functions
(zsprob.data.masking) on counts and determinism; the training wiring and the CLI errors."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_TOWERS, run_cli
from zsprob import UserError
from zsprob.data.masking import (cells_to_mask, delete_tokens, mask_image_cells, mask_tokens,
                                 text_mask_spec)
from prob_reference import inclusion_logit_per_dim
from zsprob.prob import ProLIPLoss, create_loss, needs_sigma
from zsprob.prob.distances import inclusion_logit
from zsprob.prob.prolip import cover_loss, prolip_vib


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def gaussians(n, d=4, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = [F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1),
         torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5 - 2.0,
         F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1),
         torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5 - 2.0]
    return [x.requires_grad_(grad) for x in t]


def soft_targets(n):
    m = torch.eye(n, dtype=torch.float64)
    m[1, 1], m[1, n - 1] = 0.7, 0.3          # a mixed image (MSDA)
    m[n - 1, n - 1], m[n - 1, 0] = 0.45, 0.55
    return m


# ----------------------------------------------------------------------------- float64 references (paper's equations, scalar loops)

def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_ppcl(img_mu, img_lv, txt_mu, txt_lv, scale, bias, targets=None):
    """ProLIP Eq. (PPCL): sum over all pairs of the pairwise BCE, divided by the number of images."""
    n_img, n_txt, dim = img_mu.shape[0], txt_mu.shape[0], img_mu.shape[1]
    total = 0.0
    for i in range(n_img):
        for t in range(n_txt):
            dot = sum(float(img_mu[i, k]) * float(txt_mu[t, k]) for k in range(dim))
            var = sum(math.exp(float(img_lv[i, k])) + math.exp(float(txt_lv[t, k])) for k in range(dim))
            logit = scale * (dot - var / 2) + bias
            m = (1.0 if i == t else 0.0) if targets is None else float(targets[i, t])
            total -= m * log_sigmoid(logit) + (1 - m) * log_sigmoid(-logit)
    return total / n_img


def ref_inclusion_value(m1, v1, m2, v2, eps):
    """Per-dimension ProLIP inclusion test of N(m1, v1) in N(m2, v2) (v = log sigma^2)."""
    w1, w2 = math.exp(eps - v1), math.exp(eps - v2)
    a = w1 + w2 / 2
    b = 2 * m1 * w1 + m2 * w2
    c = m1 * m1 * w1 + m2 * m2 * w2 / 2
    return -2 * v1 - v2 - 0.5 * math.log(a) + b * b / (4 * a) - c


def ref_inclusion(mu_in, lv_in, mu_out, lv_out, scale, eps):
    n, dim = mu_in.shape
    total = 0.0
    for i in range(n):
        for k in range(dim):
            args_in = (float(mu_in[i, k]), float(lv_in[i, k]))
            args_out = (float(mu_out[i, k]), float(lv_out[i, k]))
            logit = ref_inclusion_value(*args_in, *args_out, eps) - ref_inclusion_value(*args_out, *args_in, eps)
            total -= log_sigmoid(scale * logit)
    return total / (n * dim)


def ref_vib(mu, lv):
    """ProLIP's kl_divergence: log sigma = logvar / 2, -0.5 mean(1 + log sigma - mu^2 - sigma)."""
    n, dim = mu.shape
    total = 0.0
    for i in range(n):
        for k in range(dim):
            h = float(lv[i, k]) / 2
            total += 1 + h - float(mu[i, k]) ** 2 - math.exp(h)
    return -0.5 * total / (n * dim)


# ----------------------------------------------------------------------------- each term

@pytest.mark.parametrize("soft", [False, True])
def test_ppcl_matches_reference(soft):
    x = gaussians(5)
    crit = ProLIPLoss(inclusion_alpha=0, inclusion_alpha_occ=0, vib_beta=0, init_logit_scale=math.log(3.0),
                      init_logit_bias=-1.5).double()
    targets = soft_targets(5) if soft else None
    loss, stats = crit(*x, targets)
    scale = math.exp(crit.logit_scale.item())  # log 3 as stored (a float32 parameter cast to float64)
    expected = ref_ppcl(*[t.detach() for t in x], scale, -1.5, targets)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["ppcl"].item() == pytest.approx(expected, rel=1e-12)
    assert stats["scale"].item() == pytest.approx(3.0) and stats["bias"].item() == -1.5


def test_hard_targets_equal_the_official_signed_form():
    """-log sigmoid(y * logits) summed / rows, y = +1 on the diagonal and -1 elsewhere (ProLIP's code)."""
    x = gaussians(6, seed=2)
    crit = ProLIPLoss(inclusion_alpha=0, inclusion_alpha_occ=0, vib_beta=0).double()
    loss, _ = crit(*x)
    logits = crit.logits(*x)
    signs = 2 * torch.eye(6, dtype=torch.float64) - 1
    official = -F.logsigmoid(signs * logits).sum() / 6
    torch.testing.assert_close(loss, official, rtol=1e-13, atol=0)


def test_inclusion_and_vib_match_reference():
    x = gaussians(4, d=3, seed=5)
    mimg = [x[0][:2] + 0.1, x[1][:2] + 0.7]
    mtxt = [x[2][:2] - 0.2, x[3][:2] + 0.4]
    for scale, eps in ((1000.0, -20.0), (2.0, 0.0), (10.0, -100.0)):
        crit = ProLIPLoss(ppcl_weight=0, inclusion_alpha=0.3, inclusion_alpha_occ=0.7, vib_beta=0.11,
                          inclusion_scale=scale, inclusion_eps=eps).double()
        loss, stats = crit(*x, masked_img=mimg, masked_txt=mtxt)
        d = [t.detach() for t in x]
        incl = ref_inclusion(d[0], d[1], d[2], d[3], scale, eps)
        occ_img = ref_inclusion(d[0][:2], d[1][:2], mimg[0].detach(), mimg[1].detach(), scale, eps)
        occ_txt = ref_inclusion(d[2][:2], d[3][:2], mtxt[0].detach(), mtxt[1].detach(), scale, eps)
        vib_img, vib_txt = ref_vib(d[0], d[1]), ref_vib(d[2], d[3])
        assert stats["inclusion"].item() == pytest.approx(incl, rel=1e-10)
        assert stats["img_inclusion"].item() == pytest.approx(occ_img, rel=1e-10)
        assert stats["txt_inclusion"].item() == pytest.approx(occ_txt, rel=1e-10)
        assert stats["vib_img"].item() == pytest.approx(vib_img, rel=1e-12)
        assert stats["vib_txt"].item() == pytest.approx(vib_txt, rel=1e-12)
        total = 0.3 * incl + 0.7 * (occ_img + occ_txt) + 0.11 * (vib_img + vib_txt)
        assert loss.item() == pytest.approx(total, rel=1e-10)
        assert int(stats["n_masked"]) == 2


@pytest.mark.parametrize("eps", [0.0, -20.0, -100.0, 3.0])
def test_closed_form_logit_equals_the_package_inclusion_test(eps):
    """The loss's closed form == zsprob.prob.distances.inclusion_logit on [N, D, 1] views (per dimension)."""
    g = torch.Generator().manual_seed(9)
    mu_1, mu_2 = torch.randn(2, 6, 5, generator=g, dtype=torch.float64) * 2
    lv_1, lv_2 = torch.randn(2, 6, 5, generator=g, dtype=torch.float64) * 2 - 1
    direct = inclusion_logit(mu_1.unsqueeze(-1), lv_1.unsqueeze(-1), mu_2.unsqueeze(-1), lv_2.unsqueeze(-1), eps=eps)
    torch.testing.assert_close(inclusion_logit_per_dim(mu_1, lv_1, mu_2, lv_2, eps), direct, rtol=1e-9, atol=1e-9)
    # and ProLIP's -log sigmoid form built on it, float32 at the recipe's eps, against float64
    loss32 = ProLIPLoss(ppcl_weight=0, inclusion_alpha=1.0, inclusion_alpha_occ=0, vib_beta=0, inclusion_eps=-20.0)
    value = loss32(*(t.float() for t in (mu_1, lv_1, mu_2, lv_2)))[0]
    reference = -F.logsigmoid(1000.0 * inclusion_logit_per_dim(mu_1, lv_1, mu_2, lv_2, -20.0)).mean()
    assert value.item() == pytest.approx(reference.item(), rel=1e-5)


def test_inclusion_loss_prefers_the_narrow_gaussian_inside_the_wide_one():
    mu = torch.zeros(1, 3, dtype=torch.float64)
    narrow, wide = torch.full((1, 3), -3.0, dtype=torch.float64), torch.full((1, 3), 1.0, dtype=torch.float64)
    crit = ProLIPLoss(ppcl_weight=0, inclusion_alpha=1.0, inclusion_alpha_occ=0, vib_beta=0,
                      inclusion_scale=1.0, inclusion_eps=0.0).double()
    right, _ = crit(mu, narrow, mu, wide)   # image narrow, caption wide: the image is included
    wrong, _ = crit(mu, wide, mu, narrow)
    assert right.item() < math.log(2) < wrong.item()


def test_prolip_vib_is_the_official_expression_not_the_textbook_kl():
    mu, lv = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[math.log(4.0)]], dtype=torch.float64)
    # h = log 2: -0.5 (1 + log 2 - 2)
    assert prolip_vib(mu, lv).item() == pytest.approx(-0.5 * (1 + math.log(2) - 2))
    assert prolip_vib(torch.zeros(2, 3), torch.zeros(2, 3)).item() == 0.0  # minimum at N(0, I)


def test_guards_skip_exploding_terms():
    x = gaussians(3)
    big = [x[0] * 1e3, x[1], x[2], x[3]]
    crit = ProLIPLoss(ppcl_weight=0, inclusion_alpha=0, inclusion_alpha_occ=0, vib_beta=1.0).double()
    loss, stats = crit(*big)
    assert stats["vib_img"].item() == 0.0 and stats["vib_txt"].item() > 0
    assert stats["vib_guard_trips"].item() == 1.0
    assert loss.item() == pytest.approx(stats["vib_txt"].item())


def test_defaults_are_the_recipe_and_scale_is_clamped():
    crit = create_loss("prolip")
    assert isinstance(crit, ProLIPLoss) and needs_sigma("prolip")
    assert (crit.ppcl_weight, crit.inclusion_alpha, crit.inclusion_alpha_occ, crit.vib_beta) == (1.0, 1e-7, 1e-3, 1e-4)
    assert (crit.inclusion_scale, crit.inclusion_eps, crit.drop_ratio, crit.drop_prob) == (1000.0, -20.0, 0.125, 0.75)
    assert crit.logit_scale.item() == pytest.approx(math.log(1 / 0.07)) and crit.logit_bias.item() == -10.0
    with torch.no_grad():
        crit.logit_scale.fill_(9.0)
    assert crit.scale().item() == pytest.approx(100.0)
    assert crit.n_masked(64) == 8 and ProLIPLoss(inclusion_alpha_occ=0).n_masked(64) == 0


@pytest.mark.parametrize("kw,match", [
    ({"vib_beta": -1e-4}, "vib_beta must be a number >= 0"),
    ({"inclusion_alpha": -1}, "inclusion_alpha must be"),
    ({"inclusion_alpha_occ": float("nan")}, "inclusion_alpha_occ must be"),
    ({"ppcl_weight": -0.5}, "ppcl_weight"),
    ({"inclusion_scale": 0}, "inclusion_scale must be a number > 0"),
    ({"drop_ratio": 1.5}, "drop_ratio must be a number >= 0 and <= 1"),
    ({"drop_prob": -0.1}, "drop_prob"),
    ({"init_logit_scale": 10.0}, "init_logit_scale"),
    ({"mask_patch_size": 0}, "mask_patch_size"),
    ({"inclusion_eps": "x"}, "inclusion_eps must be a finite number"),
    ({"inclusion_form": "kl"}, "inclusion_form must be one of prolip, cover"),
    ({"text_mask_mode": "drop"}, "text_mask_mode must be one of replace, delete"),
    ({"cover_scale": 0}, "cover_scale must be a number > 0"),
    ({"cover_lambda": -1}, "cover_lambda must be a number >= 0"),
])
def test_out_of_range_hyper_parameters(kw, match):
    with pytest.raises(UserError, match=match):
        create_loss("prolip", **kw)


def test_deterministic_inputs_are_a_user_error():
    x = gaussians(3)
    with pytest.raises(UserError, match="deterministic"):
        ProLIPLoss()(x[0], None, x[2], None)


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("scale,eps", [(2.0, 0.0), (1000.0, -20.0)])
def test_gradcheck_every_term(scale, eps):
    x = gaussians(3, d=2, seed=7)
    g = torch.Generator().manual_seed(8)
    masked = [torch.randn(2, 2, generator=g, dtype=torch.float64).requires_grad_() for _ in range(4)]
    crit = ProLIPLoss(inclusion_alpha=0.5, inclusion_alpha_occ=0.3, vib_beta=0.2, inclusion_scale=scale,
                      inclusion_eps=eps, init_logit_scale=math.log(2.0), init_logit_bias=-0.5).double()
    targets = soft_targets(3)

    def fn(img_mu, img_lv, txt_mu, txt_lv, m_img_mu, m_img_lv, m_txt_mu, m_txt_lv):
        loss, _ = crit(img_mu, img_lv, txt_mu, txt_lv, targets, masked_img=(m_img_mu, m_img_lv),
                       masked_txt=(m_txt_mu, m_txt_lv))
        return loss

    assert torch.autograd.gradcheck(fn, (*x, *masked))
    # the learnable scale and bias: autograd against central differences of the loss
    loss, _ = crit(*x, targets, masked_img=masked[:2], masked_txt=masked[2:])
    grads = torch.autograd.grad(loss, [crit.logit_scale, crit.logit_bias])
    for param, grad in zip((crit.logit_scale, crit.logit_bias), grads):
        step = 1e-6
        with torch.no_grad():
            param += step
            up = crit(*x, targets, masked_img=masked[:2], masked_txt=masked[2:])[0].item()
            param -= 2 * step
            down = crit(*x, targets, masked_img=masked[:2], masked_txt=masked[2:])[0].item()
            param += step
        assert grad.item() == pytest.approx((up - down) / (2 * step), rel=1e-6, abs=1e-9)


# ----------------------------------------------------------------------------- distributed form

@pytest.mark.parametrize("soft", [False, True])
def test_two_process_split_equals_single_batch(soft):
    """Each simulated process: local rows, gathered columns (with gradients), its own first 2 rows
    masked. The single process sees the batch permuted so that the same rows are the masked ones."""
    n_proc, n, n_masked, d = 2, 4, 2, 3
    N = n * n_proc
    x = gaussians(N, d, seed=3)
    g = torch.Generator().manual_seed(4)
    masked_all = [torch.randn(N, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(4)]
    matched = soft_targets(N) if soft else None
    if soft:
        matched[5, 5], matched[5, 6] = 0.2, 0.8  # a pair across the two processes' blocks
    crit = ProLIPLoss(inclusion_alpha=0.5, inclusion_alpha_occ=0.4, vib_beta=0.3, inclusion_scale=3.0,
                      inclusion_eps=-1.0, init_logit_bias=-2.0).double()
    params = list(crit.parameters())
    leaves = x + masked_all + params

    losses = []
    for p in range(n_proc):
        rows = slice(p * n, (p + 1) * n)
        first = slice(p * n, p * n + n_masked)
        loc = [t[rows] for t in x]
        lp, _ = crit(*loc, matched, all_img=(x[0], x[1]), all_txt=(x[2], x[3]), offset=p * n,
                     masked_img=(masked_all[0][first], masked_all[1][first]),
                     masked_txt=(masked_all[2][first], masked_all[3][first]))
        losses.append(lp)
    split = torch.stack(losses).mean()

    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])     # masked rows of both processes first
    picked = torch.tensor([0, 1, 4, 5])
    perm = [t[order] for t in x]
    perm_matched = None if matched is None else matched[order][:, order]
    single, _ = crit(*perm, perm_matched, masked_img=(masked_all[0][picked], masked_all[1][picked]),
                     masked_txt=(masked_all[2][picked], masked_all[3][picked]))
    torch.testing.assert_close(split, single, rtol=1e-12, atol=1e-13)
    g_split = torch.autograd.grad(split, leaves, allow_unused=True)
    g_single = torch.autograd.grad(single, leaves, allow_unused=True)
    for a, b in zip(g_split, g_single):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------- masking

def clip_tokens():
    import open_clip
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=16)
    return tokenizer, tokenizer(["a red star and a large blue striped circle", "a shape", "two small green squares"])


def test_clip_mask_spec():
    tokenizer, _ = clip_tokens()
    spec = text_mask_spec(tokenizer)
    assert spec.mask_id == 286 and tokenizer.decoder[spec.mask_id] == "?</w>"
    assert spec.protected_ids == (0, tokenizer.sot_token_id, tokenizer.eot_token_id)
    assert spec.mask_id < tokenizer.eot_token_id  # argmax pooling still finds end-of-text


def test_hf_mask_spec_uses_mask_then_extra_id():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    class Wrapped:  # open_clip's HFTokenizer keeps the Hugging Face tokenizer as .tokenizer
        def __init__(self, hf):
            self.tokenizer = hf

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "star": 4, "<extra_id_99>": 5, "[MASK]": 6}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    with_mask = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", mask_token="[MASK]")
    spec = text_mask_spec(Wrapped(with_mask))
    assert spec.mask_id == 6 and {0, 1, 2} <= set(spec.protected_ids) and 6 not in spec.protected_ids
    no_mask = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    assert text_mask_spec(Wrapped(no_mask)).mask_id == 5
    with pytest.raises(UserError, match="mask token"):
        text_mask_spec(object())


def test_mask_tokens_counts_and_determinism():
    tokenizer, tokens = clip_tokens()
    spec = text_mask_spec(tokenizer)
    protected = torch.isin(tokens, torch.tensor(spec.protected_ids))
    assert torch.equal(mask_tokens(tokens, 0.0, spec, torch.Generator().manual_seed(0)), tokens)
    full = mask_tokens(tokens, 1.0, spec, torch.Generator().manual_seed(0))
    assert torch.equal(full[protected], tokens[protected]) and (full[~protected] == spec.mask_id).all()
    # many draws: the replaced share of ordinary tokens is drop_prob within 5 standard errors
    many = tokens.repeat(400, 1)
    out = mask_tokens(many, 0.75, spec, torch.Generator().manual_seed(1))
    ordinary = ~torch.isin(many, torch.tensor(spec.protected_ids))
    assert torch.equal(out[~ordinary], many[~ordinary])
    share = (out[ordinary] == spec.mask_id).double().mean().item()
    n = int(ordinary.sum())
    assert abs(share - 0.75) < 5 * math.sqrt(0.75 * 0.25 / n)
    again = mask_tokens(many, 0.75, spec, torch.Generator().manual_seed(1))
    other = mask_tokens(many, 0.75, spec, torch.Generator().manual_seed(2))
    assert torch.equal(out, again) and not torch.equal(out, other)
    # lengths (non-padding counts) and the end-of-text position are unchanged
    assert torch.equal((out != 0).sum(1), (many != 0).sum(1)) and torch.equal(out.argmax(1), many.argmax(1))


@pytest.mark.parametrize("size,cell,drop", [(32, 8, 0.25), (30, 8, 0.75), (64, 16, 0.5), (16, 16, 0.9)])
def test_mask_image_cells_counts(size, cell, drop):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(5, 3, size, size, generator=g) + 1.0   # never equal to the fill value 0
    out = mask_image_cells(images, drop, cell, torch.Generator().manual_seed(3))
    rows = -(-size // cell)
    expected = cells_to_mask(rows * rows, drop)
    for b in range(5):
        blank = (out[b] == 0).all(0)                           # pixel blanked in every channel
        cells = {(r // cell, c // cell) for r, c in blank.nonzero().tolist()}
        assert len(cells) == expected
        for (r, c) in cells:                                    # whole cells, nothing else touched
            assert blank[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell].all()
        assert torch.equal(out[b][:, ~blank], images[b][:, ~blank])
    assert torch.equal(out, mask_image_cells(images, drop, cell, torch.Generator().manual_seed(3)))
    assert cells_to_mask(196, 0.25) == 196 - int(196 * 0.75)   # ProLIP's ViT keeps int(n * 0.75) patches
    assert cells_to_mask(4, 1.0) == 3                           # at least one cell stays


def test_masking_bad_arguments():
    """The masks' share and cell size are checked where they enter, with the loss's options (the masking
    functions trust them)."""
    with pytest.raises(UserError):
        create_loss("prolip", drop_prob=1.5)
    with pytest.raises(UserError):
        create_loss("prolip", mask_patch_size=0)


# ----------------------------------------------------------------------------- training wiring

TINY = TINY_TOWERS


def test_step_module_masks_the_first_rows_reproducibly():
    from zsprob.models import create_model
    from zsprob.train.step import ContrastiveStep
    model = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY)
    crit = ProLIPLoss(drop_ratio=0.25, mask_patch_size=8)
    step = ContrastiveStep(model, crit, seed=5)
    images = torch.randn(8, 3, 32, 32)
    tokens = model.tokenizer(["a red star", "a blue circle", "a shape", "two squares"] * 2)
    first = step.masked_features(images, tokens, step=3)
    again = step.masked_features(images, tokens, step=3)
    later = step.masked_features(images, tokens, step=4)
    assert first["masked_img"][0].shape == (2, 16) and first["masked_txt"][1].shape == (2, 16)
    torch.testing.assert_close(first["masked_txt"][0], again["masked_txt"][0])
    assert not torch.allclose(first["masked_img"][0], later["masked_img"][0])
    assert ContrastiveStep(model, ProLIPLoss(inclusion_alpha_occ=0)).masked_features(images, tokens, 3) == {}
    loss, stats = step(images, tokens, step=3)
    assert torch.isfinite(loss) and "img_inclusion" in stats and "txt_inclusion" in stats


def test_prolip_trains_and_loss_decreases(tiny_world, tmp_path):
    from zsprob.config import deep_merge
    from zsprob.train import train
    cfg = {
        "seed": 0, "method": "prolip",
        "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": dict(TINY, sigma_bias_init=-6.0)},
        "loss": {"prolip": {"init_logit_bias": -2.0, "drop_ratio": 0.25, "mask_patch_size": 8}},
        "data": {"kind": "synthetic", "shards": str(tiny_world / "pretrain"), "batch_size": 16, "num_workers": 0,
                 "shuffle_buffer": 32, "pipeline": {"caption_key": "json:captions"}},
        "optim": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        "schedule": {"name": "constant", "steps": 12, "warmup_steps": 0},
        "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1},
    }
    summary = train(deep_merge({}, cfg), tmp_path / "run", progress=False)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r.get("loss") is not None]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    last = recs[-1]
    assert last["n_masked"] == 4 and math.isfinite(last["img_inclusion"]) and math.isfinite(last["txt_inclusion"])
    assert {"ppcl", "inclusion", "vib_img", "vib_txt", "scale", "bias"} <= set(last)
    assert summary["method"] == "prolip"


@pytest.mark.slow
def test_cli_bad_input_one_line(tiny_world, tmp_path):
    base = ["pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), "--out", str(tmp_path / "o"),
            "--steps", "1", "--batch-size", "8", "--no-progress", "--set", "train.tensorboard=false"]
    cases = [(["--method", "arcface"], "arcface"),
             (["--method", "prolip", "--set", "loss.prolip.inclusion_scale=0"], "inclusion_scale must be a number > 0"),
             (["--method", "prolip", "--set", "loss.prolip.inclusion_alpha_occ=-1"], "inclusion_alpha_occ"),
             (["--method", "prolip", "--set", "model.overrides.deterministic=true"], "deterministic")]
    for extra, text in cases:
        r = run_cli(*base, *extra)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.count("\n") == 1 and text in r.stderr and "Traceback" not in r.stderr


def test_delete_tokens_keeps_a_subset_in_order():
    tokenizer, tokens = clip_tokens()
    spec = text_mask_spec(tokenizer)
    many = tokens.repeat(200, 1)
    out = delete_tokens(many, 0.5, spec, torch.Generator().manual_seed(3))
    ordinary = ~torch.isin(many, torch.tensor(spec.protected_ids))
    for row_in, row_out, keep in zip(many, out, ordinary):
        kept = row_out[row_out != 0].tolist()
        # a subsequence of the input that still holds every protected (start / end) token, padding after it
        it = iter(row_in.tolist())
        assert all(tok in it for tok in kept)
        assert kept[0] == tokenizer.sot_token_id and kept[-1] == tokenizer.eot_token_id
        assert (row_out[len(kept):] == 0).all()
    deleted = int(ordinary.sum() - (~torch.isin(out, torch.tensor(spec.protected_ids))).sum())
    n = int(ordinary.sum())
    assert abs(deleted / n - 0.5) < 5 * math.sqrt(0.25 / n)
    # the same draws as mask_tokens: a token is deleted exactly where mask_tokens would replace it
    masked = mask_tokens(many, 0.5, spec, torch.Generator().manual_seed(3))
    assert torch.equal((masked == spec.mask_id).sum(1), (many != 0).sum(1) - (out != 0).sum(1))
    assert torch.equal(delete_tokens(many, 0.0, spec, torch.Generator().manual_seed(0)), many)


def test_cover_loss_matches_reference_and_asks_for_the_mean_shift():
    g = torch.Generator().manual_seed(5)
    mu_in, mu_out = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    lv_in, lv_out = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    expected = 0.0
    for i in range(6):
        s_in = sum(math.exp(v) for v in lv_in[i].tolist())
        s_out = sum(math.exp(v) for v in lv_out[i].tolist())
        gap = sum((a - b) ** 2 for a, b in zip(mu_in[i].tolist(), mu_out[i].tolist()))
        logit = 3.0 * (math.log(s_out) - math.log(s_in + 0.5 * gap))
        expected += math.log1p(math.exp(-logit)) / 6
    got = cover_loss(mu_in, lv_in, mu_out, lv_out, 3.0, 0.5)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, c, d: cover_loss(a, b, c, d, 3.0, 0.5),
                                    tuple(t.clone().requires_grad_() for t in (mu_in, lv_in, mu_out, lv_out)))
    # the same variances: a displaced outer Gaussian covers less than a concentric one
    lv = torch.full((1, 4), -2.0, dtype=torch.float64)
    centre, moved = torch.zeros(1, 4, dtype=torch.float64), torch.full((1, 4), 0.5, dtype=torch.float64)
    assert cover_loss(centre, lv, moved, lv + 1, 5.0, 1.0) > cover_loss(centre, lv, centre, lv + 1, 5.0, 1.0)
    # through the loss: inclusion_form="cover" is what the occlusion term uses
    crit = ProLIPLoss(inclusion_form="cover", cover_scale=3.0, cover_lambda=0.5, inclusion_alpha=0.0, vib_beta=0.0)
    x = [t.float() for t in (mu_in, lv_in, mu_in, lv_in)]
    _, stats = crit(*x, masked_txt=(mu_out[:3].float(), lv_out[:3].float()))
    want = cover_loss(mu_in[:3], lv_in[:3], mu_out[:3], lv_out[:3], 3.0, 0.5).item()
    assert float(stats["txt_inclusion"]) == pytest.approx(want, rel=1e-5)


def test_pcmepp_occlusion_term_is_the_prolip_inclusion_loss():
    from zsprob.prob import PCMEPPLoss
    from zsprob.prob.prolip import inclusion_loss
    img_mu, img_lv, txt_mu, txt_lv = gaussians(6)
    masked_img = (img_mu[:3] + 0.1, img_lv[:3] + 0.5)
    masked_txt = (txt_mu[:3] - 0.1, txt_lv[:3] + 0.3)
    plain = PCMEPPLoss(pp_alpha=0.0)
    with_occ = PCMEPPLoss(pp_alpha=0.0, inclusion_alpha_occ=0.5)
    assert with_occ.wants_masked and with_occ.n_masked(8) == 4 and not plain.wants_masked
    base, _ = plain(img_mu, img_lv, txt_mu, txt_lv)
    total, stats = with_occ(img_mu, img_lv, txt_mu, txt_lv, masked_img=masked_img, masked_txt=masked_txt)
    want = 0.5 * (inclusion_loss(img_mu[:3], img_lv[:3], *masked_img, 1000.0, -20.0)
                  + inclusion_loss(txt_mu[:3], txt_lv[:3], *masked_txt, 1000.0, -20.0))
    assert (total - base).item() == pytest.approx(want.item(), rel=1e-6)
    assert "txt_inclusion" in stats and "img_inclusion" in stats
    # distance "mu": the match loss on the means only, sigma from the occlusion term and VIB
    mu_only, _ = PCMEPPLoss(pp_alpha=0.0, distance="mu", vib_beta=0.0)(img_mu, img_lv, txt_mu, txt_lv)
    mu_occ, mu_stats = PCMEPPLoss(pp_alpha=0.0, distance="mu", vib_beta=0.0, inclusion_alpha_occ=0.5)(
        img_mu, img_lv, txt_mu, txt_lv, masked_img=masked_img, masked_txt=masked_txt)
    assert (mu_occ - mu_only).item() == pytest.approx(want.item(), rel=1e-6) and "txt_inclusion" in mu_stats
    with pytest.raises(ValueError, match="needs sigma"):
        PCMEPPLoss(distance="mu", inclusion_alpha_occ=0.1)(img_mu, None, txt_mu, None, masked_txt=masked_txt)
    with pytest.raises(UserError, match="text_mask_mode"):
        PCMEPPLoss(text_mask_mode="swap")


def test_pcmepp_occlusion_term_can_use_the_cover_form():
    from zsprob.prob import PCMEPPLoss
    img_mu, img_lv, txt_mu, txt_lv = gaussians(6)
    masked_txt = (txt_mu[:3] - 0.1, txt_lv[:3] + 0.3)
    plain = PCMEPPLoss(pp_alpha=0.0)
    cover = PCMEPPLoss(pp_alpha=0.0, inclusion_alpha_occ=0.5, inclusion_form="cover", cover_scale=3.0, cover_lambda=4.0)
    base, _ = plain(img_mu, img_lv, txt_mu, txt_lv)
    total, _ = cover(img_mu, img_lv, txt_mu, txt_lv, masked_txt=masked_txt)
    want = 0.5 * cover_loss(txt_mu[:3], txt_lv[:3], *masked_txt, 3.0, 4.0)
    assert (total - base).item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(UserError, match="inclusion_form"):
        PCMEPPLoss(inclusion_form="kl")


@pytest.mark.parametrize("cls", ["pcmepp", "prolip"])
def test_occlusion_grad_sigma_leaves_the_means_to_the_other_terms(cls):
    """occlusion_grad="sigma": the same loss value, the same gradient on every mean as without the
    occlusion term, and the full gradient on the log-variances."""
    from zsprob.prob import PCMEPPLoss
    make = PCMEPPLoss if cls == "pcmepp" else ProLIPLoss
    kw = {"pp_alpha": 0.0} if cls == "pcmepp" else {}

    def grads(**opts):
        x = gaussians(6)
        c = [t.detach() for t in x]  # the masked copies as separate inputs (as the encoder's outputs are)
        masked = {"masked_img": (c[0][:3] + 0.1, c[1][:3] + 0.5), "masked_txt": (c[2][:3] - 0.1, c[3][:3] + 0.3)}
        loss, _ = make(inclusion_scale=2.0, inclusion_eps=0.0, **kw, **opts)(*x, **masked)  # a term far from 0
        return loss.item(), torch.autograd.grad(loss, x)

    off_val, off = grads(inclusion_alpha_occ=0.0)
    all_val, full = grads(inclusion_alpha_occ=0.5)
    sig_val, sig = grads(inclusion_alpha_occ=0.5, occlusion_grad="sigma")
    assert sig_val == pytest.approx(all_val, rel=1e-12) and sig_val != pytest.approx(off_val)
    for k in (0, 2):  # means: only the match / VIB terms reach them
        assert torch.allclose(sig[k], off[k], rtol=1e-10, atol=1e-12) and not torch.allclose(full[k], off[k])
    for k in (1, 3):  # log-variances: the occlusion term's gradient is kept whole
        assert torch.allclose(sig[k], full[k], rtol=1e-10, atol=1e-12) and not torch.allclose(sig[k], off[k])
    with pytest.raises(UserError, match="occlusion_grad must be one of all, sigma"):
        make(occlusion_grad="mu", **kw)


@pytest.mark.parametrize("cls", ["pcmepp", "prolip"])
def test_occlusion_weight_ramps_in_after_the_start_step(cls):
    from zsprob.models import create_model
    from zsprob.prob import PCMEPPLoss
    from zsprob.prob.prolip import occlusion_ramp
    from zsprob.train.step import ContrastiveStep
    assert [occlusion_ramp(s, 10, 4) for s in (0, 9, 10, 11, 13, 14, 500)] == [0, 0, 0.25, 0.5, 1, 1, 1]
    assert occlusion_ramp(None, 10, 4) == 1.0 and occlusion_ramp(3, 3, 0) == 1.0 and occlusion_ramp(2, 3, 0) == 0.0
    make = PCMEPPLoss if cls == "pcmepp" else ProLIPLoss
    kw = {"pp_alpha": 0.0} if cls == "pcmepp" else {}
    crit = make(inclusion_alpha_occ=0.5, inclusion_start_step=10, inclusion_warmup_steps=4, **kw)
    off = make(inclusion_alpha_occ=0.0, **kw)
    img_mu, img_lv, txt_mu, txt_lv = gaussians(6)
    masked = {"masked_img": (img_mu[:3] + 0.1, img_lv[:3] + 0.5), "masked_txt": (txt_mu[:3] - 0.1, txt_lv[:3] + 0.3)}
    base, _ = off(img_mu, img_lv, txt_mu, txt_lv)
    full, _ = crit(img_mu, img_lv, txt_mu, txt_lv, **masked)           # no step: the full weight
    early, stats = crit(img_mu, img_lv, txt_mu, txt_lv, step=9, **masked)
    mid, stats_mid = crit(img_mu, img_lv, txt_mu, txt_lv, step=11, **masked)
    assert early.item() == pytest.approx(base.item(), rel=1e-7) and "txt_inclusion" not in stats
    assert (mid - base).item() == pytest.approx(0.5 * (full - base).item(), rel=1e-6)
    assert float(stats_mid["occ_weight"]) == pytest.approx(0.25)
    assert crit.n_masked(8, step=9) == 0 and crit.n_masked(8, step=10) == crit.n_masked(8) > 0
    # the trainer encodes no masked copies before the start, and passes the step to the loss
    model = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY)
    module = ContrastiveStep(model, crit, seed=1)
    images = torch.randn(8, 3, 32, 32)
    tokens = model.tokenizer(["a red star", "a blue circle", "a shape", "two squares"] * 2)
    assert module.masked_features(images, tokens, step=9) == {}
    assert module.masked_features(images, tokens, step=12)["masked_txt"][0].shape[0] == crit.n_masked(8)
    _, late_stats = module(images, tokens, step=12)
    assert float(late_stats["occ_weight"]) == pytest.approx(0.5 * 0.75) and "txt_inclusion" in late_stats
    with pytest.raises(UserError, match="inclusion_warmup_steps"):
        make(inclusion_warmup_steps=-1, **kw)
    with pytest.raises(UserError, match="inclusion_start_step"):
        make(inclusion_start_step=2.5, **kw)


def test_masked_copies_do_not_move_batchnorm_statistics():
    """The occlusion term's masked images go through the CNN tower's BatchNorm layers without
    changing their running statistics: after a step they are those of the real batch alone."""
    from zsprob.models import create_model
    from zsprob.prob import PCMEPPLoss
    from zsprob.train.step import ContrastiveStep
    cnn = {"vision_cfg": {"image_size": 64}, "text_cfg": {"layers": 1, "width": 32, "heads": 2, "context_length": 16}}
    images = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    stats = []
    for occ in (0.0, 0.5):
        model = create_model("zsprob-tiny-cnn", embed_dim=16, seed=0, open_clip_cfg=cnn).train()
        tokens = model.tokenizer(["a red star", "a blue circle", "a shape", "two squares"] * 2)
        module = ContrastiveStep(model, PCMEPPLoss(pp_alpha=0.0, inclusion_alpha_occ=occ, image_drop_prob=0.5), seed=1)
        assert bool(module.masked_features(images, tokens, step=0)) == (occ > 0)
        model.train()
        loss, _ = module(images, tokens, step=0)
        loss.backward()  # the graph of the masked pass stays valid
        stats.append({n: b.clone() for n, b in model.named_buffers() if "running" in n or "num_batches" in n})
    assert stats[0] and all(torch.equal(stats[0][n], stats[1][n]) for n in stats[0])
