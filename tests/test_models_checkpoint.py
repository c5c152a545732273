"""Pretrained open_clip files, zsprob checkpoints (round trip, corruption), batched encoding."""
from __future__ import annotations

import json

import open_clip
import pytest
import torch

from zsprob import UserError
from zsprob.models import (create_model, encode_images, encode_texts, load, load_extra_tensors,
                           load_for_inference, load_meta, save)

TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
NAME = "zsprob-test-ckpt-tiny"
CAPTIONS = ["a red square", "two small blue circles left of a big green triangle", "x"]


@pytest.fixture(scope="module")
def oc_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("oc_cfg2")
    (d / f"{NAME}.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(d)
    torch.manual_seed(7)
    return open_clip.create_model(NAME).eval()


@pytest.fixture(scope="module")
def images():
    return torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _ref(oc, images, tok):
    with torch.no_grad():
        return oc.encode_image(images, normalize=True), oc.encode_text(tok, normalize=True)


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "wrapped"])
def test_pretrained_file_loads_into_mu_branch(oc_model, images, tmp_path, fmt):
    sd = oc_model.state_dict()
    if fmt == "pt":
        path = tmp_path / "oc.pt"
        torch.save(sd, path)
    elif fmt == "wrapped":  # open_clip training checkpoints: {"state_dict": {"module.x": ...}}
        path = tmp_path / "epoch_1.pt"
        torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in sd.items()}}, path)
    else:
        from safetensors.torch import save_file

        path = tmp_path / "open_clip_model.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    m = create_model(NAME, pretrained=str(path), pooling="native", truncate_text=False, sigma_init="random",
                     seed=99).eval()
    tok = m.tokenizer(CAPTIONS)
    ref_i, ref_t = _ref(oc_model, images, tok)
    with torch.no_grad():  # the image tower's last block runs at the class token only: equal up to float rounding
        torch.testing.assert_close(m.encode_image(images)[0], ref_i, atol=1e-6, rtol=0)
        assert torch.equal(m.encode_text(tok)[0], ref_t)
    # random sigma head: differs from the loaded last block
    assert not torch.equal(m.image_sigma.blocks[0].mlp.c_fc.weight,
                           oc_model.visual.transformer.resblocks[-1].mlp.c_fc.weight)
    # copy: the sigma head starts as the *pretrained* mean head
    c = create_model(NAME, pretrained=str(path), sigma_init="copy", seed=5)
    assert torch.equal(c.image_sigma.blocks[0].mlp.c_fc.weight, oc_model.visual.transformer.resblocks[-1].mlp.c_fc.weight)
    assert torch.equal(c.text_sigma.blocks[0].attn.in_proj_weight, oc_model.transformer.resblocks[-1].attn.in_proj_weight)
    assert torch.equal(c.text_sigma.proj, oc_model.text_projection)
    assert c.config["pretrained"] == str(path)


