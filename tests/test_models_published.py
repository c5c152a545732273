"""Published ProLIP / PCME++ weights through ``create_model(name, pretrained=OFFICIAL)``: the same mu and
log sigma^2 as the official forward.

The official files are written here with random weights in the official key layout (tiny
architectures ``prolip-tiny`` / ``pcmepp-tiny``). The reference is a float64 re-implementation of
the official forward passes (naver-ai/prolip ``src/prolip/transformer.py``; naver-ai/pcmepp
``hf_models/``), written against the *official* key names, independent of open_clip and of
zsprob's key map. With ``ZSPROB_PROLIP_SRC`` pointing at ProLIP's ``src/`` directory, the official
model class itself is compared too.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers_convert import zsprob_to_official
from test_models_hf_tokenizer import make_tokenizer_dir
from zsprob.errors import UserError
from zsprob.models import create_model, load, save


# ------------------------------------------------------------------ float64 reference (official names)
def _ln(x, sd, prefix, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps)


def _block(x, sd, p, heads, mask=None, eps=1e-5, act=F.gelu):
    """A pre-norm residual attention block (ln_1, attn, ln_2, mlp c_fc / ``act`` / c_proj), batch first;
    ``act``: GELU (open_clip's default), QuickGELU for OpenAI CLIP trunks (tests/test_models_pcmepp_coco.py)."""
    b, n, w = x.shape
    h = _ln(x, sd, p + ".ln_1", eps)
    q, k, v = F.linear(h, sd[p + ".attn.in_proj_weight"], sd[p + ".attn.in_proj_bias"]).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, n, heads, w // heads).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-1, -2)) / (w // heads) ** 0.5
    if mask is not None:
        att = att + mask
    out = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, w)
    x = x + F.linear(out, sd[p + ".attn.out_proj.weight"], sd[p + ".attn.out_proj.bias"])
    h = _ln(x, sd, p + ".ln_2", eps)
    h = F.linear(act(F.linear(h, sd[p + ".mlp.c_fc.weight"], sd[p + ".mlp.c_fc.bias"])),
                 sd[p + ".mlp.c_proj.weight"], sd[p + ".mlp.c_proj.bias"])
    return x + h


def _patches(images, sd, prefix, patch):
    x = F.conv2d(images, sd[prefix + "conv1.weight"], stride=patch)
    return x.flatten(2).transpose(1, 2)


def prolip_reference(sd, images, text, heads=2, patch=8, layers=2):
    """ProLIP's released forward: (image mu, image logvar, text mu, text logvar), float64."""
    sd = {k: v.double() for k, v in sd.items()}
    x = _patches(images.double(), sd, "visual.", patch)
    b, w = x.shape[0], x.shape[2]
    x = torch.cat([sd["visual.class_embedding"].expand(b, 1, w), sd["visual.unc_embedding"].expand(b, 1, w), x], 1)
    x = _ln(x + sd["visual.positional_embedding"], sd, "visual.ln_pre", 1e-5)
    for i in range(layers):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}", heads)
    x = _ln(x, sd, "visual.ln_post", 1e-5)
    img_mu = _ln(x[:, 0], sd, "visual.ln_post", 1e-5) @ sd["visual.proj"]  # ln_post twice, as released
    img_logvar = F.linear(x[:, 1], sd["visual.uncertainty_proj.weight"], sd["visual.uncertainty_proj.bias"])
    t = sd["text.token_embedding.weight"][text]
    b, n, w = t.shape
    t = torch.cat([t, sd["text.unc_emb"].expand(b, 1, w), sd["text.cls_emb"].expand(b, 1, w)], 1)
    t = t + sd["text.positional_embedding"][:n + 2]
    for i in range(layers):  # no attention mask at all
        t = _block(t, sd, f"text.transformer.resblocks.{i}", heads, eps=1e-6)
    txt = F.linear(_ln(t[:, -1], sd, "text.ln_final", 1e-6), sd["text.text_projection.weight"],
                   sd["text.text_projection.bias"])
    txt_logvar = F.linear(txt, sd["text.text_uncertainty_projection.weight"],
                          sd["text.text_uncertainty_projection.bias"])  # the projected [CLS], as released
    return F.normalize(img_mu, dim=-1), img_logvar, F.normalize(txt, dim=-1), txt_logvar


