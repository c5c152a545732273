"""Checkpoints of PCME++'s official COCO trainer (naver-ai/pcmepp ``train.py``; layout ``pcmepp-coco``)
through ``create_model(name, pretrained=FILE)``, ``zsprob convert``, ``eval coco`` and ``finetune coco``.

The files are written here with random weights in the exact official layout: the key lists are
fixtures (tests/fixtures/official_layouts/pcmepp-coco-*.json, from the official model classes on the
meta device: ViT-B/32 with 1 or 2 uncertainty blocks, with and without the sigma LayerNorm; ViT-B/16 and
ViT-L/14 as the official README's commands build them); the CPU-sized ``pcmepp-coco-tiny`` files are a zsprob ``mean_head="fc"`` model renamed to
the official keys. The reference below is an independent float64 re-implementation of the official
forward (``pcmepp/modules/clip/model.py`` ProbVisionTransformer / ProbTransformer with QuickGELU,
``pcmepp/models/img_encoder.py`` / ``txt_encoder.py``, VSE infinity's GPO: sinusoidal position
encodings -> bidirectional GRU -> linear scores -> softmax(score / 0.1) over the per-dimension
descending-sorted features), written with plain torch ops on the *official* key names: no open_clip,
no zsprob module, no key map. The mu-only baselines (``is_probabilistic_model: false``, layout
``pcmepp-coco-mu``: ``configs/others/info_nce.yaml``, ``vse_infty.yaml``, ``pcmepp_mu_only.yaml``)
run the same reference without the std branches; their fixture is pcmepp-coco-ViT-B-32-mu.json (one
encoder layout, each config's criterion keys beside it). Files of an SWA run (``swa_start_epoch``) add
AveragedModel copies (fixture pcmepp-coco-ViT-B-32-unc1-lnnone-swa.json); the files written here hold raw
and SWA copies with different values, and the reference runs on the copy ``weights`` chooses.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from helpers_convert import zsprob_to_official
from test_models_convert import official_layout, official_state
from test_models_published import _assert_matches, _block, _inputs, _ln
from zsprob.errors import UserError
from zsprob.models import create_model, load, save
from zsprob.models.catalogue import LAYOUTS, default_model, detect_layout
from zsprob.models.convert.load import load_official, official_to_zsprob

B32_FIXTURES = [f"pcmepp-coco-ViT-B-32-unc{u}-ln{ln}" for u in (1, 2) for ln in ("none", "0.01")]
COCO_FIXTURES = B32_FIXTURES + ["pcmepp-coco-ViT-B-16-unc1-lnnone", "pcmepp-coco-ViT-L-14-unc1-lnnone"]


MU_FIXTURE = "pcmepp-coco-ViT-B-32-mu"  # the encoders of configs/others/*.yaml, each config's criterion keys beside
MU_CONFIGS = sorted(official_layout(MU_FIXTURE)["criterion_keys"])


def model_of(fixture: str) -> str:
    """The zsprob model of a COCO layout fixture: pcmepp-coco-ViT-L-14-unc1-lnnone -> pcmepp-coco-ViT-L-14."""
    return fixture.split("-unc")[0]


# ------------------------------------------------------------------ float64 reference (official names)
def _quick_gelu(h):
    return h * torch.sigmoid(1.702 * h)  # OpenAI CLIP's activation (the official COCO trainer's backbones)


def _gru_direction(x, sd, p, suffix):
    """One direction of a 1-layer GRU (PyTorch's gate order r, z, n) over x [n, d_in] -> [n, d_hidden]."""
    w_ih, w_hh = sd[f"{p}.weight_ih_l0{suffix}"], sd[f"{p}.weight_hh_l0{suffix}"]
    b_ih, b_hh = sd[f"{p}.bias_ih_l0{suffix}"], sd[f"{p}.bias_hh_l0{suffix}"]
    h = torch.zeros(w_hh.shape[1], dtype=x.dtype)
    out = []
    for t in range(x.shape[0]):
        gi, gh = w_ih @ x[t] + b_ih, w_hh @ h + b_hh
        ir, iz, i_n = gi.chunk(3)
        hr, hz, hn = gh.chunk(3)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * hn)
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out)


def _gpo(features, lengths, sd, p, d_pe=32):
    """VSE infinity's GPO, one sample at a time: features [B, T, D], lengths [B] -> [B, D]."""
    pooled = []
    for feats, n in zip(features, lengths.tolist()):
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        div = torch.exp(torch.arange(0, d_pe, 2, dtype=torch.float64) * -(math.log(10000.0) / d_pe))
        pe = torch.zeros(n, d_pe, dtype=torch.float64)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        fwd = _gru_direction(pe, sd, p + ".gru", "")
        bwd = _gru_direction(pe.flip(0), sd, p + ".gru", "_reverse").flip(0)
        scores = ((fwd + bwd) / 2) @ sd[p + ".linear.weight"][0]
        weights = torch.softmax(scores / 0.1, dim=0)
        ranked = feats[:n].sort(dim=0, descending=True).values
        pooled.append((ranked * weights[:, None]).sum(0))
    return torch.stack(pooled)


def _std_head(tokens, lengths, sd, fc, gpool, ln):
    """The official std branch (biased fc, GPO, the sigma LayerNorm if any); None in a mu-only file."""
    if fc + ".weight" not in sd:
        return None
    out = _gpo(F.linear(tokens, sd[fc + ".weight"], sd[fc + ".bias"]), lengths, sd, gpool)
    return _ln(out, sd, ln) if ln + ".weight" in sd else out


