"""The log-variance heads: PCME++'s official block layout, the legacy layout, ProLIP's [UNC] token
and its pooled-MLP analogue; checked against independent computations from the same weights."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zsprob import UserError
from zsprob.models import create_model, load, save
from zsprob.models.sigma_heads import UncPooledHead, UncTokenHead

# 2 blocks per tower: every model here builds and runs in well under a second
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
TEXT = TINY["text_cfg"]
CNN = {"embed_dim": 32, "text_cfg": TEXT,
       "vision_cfg": {"image_size": 64, "timm_model_name": "zsprob_plaincnn_small", "timm_model_pretrained": False,
                      "timm_pool": "avg", "timm_proj": "linear"}}
BOW = {"embed_dim": 32, "text_cfg": {"tower": "bow", "context_length": 16, "vocab_size": 49408, "width": 48},
       "vision_cfg": CNN["vision_cfg"]}
# tower kind -> (shipped config it overrides, open_clip config merged over it, image size)
TOWERS = {"vit": ("zsprob-tiny", TINY, 32), "cnn": ("zsprob-tiny-cnn", CNN, 64), "bow": ("zsprob-tiny-bow", BOW, 64)}
HEADS = {"official": {}, "legacy": {"sigma_layout": "legacy"}, "unc": {"sigma_head": "unc"}}
CAPTIONS = ["a red star", "x", "two small blue circles left of a big green triangle"]


def build(tower: str, pooling: str = "native", seed: int = 0, **kw):
    base, cfg, _ = TOWERS[tower]
    return create_model(base, open_clip_cfg=json.loads(json.dumps(cfg)), pooling=pooling, seed=seed, **kw)


def images_for(tower: str, n: int = 3) -> torch.Tensor:
    size = TOWERS[tower][2]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(7))


def sigma_only(model) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.startswith(("image_sigma.", "text_sigma."))}


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("tower", list(TOWERS))
def test_shapes_and_dtypes_every_tower_and_head(tower, head):
    m = build(tower, pooling="gpo", **HEADS[head]).eval()
    images, tok = images_for(tower), m.tokenizer(CAPTIONS)
    with torch.no_grad():
        out = m(images, tok)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = m(images, tok)
    for key, value in out.items():
        assert value.shape == (3, 32) and value.dtype == torch.float32 and torch.isfinite(value).all(), key
        assert low[key].dtype == torch.float32 and torch.isfinite(low[key]).all(), key
    kind = {"official": "block", "legacy": "block", "unc": "unc"}[head]
    assert m.sigma_head == kind and m.config["sigma_head"] == kind
    if head == "unc":  # ProLIP's init_unc_bias: a tiny variance at the start
        assert out["img_logvar"].mean() == pytest.approx(-10.0, abs=1.0)
        assert out["txt_logvar"].mean() == pytest.approx(-10.0, abs=1.0)


def test_official_layout_has_no_layernorm_before_the_sigma_projection():
    """log sigma^2 = pooled(copied blocks(trunk)) @ proj + bias, computed from open_clip's modules directly."""
    m = build("vit", sigma_bias_init=-2.0).eval()
    assert isinstance(m.image_sigma.ln, nn.Identity) and isinstance(m.text_sigma.ln, nn.Identity)
    legacy = build("vit", sigma_layout="legacy")
    assert isinstance(legacy.image_sigma.ln, nn.LayerNorm) and isinstance(legacy.text_sigma.ln, nn.LayerNorm)
    images, tok = images_for("vit"), m.tokenizer(CAPTIONS)
    visual, clip = m.clip.visual, m.clip
    with torch.no_grad():
        x = visual._embeds(images)
        x = visual.transformer.resblocks[0](x)
        x = m.image_sigma.blocks[0](x)
        want_img = x[:, 0] @ m.image_sigma.proj + m.image_sigma.bias
        t = clip.token_embedding(tok) + clip.positional_embedding
        t = clip.transformer.resblocks[0](t, attn_mask=clip.attn_mask)
        t = m.text_sigma.blocks[0](t, attn_mask=clip.attn_mask)
        want_txt = t[torch.arange(3), tok.argmax(-1)] @ m.text_sigma.proj + m.text_sigma.bias
        _, lv_img = m.encode_image(images)
        _, lv_txt = m.encode_text(tok)
    torch.testing.assert_close(lv_img, want_img, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lv_txt, want_txt, atol=1e-5, rtol=1e-5)
    assert torch.equal(m.image_sigma.bias, torch.full((32,), -2.0))