def pcmepp_hf_reference(sd, images, text, layers=3, unc=2, heads=2, patch=8):
    """PCME++'s hf_models forward (HfPCMEPPModel): (image mu, image logvar, text mu, text logvar), float64."""
    sd = {k: v.double() for k, v in sd.items()}
    x = _patches(images.double(), sd, "visual.", patch)
    b, w = x.shape[0], x.shape[2]
    x = torch.cat([sd["visual.class_embedding"].expand(b, 1, w), x], 1) + sd["visual.positional_embedding"]
    x = _ln(x, sd, "visual.ln_pre", 1e-5)
    for i in range(layers - unc):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}", heads)
    s = x
    for i in range(layers - unc, layers):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}", heads)
    for i in range(unc):
        s = _block(s, sd, f"visual.uncertainty_transformer.resblocks.{i}", heads)
    img_mu = _ln(x[:, 0], sd, "visual.ln_post", 1e-5) @ sd["visual.proj"]
    img_logvar = s[:, 0] @ sd["visual.uncertainty_proj"]  # no LayerNorm, no bias
    n = text.shape[1]
    t = sd["token_embedding.weight"][text] + sd["positional_embedding"][:n]
    causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(layers - unc):
        t = _block(t, sd, f"transformer.resblocks.{i}", heads, causal)
    s = t
    for i in range(layers - unc, layers):
        t = _block(t, sd, f"transformer.resblocks.{i}", heads, causal)
    for i in range(unc):
        s = _block(s, sd, f"uncertainty_transformer.resblocks.{i}", heads, causal)
    eot = text.argmax(dim=-1)
    rows = torch.arange(text.shape[0])
    txt = _ln(t, sd, "ln_final", 1e-5)[rows, eot] @ sd["text_projection"]
    txt_logvar = s[rows, eot] @ sd["uncertainty_text_projection"]
    return F.normalize(img_mu, dim=-1), img_logvar, F.normalize(txt, dim=-1), txt_logvar


# ------------------------------------------------------------------ official files with random weights
def _randomise(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 0.2 + (1.0 if k.endswith(("ln_1.weight", "ln_2.weight"))
                                                          else 0.0)).to(v.dtype)
            for k, v in state.items()}


def write_prolip(directory, seed=0):
    """A ProLIP Hugging Face directory (model.safetensors + config.json + tokenizer/), official names."""
    from safetensors.torch import save_file

    tokenizer = make_tokenizer_dir(directory / "tokenizer")
    model = create_model("prolip-tiny", sigma_head="unc", unc_layout="prolip", pooling="native",
                         tokenizer_dir=tokenizer)
    state = _randomise(zsprob_to_official(model.state_dict(), "prolip"), seed)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"embed_dim": 64, "note": "random weights, prolip-tiny"}))
    return state


def write_pcmepp_hf(directory, seed=0):
    """A PCME++ hf_models directory (model.safetensors + config.json), official names, 2 uncertainty blocks."""
    from safetensors.torch import save_file

    model = create_model("pcmepp-tiny", sigma_depth=2, pooling="native")
    zs = {k: v for k, v in model.state_dict().items() if k not in ("image_sigma.bias", "text_sigma.bias")}
    zs.update({"loss.shift": torch.ones(1), "loss.negative_scale": torch.ones(1)})
    state = _randomise(zsprob_to_official(zs, "pcmepp-hf"), seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"embed_dim": 32, "note": "random weights, pcmepp-tiny"}))
    return state


def _inputs(model, seed=1, n_images=3):
    size = model.image_size
    images = torch.randn(n_images, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return images, model.tokenizer(["a red car on the road", "an oak tree", "a photo of a dog and a cat"])


def _assert_matches(model, reference, images, tokens, atol=2e-5):
    model.eval()
    with torch.no_grad():
        got = (*model.encode_image(images), *model.encode_text(tokens))
    for name, g, want in zip(("image mu", "image logvar", "text mu", "text logvar"), got, reference):
        if want is None:  # a deterministic model: no log sigma^2
            assert g is None, name
            continue
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), want, atol=atol, rtol=1e-4, msg=name)


