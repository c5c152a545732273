"""ProbCLIP against the open_clip model it wraps: exactness, heads, GPO, shapes, dtypes, gradients."""
from __future__ import annotations

import json

import open_clip
import pytest
import torch

from zsprob import UserError
from zsprob.models import GPO, create_model, list_models
from zsprob.models.heads import bound_logvar

# A tiny open_clip config (2 blocks per tower) so every test runs in well under a second.
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
CAPTIONS = ["a red square", "two small blue circles left of a big green triangle", "x", "a photo of a cat"]


def tiny(**kw):
    kw.setdefault("seed", 0)
    return create_model("zsprob-tiny", open_clip_cfg=TINY, **kw)


@pytest.fixture(scope="module")
def images():
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A tiny config registered with open_clip itself, so open_clip.create_model builds it."""
    d = tmp_path_factory.mktemp("oc_cfg")
    (d / "zsprob-test-tiny.json").write_text(json.dumps(TINY))
    cust = json.loads(json.dumps(TINY))
    cust["custom_text"] = True
    (d / "zsprob-test-tiny-custom.json").write_text(json.dumps(cust))
    open_clip.add_model_config(d)
    return "zsprob-test-tiny"


# ---------------------------------------------------------------------------------------
def test_configs_registered():
    names = list_models()
    assert "zsprob-tiny" in names and "ViT-S-16-d128" in names and "ViT-B-16" in names
    cfg = open_clip.get_model_config("ViT-S-16-d128")
    assert cfg["embed_dim"] == 128 and cfg["vision_cfg"]["width"] == 384 and cfg["vision_cfg"]["patch_size"] == 16
    assert cfg["text_cfg"]["width"] == 512 and cfg["text_cfg"]["layers"] == 12
    t = open_clip.get_model_config("zsprob-tiny")
    assert t["vision_cfg"]["image_size"] == 64 and t["text_cfg"]["context_length"] == 32


def test_shipped_tiny_model_attributes():
    m = create_model("zsprob-tiny")
    assert m.image_size == 64 and m.embed_dim == open_clip.get_model_config("zsprob-tiny")["embed_dim"]
    tok = m.tokenizer(CAPTIONS)
    assert tok.dtype == torch.long and tok.shape == (4, 32)
    from PIL import Image

    img = Image.new("RGB", (80, 70), (200, 10, 10))
    assert m.preprocess_val(img).shape == (3, 64, 64)
    assert m.preprocess_train(img).shape == (3, 64, 64)
    assert m.config["name"] == "zsprob-tiny" and m.config["open_clip_cfg"]["vision_cfg"]["patch_size"] == 8


@pytest.mark.parametrize("name", ["zsprob-test-tiny", "zsprob-test-tiny-custom"])
def test_native_mu_equals_open_clip(registered, images, name):
    """With native pooling the mean branch is open_clip's computation: same weights, same outputs (the
    image tower's last block runs at the class token only, equal up to float rounding; the text tower
    pools at the end-of-text token, which moves with the caption, so it runs whole and bit-identical)."""
    torch.manual_seed(0)
    oc = open_clip.create_model(name).eval()
    sd = {k: v.clone() for k, v in oc.state_dict().items()}
    m = create_model(name, pooling="native", truncate_text=False, seed=123)
    m.clip.load_state_dict(sd)
    m.eval()
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        ref_i = oc.encode_image(images, normalize=True)
        ref_t = oc.encode_text(tok, normalize=True)
        mu_i, lv_i = m.encode_image(images)
        mu_t, lv_t = m.encode_text(tok)
    torch.testing.assert_close(mu_i, ref_i, atol=1e-6, rtol=0)
    assert torch.equal(mu_t, ref_t)
    assert lv_i.shape == mu_i.shape and lv_t.shape == mu_t.shape
    # default: sequences cut after the longest EOT (exact up to float rounding for causal towers)
    m2 = create_model(name, pooling="native", seed=123)
    m2.clip.load_state_dict(sd)
    with torch.no_grad():
        assert torch.allclose(m2.eval().encode_text(tok)[0], ref_t, atol=1e-5, rtol=0)


def test_wrapped_model_matches_itself_and_sigma_copy(images):
    """sigma_init="copy" with raw means: the log-variance head is the mean head, output for output."""
    m = tiny(sigma_init="copy", normalize_mu=False, pooling="gpo").eval()
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        mu, lv = m.encode_image(images)
        assert torch.allclose(mu, lv, atol=1e-6)
        mu, lv = m.encode_text(tok)
        assert torch.allclose(mu, lv, atol=1e-6)
    # the random init (default) gives a different head
    r = tiny().eval()
    a = dict(r.clip.visual.transformer.resblocks[-1].named_parameters())
    b = dict(r.image_sigma.blocks[0].named_parameters())
    assert not torch.equal(a["mlp.c_fc.weight"], b["mlp.c_fc.weight"])
    assert not torch.equal(r.clip.visual.proj, r.image_sigma.proj)


def test_shapes_and_normalisation(images):
    m = tiny().eval()
    out = m(images, m.tokenizer(CAPTIONS))
    assert set(out) == {"img_mu", "img_logvar", "txt_mu", "txt_logvar"}
    for v in out.values():
        assert v.shape == (4, 32) and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert torch.allclose(out["img_mu"].norm(dim=-1), torch.ones(4), atol=1e-5)
    assert torch.allclose(out["txt_mu"].norm(dim=-1), torch.ones(4), atol=1e-5)
    # log-variance is raw: not normalised, can be negative and positive
    assert not torch.allclose(out["img_logvar"].norm(dim=-1), torch.ones(4), atol=1e-2)


def test_text_padding_after_eot_is_ignored():
    m = tiny(truncate_text=False).eval()
    tok = m.tokenizer(CAPTIONS)
    tok2 = tok.clone()
    eot = tok.argmax(-1)
    for i in range(len(tok2)):
        tok2[i, eot[i] + 1:] = 320 + i  # garbage after the end-of-text token
    with torch.no_grad():
        a = m.encode_text(tok)
        b = m.encode_text(tok2)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-6)
    # and the truncated fast path agrees with the full-length one
    m.config["truncate_text"] = True
    m._text.truncate = True
    with torch.no_grad():
        c = m.encode_text(tok)
    assert torch.allclose(a[0], c[0], atol=1e-5) and torch.allclose(a[1], c[1], atol=1e-4)


def test_gradients_reach_both_heads(images):
    m = tiny().train()
    out = m(images, m.tokenizer(CAPTIONS))
    loss = (out["img_mu"] @ out["txt_mu"].T).sum() + out["img_logvar"].exp().sum() + out["txt_logvar"].exp().sum()
    loss.backward()
    g = {n: p.grad for n, p in m.named_parameters()}
    must = ["clip.visual.conv1.weight", "clip.visual.transformer.resblocks.0.attn.in_proj_weight",
            "clip.visual.transformer.resblocks.1.mlp.c_fc.weight", "clip.visual.proj",
            "image_sigma.blocks.0.mlp.c_fc.weight", "image_sigma.proj", "image_sigma.bias",
            "image_gpo.gru.weight_hh_l0", "image_sigma.gpo.score.weight",
            "clip.token_embedding.weight", "clip.transformer.resblocks.0.attn.in_proj_weight",
            "clip.transformer.resblocks.1.mlp.c_fc.weight", "clip.text_projection",
            "text_sigma.blocks.0.attn.out_proj.weight", "text_sigma.proj", "text_gpo.gru.weight_ih_l0"]
    for n in must:
        assert g[n] is not None and g[n].abs().sum() > 0, n
    # every trainable parameter is used (DDP needs no find_unused_parameters)
    unused = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
    assert unused == []
    assert not m.clip.logit_scale.requires_grad


def test_deterministic_mode(images):
    m = tiny(deterministic=True).eval()
    assert m.image_sigma is None and m.text_sigma is None
    assert not any("sigma" in n for n, _ in m.named_parameters())
    out = m(images, m.tokenizer(CAPTIONS))
    assert out["img_logvar"] is None and out["txt_logvar"] is None
    assert out["img_mu"].shape == (4, 32)
    # mu-only inference of a probabilistic model equals its full mean
    p = tiny().eval()
    with torch.no_grad():
        assert torch.equal(p.encode_image(images, with_sigma=False)[0], p.encode_image(images)[0])
        assert p.encode_image(images, with_sigma=False)[1] is None


def test_variance_bounds(images):
    m = tiny(var_bounds=(0.1, 10)).eval()
    with torch.no_grad():
        m.image_sigma.proj.mul_(1000.0)  # push raw outputs far out of range
        m.text_sigma.bias.fill_(-50.0)
        _, lv_i = m.encode_image(images)
        _, lv_t = m.encode_text(m.tokenizer(CAPTIONS))
    import math

    for lv in (lv_i, lv_t):
        assert lv.min() >= math.log(0.1) - 1e-5 and lv.max() <= math.log(10) + 1e-5
    assert lv_i.max() > math.log(10) - 0.1 and lv_i.min() < math.log(0.1) + 0.1  # saturates both ways
    raw = torch.linspace(-5, 5, 11, requires_grad=True)
    out = bound_logvar(raw, (0.1, 10.0))
    assert abs(float(out[5].detach())) < 1e-6  # raw 0 -> variance 1
    out.sum().backward()
    assert (raw.grad > 0).all()  # smooth: gradients never vanish exactly
    with pytest.raises(UserError):
        tiny(var_bounds=(10, 0.1))


def test_bfloat16_autocast_cpu(images):
    m = tiny().eval()
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        ref = m(images, tok)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(images, tok)
    for k in ref:
        assert out[k].dtype == torch.float32 and torch.isfinite(out[k]).all()
    cos = torch.nn.functional.cosine_similarity(out["img_mu"], ref["img_mu"], dim=-1)
    assert cos.min() > 0.98
    assert (out["txt_logvar"] - ref["txt_logvar"]).abs().max() < 0.25
    # and a training step under autocast yields finite gradients
    m.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = m(images, tok)
        loss = o["img_mu"].sum() + o["txt_logvar"].exp().mean()
    loss.backward()
    assert torch.isfinite(m.text_sigma.blocks[0].mlp.c_fc.weight.grad).all()


def test_sigma_depth_two_and_param_info():
    m = tiny(sigma_depth=2)
    assert len(m.image_sigma.blocks) == 2 and len(m.text_sigma.blocks) == 2
    info = m.param_info()
    assert set(info) == {n for n, _ in m.named_parameters()}
    assert info["clip.visual.conv1.weight"] == {"tower": "image", "depth": 0, "num_layers": 3, "backbone": True}
    assert info["clip.visual.transformer.resblocks.1.ln_1.weight"]["depth"] == 2
    assert info["clip.visual.proj"]["depth"] == 3
    assert info["clip.token_embedding.weight"]["tower"] == "text" and info["clip.token_embedding.weight"]["depth"] == 0
    assert info["clip.transformer.resblocks.0.attn.in_proj_weight"]["depth"] == 1
    assert info["text_sigma.blocks.0.mlp.c_fc.weight"] == {"tower": "text", "depth": 1, "num_layers": 3,
                                                          "backbone": False}
    assert info["image_sigma.blocks.1.mlp.c_fc.weight"]["depth"] == 2
    assert info["image_gpo.gru.weight_ih_l0"]["backbone"] is False
    assert info["clip.logit_scale"]["tower"] == "other"
    with pytest.raises(UserError):
        tiny(sigma_depth=3)


def test_gpo_properties():
    torch.manual_seed(0)
    gpo = GPO(16, 16)
    x = torch.randn(3, 7, 5)
    lengths = torch.tensor([7, 4, 1])
    y = gpo(x, lengths)
    # padding positions do not matter
    x2 = x.clone()
    x2[1, 4:] = 1e3
    x2[2, 1:] = -1e3
    assert torch.allclose(gpo(x2, lengths), y)
    # a length-1 sequence pools to its single token; pooled values lie within the token range
    assert torch.allclose(y[2], x[2, 0])
    for i, n in enumerate(lengths.tolist()):
        assert (y[i] <= x[i, :n].max(0).values + 1e-6).all() and (y[i] >= x[i, :n].min(0).values - 1e-6).all()
    w, mask = gpo.rank_weights(lengths, 7)
    assert torch.allclose(w.sum(1), torch.ones(3)) and (w[~mask] == 0).all()
    # permutation invariant over tokens (it sorts per dimension)
    perm = torch.randperm(7)
    assert torch.allclose(gpo(x[:1, perm]), gpo(x[:1]), atol=1e-6)


def test_user_errors():
    with pytest.raises(UserError, match="unknown model"):
        create_model("no-such-model")
    with pytest.raises(UserError):
        tiny(pooling="mean")
    with pytest.raises(UserError):
        tiny(sigma_init="zeros")
    with pytest.raises(UserError, match="unknown create_model options"):
        tiny(bogus_option=1)


def test_size_augment_drops_image_tokens_in_training_only(images):
    m = tiny(size_augment=0.5)
    ref = tiny(size_augment=0.0)
    ref.load_state_dict(m.state_dict())
    torch.manual_seed(0)
    sel = m.train()._size_augment(64, 17, torch.device("cpu"))
    order, kept = sel
    assert (kept >= 1).all() and (kept < 17).any() and (kept == 17).any()
    assert (order.sort(dim=1).values == torch.arange(17)).all()  # a permutation per sample
    with torch.no_grad():
        m.eval()
        assert torch.equal(m.encode_image(images)[0], ref.eval().encode_image(images)[0])  # off in eval
        m.train()
        ref.train()
        torch.manual_seed(1)
        a = m.encode_image(images)
        b = ref.encode_image(images)
    assert not torch.allclose(a[0], b[0]) and not torch.allclose(a[1], b[1])
    with pytest.raises(UserError):
        tiny(size_augment=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("name,size,dim", [("ViT-S-16-d128", 224, 128), ("ViT-B-16", 224, 512)])
def test_full_size_configs_build_and_encode(name, size, dim):
    m = create_model(name, seed=0).eval()
    assert m.image_size == size and m.embed_dim == dim
    assert m._vision.num_blocks == 12 and m._text.num_blocks == 12
    with torch.no_grad():
        mu, lv = m.encode_text(m.tokenizer(["a photo of a dog"]))
    assert mu.shape == (1, dim) and lv.shape == (1, dim) and torch.isfinite(lv).all()
