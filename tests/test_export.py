"""`zsprob export --format open_clip`: open_clip reads the directory and gives zsprob's means; zsprob reads it
back whole (sigma heads included); refusals are one line with nothing written. Also: an open_clip model
directory's open_clip_config.json (model_cfg, preprocess_cfg) is what zsprob builds and preprocesses with."""
from __future__ import annotations

import json
import shutil

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from zsprob import UserError
from zsprob.models import create_model, load, load_for_inference, save

TOWERS = {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8, "image_size": 32},
          "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}
CAPTIONS = ["a red square", "two small blue circles left of a big green triangle", "x"]


def _tiny(**kw):
    args = dict(embed_dim=16, pooling="native", sigma_depth=1, seed=3, open_clip_cfg=TOWERS)
    args.update(kw)
    return create_model("zsprob-tiny", **args).eval()


def _images(n=4, size=40):
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    model = _tiny()
    with torch.no_grad():  # non-trivial heads: the round trip must carry them exactly
        for p in model.image_sigma.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save(model, d / "run" / "model", extra={"method": "pcmepp", "step": 7})
    (d / "run" / "config.yaml").write_text("method: pcmepp\nseed: 0\n")
    (d / "run" / "summary.json").write_text(json.dumps({"steps": 7, "global_batch_size": 8, "world_size": 1,
                                                         "final_loss": 1.25}))
    (d / "run" / "metrics.jsonl").write_text(json.dumps({"step": 7, "eval": {"synthetic_rsum": 123.5}}) + "\n")
    return d / "run" / "model"


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    from zsprob.models.export import export_open_clip

    out = tmp_path_factory.mktemp("hf") / "tiny"
    return export_open_clip(ckpt, out)


def test_export_writes_open_clip_files_and_a_model_card(exported):
    names = sorted(p.name for p in exported.iterdir())
    assert names == ["README.md", "open_clip_config.json", "open_clip_model.safetensors",
                     "zsprob_sigma_heads.safetensors"]
    doc = json.loads((exported / "open_clip_config.json").read_text())
    assert doc["model_cfg"]["vision_cfg"]["width"] == 32 and doc["model_cfg"]["embed_dim"] == 16
    assert doc["preprocess_cfg"]["size"] == 32 and "mean" in doc["preprocess_cfg"]
    from safetensors.torch import load_file
    keys = set(load_file(str(exported / "open_clip_model.safetensors")))
    assert "visual.proj" in keys and "text_projection" in keys and not any(k.startswith("clip.") for k in keys)
    heads = set(load_file(str(exported / "zsprob_sigma_heads.safetensors")))
    assert heads and all(k.startswith(("image_sigma.", "text_sigma.")) for k in heads)
    card = (exported / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: open_clip" in front and "- pcmepp" in front
    assert "method: pcmepp" in card and "final loss: 1.25" in card and "synthetic_rsum: 123.5" in card


def test_open_clip_local_dir_gives_zsprob_means(ckpt, exported):
    ref = load(ckpt).eval()
    oc, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    oc.eval()
    tok = open_clip.get_tokenizer(f"local-dir:{exported}")
    imgs = _images()
    x_oc = torch.stack([preprocess(im) for im in imgs])
    x_zs = torch.stack([ref.preprocess_val(im) for im in imgs])
    assert torch.equal(x_oc, x_zs)  # the same preprocessing, from preprocess_cfg
    assert torch.equal(tok(CAPTIONS), ref.tokenizer(CAPTIONS))
    with torch.no_grad():
        mu_i, _ = ref.encode_image(x_zs)
        mu_t, _ = ref.encode_text(ref.tokenizer(CAPTIONS))
        assert torch.allclose(oc.encode_image(x_oc, normalize=True), mu_i, atol=1e-5, rtol=0)
        assert torch.allclose(oc.encode_text(tok(CAPTIONS), normalize=True), mu_t, atol=1e-5, rtol=0)


@pytest.mark.parametrize("how", ["load", "pretrained", "checkpoint"])
def test_zsprob_loads_the_export_back_with_its_sigma_heads(ckpt, exported, how):
    ref = load(ckpt).eval()
    if how == "load":
        back = load(exported)
    elif how == "pretrained":
        back = load_for_inference(model="zsprob-tiny", pretrained=str(exported))
    else:
        back = load_for_inference(checkpoint=str(exported))
    back.eval()
    assert back.config == ref.config
    x = torch.stack([ref.preprocess_val(im) for im in _images()])
    tok = ref.tokenizer(CAPTIONS)
    with torch.no_grad():
        for a, b in zip(ref.encode_image(x) + ref.encode_text(tok), back.encode_image(x) + back.encode_text(tok)):
            assert torch.equal(a, b)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_a_corrupted_export_is_one_error(ckpt, tmp_path):
    from zsprob.models.export import export_open_clip

    out = export_open_clip(ckpt, tmp_path / "x")
    f = out / "zsprob_sigma_heads.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupted"):
        load(out)