# ------------------------------------------------------------------ tests
def test_prolip_official_file_computes_the_official_mu_and_logvar(tmp_path):
    state = write_prolip(tmp_path / "prolip")
    model = create_model("prolip-tiny", pretrained=tmp_path / "prolip")  # tokenizer/ found beside the weights
    assert model.config["official_layout"] == "prolip" and model.unc_layout == "prolip"
    images, tokens = _inputs(model)
    assert tokens.shape == (3, 16)
    _assert_matches(model, prolip_reference(state, images, tokens), images, tokens)
    # the converted checkpoint rebuilds the same model, tokenizer included
    again = load(save(model, tmp_path / "ckpt"))
    _assert_matches(again, prolip_reference(state, images, again.tokenizer(
        ["a red car on the road", "an oak tree", "a photo of a dog and a cat"])), images, tokens)


def test_pcmepp_hf_official_file_computes_the_official_mu_and_logvar(tmp_path):
    state = write_pcmepp_hf(tmp_path / "pcmepp")
    model = create_model("pcmepp-tiny", pretrained=tmp_path / "pcmepp")
    assert model.sigma_depth == 2 and model.config["official_layout"] == "pcmepp-hf"
    assert torch.equal(model.official_loss["shift"], state["shift"])
    images, tokens = _inputs(model)
    _assert_matches(model, pcmepp_hf_reference(state, images, tokens), images, tokens)


def test_zsprob_unc_layout_differs_from_the_released_code_where_documented(tmp_path):
    """unc_layout 'zsprob' (the paper's reading) gives the same text mu but another text log sigma^2."""
    state = write_prolip(tmp_path / "prolip")
    released = create_model("prolip-tiny", pretrained=tmp_path / "prolip").eval()
    ours = create_model("prolip-tiny", sigma_head="unc", pooling="native",
                        tokenizer_dir=tmp_path / "prolip" / "tokenizer").eval()
    ours.load_state_dict(released.state_dict())
    images, tokens = _inputs(released)
    with torch.no_grad():
        a, b = released.encode_text(tokens), ours.encode_text(tokens)
        ia, ib = released.encode_image(images), ours.encode_image(images)
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])
    torch.testing.assert_close(ia[1], ib[1])  # image log sigma^2 reads the [UNC] token in both
    assert not torch.allclose(ia[0], ib[0])  # ln_post once vs twice
    del state


def test_strict_loading_names_the_key(tmp_path):
    from safetensors.torch import save_file

    state = write_pcmepp_hf(tmp_path / "pcmepp")
    bad = dict(state)
    bad["visual.transformer.resblocks.0.attn.in_proj_weights"] = bad.pop("visual.transformer.resblocks.0.attn.in_proj_weight")
    save_file(bad, str(tmp_path / "renamed.safetensors"))
    with pytest.raises(UserError, match=r"missing key for 'clip.visual.transformer.resblocks.0.attn.in_proj_weight'"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "renamed.safetensors")
    save_file(dict(state, text_projection=torch.zeros(32, 16)), str(tmp_path / "shape.safetensors"))
    with pytest.raises(UserError, match=r"key 'text_projection' has shape \(32, 16\)"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "shape.safetensors")
    save_file(dict(state, **{"visual.extra": torch.zeros(2)}), str(tmp_path / "extra.safetensors"))
    with pytest.raises(UserError, match=r"key 'visual.extra'"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "extra.safetensors")
    write_prolip(tmp_path / "p2")
    import shutil

    shutil.rmtree(tmp_path / "p2" / "tokenizer")
    with pytest.raises(UserError, match="no Hugging Face tokenizer next to"):
        create_model("prolip-tiny", pretrained=tmp_path / "p2")
    with pytest.raises(UserError, match=r"deterministic must be as it was trained \(deterministic=False\)"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "pcmepp", deterministic=True)
    with pytest.raises(UserError, match="architecture is fixed"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "pcmepp", embed_dim=64)