def test_official_init_laws_and_sigma_ln():
    width, layers, dim = 64, 2, 32
    m = build("vit", seed=3)
    img_block, txt_block = m.image_sigma.blocks[0], m.text_sigma.blocks[0]
    # image blocks: PyTorch's defaults (Xavier-uniform in-projection, zero attention biases, uniform MLP biases)
    xavier = math.sqrt(6.0 / (width + 3 * width))
    w = img_block.attn.in_proj_weight
    assert w.abs().max() <= xavier and w.std().item() == pytest.approx(xavier / math.sqrt(3), rel=0.05)
    assert not img_block.attn.in_proj_bias.any() and not img_block.attn.out_proj.bias.any()
    fc_bias = img_block.mlp.c_fc.bias
    assert fc_bias.abs().max() <= width ** -0.5 and fc_bias.abs().sum() > 0
    # text blocks: CLIP's normal laws on the four weights, the same default biases
    assert txt_block.attn.in_proj_weight.std().item() == pytest.approx(width ** -0.5, rel=0.05)
    proj_std = width ** -0.5 * (2 * layers) ** -0.5
    assert txt_block.attn.out_proj.weight.std().item() == pytest.approx(proj_std, rel=0.05)
    assert txt_block.mlp.c_proj.weight.std().item() == pytest.approx(proj_std, rel=0.05)
    assert txt_block.mlp.c_fc.weight.std().item() == pytest.approx((2 * width) ** -0.5, rel=0.05)
    assert txt_block.mlp.c_fc.bias.abs().sum() > 0 and not txt_block.attn.in_proj_bias.any()
    for ln in (txt_block.ln_1, img_block.ln_2):
        assert torch.equal(ln.weight, torch.ones(width)) and not ln.bias.any()
    # projections: image Xavier-uniform, text nn.Linear's U(-w^-1/2, w^-1/2); bias = sigma_bias_init (0)
    assert m.image_sigma.proj.abs().max() <= math.sqrt(6.0 / (width + dim))
    assert m.text_sigma.proj.abs().max() <= width ** -0.5
    assert m.text_sigma.proj.std().item() == pytest.approx(width ** -0.5 / math.sqrt(3), rel=0.1)
    assert not m.image_sigma.bias.any() and not m.text_sigma.bias.any() and m.image_sigma.sigma_ln is None
    # sigma_ln_init: PCME++'s LayerNorm on log sigma^2; the projection bias follows the official default
    s = build("vit", seed=3, sigma_ln_init=0.01, sigma_ln_init_bias=-1.5, sigma_bias_init=-7.0)
    for head in (s.image_sigma, s.text_sigma):
        assert torch.equal(head.sigma_ln.weight, torch.full((dim,), 0.01))
        assert torch.equal(head.sigma_ln.bias, torch.full((dim,), -1.5))
    assert not s.image_sigma.bias.any()
    assert s.text_sigma.bias.abs().max() <= width ** -0.5 and s.text_sigma.bias.abs().sum() > 0
    with torch.no_grad():
        _, lv = s.eval().encode_text(s.tokenizer(CAPTIONS))
    assert lv.mean(dim=-1).sub(-1.5).abs().max() < 1e-4  # a LayerNorm output: mean = its bias
    # ProLIP's [UNC] init
    u = build("vit", seed=3, sigma_head="unc", sigma_bias_init=-8.0)
    assert torch.equal(u.image_sigma.uncertainty_proj.bias, torch.full((dim,), -8.0))
    assert u.text_sigma.text_uncertainty_projection.weight.std().item() == pytest.approx(width ** -0.5, rel=0.1)
    assert u.text_sigma.unc_emb.std().item() == pytest.approx(0.01, rel=0.5)
    assert build("vit", sigma_head="unc").config["sigma_bias_init"] == -10.0