def coco_reference(sd, images, text, *, layers, unc, image_heads, text_heads, patch, text_layers=None):
    """(image mu, image logvar, text mu, text logvar) of the official COCO model in eval mode, float64
    (``layers`` blocks in the image tower, ``text_layers`` - default ``layers`` - in the text tower).
    A mu-only file (``unc=0``, no std keys: the official CLIP / VisionTransformer / EncoderTextClip, the
    same trunk without uncertainty blocks) gives None for both logvars."""
    sd = {k: v.double() for k, v in sd.items()}
    text_layers = layers if text_layers is None else text_layers
    v = "img_enc.backbone."
    x = F.conv2d(images.double(), sd[v + "conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    b, w = x.shape[0], x.shape[2]
    x = torch.cat([sd[v + "class_embedding"].expand(b, 1, w), x], 1) + sd[v + "positional_embedding"]
    x = _ln(x, sd, v + "ln_pre")
    for i in range(layers - unc):
        x = _block(x, sd, f"{v}transformer.resblocks.{i}", image_heads, act=_quick_gelu)
    s = x
    for i in range(layers - unc, layers):
        x = _block(x, sd, f"{v}transformer.resblocks.{i}", image_heads, act=_quick_gelu)
    for i in range(unc):
        s = _block(s, sd, f"{v}uncertainty_transformer.resblocks.{i}", image_heads, act=_quick_gelu)
    all_tokens = torch.full((b,), x.shape[1], dtype=torch.long)  # every token, class token included
    enc = "img_enc.image_encoder."
    img_mu = _gpo(F.linear(x, sd[enc + "fc.weight"], sd[enc + "fc.bias"]), all_tokens, sd, enc + "gpool")
    std = "img_enc.image_std_encoder."
    img_std = _std_head(s, all_tokens, sd, std + "fc", std + "gpool", "img_enc.image_std_ln")

    t = "txt_enc.backbone."
    n = text.shape[1]
    y = sd[t + "token_embedding.weight"][text] + sd[t + "positional_embedding"][:n]
    causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(text_layers - unc):
        y = _block(y, sd, f"{t}transformer.resblocks.{i}", text_heads, causal, act=_quick_gelu)
    ys = y
    for i in range(text_layers - unc, text_layers):
        y = _block(y, sd, f"{t}transformer.resblocks.{i}", text_heads, causal, act=_quick_gelu)
    for i in range(unc):
        ys = _block(ys, sd, f"{t}transformer.prob_resblocks.{i}", text_heads, causal, act=_quick_gelu)
    lengths = text.argmax(dim=-1) + 1  # <start> .. <end> (the end token has the highest id)
    y = _ln(y, sd, t + "ln_final")  # the mean branch only
    txt_mu = _gpo(F.linear(y, sd["txt_enc.linear.weight"], sd["txt_enc.linear.bias"]), lengths, sd, "txt_enc.gpool")
    txt_std = _std_head(ys, lengths, sd, "txt_enc.std_linear", "txt_enc.std_gpool", "txt_enc.text_std_ln")
    return F.normalize(img_mu, dim=-1), img_std, F.normalize(txt_mu, dim=-1), txt_std


TINY = dict(layers=3, image_heads=2, text_heads=2, patch=8)
B32 = dict(layers=12, image_heads=12, text_heads=8, patch=32)
B16 = dict(layers=12, image_heads=12, text_heads=8, patch=16)
L14 = dict(layers=24, text_layers=12, image_heads=16, text_heads=12, patch=14)  # OpenAI CLIP ViT-L/14: heads = width / 64


# ------------------------------------------------------------------ official files with random weights
def _randomise(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 0.2 + (1.0 if k.endswith(("ln_1.weight", "ln_2.weight"))
                                                          else 0.0)).to(v.dtype)
            for k, v in state.items()}


def tiny_coco_state(unc: int = 2, ln: bool = True, seed: int = 0) -> dict:
    """Official COCO-trainer names, pcmepp-coco-tiny shapes, random weights."""
    model = create_model("pcmepp-coco-tiny", mean_head="fc", sigma_depth=unc, sigma_ln_init=0.01 if ln else None)
    coco = LAYOUTS["pcmepp-coco"]
    skip = set(coco.zero_fills) | set(coco.keep_own)
    zs = {k: v for k, v in model.state_dict().items() if k not in skip}
    zs.update({"loss.shift": torch.ones(1), "loss.negative_scale": torch.ones(1)})
    return _randomise(zsprob_to_official(zs, "pcmepp-coco"), seed)


def mu_only_state(config: str, device="meta", generator=None) -> dict:
    """The exact official ViT-B/32 mu-only layout of ``config`` (encoders + that criterion's keys)."""
    state = {k: v for k, v in official_state(MU_FIXTURE, device, generator).items() if not k.startswith("criterion.")}
    for key, spec in official_layout(MU_FIXTURE)["criterion_keys"][config].items():
        state[key] = torch.empty(spec["shape"], device="meta") if device == "meta" else torch.full(spec["shape"], 5.0)
    return state


def tiny_mu_state(config: str = "configs/others/info_nce.yaml", seed: int = 0) -> dict:
    """Official mu-only COCO-trainer names (``config``'s criterion), pcmepp-coco-tiny shapes, random weights."""
    model = create_model("pcmepp-coco-tiny", mean_head="fc", deterministic=True)
    zs = {k: v for k, v in model.state_dict().items() if k not in LAYOUTS["pcmepp-coco-mu"].keep_own}
    state = zsprob_to_official(zs, "pcmepp-coco-mu")
    state.update({k: torch.ones(spec["shape"]) for k, spec in official_layout(MU_FIXTURE)["criterion_keys"][config].items()})
    return _randomise(state, seed)


def _key_patterns(keys) -> set[str]:
    return {re.sub(r"\.\d+\.", ".N.", k) for k in keys}


def write_trainer_ckpt(path, state: dict):
    """The dict a Lightning ModelCheckpoint writes (weights under ``state_dict``)."""
    torch.save({"epoch": 24, "global_step": 1000, "state_dict": state}, path)
    return path


# ------------------------------------------------------------------ tests
def test_convert_picks_the_coco_backbone_from_the_patch_size():
    for fixture in COCO_FIXTURES:
        assert default_model("pcmepp-coco", official_state(fixture)) == model_of(fixture)
    assert default_model("pcmepp-hf", official_state("pcmepp-ViT-B-16")) == "pcmepp-ViT-B-16"


@pytest.mark.parametrize("fixture", COCO_FIXTURES)
def test_every_coco_layout_fills_its_model_exactly(fixture):
    """The loader's options build a model whose keys are the official ones, shape for shape (the zero sigma
    biases and open_clip's unused logit_scale are the only fills), and the strict loader takes the file
    (every official key consumed, every parameter filled), on the meta device."""
    state = official_state(fixture)
    cfg = official_layout(fixture)["config"]["model"]
    options = LAYOUTS["pcmepp-coco"].options_for(state)
    assert options["mean_head"] == "fc" and options["pooling"] == "gpo"
    assert options["sigma_depth"] == cfg["n_unc_layers"]
    assert (options["sigma_ln_init"] is None) == (cfg["sigma_ln_init"] is None)
    with torch.device("meta"):
        model = create_model(model_of(fixture), **options)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    converted = {k: tuple(v.shape) for k, v in official_to_zsprob(state, "pcmepp-coco").items()
                 if not k.startswith("loss.")}
    coco = LAYOUTS["pcmepp-coco"]
    assert set(expected) - set(converted) == set(coco.zero_fills) | set(coco.keep_own)
    assert set(converted) <= set(expected) and all(converted[k] == expected[k] for k in converted)
    assert set(load_official(model, state, "pcmepp-coco", fixture)) == {"shift", "negative_scale"}


@pytest.mark.parametrize("unc,ln", [(1, False), (2, True)])
def test_tiny_official_file_computes_the_official_mu_and_logvar(tmp_path, unc, ln):
    from safetensors.torch import save_file

    state = tiny_coco_state(unc, ln)
    write_trainer_ckpt(tmp_path / "last.ckpt", state)
    model = create_model("pcmepp-coco-tiny", pretrained=tmp_path / "last.ckpt")
    assert model.config["official_layout"] == "pcmepp-coco" and model.mean_head == "fc"
    assert model.sigma_depth == unc and (model.image_sigma.sigma_ln is not None) == ln
    assert torch.equal(model.official_loss["shift"], state["criterion.shift"])
    images, tokens = _inputs(model)
    reference = coco_reference(state, images, tokens, unc=unc, **TINY)
    _assert_matches(model, reference, images, tokens, atol=1e-5)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    _assert_matches(create_model("pcmepp-coco-tiny", pretrained=tmp_path / "w.safetensors"), reference, images,
                    tokens, atol=1e-5)
    # the zsprob checkpoint rebuilds the same model (mean_head kept in its config)
    again = load(save(model, tmp_path / "ckpt"))
    assert again.mean_head == "fc"
    _assert_matches(again, reference, images, tokens, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("fixture,dims", [("pcmepp-coco-ViT-B-32-unc2-ln0.01", B32),
                                          ("pcmepp-coco-ViT-B-16-unc1-lnnone", B16)])
def test_full_size_official_files_compute_the_official_mu_and_logvar(tmp_path, fixture, dims):
    """The real ViT-B/32 and ViT-B/16 architectures: a trainer .ckpt and a safetensors file, random weights,
    to 1e-5."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    unc = official_layout(fixture)["config"]["model"]["n_unc_layers"]
    state = official_state(fixture, device="cpu", generator=torch.Generator().manual_seed(0))
    write_trainer_ckpt(tmp_path / "model_best.pth", state)
    model = create_model(model_of(fixture), pretrained=tmp_path / "model_best.pth")
    assert model.sigma_depth == unc and model.embed_dim == 1024
    images, tokens = _inputs(model, n_images=2)
    tokens = tokens[:2]
    with torch.no_grad():
        reference = coco_reference(state, images, tokens, unc=unc, **dims)
    _assert_matches(model, reference, images, tokens, atol=1e-5)
    del model
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    _assert_matches(create_model(model_of(fixture), pretrained=tmp_path / "w.safetensors"), reference,
                    images, tokens, atol=1e-5)


def _first_blocks(state: dict, n: int) -> dict:
    """The official state of the same model with ``n`` trunk blocks per tower (the uncertainty blocks kept)."""
    trunks = ("img_enc.backbone.transformer.resblocks.", "txt_enc.backbone.transformer.resblocks.")
    return {k: v for k, v in state.items()
            if not k.startswith(trunks) or int(k.split("resblocks.", 1)[1].split(".", 1)[0]) < n}


@pytest.mark.slow
def test_l14_official_file_computes_the_official_mu_and_logvar_on_two_blocks(tmp_path):
    """ViT-L/14 at its real widths, heads, patch and D (1024 / 768 wide, 16 / 12 heads, 257 image tokens),
    cut to 2 blocks per tower: the official build_model counts the blocks from the file and every block has
    the same keys and shapes, so this is the same code path; the full 24 + 12 blocks are checked on the meta
    device above (strict fill) and here by a round trip of the real-size file."""
    state = official_state("pcmepp-coco-ViT-L-14-unc1-lnnone", device="cpu", generator=torch.Generator().manual_seed(2))
    write_trainer_ckpt(tmp_path / "full.ckpt", state)
    model = create_model("pcmepp-coco-ViT-L-14", pretrained=tmp_path / "full.ckpt")
    own = model.state_dict()
    fills = LAYOUTS["pcmepp-coco"].zero_fills + LAYOUTS["pcmepp-coco"].keep_own
    back = zsprob_to_official({k: v for k, v in own.items() if k not in fills}
                              | {f"loss.{k}": v for k, v in model.official_loss.items()}, "pcmepp-coco")
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    del model, own, back
    small = _first_blocks(state, 2)
    write_trainer_ckpt(tmp_path / "two.ckpt", small)
    model = create_model("pcmepp-coco-ViT-L-14", pretrained=tmp_path / "two.ckpt",
                         open_clip_cfg={"vision_cfg": {"layers": 2}, "text_cfg": {"layers": 2}})
    images, tokens = _inputs(model, n_images=2)
    with torch.no_grad():
        reference = coco_reference(small, images, tokens[:2], unc=1, **dict(L14, layers=2, text_layers=2))
    _assert_matches(model, reference, images, tokens[:2], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", [f for f in B32_FIXTURES if f != "pcmepp-coco-ViT-B-32-unc2-ln0.01"])
def test_other_b32_layouts_load_from_trainer_checkpoints(tmp_path, fixture):
    state = official_state(fixture, device="cpu", generator=torch.Generator().manual_seed(1))
    write_trainer_ckpt(tmp_path / "last.ckpt", state)
    model = create_model("pcmepp-coco-ViT-B-32", pretrained=tmp_path / "last.ckpt")
    got = model.state_dict()
    converted = official_to_zsprob(state, "pcmepp-coco")
    assert all(torch.equal(got[k], v) for k, v in converted.items() if not k.startswith("loss."))


def test_renamed_or_misshaped_keys_fail_in_one_line_naming_the_key(tmp_path):
    state = tiny_coco_state()
    bad = dict(state)
    bad["txt_enc.linear.weights"] = bad.pop("txt_enc.linear.weight")
    write_trainer_ckpt(tmp_path / "renamed.ckpt", bad)
    with pytest.raises(UserError, match=r"missing key for 'text_head.fc.weight' \(official 'txt_enc.linear.weight'\)"):
        create_model("pcmepp-coco-tiny", pretrained=tmp_path / "renamed.ckpt")
    bad = dict(state)
    bad["img_enc.image_std_encoder.fc.weight"] = torch.zeros(16, 64)
    write_trainer_ckpt(tmp_path / "shape.ckpt", bad)
    with pytest.raises(UserError, match=r"key 'img_enc.image_std_encoder.fc.weight' has shape \(16, 64\)") as e:
        create_model("pcmepp-coco-tiny", pretrained=tmp_path / "shape.ckpt")
    assert "\n" not in str(e.value)
    bad = dict(state)
    bad["img_enc.backbone.proj"] = torch.zeros(64, 32)  # open_clip's projection: not in the COCO layout
    write_trainer_ckpt(tmp_path / "extra.ckpt", bad)
    with pytest.raises(UserError, match=r"key 'img_enc.backbone.proj'"):
        create_model("pcmepp-coco-tiny", pretrained=tmp_path / "extra.ckpt")
    write_trainer_ckpt(tmp_path / "ok.ckpt", state)
    with pytest.raises(UserError, match="mean_head must be as it was trained"):
        create_model("pcmepp-coco-tiny", pretrained=tmp_path / "ok.ckpt", mean_head="proj")


def test_mean_head_fc_builds_trains_and_round_trips(tmp_path):
    """mean_head 'fc' on a fresh model: no ln_post / projections in the wrapped open_clip model, the fc heads
    are heads (not backbone) for the optimiser, gradients reach them, and save / load / fine-tune keep them."""
    model = create_model("pcmepp-coco-tiny", mean_head="fc", sigma_depth=2)
    keys = set(model.state_dict())
    assert not any(k.startswith(("clip.visual.ln_post", "clip.visual.proj", "clip.text_projection")) for k in keys)
    assert {"image_head.fc.weight", "image_head.fc.bias", "text_head.fc.weight", "image_sigma.proj.bias"} <= keys
    info = model.param_info()
    assert info["image_head.fc.weight"]["tower"] == "image" and not info["image_head.fc.weight"]["backbone"]
    assert info["text_head.fc.bias"]["tower"] == "text"
    images, tokens = _inputs(model)
    out = model(images, tokens)
    (out["img_mu"].sum() + out["txt_mu"].sum() + out["img_logvar"].sum() + out["txt_logvar"].sum()).backward()
    assert model.image_head["fc"].weight.grad.abs().sum() > 0 and model.text_head["fc"].weight.grad.abs().sum() > 0
    saved = save(model, tmp_path / "ckpt")
    again = load(saved)
    assert again.config["mean_head"] == "fc"
    tuned = create_model("pcmepp-coco-tiny", pretrained=saved, sigma_depth=2)  # fine-tuning start: heads reused
    assert tuned.mean_head == "fc" and {"image_head", "text_head"} <= set(tuned.config["heads_from_checkpoint"])
    for m in (again, tuned):
        for k, v in model.state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k
    with pytest.raises(UserError, match="mean_head must be one of proj, fc"):
        create_model("pcmepp-coco-tiny", mean_head="linear")
    with pytest.raises(UserError, match="goes with sigma_head 'block'"):
        create_model("pcmepp-coco-tiny", mean_head="fc", sigma_head="unc")
    with pytest.raises(UserError, match="needs an open_clip CLIP with a ViT image tower"):
        create_model("zsprob-tiny-cnn", mean_head="fc")
    # the default mean head is unchanged: open_clip's ln_post and projections
    plain = create_model("pcmepp-coco-tiny")
    assert plain.mean_head == "proj" and "clip.visual.proj" in plain.state_dict() and plain.image_head is None


def test_mean_head_fc_starts_from_open_clip_weights(tmp_path):
    """The official training start: open_clip (OpenAI CLIP) weights fill both trunks, ln_post and the
    projections are dropped (another embed_dim is no error: they are not used)."""
    import open_clip

    from zsprob.models.factory import get_open_clip_config

    cfg = get_open_clip_config("pcmepp-coco-tiny")
    cfg.pop("preprocess_cfg")
    cfg["embed_dim"] = 16
    reference = open_clip.CLIP(**cfg)
    torch.save(reference.state_dict(), tmp_path / "clip.pt")
    model = create_model("pcmepp-coco-tiny", pretrained=tmp_path / "clip.pt", mean_head="fc")
    own = model.state_dict()
    for key, value in reference.state_dict().items():
        if key.startswith(("visual.ln_post", "visual.proj", "text_projection")):
            assert "clip." + key not in own
            continue
        assert torch.equal(own["clip." + key], value), key


# ------------------------------------------------------------------ mu-only baselines (pcmepp-coco-mu)
@pytest.mark.parametrize("config", MU_CONFIGS)
def test_mu_only_layout_fills_a_deterministic_model_exactly(config):
    """configs/others/*.yaml (is_probabilistic_model: false) on ViT-B/32: detected as pcmepp-coco-mu and
    loaded strictly, on the meta device, into a model without log sigma^2 heads; every official key
    consumed (the criterion's tau / shift / negative_scale, or none for the triplet loss, as loss tensors)."""
    state = mu_only_state(config)
    assert detect_layout(state) == "pcmepp-coco-mu" and default_model("pcmepp-coco-mu", state) == "pcmepp-coco-ViT-B-32"
    options = LAYOUTS["pcmepp-coco-mu"].options_for(state)
    assert options["deterministic"] is True and options["mean_head"] == "fc" and options["pooling"] == "gpo"
    with torch.device("meta"):
        model = create_model("pcmepp-coco-ViT-B-32", **options)
    assert model.image_sigma is None and model.text_sigma is None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    converted = {k: tuple(v.shape) for k, v in official_to_zsprob(state, "pcmepp-coco-mu").items()
                 if not k.startswith("loss.")}
    assert set(expected) - set(converted) == set(LAYOUTS["pcmepp-coco-mu"].keep_own)
    assert set(converted) <= set(expected) and all(converted[k] == expected[k] for k in converted)
    loss = load_official(model, state, "pcmepp-coco-mu", MU_FIXTURE)
    assert sorted(loss) == sorted(k[len("criterion."):] for k in state if k.startswith("criterion."))


def test_tiny_mu_only_file_computes_the_official_mu(tmp_path):
    from safetensors.torch import save_file

    state = tiny_mu_state()
    assert _key_patterns(state) == _key_patterns(mu_only_state("configs/others/info_nce.yaml"))  # the official names
    ckpt = write_trainer_ckpt(tmp_path / "last.ckpt", state)
    model = create_model("pcmepp-coco-tiny", pretrained=ckpt)
    assert model.config["official_layout"] == "pcmepp-coco-mu" and model.deterministic and model.mean_head == "fc"
    assert torch.equal(model.official_loss["tau"], state["criterion.tau"])
    images, tokens = _inputs(model)
    reference = coco_reference(state, images, tokens, unc=0, **TINY)
    assert reference[1] is None and reference[3] is None
    _assert_matches(model, reference, images, tokens, atol=1e-5)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    _assert_matches(create_model("pcmepp-coco-tiny", pretrained=tmp_path / "w.safetensors"), reference, images,
                    tokens, atol=1e-5)
    again = load(save(model, tmp_path / "ckpt"))
    assert again.deterministic and again.mean_head == "fc"
    _assert_matches(again, reference, images, tokens, atol=1e-5)
    # deterministic=True is the file's own; False contradicts it (and True a probabilistic file)
    assert create_model("pcmepp-coco-tiny", pretrained=ckpt, deterministic=True).deterministic
    with pytest.raises(UserError, match=r"deterministic must be as it was trained \(deterministic=True\)"):
        create_model("pcmepp-coco-tiny", pretrained=ckpt, deterministic=False)
    prob = write_trainer_ckpt(tmp_path / "prob.ckpt", tiny_coco_state(1, False))
    with pytest.raises(UserError, match=r"deterministic must be as it was trained \(deterministic=False\)"):
        create_model("pcmepp-coco-tiny", pretrained=prob, deterministic=True)


def test_mu_only_misshaped_or_half_probabilistic_files_fail_in_one_line(tmp_path):
    state = tiny_mu_state("configs/others/vse_infty.yaml")
    prob = tiny_coco_state(1, False)
    cases = [
        (dict(state, **{"txt_enc.linear.weight": torch.zeros(16, 64)}),
         r"key 'txt_enc.linear.weight' has shape \(16, 64\), the model expects"),
        ({k: v for k, v in state.items() if k != "txt_enc.gpool.linear.weight"},
         r"missing key for 'text_gpo.score.weight' \(official 'txt_enc.gpool.linear.weight'\)"),
        (dict(state, **{k: v for k, v in prob.items() if k.startswith("img_enc.image_std_encoder.")}),
         r"neither PCME\+\+ COCO layout: it has image std encoder but no image uncertainty blocks, text uncertainty "
         r"blocks, text std head"),
        # what the official mu-only encoders hold if n_unc_layers is set too: uncertainty blocks, no std heads
        (dict(state, **{k: v for k, v in prob.items() if "uncertainty_transformer" in k or "prob_resblocks" in k}),
         r"neither PCME\+\+ COCO layout: it has image uncertainty blocks, text uncertainty blocks but no image std"),
    ]
    for i, (bad, message) in enumerate(cases):
        write_trainer_ckpt(tmp_path / f"bad{i}.ckpt", bad)
        with pytest.raises(UserError, match=message) as e:
            create_model("pcmepp-coco-tiny", pretrained=tmp_path / f"bad{i}.ckpt")
        assert "\n" not in str(e.value) and f"bad{i}.ckpt" in str(e.value)


@pytest.mark.slow
def test_b32_mu_only_file_computes_the_official_mu(tmp_path):
    """The real ViT-B/32 mu-only layout (configs/others/vse_infty.yaml: no criterion keys), random weights."""
    state = mu_only_state("configs/others/vse_infty.yaml", device="cpu", generator=torch.Generator().manual_seed(4))
    write_trainer_ckpt(tmp_path / "last.ckpt", state)
    model = create_model("pcmepp-coco-ViT-B-32", pretrained=tmp_path / "last.ckpt")
    assert model.deterministic and model.official_loss == {}
    images, tokens = _inputs(model, n_images=2)
    with torch.no_grad():
        reference = coco_reference(state, images, tokens[:2], unc=0, **B32)
    _assert_matches(model, reference, images, tokens[:2], atol=1e-5)


# ------------------------------------------------------------------ SWA copies (train.swa_start_epoch)
SWA_FIXTURE = "pcmepp-coco-ViT-B-32-unc1-lnnone-swa"  # configs/pcmepp.yaml as shipped: raw keys + AveragedModel copies


def with_swa(state: dict, kind: str = "pcmepp-coco", n_averaged: int = 3, seed: int = 7) -> dict:
    """``state`` (official raw names) with the engine's SWA copies of its modules: other random values, the count."""

    out = dict(state)
    for module, copy in LAYOUTS[kind].swa_copies.items():
        own = {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".")}
        out.update({f"{copy}.module.{rest}": v for rest, v in _randomise(own, seed).items()})
        out[f"{copy}.n_averaged"] = torch.tensor(n_averaged)
        seed += 1
    return out


def chosen_copy(state: dict, modules) -> dict:
    """The plain official state whose ``modules`` are taken from their SWA copies (what the reference runs on)."""
    out = {k: v for k, v in state.items() if not k.startswith("swa_")}
    for module in modules:
        prefix = f"swa_{module}.module."
        out.update({module + "." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return out


def test_swa_fixture_is_the_official_modules_wrapped_and_loads_strictly_either_way():
    """The exact SWA layout of configs/pcmepp.yaml (ViT-B/32, from the official classes wrapped in AveragedModel as
    pcmepp/engine.py wraps them): every copy mirrors its raw module key for key, and both choices fill the model
    strictly, on the meta device."""
    from zsprob.models.convert.swa import WEIGHTS, select_weights

    layout = official_layout(SWA_FIXTURE)
    raw = official_layout(layout["raw_keys"])["keys"]
    added = layout["keys"]
    assert layout["config"]["train"]["swa_start_epoch"] == 16
    for module, copy in LAYOUTS["pcmepp-coco"].swa_copies.items():
        assert added[f"{copy}.n_averaged"] == {"shape": [], "dtype": "int64"}
        mirrored = {k[len(copy) + len(".module."):]: v for k, v in added.items() if k.startswith(copy + ".module.")}
        assert mirrored == {k[len(module) + 1:]: v for k, v in raw.items() if k.startswith(module + ".")}, module
    assert {k.split(".")[0] for k in added} == set(LAYOUTS["pcmepp-coco"].swa_copies.values())
    state = official_state(SWA_FIXTURE)
    assert detect_layout(state) == "pcmepp-coco" and len(state) == len(raw) + len(added)
    state.update({k: torch.tensor(9) for k in added if k.endswith(".n_averaged")})
    options = LAYOUTS["pcmepp-coco"].options_for(state)
    for weights in WEIGHTS:
        chosen, name = select_weights(state, "pcmepp-coco", weights, SWA_FIXTURE)
        assert name == weights and set(chosen) == set(raw)
        with torch.device("meta"):
            model = create_model("pcmepp-coco-ViT-B-32", **options)
        assert set(load_official(model, chosen, "pcmepp-coco", SWA_FIXTURE)) == {"shift", "negative_scale"}
    assert select_weights(state, "pcmepp-coco", None, SWA_FIXTURE)[1] == "swa-text"  # the official final evaluation


@pytest.mark.parametrize("weights,modules", [(None, ("txt_enc",)), ("swa-text", ("txt_enc",)),
                                             ("swa", ("img_enc", "txt_enc", "criterion")), ("raw", ())])
def test_swa_file_loads_the_chosen_copy(tmp_path, weights, modules):
    """A file whose raw and SWA copies differ: the loaded model computes the official mu / log sigma^2 of the
    chosen copy (the float64 reference on that copy), with that copy's shift / negative_scale."""
    state = with_swa(tiny_coco_state(1, False))
    assert _key_patterns(state) == _key_patterns(official_state(SWA_FIXTURE))  # the official names
    ckpt = write_trainer_ckpt(tmp_path / "last.ckpt", state)
    model = create_model("pcmepp-coco-tiny", pretrained=ckpt, **({} if weights is None else {"weights": weights}))
    assert model.config["official_weights"] == (weights or "swa-text")
    chosen = chosen_copy(state, modules)
    assert torch.equal(model.official_loss["shift"], chosen["criterion.shift"])
    images, tokens = _inputs(model)
    reference = coco_reference(chosen, images, tokens, unc=1, **TINY)
    _assert_matches(model, reference, images, tokens, atol=1e-5)
    other = coco_reference(chosen_copy(state, {"img_enc", "txt_enc"} - set(modules)), images, tokens, unc=1, **TINY)
    assert not torch.allclose(reference[0], other[0]) and not torch.allclose(reference[2], other[2])


def test_swa_mu_only_file_has_no_criterion_copy(tmp_path):
    """is_swa_criterion is is_probabilistic_model: a mu-only SWA file averages the encoders only."""
    state = with_swa(tiny_mu_state(), "pcmepp-coco-mu")
    assert not any(k.startswith("swa_criterion.") for k in state)
    model = create_model("pcmepp-coco-tiny", pretrained=write_trainer_ckpt(tmp_path / "mu.ckpt", state), weights="swa")
    assert model.deterministic and torch.equal(model.official_loss["tau"], state["criterion.tau"])
    images, tokens = _inputs(model)
    chosen = chosen_copy(state, ("img_enc", "txt_enc"))
    _assert_matches(model, coco_reference(chosen, images, tokens, unc=0, **TINY), images, tokens, atol=1e-5)
    bad = dict(state, **{"swa_criterion.n_averaged": torch.tensor(3), "swa_criterion.module.tau": torch.ones(1)})
    with pytest.raises(UserError, match=r"unexpected key 'swa_criterion\.(n_averaged|module\.tau)'"):
        create_model("pcmepp-coco-tiny", pretrained=write_trainer_ckpt(tmp_path / "bad.ckpt", bad))


def _swa_cases(state: dict) -> list:
    """(file, weights, message) of SWA files that fail; each message names the key."""
    def without(*prefixes):
        return {k: v for k, v in state.items() if not k.startswith(prefixes)}
    never = dict(state, **{k: torch.tensor(0) for k in state if k.endswith(".n_averaged")})
    return [
        (without("swa_criterion."), None, r"SWA copies for only some modules: it has swa_img_enc, swa_txt_enc but no "
         r"swa_criterion\.\*"),
        (without("swa_txt_enc.", "swa_criterion."), "raw", r"but no swa_txt_enc\.\*, swa_criterion\.\*"),
        (never, "swa", r"weights='swa', but 'swa_txt_enc.n_averaged' is 0"),
        (never, "swa-text", r"weights='swa-text', but 'swa_txt_enc.n_averaged' is 0"),
        (without("swa_"), "swa", r"weights='swa', but the file holds no SWA copies"),
        (without("txt_enc.linear.weight"), "swa", r"missing key 'txt_enc.linear.weight' \(the SWA copy has "
         r"'swa_txt_enc.module.linear.weight'"),
        (without("swa_img_enc.module.image_encoder.fc.bias"), "raw",
         r"missing key 'swa_img_enc.module.image_encoder.fc.bias' \(the raw copy has 'img_enc.image_encoder.fc.bias'"),
        (dict(state, **{"swa_img_enc.module.image_encoder.fc.weight": torch.zeros(16, 64)}), "raw",
         r"key 'swa_img_enc.module.image_encoder.fc.weight' has shape \(16, 64\)"),
        (without("swa_img_enc.n_averaged"), None, r"missing key 'swa_img_enc.n_averaged'"),
        (dict(state, **{"swa_img_enc.n_averaged": torch.tensor(2)}), None, r"swa_img_enc.n_averaged=2"),
        (dict(state, **{"swa_img_enc.backbone.proj": torch.zeros(2)}), None,
         r"unexpected key 'swa_img_enc.backbone.proj'"),
        (dict(state, **{"swa_logit_scale.n_averaged": torch.tensor(3)}), None,
         r"unexpected key 'swa_logit_scale.n_averaged'"),
        (dict(state, **{"swa_txt_enc.n_averaged": torch.tensor(0.5)}), None, r"key 'swa_txt_enc.n_averaged' is not an "
         r"integer count"),
    ]


def test_swa_files_fail_in_one_line_naming_the_key(tmp_path):
    state = with_swa(tiny_coco_state(1, False))
    for i, (bad, weights, message) in enumerate(_swa_cases(state)):
        ckpt = write_trainer_ckpt(tmp_path / f"bad{i}.ckpt", bad)
        with pytest.raises(UserError, match=message) as e:
            create_model("pcmepp-coco-tiny", pretrained=ckpt, **({} if weights is None else {"weights": weights}))
        assert "\n" not in str(e.value) and f"bad{i}.ckpt" in str(e.value), (i, str(e.value))
    # copies never averaged (a checkpoint from before swa_start_epoch): the raw weights, unless SWA is asked for
    never = write_trainer_ckpt(tmp_path / "never.ckpt", with_swa(tiny_coco_state(1, False), n_averaged=0))
    assert create_model("pcmepp-coco-tiny", pretrained=never).config["official_weights"] == "raw"
    plain = write_trainer_ckpt(tmp_path / "plain.ckpt", tiny_coco_state(1, False))
    assert create_model("pcmepp-coco-tiny", pretrained=plain, weights="raw").config["official_weights"] == "raw"
    with pytest.raises(UserError, match="weights='raw' chooses the SWA or raw copy of a PCME\\+\\+ COCO trainer "
                                        "checkpoint given as pretrained; no pretrained file is given"):
        create_model("pcmepp-coco-tiny", weights="raw")
    with pytest.raises(UserError, match="weights must be one of swa-text, swa, raw, got 'best'"):
        create_model("pcmepp-coco-tiny", pretrained=plain, weights="best")


def test_weights_applies_to_coco_trainer_files_only(tmp_path):
    from test_models_published import write_pcmepp_hf

    from zsprob.cli.options import OFFICIAL_WEIGHTS
    from zsprob.models import load_for_inference
    from zsprob.models.convert.swa import WEIGHTS

    assert OFFICIAL_WEIGHTS == WEIGHTS  # the CLI's choices (no torch import there) are the loader's
    write_pcmepp_hf(tmp_path / "hf")
    with pytest.raises(UserError, match=r"is an official pcmepp-hf checkpoint: weights='raw' chooses between"):
        create_model("pcmepp-tiny", pretrained=tmp_path / "hf", weights="raw")
    converted = save(create_model("pcmepp-coco-tiny", pretrained=write_trainer_ckpt(
        tmp_path / "last.ckpt", with_swa(tiny_coco_state(1, False)))), tmp_path / "ckpt")
    assert load(converted).config["official_weights"] == "swa-text"
    for kw in (dict(checkpoint=converted), dict(model="pcmepp-coco-tiny", pretrained=converted)):
        with pytest.raises(UserError, match="is a zsprob checkpoint, whose copy was chosen when it was converted"):
            load_for_inference(**kw, weights="swa")
    from zsprob.cli.train_options import _flag_writes
    from zsprob.train.defaults import load_train_config
    from zsprob.train.build import build_model

    assert [item for _, item in _flag_writes({"weights": "swa"})] == ["model.weights=swa"]
    cfg = load_train_config(None, ["model.name=pcmepp-coco-tiny", f"model.pretrained={tmp_path / 'last.ckpt'}",
                                   "model.weights=swa", "model.sigma_depth=1"])
    assert build_model(cfg).config["official_weights"] == "swa"


# ------------------------------------------------------------------ command line, end to end
def _ok(*args, **kw):
    from conftest import run_cli

    r = run_cli(*args, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_convert_eval_and_finetune_from_an_official_coco_file(tmp_path):
    from conftest import run_cli
    from test_data_coco import make_coco
    from test_train_loop import _tiny_coco

    state = tiny_coco_state(2, True)
    ckpt = write_trainer_ckpt(tmp_path / "last.ckpt", state)
    ok = _ok
    out = tmp_path / "converted"
    ok("convert", ckpt, "--model", "pcmepp-coco-tiny", "--out", out)
    model = load(out)
    assert model.config["official_layout"] == "pcmepp-coco" and model.mean_head == "fc"
    images, tokens = _inputs(model)
    _assert_matches(model, coco_reference(state, images, tokens, unc=2, **TINY), images, tokens, atol=1e-5)

    make_coco(tmp_path / "coco")
    metrics = tmp_path / "metrics.json"
    ok("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", ckpt, "--root", tmp_path / "coco",
       "--no-analysis", "--out", metrics)
    assert 0 <= json.loads(metrics.read_text())["metrics"]["coco"]["i2t"]["r@1"] <= 100

    _tiny_coco(tmp_path / "train_coco")
    ok("finetune", "coco", "--config", "finetune_coco_vitb32.yaml", "--root", tmp_path / "train_coco",
       "--out", tmp_path / "run", "--model", "pcmepp-coco-tiny", "--pretrained", ckpt,
       "--set", "model.embed_dim=32", "--batch-size", "16", "--epochs", "3", "--precision", "fp32",
       "--workers", "0", "--no-progress", "--set", "train.tensorboard=false", "--checkpoint-every", "10",
       timeout=900)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps and all(math.isfinite(s["loss"]) for s in steps if s.get("loss") is not None)
    from safetensors.torch import load_file

    # it started from the official weights: the visual backbone, frozen for the recipe's first 2 epochs
    # (10 steps), still holds them at step 10; the trained model keeps the COCO layout
    at10 = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000010" / "model" / "model.safetensors"))
    key = "img_enc.backbone.transformer.resblocks.0.attn.in_proj_weight"
    assert torch.equal(at10["clip.visual.transformer.resblocks.0.attn.in_proj_weight"], state[key])
    tuned = load(tmp_path / "run" / "model")
    assert tuned.mean_head == "fc" and tuned.config["official_layout"] == "pcmepp-coco"

    bad = dict(state)
    bad["txt_enc.gpool.linear.weights"] = bad.pop("txt_enc.gpool.linear.weight")
    write_trainer_ckpt(tmp_path / "renamed.ckpt", bad)
    r = run_cli("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", tmp_path / "renamed.ckpt",
                "--root", tmp_path / "coco")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "txt_enc.gpool.linear.weights" in r.stderr, r.stderr


@pytest.mark.slow
def test_convert_and_eval_coco_from_an_official_mu_only_file(tmp_path):
    from conftest import run_cli
    from test_data_coco import make_coco

    from zsprob.models import load_extra_tensors

    state = tiny_mu_state()
    ckpt = write_trainer_ckpt(tmp_path / "last.ckpt", state)
    out = tmp_path / "converted"
    _ok("convert", ckpt, "--model", "pcmepp-coco-tiny", "--out", out)
    model = load(out)
    assert model.config["official_layout"] == "pcmepp-coco-mu" and model.deterministic
    assert torch.equal(load_extra_tensors(out)["loss.tau"], state["criterion.tau"])
    images, tokens = _inputs(model)
    _assert_matches(model, coco_reference(state, images, tokens, unc=0, **TINY), images, tokens, atol=1e-5)

    make_coco(tmp_path / "coco")
    for args in (("--model", "pcmepp-coco-tiny", "--pretrained", ckpt), ("--checkpoint", out)):
        metrics = tmp_path / "metrics.json"  # no sigma: ranked by cosine, as the official code ranks mu-only models
        _ok("eval", "coco", *args, "--root", tmp_path / "coco", "--score", "cosine", "--no-analysis", "--out", metrics)
        assert 0 <= json.loads(metrics.read_text())["metrics"]["coco"]["i2t"]["r@1"] <= 100
    r = run_cli("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", ckpt, "--root", tmp_path / "coco")
    assert r.returncode == 2 and "score 'csd' needs sigma" in r.stderr.splitlines()[-1], r.stderr

    bad = dict(state, **{"img_enc.image_encoder.fc.bias": torch.zeros(7)})
    write_trainer_ckpt(tmp_path / "shape.ckpt", bad)
    for command in (("convert", tmp_path / "shape.ckpt", "--model", "pcmepp-coco-tiny", "--out", tmp_path / "x"),
                    ("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", tmp_path / "shape.ckpt",
                     "--root", tmp_path / "coco")):
        r = run_cli(*command)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "img_enc.image_encoder.fc.bias" in r.stderr, r.stderr


@pytest.mark.slow
def test_convert_and_eval_coco_from_an_official_swa_file(tmp_path):
    """``zsprob convert`` / ``eval coco`` on a trainer file with SWA copies: the default and --weights choices,
    and the one-line errors (exit 2) naming the key."""
    from conftest import run_cli
    from test_data_coco import make_coco

    state = with_swa(tiny_coco_state(2, True))
    ckpt = write_trainer_ckpt(tmp_path / "last.ckpt", state)
    for weights, modules in ((None, ("txt_enc",)), ("swa", ("img_enc", "txt_enc", "criterion")), ("raw", ())):
        out = tmp_path / f"converted-{weights}"
        r = _ok("convert", ckpt, "--model", "pcmepp-coco-tiny", "--out", out, *(() if weights is None else
                                                                                  ("--weights", weights)))
        assert f"weights: {weights or 'swa-text'}" in r.stdout, r.stdout
        model = load(out)
        assert model.config["official_weights"] == (weights or "swa-text")
        assert model.checkpoint_meta["extra"]["converted_from"]["weights"] == (weights or "swa-text")
        images, tokens = _inputs(model)
        reference = coco_reference(chosen_copy(state, modules), images, tokens, unc=2, **TINY)
        _assert_matches(model, reference, images, tokens, atol=1e-5)

    make_coco(tmp_path / "coco")
    metrics = tmp_path / "metrics.json"
    _ok("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", ckpt, "--weights", "swa", "--root",
        tmp_path / "coco", "--no-analysis", "--out", metrics)
    assert 0 <= json.loads(metrics.read_text())["metrics"]["coco"]["i2t"]["r@1"] <= 100

    never = write_trainer_ckpt(tmp_path / "never.ckpt", with_swa(tiny_coco_state(2, True), n_averaged=0))
    half = write_trainer_ckpt(tmp_path / "half.ckpt",
                              {k: v for k, v in state.items() if not k.startswith("swa_criterion.")})
    for command, key in ((("eval", "coco", "--model", "pcmepp-coco-tiny", "--pretrained", never, "--weights", "swa",
                           "--root", tmp_path / "coco"), "swa_txt_enc.n_averaged"),
                         (("convert", half, "--model", "pcmepp-coco-tiny", "--out", tmp_path / "x"), "swa_criterion"),
                         (("eval", "coco", "--checkpoint", tmp_path / "converted-raw", "--weights", "raw", "--root",
                           tmp_path / "coco"), "converted-raw")):
        r = run_cli(*command)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and key in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