def test_pretrained_directory_and_embed_dim_change(oc_model, tmp_path):
    torch.save(oc_model.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    m = create_model(NAME, pretrained=str(tmp_path), embed_dim=48)
    assert m.embed_dim == 48 and m.clip.visual.proj.shape == (64, 48)
    # blocks loaded, projections re-initialised and no longer "backbone"
    assert torch.equal(m.clip.visual.transformer.resblocks[0].mlp.c_fc.weight,
                       oc_model.visual.transformer.resblocks[0].mlp.c_fc.weight)
    info = m.param_info()
    assert info["clip.visual.proj"]["backbone"] is False and info["clip.text_projection"]["backbone"] is False
    assert info["clip.visual.transformer.resblocks.0.mlp.c_fc.weight"]["backbone"] is True


def test_pretrained_errors(oc_model, tmp_path):
    with pytest.raises(UserError, match="not found"):
        create_model(NAME, pretrained=str(tmp_path / "missing.pt"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read"):
        create_model(NAME, pretrained=str(bad))
    other = {k: v for k, v in oc_model.state_dict().items() if "resblocks.1" not in k}
    torch.save(other, tmp_path / "partial.pt")
    with pytest.raises(UserError, match="does not match"):
        create_model(NAME, pretrained=str(tmp_path / "partial.pt"))
    # a real tag whose weights are not cached: no download, a message naming what to fetch
    with pytest.raises(UserError, match="not in the local cache") as ei:
        create_model("ViT-B-32", pretrained="openai", cache_dir=str(tmp_path / "empty_cache"))
    assert "huggingface" in str(ei.value) or "http" in str(ei.value)
    with pytest.raises(UserError, match="neither a pretrained tag"):
        create_model("ViT-B-32", pretrained="no_such_tag")


def test_save_load_round_trip(images, tmp_path):
    m = create_model("zsprob-tiny", open_clip_cfg=TINY,
                     var_bounds=(0.1, 10), sigma_bias_init=-2.0, seed=1)
    with torch.no_grad():  # make weights differ from any fresh init
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    m.eval()
    tok = m.tokenizer(CAPTIONS)
    ckpt = save(m, tmp_path / "ckpt", extra={"method": "pcmepp", "step": 42, "note": "x"},
                extra_tensors={"loss.scale": torch.tensor(5.0)})
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "zsprob.json").is_file()
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")]
    meta = load_meta(ckpt)
    assert meta["method"] == "pcmepp" and meta["step"] == 42 and meta["extra"]["note"] == "x"
    assert meta["sigma_depth"] == 1 and meta["pooling"] == "gpo" and meta["var_bounds"] == [0.1, 10.0]
    assert meta["config"]["open_clip_cfg"]["vision_cfg"]["width"] == 64 and meta["zsprob_version"]
    r = load(ckpt).eval()
    assert r.name == m.name and r.var_bounds == (0.1, 10.0) and r.embed_dim == 32
    with torch.no_grad():
        a, b = m(images, tok), r(images, tok)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert float(load_extra_tensors(ckpt)["loss.scale"]) == 5.0
    # loading through a file inside the directory works too
    assert load(ckpt / "zsprob.json").embed_dim == 32
    # deterministic models round-trip as well
    d = create_model("zsprob-tiny", open_clip_cfg=TINY, deterministic=True, seed=2)
    save(d, tmp_path / "det")
    rd = load(tmp_path / "det")
    assert rd.deterministic and rd.image_sigma is None
    with torch.no_grad():
        assert torch.equal(d.eval().encode_text(tok)[0], rd.eval().encode_text(tok)[0])


def test_corrupted_checkpoints(tmp_path):
    m = create_model("zsprob-tiny", open_clip_cfg=TINY, seed=3)
    ckpt = save(m, tmp_path / "c")
    w = ckpt / "model.safetensors"
    data = bytearray(w.read_bytes())
    # flipped bytes in the tensor data
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupted"):
        load(ckpt)
    # truncated
    w.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(UserError, match="truncated"):
        load(ckpt)
    # missing weights, missing / malformed metadata, not a directory
    w.unlink()
    with pytest.raises(UserError, match="missing"):
        load(ckpt)
    (ckpt / "zsprob.json").write_text("{ not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load(ckpt)
    (ckpt / "zsprob.json").unlink()
    with pytest.raises(UserError, match="not found"):
        load(ckpt)
    with pytest.raises(UserError, match="not found"):
        load(tmp_path / "nowhere")
    # a garbage safetensors header of the right size (hash check off) is still a clean error
    ck2 = save(m, tmp_path / "c2")
    w2 = ck2 / "model.safetensors"
    n = w2.stat().st_size
    w2.write_bytes(b"\xff" * n)
    with pytest.raises(UserError, match="cannot read"):
        load(ck2, verify=False)


def test_load_for_inference(oc_model, images, tmp_path):
    torch.save(oc_model.state_dict(), tmp_path / "w.pt")
    m = load_for_inference(model=NAME, pretrained=str(tmp_path / "w.pt"))
    assert not m.training and m.deterministic and m.pooling == "native"
    tok = m.tokenizer(CAPTIONS)
    ref_i, ref_t = _ref(oc_model, images, tok)
    with torch.no_grad():
        assert torch.allclose(m.encode_image(images)[0], ref_i, atol=1e-6)
        assert torch.allclose(m.encode_text(tok)[0], ref_t, atol=1e-5)
    save(create_model("zsprob-tiny", open_clip_cfg=TINY, seed=4), tmp_path / "ck")
    assert not load_for_inference(checkpoint=tmp_path / "ck").training
    with pytest.raises(UserError):
        load_for_inference()
    with pytest.raises(UserError):
        load_for_inference(checkpoint=tmp_path / "ck", model=NAME)


def test_encode_helpers(images):
    m = create_model("zsprob-tiny", open_clip_cfg=TINY, seed=5).train()
    ds = [(images[i], i) for i in range(len(images))]
    mu, lv = encode_images(m, ds, batch_size=2, progress=False)
    assert m.training  # mode restored
    m.eval()
    with torch.no_grad():
        ref_mu, ref_lv = m.encode_image(images)
    assert mu.dtype == torch.float32 and mu.device.type == "cpu" and mu.shape == (5, 32)
    assert torch.allclose(mu, ref_mu, atol=1e-5) and torch.allclose(lv, ref_lv, atol=1e-5)
    from torch.utils.data import DataLoader

    mu2, _ = encode_images(m, DataLoader(images, batch_size=3), progress=False)
    assert torch.allclose(mu2, ref_mu, atol=1e-5)
    caps = CAPTIONS * 3
    tmu, tlv = encode_texts(m, caps, batch_size=4, progress=False)
    with torch.no_grad():
        r_mu, r_lv = m.encode_text(m.tokenizer(caps))
    assert tmu.shape == (9, 32) and torch.allclose(tmu, r_mu, atol=1e-5) and torch.allclose(tlv, r_lv, atol=1e-4)
    e_mu, e_lv = encode_texts(m, [], progress=False)
    assert e_mu.shape == (0, 32) and e_lv.shape == (0, 32)
    d = create_model("zsprob-tiny", open_clip_cfg=TINY, deterministic=True, seed=6)
    dm, dl = encode_texts(d, CAPTIONS, progress=False)
    assert dl is None and dm.shape == (3, 32)
    assert encode_images(d, images, progress=False)[1] is None
    with pytest.raises(UserError):
        encode_texts(m, "a single string", progress=False)


def test_zsprob_checkpoint_as_pretrained(images, tmp_path):
    m = create_model("zsprob-tiny", open_clip_cfg=TINY, seed=8).eval()
    save(m, tmp_path / "pre")
    tok = m.tokenizer(CAPTIONS)
    # same heads: everything (mean and log-variance branches) is reused
    f = create_model("zsprob-tiny", pretrained=str(tmp_path / "pre"), seed=9).eval()
    assert f.config["open_clip_cfg"]["vision_cfg"]["width"] == 64
    assert f.config["heads_from_checkpoint"] == ["image_gpo", "text_gpo", "image_sigma", "text_sigma"]
    with torch.no_grad():
        a, b = m(images, tok), f(images, tok)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # deterministic fine-tuning from it: the mean branch carries over
    d = create_model("zsprob-tiny", pretrained=str(tmp_path / "pre"), deterministic=True).eval()
    with torch.no_grad():
        assert torch.equal(d.encode_image(images)[0], a["img_mu"])


def test_deepcopy_and_grad_checkpointing(images):
    import copy

    m = create_model("zsprob-tiny", open_clip_cfg=TINY, seed=10).train()
    c = copy.deepcopy(m)  # e.g. SWA's AveragedModel
    assert c._vision.visual is c.clip.visual and c._text.blocks is c.clip.transformer.resblocks
    tok = m.tokenizer(CAPTIONS)
    c.set_grad_checkpointing(True)
    for model in (m, c):
        o = model(images[:3], tok)
        (o["img_mu"].sum() + o["txt_logvar"].exp().sum() + o["img_logvar"].sum()).backward()
    for (n, p), (_, q) in zip(m.named_parameters(), c.named_parameters()):
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), n


def test_pretrained_tag_found_in_local_hf_cache(tmp_path):
    """A tag resolves to a file already in the Hugging Face cache layout, without any download."""
    from zsprob.models.factory import resolve_pretrained

    repo = tmp_path / "models--timm--vit_base_patch32_clip_224.openai"
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    f = snap / "open_clip_model.safetensors"
    f.write_bytes(b"x")
    path, cfg = resolve_pretrained("ViT-B-32", "openai", cache_dir=str(tmp_path))
    assert path == f and cfg["quick_gelu"] is True
    # open_clip's URL cache (~/.cache/clip style) is looked at too
    f.unlink()
    (tmp_path / "ViT-B-32.pt").write_bytes(b"x")
    path, _ = resolve_pretrained("ViT-B-32", "openai", cache_dir=str(tmp_path))
    assert path == tmp_path / "ViT-B-32.pt"


def test_one_sha256_of_a_file_serves_the_checkpoint_and_the_synthworld_manifest(tmp_path):
    """The file hash reads in chunks: a file over one chunk hashes as hashlib does on the whole bytes."""
    import hashlib

    from zsprob.data.synthworld import checks
    from zsprob.utils.io import sha256_file

    data = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, ((1 << 22) + 12345,), generator=data, dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "pretrain").mkdir()
    path = tmp_path / "pretrain" / "blob.bin"
    path.write_bytes(payload)
    assert sha256_file(path) == hashlib.sha256(payload).hexdigest()
    from zsprob.models import checkpoint

    assert checkpoint.sha256_file is sha256_file
    assert checks.file_checksums(tmp_path) == {"pretrain/blob.bin": {"size": len(payload),
                                                                     "sha256": hashlib.sha256(payload).hexdigest()}}