def test_deterministic_model_exports_without_heads(tmp_path):
    from zsprob.models.export import export_open_clip

    model = _tiny(deterministic=True)
    save(model, tmp_path / "ckpt")
    out = export_open_clip(tmp_path / "ckpt", tmp_path / "oc")
    assert not (out / "zsprob_sigma_heads.safetensors").exists()
    back = load(out)
    assert back.deterministic and back.image_sigma is None


@pytest.mark.parametrize("kind, match", [
    ("gpo", "pooled by GPO"),
    ("bow", "bag of words"),
    ("unc", r"\[UNC\] tokens"),
])
def test_models_open_clip_cannot_build_are_refused(kind, match, tmp_path):
    from zsprob.models.export import export_open_clip

    if kind == "gpo":
        model = _tiny(pooling="gpo")
    elif kind == "unc":
        model = _tiny(sigma_head="unc")
    else:
        model = create_model("zsprob-tiny-bow", pooling="native", seed=0)
    save(model, tmp_path / "ckpt")
    with pytest.raises(UserError, match=match):
        export_open_clip(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_export_and_its_refusals(ckpt, tmp_path, cli_run):
    out = tmp_path / "cli_out"
    r = cli_run("export", ckpt, "--format", "open_clip", "--out", out)
    assert r.returncode == 0, r.stderr
    assert (out / "open_clip_config.json").is_file()
    r = cli_run("export", ckpt, "--out", out)  # not empty any more
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert cli_run("export", ckpt, "--out", out, "--overwrite").returncode == 0
    for args, match in ((["--format", "onnx"], "unknown export format 'onnx'"),):
        r = cli_run("export", ckpt, "--out", tmp_path / "fmt", *args)
        assert r.returncode == 2 and r.stderr.startswith("zsprob: error:") and match in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "fmt").exists()
    not_ckpt = tmp_path / "plain"
    not_ckpt.mkdir()
    (not_ckpt / "weights.pt").write_bytes(b"0")
    r = cli_run("export", not_ckpt, "--out", tmp_path / "n")
    assert r.returncode == 2 and "is not a zsprob checkpoint" in r.stderr and not (tmp_path / "n").exists()
    assert len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------- an open_clip model directory's config