def _vit_unc_reference(m, images):
    """ProLIP's image forward, written out: [CLS, UNC, patches] through open_clip's own transformer."""
    visual, head = m.clip.visual, m.image_sigma
    x = visual.conv1(images).flatten(2).transpose(1, 2)
    cls = (visual.class_embedding + visual.positional_embedding[0]).expand(x.shape[0], 1, -1)
    unc = (head.unc_embedding + head.unc_pos_embedding).expand(x.shape[0], 1, -1)
    x = torch.cat([cls, unc, x + visual.positional_embedding[1:]], dim=1)
    x = visual.transformer(visual.ln_pre(x))
    mu = F.normalize(visual.ln_post(x[:, 0]) @ visual.proj, dim=-1)
    return mu, head.uncertainty_proj(visual.ln_post(x[:, 1]))


def _text_unc_reference(text_module, head, tok, causal: bool, pad_mask: bool):
    """[UNC] appended after the padded caption; [UNC] reads the caption (SOT..EOT) and itself."""
    b, seq = tok.shape
    x = text_module.token_embedding(tok) + text_module.positional_embedding[:seq]
    x = torch.cat([x, (head.unc_emb + head.unc_pos_embedding).expand(b, 1, -1)], dim=1)
    mask = None
    if causal or pad_mask:
        heads = text_module.transformer.resblocks[0].attn.num_heads
        allowed = torch.ones(b, seq + 1, seq + 1, dtype=torch.bool)
        if causal:
            allowed &= torch.tril(torch.ones(seq + 1, seq + 1, dtype=torch.bool))
        if pad_mask:
            allowed[:, :, :seq] &= (tok != 0)[:, None, :]
        length = tok.argmax(-1) + 1 if causal else (tok != 0).sum(-1)
        allowed[:, seq] = torch.arange(seq + 1)[None, :] < length[:, None]
        allowed[:, seq, seq] = True
        mask = torch.zeros(b, seq + 1, seq + 1).masked_fill(~allowed, float("-inf")).repeat_interleave(heads, 0)
    x = text_module.transformer(x, attn_mask=mask)
    eot = x[torch.arange(b), tok.argmax(-1)]
    proj = text_module.text_projection
    pooled = text_module.ln_final(eot)
    pooled = proj(pooled) if isinstance(proj, nn.Module) else pooled @ proj
    return F.normalize(pooled, dim=-1), head.text_uncertainty_projection(text_module.ln_final(x[:, -1]))


