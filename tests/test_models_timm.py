"""timm image towers (open_clip TimmModel): the mean branch is open_clip's, the heads are cut at stages."""
from __future__ import annotations

import json

import open_clip
import pytest
import torch
from torch import nn

from zsprob import UserError
from zsprob.models import create_model, load, save

TEXT = {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}
# one small timm model per supported family (test_* are timm's own tiny test architectures)
FAMILIES = {"resnet": "test_resnet", "efficientnet": "test_efficientnet", "convnext": "test_convnext",
            "regnet": "regnetx_002", "plaincnn": "zsprob_plaincnn"}
CAPTIONS = ["a red square", "two small blue circles", "x"]


def cfg(timm_name: str, proj: str = "linear") -> dict:
    return {"embed_dim": 32, "text_cfg": TEXT,
            "vision_cfg": {"image_size": 64, "timm_model_name": timm_name, "timm_model_pretrained": False,
                           "timm_pool": "avg", "timm_proj": proj}}


@pytest.fixture(scope="module")
def images():
    return torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    from zsprob.models.factory import register_model_configs

    register_model_configs()  # also registers zsprob's timm model zsprob_plaincnn
    d = tmp_path_factory.mktemp("oc_timm")
    for fam, name in FAMILIES.items():
        (d / f"zsprob-test-{fam}.json").write_text(json.dumps(cfg(name)))
    (d / "zsprob-test-resnet-mlp.json").write_text(json.dumps(cfg("test_resnet", "mlp")))
    open_clip.add_model_config(d)
    return d


