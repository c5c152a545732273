"""The adapter's loss terms (zsprob.posthoc.adapter.sigma_terms) against float64 references written out here.

What would break: the inclusion term not being ProLIP's inclusion test of the original inside its copy, the
same-length term ranking captions of different lengths or in the wrong direction, or a term's weight not
reaching the loss.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a red star", "a big blue circle", "a green square", "a small dotted yellow triangle", "a kite",
            "an orange star on the left", "a medium ring", "a solid cross"]


@pytest.fixture(scope="module")
def parts():
    """Real adapters of a post-hoc copy of a tiny bag-of-words model and one batch of their cached rows."""
    from zsprob.data.masking import delete_tokens, text_mask_spec
    from zsprob.models import create_model
    from zsprob.posthoc.heads import adapter_for, probabilistic_copy

    torch.manual_seed(0)
    frozen = create_model("zsprob-tiny-bow", pretrained=None, deterministic=True, pooling="native", image_size=32)
    model, _ = probabilistic_copy(frozen, seed=0)
    model.eval()
    adapters = {side: adapter_for(model, side) for side in ("image", "text")}
    g = torch.Generator().manual_seed(1)
    images = torch.randn(len(CAPTIONS), 3, 32, 32, generator=g)
    tokens = model.tokenizer(CAPTIONS)
    inputs = {"image": images, "image_copy": images * 0.5, "text": tokens,
              "text_copy": delete_tokens(tokens, 0.5, text_mask_spec(model.tokenizer), g)}
    batch = {}
    with torch.no_grad():
        for part, value in inputs.items():
            batch[f"{part}_mu"], batch[f"{part}_features"] = adapters[part.split("_")[0]].encode(value)
    return adapters, batch


def _inclusion_reference(mu_1, lv_1, mu_2, lv_2, eps=-10.0):
    """ProLIP's test(1 in 2) - test(2 in 1), averaged over dimensions, in float64."""
    def test(m1, l1, m2, l2):
        p1, p2 = math.exp(eps - l1), math.exp(eps - l2)
        a, b = p1 + 0.5 * p2, 2 * m1 * p1 + m2 * p2
        c = m1 * m1 * p1 + 0.5 * m2 * m2 * p2
        return -2 * l1 - l2 - 0.5 * math.log(a) + b * b / (4 * a) - c

    rows = []
    for r in range(mu_1.shape[0]):
        values = [test(*(float(t[r, d]) for t in (mu_1, lv_1, mu_2, lv_2)))
                  - test(*(float(t[r, d]) for t in (mu_2, lv_2, mu_1, lv_1))) for d in range(mu_1.shape[1])]
        rows.append(sum(values) / len(values))
    return rows


def _softplus_neg(x):  # -log sigmoid(x)
    return math.log1p(math.exp(-x)) if x > 0 else -x + math.log1p(math.exp(x))


def test_inclusion_term_is_the_original_inside_its_copy(parts):
    from zsprob.posthoc.adapter import AdapterSettings, sigma_terms

    adapters, batch = parts
    s = AdapterSettings(inclusion_scale=40.0)
    with torch.no_grad():
        terms = sigma_terms(adapters, batch, s)
        for side in ("image", "text"):
            lv = adapters[side].logvar(batch[f"{side}_features"]).double()
            lv_copy = adapters[side].logvar(batch[f"{side}_copy_features"]).double()
            logits = _inclusion_reference(batch[f"{side}_mu"].double(), lv, batch[f"{side}_copy_mu"].double(), lv_copy)
            want = sum(_softplus_neg(s.inclusion_scale * x) for x in logits) / len(logits)
            assert float(terms[f"inclusion_{side}"]) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("target", ["own", "centre"])
def test_same_length_term_ranks_only_captions_of_equal_length(parts, target):
    from zsprob.posthoc.adapter import AdapterSettings, sigma_terms

    adapters, batch = parts
    s = AdapterSettings(same_length_scale=7.0, same_length_target=target)
    with torch.no_grad():
        got = float(sigma_terms(adapters, batch, s)["same_length"])
        lv = adapters["text"].logvar(batch["text_features"]).double()
    log_s = lv.exp().sum(1).log().tolist()
    image = batch["image_mu"].double()
    image = image if target == "own" else image.mean(0, keepdim=True)  # the caption's own image, or the batch's centre
    r = (image - batch["text_mu"].double()).square().sum(1).tolist()
    n = [len(c.split()) for c in CAPTIONS]
    losses = [_softplus_neg(s.same_length_scale * (log_s[i] - log_s[j]))
              for i in range(len(n)) for j in range(len(n)) if i != j and n[i] == n[j] and r[i] > r[j]]
    assert len(losses) >= 2  # the batch has several equal-length pairs
    assert got == pytest.approx(sum(losses) / len(losses), rel=1e-4)


def test_each_weight_reaches_the_loss(parts):
    from zsprob.posthoc.adapter import AdapterSettings, sigma_terms

    adapters, batch = parts
    base = AdapterSettings(inclusion_alpha=0.0, same_length_alpha=0.0)
    with torch.no_grad():
        t0 = sigma_terms(adapters, batch, base)
    for field, term in (("inclusion_alpha", ("inclusion_image", "inclusion_text")), ("same_length_alpha", ("same_length",))):
        with torch.no_grad():
            t1 = sigma_terms(adapters, batch, dataclasses.replace(base, **{field: 0.5}))
        extra = 0.5 * sum(float(t0[name]) for name in term)
        assert float(t1["loss"]) == pytest.approx(float(t0["loss"]) + extra, rel=1e-5, abs=1e-6)