def test_unc_vit_and_causal_text_equal_an_independent_computation():
    m = build("vit", sigma_head="unc", seed=2).eval()
    with torch.no_grad():  # make the [UNC] token and the projection bias matter
        m.image_sigma.uncertainty_proj.bias.zero_()
        m.text_sigma.text_uncertainty_projection.bias.zero_()
        m.image_sigma.unc_embedding.mul_(20.0)
        m.text_sigma.unc_emb.normal_(std=1.0)
    images, tok = images_for("vit"), m.tokenizer(CAPTIONS)
    with torch.no_grad():
        mu_i, lv_i = m.encode_image(images)
        mu_t, lv_t = m.encode_text(tok)
        ref_mu_i, ref_lv_i = _vit_unc_reference(m, images)
        ref_mu_t, ref_lv_t = _text_unc_reference(m.clip, m.text_sigma, tok, causal=True, pad_mask=False)
        plain = build("vit", seed=2, deterministic=True).eval()
        plain.clip.load_state_dict(m.clip.state_dict())
        plain_mu_i, plain_mu_t = plain.encode_image(images)[0], plain.encode_text(tok)[0]
    for got, want in ((mu_i, ref_mu_i), (lv_i, ref_lv_i), (mu_t, ref_mu_t), (lv_t, ref_lv_t)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # causal text: no caption token reads [UNC], so mu is the model without it; the image [UNC] is read (ProLIP)
    torch.testing.assert_close(mu_t, plain_mu_t, atol=2e-5, rtol=1e-5)
    assert (mu_i - plain_mu_i).abs().max() > 1e-3
    # [UNC] reads only the caption: padding and truncation do not change log sigma^2
    full = create_model("zsprob-tiny", open_clip_cfg=TINY, sigma_head="unc", pooling="native", seed=2,
                        truncate_text=False).eval()
    full.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(full.encode_text(tok)[1], lv_t, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("pad_mask", [False, True])
def test_unc_bidirectional_text_towers(pad_mask):
    """A tower without a causal mask: no mask stays no mask (ProLIP); a padding mask gains the [UNC] row."""
    cfg = json.loads(json.dumps(TINY))
    cfg["custom_text"] = True
    cfg["text_cfg"]["no_causal_mask"] = True
    m = create_model("zsprob-tiny", open_clip_cfg=cfg, sigma_head="unc", pooling="native", seed=4).eval()
    m.clip.text.use_pad_mask = pad_mask  # open_clip's padding mask (its CLIPTextCfg has no key for it)
    with torch.no_grad():
        m.text_sigma.unc_emb.normal_(std=1.0)
        m.text_sigma.text_uncertainty_projection.bias.zero_()
    tok = m.tokenizer(CAPTIONS)
    with torch.no_grad():
        mu, lv = m.encode_text(tok)
        ref_mu, ref_lv = _text_unc_reference(m.clip.text, m.text_sigma, tok, causal=False, pad_mask=pad_mask)
    torch.testing.assert_close(mu, ref_mu, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lv, ref_lv, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tower", list(TOWERS))
def test_gradients_reach_the_unc_parameters_and_mu_ignores_sigma_only_ones(tower):
    m = build(tower, pooling="gpo", sigma_head="unc").train()
    images, tok = images_for(tower), m.tokenizer(CAPTIONS)
    out = m(images, tok)
    params = sigma_only(m)
    names = list(params)
    grads = torch.autograd.grad(out["img_logvar"].sum() + out["txt_logvar"].sum(), list(params.values()),
                                allow_unused=True, retain_graph=True)
    for name, g in zip(names, grads):
        if name.endswith("sigma_ln.weight") or name.endswith("sigma_ln.bias"):
            continue
        assert g is not None and g.abs().sum() > 0, name
    mu_grads = torch.autograd.grad(out["img_mu"].sum() + out["txt_mu"].sum(), list(params.values()),
                                   allow_unused=True)
    read_by_mu = {"image_sigma.unc_embedding", "image_sigma.unc_pos_embedding"}  # ProLIP: patches attend to [UNC]
    for name, g in zip(names, mu_grads):
        if tower == "vit" and name in read_by_mu:
            assert g is not None and g.abs().sum() > 0, name
        else:
            assert g is None or not g.any(), name
    # the log-variance output reaches the shared trunk too (the [UNC] token runs through every block)
    trunk = dict(m.named_parameters())
    first = "clip.text.token_embedding.weight" if tower == "bow" else "clip.token_embedding.weight"
    g = torch.autograd.grad(m(images, tok)["txt_logvar"].sum(), trunk[first])[0]
    assert g.abs().sum() > 0


def test_block_heads_are_sigma_only_for_mu():
    m = build("vit", pooling="gpo").train()
    out = m(images_for("vit"), m.tokenizer(CAPTIONS))
    grads = torch.autograd.grad(out["img_mu"].sum() + out["txt_mu"].sum(), list(sigma_only(m).values()),
                                allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.parametrize("tower,head", [("vit", {}), ("bow", {"sigma_head": "unc"}), ("cnn", {})])
def test_sigma_detach_keeps_sigma_gradients_out_of_the_trunk(tower, head):
    """sigma_detach: log sigma^2 trains its own head only; the outputs are those of the same weights
    without the option, and the means' gradients are untouched."""
    plain, cut = build(tower, seed=3, **head).train(), build(tower, seed=3, sigma_detach=True, **head).train()
    assert cut.config["sigma_detach"] is True and plain.config["sigma_detach"] is False
    images, tok = images_for(tower), plain.tokenizer(CAPTIONS)
    torch.manual_seed(0)
    a = plain(images, tok)
    torch.manual_seed(0)
    b = cut(images, tok)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    names = [n for n, p in cut.named_parameters() if p.requires_grad]

    def grads(model, out):
        params = dict(model.named_parameters())
        return dict(zip(names, torch.autograd.grad(out["img_logvar"].sum() + out["txt_logvar"].sum(),
                                                   [params[n] for n in names], allow_unused=True)))
    g_cut, g_plain = grads(cut, b), grads(plain, a)
    head_only = set(sigma_only(cut))
    for name in names:
        reached = g_cut[name] is not None and bool(g_cut[name].any())
        assert reached == (name in head_only and g_plain[name] is not None and bool(g_plain[name].any())), name
    assert any(g is not None and g.any() for n, g in g_plain.items() if n not in head_only)  # plain: the trunk too
    with pytest.raises(UserError, match="sigma_detach needs"):
        build("vit", sigma_head="unc", sigma_detach=True)


def test_bag_of_words_unc_word_and_cnn_pooled_mlp():
    m = build("bow", sigma_head="unc", seed=5).eval()
    assert isinstance(m.text_sigma, UncPooledHead) and isinstance(m.image_sigma, UncPooledHead)
    assert m.image_sigma.unc_emb is None and m.text_sigma.unc_emb.shape == (48,)
    tok = m.tokenizer(CAPTIONS)
    images = images_for("bow")
    with torch.no_grad():
        mu, lv = m.encode_text(tok)
        words = m.clip.text.token_embedding.weight
        bags = [words[row[row != 0]] for row in tok]
        pooled = torch.stack([(bag.sum(0) + m.text_sigma.unc_emb) / (len(bag) + 1) for bag in bags])
        torch.testing.assert_close(lv, m.text_sigma.mlp(pooled), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mu, m.clip.encode_text(tok, normalize=True), atol=1e-6, rtol=1e-6)
        # CNN: an MLP on timm's own globally pooled last-stage features
        trunk = m.clip.visual.trunk
        feats = trunk.forward_head(trunk.forward_features(images), pre_logits=True)
        torch.testing.assert_close(m.encode_image(images)[1], m.image_sigma.mlp(feats), atol=1e-5, rtol=1e-5)
        # the [UNC] word weighs 1 / (n + 1): with every other word at zero, more words mean less [UNC]
        m.text_sigma.unc_emb.fill_(1.0)
        short, long = m.tokenizer(["star", "a star on the left"])
        x_short = m.text_sigma.pool_words(torch.zeros(1, 16, 48), (short != 0).sum()[None])
        x_long = m.text_sigma.pool_words(torch.zeros(1, 16, 48), (long != 0).sum()[None])
    assert x_short[0, 0] == pytest.approx(1 / 4) and x_long[0, 0] == pytest.approx(1 / 8)
    assert m.text_sigma.mlp.fc2.bias.eq(-10.0).all()


@pytest.mark.parametrize("tower", list(TOWERS))
def test_param_info_covers_every_parameter(tower):
    for head in HEADS.values():
        m = build(tower, pooling="gpo", sigma_ln_init=0.01, **head)
        info = m.param_info()
        assert set(info) == {n for n, _ in m.named_parameters()}
        for name, meta in info.items():
            if not name.startswith(("image_sigma.", "text_sigma.")):
                continue
            assert meta["backbone"] is False and meta["tower"] == name.split("_")[0], name
            leaf = name.split(".")[1]
            if leaf in ("unc_embedding", "unc_emb", "unc_pos_embedding"):
                assert meta["depth"] == 0, name
            elif leaf != "blocks":
                assert meta["depth"] == meta["num_layers"], name
    u = build("vit", sigma_head="unc").param_info()
    assert u["image_sigma.uncertainty_proj.weight"] == {"tower": "image", "depth": 3, "num_layers": 3,
                                                        "backbone": False}
    assert u["text_sigma.unc_emb"] == {"tower": "text", "depth": 0, "num_layers": 3, "backbone": False}


@pytest.mark.parametrize("options", [{"sigma_head": "unc"}, {"sigma_ln_init": 0.01, "sigma_ln_init_bias": -2.0},
                                     {"sigma_layout": "legacy"}])
def test_save_load_round_trip(tmp_path, options):
    for tower in ("vit", "bow"):
        m = build(tower, pooling="gpo", seed=6, **options)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.randn_like(p))
        save(m, tmp_path / tower)
        r = load(tmp_path / tower).eval()
        assert r.sigma_head == m.sigma_head and r.sigma_layout == m.sigma_layout
        assert r.sigma_ln_init == m.sigma_ln_init
        images, tok = images_for(tower), m.tokenizer(CAPTIONS)
        with torch.no_grad():
            a, b = m.eval()(images, tok), r(images, tok)
        for key in a:
            assert torch.equal(a[key], b[key]), (tower, key)


def test_configs_without_the_new_keys_rebuild_the_legacy_layout(tmp_path):
    """A checkpoint saved before the head options has no sigma_head / sigma_layout keys: it loads unchanged."""
    new = build("vit", seed=8)
    assert new.config["sigma_layout"] == "official" and new.sigma_layout == "official"
    m = build("vit", seed=8, sigma_layout="legacy").eval()
    save(m, tmp_path / "old")
    meta_path = tmp_path / "old" / "zsprob.json"
    meta = json.loads(meta_path.read_text())
    for key in ("sigma_head", "sigma_layout", "sigma_ln_init", "sigma_ln_init_bias"):
        del meta["config"][key]
    meta_path.write_text(json.dumps(meta))
    r = load(tmp_path / "old").eval()
    assert r.sigma_layout == "legacy" and r.sigma_head == "block"
    assert set(r.state_dict()) == set(m.state_dict()) and isinstance(r.image_sigma.ln, nn.LayerNorm)
    images, tok = images_for("vit"), m.tokenizer(CAPTIONS)
    with torch.no_grad():
        a, b = m(images, tok), r(images, tok)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_bad_sigma_options_are_one_line_user_errors():
    cases = [({"sigma_head": "gaussian"}, "sigma_head must be one of"),
             ({"sigma_head": "unc", "deterministic": True}, "needs a probabilistic model"),
             ({"sigma_head": "unc", "sigma_init": "copy"}, "nothing to copy"),
             ({"sigma_layout": "paper"}, "sigma_layout must be one of"),
             ({"sigma_ln_init": "small"}, "sigma_ln_init must be a finite number"),
             ({"sigma_bias_init": float("nan")}, "sigma_bias_init must be a finite number")]
    for options, message in cases:
        with pytest.raises(UserError, match=message) as err:
            build("vit", **options)
        assert "\n" not in str(err.value)
    assert isinstance(build("vit", sigma_head="unc").image_sigma, UncTokenHead)


@pytest.mark.slow  # a subprocess importing the CLI: ~10 s alone, ~30 s on a shared 2-core machine
def test_cli_rejects_unc_head_on_a_deterministic_method(tmp_path):
    """Through a recipe's model section: one line on stderr, exit 2, no traceback."""
    from conftest import run_cli

    r = run_cli("pretrain", "--config", "synthetic_tiny.yaml", "--data", "synthetic", "--shards", tmp_path,
                "--method", "infonce", "--out", tmp_path / "run", "--steps", 2,
                "--set", "model.overrides.sigma_head=unc", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("zsprob: error: sigma_head 'unc' needs a probabilistic model")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_zsprob_checkpoint_as_pretrained_keeps_its_head_kind(tmp_path):
    """Fine-tuning a legacy (or [UNC]) checkpoint reuses its log-variance heads unless the caller asks otherwise."""
    images = images_for("vit")
    for options in ({"sigma_layout": "legacy"}, {"sigma_head": "unc"}):
        m = build("vit", seed=9, **options).eval()
        save(m, tmp_path / "pre")
        f = create_model("zsprob-tiny", pretrained=str(tmp_path / "pre"), pooling="native", seed=10).eval()
        assert f.sigma_head == m.sigma_head and f.sigma_layout == m.sigma_layout
        assert "image_sigma" in f.config["heads_from_checkpoint"] and "text_sigma" in f.config["heads_from_checkpoint"]
        tok = m.tokenizer(CAPTIONS)
        with torch.no_grad():
            a, b = m(images, tok), f(images, tok)
        for key in a:
            assert torch.equal(a[key], b[key]), (options, key)
    # asked for: a fresh official block head on the checkpoint's trunk
    o = create_model("zsprob-tiny", pretrained=str(tmp_path / "pre"), pooling="native", sigma_head="block",
                     sigma_layout="official", seed=10)
    assert o.sigma_layout == "official" and "image_sigma" not in o.config["heads_from_checkpoint"]