def test_open_clip_directory_config_and_preprocessing_are_read(tmp_path):
    """A Hugging Face / open_clip directory whose image size, mean, std, interpolation and resize mode
    differ from the defaults: zsprob builds the directory's model_cfg and preprocesses as open_clip does."""
    from safetensors.torch import save_file

    cfg = {"embed_dim": 16, "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                           "image_size": 48},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    pre = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "interpolation": "bilinear", "resize_mode": "squash"}
    d = tmp_path / "hf"
    d.mkdir()
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": pre}))
    torch.manual_seed(0)
    oc_dir = open_clip.CLIP(**cfg)
    save_file({k: v.contiguous() for k, v in oc_dir.state_dict().items()}, str(d / "open_clip_model.safetensors"))
    (d / "zz_other.safetensors").write_bytes(b"not weights")  # not the first weights file open_clip picks

    m = load_for_inference(model="zsprob-tiny", pretrained=str(d))
    got = m.config["preprocess_cfg"]
    assert got["size"] == 48 and got["mean"] == pre["mean"] and got["std"] == pre["std"]
    assert got["interpolation"] == "bilinear" and got["resize_mode"] == "squash"
    oc, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{d}")
    oc.eval()
    imgs = _images(size=61)
    x_oc = torch.stack([preprocess(im) for im in imgs])
    x_zs = torch.stack([m.preprocess_val(im) for im in imgs])
    assert x_zs.shape[-1] == 48 and torch.equal(x_oc, x_zs)
    with torch.no_grad():
        assert torch.allclose(m.encode_image(x_zs)[0], oc.encode_image(x_oc, normalize=True), atol=1e-5, rtol=0)


def test_open_clip_directory_with_a_malformed_config_is_one_error(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "open_clip_config.json").write_text("{not json")
    (d / "open_clip_model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="not valid JSON"):
        load_for_inference(model="zsprob-tiny", pretrained=str(d))


def test_a_hugging_face_tokenizer_travels_with_the_export(tmp_path):
    """A model with a local Hugging Face tokenizer: its files go into the export, open_clip's
    get_tokenizer("local-dir:") reads them with the same cleaning, and zsprob reloads them from there."""
    from test_models_hf_tokenizer import make_tokenizer_dir

    from zsprob.models.export import export_open_clip

    tok_dir = make_tokenizer_dir(tmp_path / "tok")
    model = _tiny(tokenizer_dir=str(tok_dir))
    save(model, tmp_path / "ckpt")
    out = export_open_clip(tmp_path / "ckpt", tmp_path / "oc")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    texts = ["A Photo of a RED car!!", "the   oak tree, green."]
    oc_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    assert torch.equal(oc_tok(texts), model.tokenizer(texts))
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    with torch.no_grad():
        assert torch.allclose(oc.eval().encode_text(oc_tok(texts), normalize=True),
                              model.encode_text(model.tokenizer(texts))[0], atol=1e-5, rtol=0)
    shutil.rmtree(tok_dir)  # the reloaded model reads the export's own copy
    back = load(out)
    assert back.config["tokenizer_dir"] == str(out.resolve()) and torch.equal(back.tokenizer(texts),
                                                                                model.tokenizer(texts))


def test_eval_files_of_another_model_are_refused(ckpt, tiny_world, tmp_path):
    """`zsprob eval` records the model it evaluated; export takes only that model's results into its card."""
    from conftest import run_cli

    from zsprob.models.export import export_open_clip
    from zsprob.models.fingerprint import model_fingerprint

    other = tmp_path / "other" / "model"
    save(_tiny(seed=4), other, extra={"method": "pcmepp", "step": 1})
    metrics = {}
    for name, model in (("own", ckpt), ("other", other)):
        metrics[name] = tmp_path / name / "metrics.json"
        r = run_cli("eval", "synthetic", "--checkpoint", model, "--root", tiny_world, "--no-analysis", "--device", "cpu",
                    "--workers", "0", "--out", metrics[name])
        assert r.returncode == 0, r.stderr[-2000:]
    made_with = json.loads(metrics["own"].read_text())["model"]
    assert made_with == {"id": model_fingerprint(load(ckpt)), "name": "zsprob-tiny"}  # load() is export's loader
    card = (export_open_clip(ckpt, tmp_path / "ok", eval_files=[metrics["own"]]) / "README.md").read_text()
    assert "From `metrics.json`:" in card and "RSUM" in card
    with pytest.raises(UserError, match=r"was made with another model .* give the results of this model"):
        export_open_clip(ckpt, tmp_path / "refused", eval_files=[metrics["own"], metrics["other"]])
    assert not (tmp_path / "refused").exists()
    # a results file that names no model (precomputed embeddings) is taken as it is
    anonymous = tmp_path / "anon.json"
    anonymous.write_text(json.dumps({k: v for k, v in json.loads(metrics["other"].read_text()).items() if k != "model"}))
    export_open_clip(ckpt, tmp_path / "anon", eval_files=[anonymous])


def test_eval_files_without_figures_are_refused_and_compare_tables_give_each_top1(ckpt, tmp_path):
    from zsprob.models.export import export_open_clip

    selection = tmp_path / "selection.json"  # a file of another kind: no figures for the card
    selection.write_text(json.dumps({"classes": [{"name": "circle", "k": 3}], "strategy": "auto"}))
    with pytest.raises(UserError, match="holds no evaluation figures"):
        export_open_clip(ckpt, tmp_path / "refused", eval_files=[selection])
    assert not (tmp_path / "refused").exists()
    compare = tmp_path / "results.json"  # zsprob zeroshot --compare
    compare.write_text(json.dumps({"rows": [{"name": "all", "label": "all 80", "metrics": {"top1": 21.5}},
                                            {"name": "auto", "label": "auto", "metrics": {"top1": 23.0}},
                                            {"name": "oracle", "label": "oracle", "skipped": "no labels"}]}))
    card = (export_open_clip(ckpt, tmp_path / "ok", eval_files=[compare]) / "README.md").read_text()
    assert "- top-1 (all 80): 21.5" in card and "- top-1 (auto): 23" in card