@pytest.mark.parametrize("family", list(FAMILIES) + ["resnet-mlp"])
def test_native_mu_equals_open_clip_timm_tower(registered, images, family):
    """Same weights as a model open_clip built itself -> bit-identical image features."""
    name = f"zsprob-test-{family}"
    torch.manual_seed(0)
    oc = open_clip.create_model(name).eval()
    m = create_model(name, pooling="native", seed=7)
    m.clip.load_state_dict(oc.state_dict())
    m.eval()
    with torch.no_grad():
        mu, lv = m.encode_image(images)
        assert torch.equal(mu, oc.encode_image(images, normalize=True))
        # text: cut after the longest EOT by default, exact up to float rounding
        assert torch.allclose(m.encode_text(m.tokenizer(CAPTIONS))[0],
                              oc.encode_text(m.tokenizer(CAPTIONS), normalize=True), atol=1e-5, rtol=0)
    assert lv.shape == mu.shape == (3, 32) and torch.isfinite(lv).all()
    assert m._vision.kind == "timm" and m._vision.layout["family"] == family.split("-")[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sigma_copy_equals_mean_head_and_random_differs(registered, images, family):
    name = f"zsprob-test-{family}"
    for pooling in ("native", "gpo"):
        m = create_model(name, pooling=pooling, sigma_init="copy", normalize_mu=False, seed=1).eval()
        with torch.no_grad():
            mu, lv = m.encode_image(images)
        assert torch.allclose(mu, lv, atol=1e-5), (family, pooling)
    r = create_model(name, seed=1).eval()
    last = r._vision.blocks[-1]
    a = [p for p in last.parameters() if p.ndim == 4][0]
    b = [p for p in r.image_sigma.blocks[0].parameters() if p.ndim == 4][0]
    assert a.shape == b.shape and not torch.equal(a, b)  # re-initialised copy
    # the copy is a separate module: training the sigma head cannot move the mean head
    assert all(p.data_ptr() != q.data_ptr() for p in last.parameters() for q in r.image_sigma.parameters())


@pytest.mark.parametrize("family", ["resnet", "convnext"])
def test_gpo_gradients_depths_and_sigma_depth(registered, images, family):
    name = f"zsprob-test-{family}"
    m = create_model(name, pooling="gpo", sigma_depth=2, seed=0).train()
    out = m(images, m.tokenizer(CAPTIONS))
    (out["img_mu"].sum() + out["img_logvar"].pow(2).sum() + out["txt_logvar"].sum()).backward()
    for n, p in m.named_parameters():
        if p.requires_grad and n.startswith(("clip.visual", "image_sigma", "image_gpo")):
            assert p.grad is not None, n
    assert len(m.image_sigma.blocks) == 2
    info = m.param_info()
    stages = m._vision.layout["stages"]
    nv = len(stages)
    for n, v in info.items():
        if not n.startswith("clip.visual.trunk."):
            continue
        sub = n[len("clip.visual.trunk."):]
        want = next((i + 1 for i, s in enumerate(stages) if sub.startswith(s + ".")), None)
        if want is None:
            want = 0 if any(sub.startswith(s + ".") for s in m._vision.layout["stem"]) else nv + 1
        assert v["depth"] == want and v["tower"] == "image" and v["num_layers"] == nv + 1, n
    sig = [v["depth"] for n, v in info.items() if n.startswith("image_sigma.blocks.0.")]
    assert set(sig) == {nv - 1}  # the copy of stage nv-2 (0-based) sits at its depth
    assert info["clip.visual.head.proj.weight"]["depth"] == nv + 1
    assert not info["image_sigma.blocks.0." + next(iter(dict(m.image_sigma.blocks[0].named_parameters())))]["backbone"]
    with pytest.raises(UserError, match="sigma_depth"):
        create_model(name, sigma_depth=nv + 1)


def test_size_augment_and_bf16_on_cnn_tokens(registered, images):
    m = create_model("zsprob-test-resnet", size_augment=0.5, seed=0).train()
    torch.manual_seed(0)
    mu, lv = m.encode_image(images)
    assert mu.shape == (3, 32) and torch.isfinite(lv).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mu, lv = m.eval().encode_image(images)
    assert mu.dtype == torch.float32 and lv.dtype == torch.float32 and torch.isfinite(mu).all()


def test_shipped_cnn_config_round_trip_and_pretrained_file(registered, images, tmp_path):
    m = create_model("zsprob-tiny-cnn", seed=0).eval()
    assert m.image_size == 64 and m._vision.layout["family"] == "resnet"
    save(m, tmp_path / "ck")
    m2 = load(tmp_path / "ck").eval()
    with torch.no_grad():
        a, b = m.encode_image(images), m2.encode_image(images)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = create_model("zsprob-test-convnext", seed=0).eval()  # head norm used per token and after pooling
    assert not [k for k in c.state_dict() if "token_norm" in k]  # stored once
    save(c, tmp_path / "cx")
    with torch.no_grad():
        a, b = c.encode_image(images), load(tmp_path / "cx").eval().encode_image(images)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # an open_clip state dict written to disk loads into the mean branch; embed_dim change re-inits head.proj
    torch.manual_seed(5)
    oc = open_clip.create_model("zsprob-test-resnet").eval()
    torch.save(oc.state_dict(), tmp_path / "oc.pt")
    p = create_model("zsprob-test-resnet", pretrained=str(tmp_path / "oc.pt"), pooling="native",
                     sigma_init="copy", normalize_mu=False).eval()
    with torch.no_grad():
        ref = oc.encode_image(images)
        mu, lv = p.encode_image(images)
    assert torch.equal(mu, ref) and torch.allclose(lv, ref, atol=1e-5)
    q = create_model("zsprob-test-resnet", pretrained=str(tmp_path / "oc.pt"), embed_dim=16)
    assert sorted(q.config["reinit_params"]) == ["clip.text_projection", "clip.visual.head.proj.weight"]
    assert not q.param_info()["clip.visual.head.proj.weight"]["backbone"]
    assert q.param_info()["clip.visual.trunk.layer1.0.conv1.weight"]["backbone"]


def test_unsupported_timm_towers_fail_clearly(tmp_path):
    c = cfg("test_vit")  # a timm ViT: open_clip's own ViT configs are the supported path
    with pytest.raises(UserError, match="not supported"):
        create_model("zsprob-tiny", open_clip_cfg={"vision_cfg": c["vision_cfg"]})
    c = cfg("test_resnet")
    c["vision_cfg"]["timm_proj"] = "none"  # timm's classifier as the projection
    with pytest.raises(UserError, match="timm_proj"):
        create_model("zsprob-tiny", open_clip_cfg={"vision_cfg": c["vision_cfg"]})


def test_timm_post_module_is_what_timm_does(registered, images):
    """_TimmPost.pooled == timm's forward_head(forward_features) for every family (the cut is exact)."""
    for fam in FAMILIES:
        m = create_model(f"zsprob-test-{fam}", seed=0).eval()
        tower = m._vision
        with torch.no_grad():
            x, _, _ = tower.embed(images)
            for blk in tower.blocks:
                x = blk(x)
            ours = tower.ln.pooled(x)
            ref = tower.trunk.forward_head(tower.trunk.forward_features(images))
            tokens = tower.ln(x)
        assert torch.equal(ours, ref), fam
        assert tokens.ndim == 3 and tokens.shape[0] == 3 and tokens.shape[2] == ours.shape[1]
        assert isinstance(tower.trunk.get_classifier(), nn.Identity)
