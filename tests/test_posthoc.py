"""`zsprob posthoc`: log-variance heads for a frozen model, end to end on a tiny SynthWorld.

What would break: the means of the post-hoc model differing from the frozen model's by one bit
(compared tensor for tensor and through `zsprob eval synthetic --score cosine`), a source kind that
does not load, heads that do not learn the sigma recipe's lesson (a caption with words deleted is
vaguer), and bad input that writes something or prints a traceback.
"""
from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a large red striped star on the left", "a small blue circle", "a green square and a red star",
            "a dotted yellow triangle at the top", "a big purple ellipse"]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """A deterministic zsprob-tiny-bow checkpoint at 32 px (random towers: the means are what they are)."""
    from zsprob.models import create_model, save

    torch.manual_seed(0)
    model = create_model("zsprob-tiny-bow", pretrained=None, deterministic=True, pooling="native", image_size=32)
    return save(model, tmp_path_factory.mktemp("frozen") / "model", extra={"method": "infonce"})


def _posthoc(tmp, world, *source, steps=40, extra=()):
    out = tmp / "ph"
    r = run_cli("posthoc", *source, "--data", "synthetic", "--shards", str(world / "pretrain"), "--steps", str(steps),
                "--threads", "1", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _encode(model, images, tokens):
    with torch.no_grad():
        return (*model.encode_image(images), *model.encode_text(tokens))


def test_means_are_bit_identical_and_eval_reads_a_probabilistic_model(tmp_path, frozen, tiny_world):
    from zsprob.models import load

    out = _posthoc(tmp_path, tiny_world, "--checkpoint", str(frozen))
    before, after = load(frozen).eval(), load(out / "model").eval()
    assert before.deterministic and not after.deterministic
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    tokens = before.tokenizer(CAPTIONS)
    b_img, b_ilv, b_txt, b_tlv = _encode(before, images, tokens)
    a_img, a_ilv, a_txt, a_tlv = _encode(after, images, tokens)
    assert b_ilv is None and b_tlv is None
    assert torch.equal(a_img, b_img) and torch.equal(a_txt, b_txt)  # bit for bit
    assert torch.isfinite(a_ilv).all() and torch.isfinite(a_tlv).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 2 * 64 and summary["method"] == "adapter"
    assert all(name.startswith(("image_sigma.", "text_sigma.")) for name in summary["trainable_parameters"])
    # retrieval by the means: the same metrics as the frozen model's, through the command itself
    metrics = {}
    for name, ckpt in (("frozen", frozen), ("posthoc", out / "model")):
        r = run_cli("eval", "synthetic", "--checkpoint", str(ckpt), "--root", str(tiny_world), "--score", "cosine",
                    "--no-corruption", "--no-analysis", "--workers", "0", "--out", str(tmp_path / name / "m.json"))
        assert r.returncode == 0, r.stderr[-2000:]
        metrics[name] = json.loads((tmp_path / name / "m.json").read_text())
    assert metrics["frozen"]["metrics"]["caption"]["t2i"]["n_queries"] == 20
    assert metrics["frozen"]["metrics"] == metrics["posthoc"]["metrics"]


def test_laplace_reads_the_adapters_feature_file_and_keeps_the_means(tmp_path, frozen, tiny_world):
    from zsprob.models import load

    first = _posthoc(tmp_path / "a", tiny_world, "--checkpoint", str(frozen), steps=5)
    out = _posthoc(tmp_path / "b", tiny_world, "--checkpoint", str(frozen), steps=60,
                   extra=("--method", "laplace", "--features", str(first / "features.safetensors")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["features_reused"] and summary["method"] == "laplace"
    assert not (out / "features.safetensors").exists()
    assert set(summary["prior_precision"]) == {"image", "text"}
    before, after = load(frozen).eval(), load(out / "model").eval()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    tokens = before.tokenizer(CAPTIONS)
    got, want = _encode(after, images, tokens), _encode(before, images, tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[3]).all()


def test_the_heads_learn_that_deleting_words_makes_a_caption_vaguer(tmp_path, frozen, tiny_world):
    from zsprob.data.masking import delete_tokens, text_mask_spec
    from zsprob.models import load
    from zsprob.posthoc.heads import probabilistic_copy

    out = _posthoc(tmp_path, tiny_world, "--checkpoint", str(frozen), steps=300)
    trained = load(out / "model").eval()
    fresh, _ = probabilistic_copy(load(frozen))
    captions = [f"a {size} {colour} {fill} {shape}" for size in ("small", "large") for colour in ("red", "blue", "green")
                for fill in ("striped", "dotted") for shape in ("star", "circle", "square")]
    tokens = trained.tokenizer(captions)
    deleted = delete_tokens(tokens, 0.5, text_mask_spec(trained.tokenizer), torch.Generator().manual_seed(0))
    changed = (deleted != tokens).any(1)

    def share_wider(model):
        with torch.no_grad():
            full = model.encode_text(tokens)[1].exp().sum(1)
            vague = model.encode_text(deleted)[1].exp().sum(1)
        return ((vague > full) & changed).sum().item() / changed.sum().item()

    assert share_wider(trained) >= 0.9
    assert share_wider(trained) > share_wider(fresh.eval()) + 0.1  # fresh heads: the [UNC] word alone


def test_an_open_clip_file_or_directory_and_a_published_file_load_as_sources(tmp_path, frozen, tiny_world):
    """An open_clip-format weights directory (`--model NAME --pretrained DIR`) and a published ProLIP file."""
    from safetensors.torch import save_file

    from test_models_published import write_pcmepp_hf, write_prolip
    from zsprob.models import load, load_for_inference

    # open_clip's own state dict of the frozen model, as an open_clip local directory holds it
    frozen_model = load(frozen)
    directory = tmp_path / "oc"
    directory.mkdir()
    save_file({k[len("clip."):]: v.contiguous() for k, v in frozen_model.state_dict().items()},
              str(directory / "open_clip_model.safetensors"))
    # the weights file itself (open_clip's file form); the directory is the reference's
    out = _posthoc(tmp_path / "a", tiny_world, "--model", "zsprob-tiny-bow", "--pretrained",
                   str(directory / "open_clip_model.safetensors"), steps=5, extra=("--max-samples", "16"))
    after = load(out / "model").eval()
    images = torch.randn(2, 3, 64, 64)
    tokens = after.tokenizer(CAPTIONS[:2])
    reference = load_for_inference(model="zsprob-tiny-bow", pretrained=str(directory))
    got, want = _encode(after, images, tokens), _encode(reference, images, tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])

    prolip = tmp_path / "prolip"
    prolip.mkdir()
    write_prolip(prolip)
    out = _posthoc(tmp_path / "b", tiny_world, "--model", "prolip-tiny", "--pretrained", str(prolip), steps=5,
                   extra=("--max-samples", "16"))
    after = load(out / "model").eval()
    original = load_for_inference(model="prolip-tiny", pretrained=str(prolip))
    images = torch.randn(2, 3, after.image_size, after.image_size)
    tokens = after.tokenizer(CAPTIONS[:2])
    got, want = _encode(after, images, tokens), _encode(original, images, tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert not torch.equal(got[1], want[1])  # the [UNC] projections were trained afresh
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["trainable_parameters"]) == {
        "image_sigma.uncertainty_proj.weight", "image_sigma.uncertainty_proj.bias",
        "text_sigma.text_uncertainty_projection.weight", "text_sigma.text_uncertainty_projection.bias"}

    pcmepp = tmp_path / "pcmepp"
    write_pcmepp_hf(pcmepp)  # PCME++'s hf_models layout: two uncertainty blocks per tower, trained afresh
    out = _posthoc(tmp_path / "c", tiny_world, "--model", "pcmepp-tiny", "--pretrained", str(pcmepp), steps=5,
                   extra=("--max-samples", "16"))
    after, original = load(out / "model").eval(), load_for_inference(model="pcmepp-tiny", pretrained=str(pcmepp))
    images = torch.randn(2, 3, after.image_size, after.image_size)
    got, want = _encode(after, images, after.tokenizer(CAPTIONS[:2])), _encode(original, images,
                                                                             original.tokenizer(CAPTIONS[:2]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and not torch.equal(got[3], want[3])


def test_a_vit_and_text_transformer_open_clip_file_gets_block_heads(tmp_path, tiny_world):
    """open_clip's own ViT + text transformer (zsprob-tiny's config) from a weights file: PCME++ block heads
    trained on the cached trunk outputs, the means bit-identical."""
    from safetensors.torch import save_file

    from zsprob.models import create_model, load, load_for_inference

    torch.manual_seed(1)
    model = create_model("zsprob-tiny", pretrained=None, deterministic=True, pooling="native")
    weights = tmp_path / "tiny.safetensors"
    save_file({k[len("clip."):]: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    out = _posthoc(tmp_path, tiny_world, "--model", "zsprob-tiny", "--pretrained", str(weights), steps=20,
                   extra=("--max-samples", "16"))
    after = load(out / "model").eval()
    assert after.sigma_head == "block" and not after.deterministic
    reference = load_for_inference(model="zsprob-tiny", pretrained=str(weights))
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    tokens = after.tokenizer(CAPTIONS)
    got, want = _encode(after, images, tokens), _encode(reference, images, tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[3]).all()
    summary = json.loads((out / "summary.json").read_text())
    assert any(n.startswith("text_sigma.blocks.0.") for n in summary["trainable_parameters"])


def _captionless_shard(path):
    """A shard of images without captions."""
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i in range(4):
            buf = io.BytesIO()
            Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(buf, format="PNG")
            info = tarfile.TarInfo(f"{i:04d}.png")
            info.size = buf.tell()
            buf.seek(0)
            tar.addfile(info, buf)


def _jwae_checkpoint(path, frozen):
    """A jWAE model (autoencoders over a frozen tower's means): no image or text towers of its own to read."""
    from zsprob.models import load, save
    from zsprob.models.jwae import JWAEModel

    jwae = JWAEModel(load(frozen), {"latent_dim": 8, "image_hidden": 16, "text_hidden": 16,
                                    "decoder": {"image_hidden": 16, "text_hidden": 16}})
    return save(jwae, path, extra={"method": "jwae"})


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, frozen, tiny_world):
    shard = tmp_path / "nocap" / "000.tar"
    shard.parent.mkdir()
    _captionless_shard(shard)
    cases = {
        "no captions": ["--checkpoint", str(frozen), "--data", "webdataset", "--shards", str(shard.parent)],
        "method": ["--checkpoint", str(frozen), "--data", "synthetic", "--shards", str(tiny_world / "pretrain"),
                   "--method", "bayes"],
        "jwae": ["--checkpoint", str(_jwae_checkpoint(tmp_path / "jwae", frozen)), "--data", "synthetic",
                 "--shards", str(tiny_world / "pretrain")],
    }
    for name, args in cases.items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        r = run_cli("posthoc", *args, "--steps", "2", "--out", str(out))
        assert r.returncode == 2, (name, r.stderr[-1500:])
        lines = [line for line in r.stderr.strip().splitlines() if line.startswith("zsprob: error:")]
        assert len(lines) == 1 and "Traceback" not in r.stderr, (name, r.stderr[-1500:])
        assert not out.exists(), name


def test_an_unknown_method_is_one_line_for_python_callers_too(tmp_path):
    """The registry lookup words it, before a model or a file is touched."""
    from zsprob.errors import UserError
    from zsprob.posthoc.features import DataSpec
    from zsprob.posthoc.run import posthoc

    with pytest.raises(UserError, match="unknown post-hoc method 'bayes'; choose one of adapter, laplace"):
        posthoc(None, DataSpec("synthetic", str(tmp_path)), tmp_path / "out", method="bayes")
    assert not (tmp_path / "out").exists()


def test_coco_data_end_to_end_keeps_the_means_and_the_cosine_retrieval(tmp_path, frozen):
    from test_data_coco import make_coco
    from zsprob.data.coco import CocoCaptions, CocoPairs
    from zsprob.models import load

    root = tmp_path / "coco"
    make_coco(root)
    out = tmp_path / "ph"
    r = run_cli("posthoc", "--checkpoint", str(frozen), "--data", "coco", "--root", str(root), "--steps", "20",
                "--batch-size", "4", "--threads", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 2 * 2 and summary["data"]["kind"] == "coco"  # train + restval, two views
    before, after = load(frozen).eval(), load(out / "model").eval()
    assert not after.deterministic
    pairs = CocoPairs(CocoCaptions(root, split="train", official_ids=False, instances=False), before.preprocess_val,
                      before.tokenizer, mode="random", seed=0)
    images = torch.stack([pairs[i][0] for i in range(len(pairs))])
    tokens = torch.stack([pairs[i][1] for i in range(len(pairs))])
    b_img, _, b_txt, _ = _encode(before, images, tokens)
    a_img, a_ilv, a_txt, a_tlv = _encode(after, images, tokens)
    assert torch.equal(a_img, b_img) and torch.equal(a_txt, b_txt)
    assert torch.isfinite(a_ilv).all() and torch.isfinite(a_tlv).all()
    metrics = {}
    for name, ckpt in (("frozen", frozen), ("posthoc", out / "model")):
        r = run_cli("eval", "coco", "--checkpoint", str(ckpt), "--root", str(root), "--score", "cosine",
                    "--no-analysis", "--workers", "0", "--out", str(tmp_path / name / "m.json"))
        assert r.returncode == 0, r.stderr[-2000:]
        metrics[name] = json.loads((tmp_path / name / "m.json").read_text())["metrics"]
    assert metrics["frozen"]["coco"]["t2i"]["n_queries"] == 10  # the two test images' captions
    assert metrics["frozen"] == metrics["posthoc"]
