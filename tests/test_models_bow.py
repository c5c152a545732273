"""zsprob-tiny-bow: timm's zsprob_plaincnn image tower (open_clip TimmModel) + a bag-of-words text tower."""
from __future__ import annotations

import json

import open_clip
import pytest
import torch

from zsprob import UserError
from zsprob.models import create_model, load, save
from zsprob.models.bow_text import BagOfWordsText, BowCLIP

CAPTIONS = ["a red star", "a shape", "a photo of a blue circle on the left", "x"]


@pytest.fixture(scope="module")
def images():
    return torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(5))


def test_plaincnn_is_a_timm_model():
    import timm

    from zsprob.models.factory import register_model_configs

    register_model_configs()
    m = timm.create_model("zsprob_plaincnn", num_classes=7).eval()
    x = torch.randn(2, 3, 64, 64)
    assert m(x).shape == (2, 7)
    assert m.forward_features(x).shape == (2, 256, 4, 4)  # stride 16 at 64 px
    assert torch.equal(m.forward_head(m.forward_features(x), pre_logits=True), m.forward_features(x).mean((2, 3)))
    m.reset_classifier(0)
    assert m(x).shape == (2, 256) and isinstance(m.get_classifier(), torch.nn.Identity)
    assert m.pretrained_cfg["architecture"] == "zsprob_plaincnn"
    with pytest.raises(UserError, match="no pretrained weights"):
        timm.create_model("zsprob_plaincnn", pretrained=True)


def test_bag_of_words_mean_ignores_padding_and_order():
    torch.manual_seed(0)
    t = BagOfWordsText(16, vocab_size=100, width=8, context_length=10)
    tok = torch.tensor([[49 % 100, 5, 7, 9, 0, 0, 0, 0, 0, 0],
                        [49 % 100, 9, 7, 5, 0, 0, 0, 0, 0, 0],
                        [49 % 100, 5, 7, 9, 0, 0, 0, 0, 0, 0]])
    out = t(tok)
    # by hand: mean of the projected embeddings of the four real tokens
    ref = t.text_projection(t.token_embedding.weight[[49, 5, 7, 9]].mean(0))
    assert torch.allclose(out[0], ref, atol=1e-6)
    assert torch.allclose(out[0], out[1], atol=1e-6)  # a bag: order does not matter
    assert torch.equal(t(tok[:, :4]), t(tok))  # trailing padding changes nothing
    # N(0, 1) word embeddings: captions that differ in one word start far apart
    assert t.token_embedding.weight.std().item() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("pooling", ["native", "gpo"])
def test_prob_model_mean_branch_is_the_bag_and_sigma_head_differs(images, pooling):
    m = create_model("zsprob-tiny-bow", pooling=pooling, seed=0).eval()
    assert isinstance(m.clip, BowCLIP) and m._text.kind == "bow" and m._text.num_blocks == 0
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        mu, lv = m.encode_text(tok)
        mi, lvi = m.encode_image(images)
        if pooling == "native":  # the mean branch runs BowCLIP's own encoders
            assert torch.allclose(mu, m.clip.encode_text(tok, normalize=True), atol=1e-6)
            assert torch.allclose(mi, m.clip.encode_image(images, normalize=True), atol=1e-6)
    assert mu.shape == lv.shape == (4, 64) and torch.isfinite(lv).all()
    assert not torch.allclose(lv - m.text_sigma.bias, mu)
    # the log-variance head: a separate projection of the same word embeddings
    assert m.text_sigma.proj.weight.data_ptr() != m.clip.text.text_projection.weight.data_ptr()
    # gradients reach the word embeddings through both heads
    m.train()
    mu, lv = m.encode_text(tok)
    (mu.sum() + lv.sum()).backward()
    assert m.clip.text.token_embedding.weight.grad.abs().sum() > 0
    assert m.text_sigma.proj.weight.grad.abs().sum() > 0


def test_bow_param_info_sigma_depth_and_round_trip(tmp_path, images):
    m = create_model("zsprob-tiny-bow", sigma_depth=2, seed=1)  # image heads: the last 2 stages
    info = m.param_info()
    assert info["clip.text.token_embedding.weight"] == {"tower": "text", "depth": 0, "num_layers": 1,
                                                        "backbone": True}
    assert info["clip.text.text_projection.weight"]["depth"] == 1
    assert info["text_sigma.proj.weight"]["backbone"] is False
    assert len(m.image_sigma.blocks) == 2 and len(m.text_sigma.blocks) == 0
    save(m, tmp_path / "ck")
    r = load(tmp_path / "ck").eval()
    m.eval()
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        for a, b in zip(m.encode_text(tok) + m.encode_image(images), r.encode_text(tok) + r.encode_image(images)):
            assert torch.equal(a, b)


def test_bow_config_errors(tmp_path):
    d = tmp_path / "cfgs"
    d.mkdir()
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 64, "timm_model_name": "zsprob_plaincnn",
                                           "timm_model_pretrained": False, "timm_pool": "avg",
                                           "timm_proj": "linear"},
           "text_cfg": {"tower": "bow", "width": 8, "heads": 2}}
    (d / "zsprob-test-bad-bow.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d)
    with pytest.raises(UserError, match="heads"):
        create_model("zsprob-test-bad-bow")