def test_pytorch_files_load_too(tmp_path):
    state = write_pcmepp_hf(tmp_path / "pcmepp")
    torch.save(state, tmp_path / "pcmepp.pth")
    a = create_model("pcmepp-tiny", pretrained=tmp_path / "pcmepp.pth").eval()
    images, tokens = _inputs(a)
    _assert_matches(a, pcmepp_hf_reference(state, images, tokens), images, tokens)


@pytest.mark.skipif(not os.environ.get("ZSPROB_PROLIP_SRC"), reason="ZSPROB_PROLIP_SRC (naver-ai/prolip src/) not set")
def test_prolip_matches_the_official_model_class(tmp_path):
    """The official ProLIP class itself (its repository's src/ on the path), built tiny and random."""
    from safetensors.torch import save_file

    sys.path.insert(0, os.environ["ZSPROB_PROLIP_SRC"])
    from prolip.model import ProLIP

    cfg = json.loads((__import__("zsprob.utils.paths", fromlist=["x"]).model_configs_dir()
                      / "prolip-tiny.json").read_text())
    cfg.pop("custom_text")
    cfg["vision_cfg"].update(embed_unc=True, init_unc_bias=-10)
    cfg["text_cfg"].update(embed_unc=True, init_unc_bias=-10)
    torch.manual_seed(0)
    official = ProLIP(**cfg).eval()
    state = _randomise(official.state_dict(), 3)
    official.load_state_dict(state)
    (tmp_path / "w").mkdir()
    make_tokenizer_dir(tmp_path / "w" / "tokenizer")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w" / "model.safetensors"))
    model = create_model("prolip-tiny", pretrained=tmp_path / "w")
    images, tokens = _inputs(model)
    with torch.no_grad():
        img, txt = official.encode_image(images, normalize=True), official.encode_text(tokens, normalize=True)
    ref = tuple(t.double() for t in (img["mean"], img["std"], txt["mean"], txt["std"]))
    _assert_matches(model, ref, images, tokens)
    _assert_matches(model, prolip_reference(state, images, tokens), images, tokens)


@pytest.mark.parametrize("name, options, cut", [
    ("prolip-tiny", dict(sigma_head="unc", unc_layout="prolip"), [[0, 1], [16, 17]]),  # released layout
    ("prolip-tiny", dict(sigma_head="unc"), [[0, 1], [16, 17]]),  # zsprob's: text sigma from [UNC]
    # block head; the ViT pools its class token, the causal text tower its end-of-text token (runs whole)
    ("pcmepp-tiny", dict(sigma_depth=2), [[0]]),
])
def test_last_block_at_the_pooled_positions_equals_the_whole_block(tmp_path, monkeypatch, name, options, cut):
    """The last block runs only where native pooling reads (class token, [CLS], [UNC]): mu, log sigma^2 and
    every gradient equal the whole-block forward in float64; GPO and PCME's attention head run it whole."""
    import zsprob.models.prob_clip as pc

    tok_dir = make_tokenizer_dir(tmp_path / "tok") if name.startswith("prolip") else None
    extra = dict(tokenizer_dir=tok_dir) if tok_dir else {}
    model = create_model(name, pooling="native", seed=3, **options, **extra).double().train()
    images, tokens = _inputs(model)
    images = images.double()
    calls = []
    real = pc._run_block_rows
    monkeypatch.setattr(pc, "_run_block_rows", lambda *a: calls.append(a[2]) or real(*a))

    def run():
        model.zero_grad()
        out = model(images, tokens)
        sum(v.pow(2).sum() * (i + 1) for i, v in enumerate(out.values())).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out, grads = run()
    assert calls == cut  # image [CLS, UNC]; text [UNC, CLS] after 16 tokens
    monkeypatch.setattr(pc.ProbCLIP, "_pooled_rows", lambda *a: None)
    ref, ref_grads = run()
    assert calls == cut
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], atol=1e-12, rtol=1e-10, msg=key)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-12, rtol=1e-10, msg=n)
    monkeypatch.undo()
    monkeypatch.setattr(pc, "_run_block_rows", lambda *a: calls.append(a[2]) or real(*a))
    gpo = create_model(name, pooling="gpo", seed=3, **options, **extra).eval()
    with torch.no_grad():
        gpo(images.float(), tokens)
    assert calls == cut  # GPO reads every token: no cut
