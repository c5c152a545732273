"""Inputs are trusted only as far as they prove it: a selection is mapped to a dataset's classes by name only,
embeddings are checked in float32 (the dtype they are used in), and an .npz that would inflate far past its
size is refused before it is decompressed. Each case was accepted, or gave a traceback, before issue 50."""
from __future__ import annotations

import zipfile

import numpy as np
import pytest

from conftest import run_cli
from zsprob.errors import UserError


def test_a_selection_of_other_classes_is_never_mapped_by_position():
    from zsprob.zeroshot.classify import check_selection_classes
    check_selection_classes(["Golden retriever", "tabby_cat"], ["golden retriever", "tabby cat"], "sel.json")
    with pytest.raises(UserError, match=r"sel.json does not hold the dataset's classes in its order: class 0 is "
                                        r"'cat' there and 'bird' in the dataset \(2 of 2 differ\)"):
        check_selection_classes(["cat", "dog"], ["bird", "fish"], "sel.json")  # no name in common: was accepted
    with pytest.raises(UserError, match="sel.json has 2 classes, the dataset 3; run zsprob select-prompts"):
        check_selection_classes(["cat", "dog"], ["bird", "fish", "cow"], "sel.json")


def _embeddings(path, **override):
    g = np.random.default_rng(0)
    arrays = dict(image_ids=np.arange(4), caption_ids=np.arange(8), image_mu=g.normal(size=(4, 3)),
                  caption_mu=g.normal(size=(8, 3)), caption_image=np.repeat(np.arange(4), 2))
    arrays.update(override)
    np.savez(path, **arrays)
    return path


def test_a_float64_value_that_overflows_float32_is_refused(tmp_path):
    from zsprob.retrieval.embeddings import load_embeddings
    mu = np.random.default_rng(1).normal(size=(8, 3))
    mu[2, 1] = 1e300  # finite in float64, inf in float32
    path = _embeddings(tmp_path / "e.npz", caption_mu=mu)
    with pytest.raises(UserError, match="caption_mu contains NaN, inf or values beyond float32's range"):
        load_embeddings(path)
    r = run_cli("eval", "embeddings", path, "--out", tmp_path / "out.json", timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith("values beyond float32's range (+-3.4e38)")


def test_an_npz_that_would_inflate_far_past_its_size_is_refused_unread(tmp_path, monkeypatch):
    from zsprob.retrieval import embeddings
    path = tmp_path / "bomb.npz"
    _embeddings(tmp_path / "ok.npz")
    with zipfile.ZipFile(tmp_path / "ok.npz") as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
        dst.writestr("zeros.npy", np.zeros(4_000_000, dtype=np.float32).tobytes())  # 16 MB of zeros: a few KB
    monkeypatch.setattr(embeddings, "NPZ_INFLATE_LIMIT", 8 * 2 ** 20)
    read = []
    monkeypatch.setattr(np, "load", lambda *a, **k: read.append(a))
    with pytest.raises(UserError, match=r"bomb.npz are refused: .* bytes that inflate to 16,0\d\d,\d\d\d"):
        embeddings.load_embeddings(path)
    assert not read  # refused before numpy opened it


def test_cached_image_features_follow_the_files_not_their_names(tmp_path):
    """A world regenerated in place with another seed (same paths, other pixels) is encoded again; the same files
    reuse the cache. Before issue 50 the cache was keyed by paths and labels: the old features were reused."""
    import json

    from conftest import TINY_TOWERS, small_world
    from zsprob.data.synthetic import generate
    sizes = dict(num_pretrain=4, num_classify_select=4, num_classify_eval=12, num_retrieval=2, num_retrieval_val=0)
    made = small_world(tmp_path, seed=2, model={**TINY_TOWERS, "embed_dim": 16}, **sizes)
    common = ["zeroshot", "synthetic", "--checkpoint", made["ckpt"], "--root", made["root"], "--strategy", "all",
              "--cache-dir", tmp_path / "cache", "--workers", "0"]

    def from_cache(n):
        r = run_cli(*common, "--out", tmp_path / f"r{n}.json", timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads((tmp_path / f"r{n}.json").read_text())["images_from_cache"]

    assert from_cache(1) is False and from_cache(2) is True
    generate(made["root"], image_size=32, progress=False, seed=3, overwrite=True, **sizes)
    assert from_cache(3) is False and from_cache(4) is True


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),  # Python's own write: no file name
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    RuntimeError("Error in faiss::write_index: 'ret == (size * 4)' failed: write error in x: 2 != 5 (No space left "
                 "on device)"),
])
def test_a_full_disk_names_the_file_and_keeps_the_previous_one(tmp_path, error):
    from zsprob.cli import _environment_error
    from zsprob.utils.io import atomic_write
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"before")

    def writer(tmp):
        open(tmp, "wb").write(b"half")
        raise error
    with pytest.raises(OSError) as e:
        atomic_write(target, writer)
    assert _environment_error(e.value) == f"no space left on device (the previous file is kept): {target}"
    assert target.read_bytes() == b"before" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_checkpoint_carries_its_tokenizer(tmp_path):
    """The tokenizer's files are copied into the checkpoint: changing or removing the directory it came from
    changes nothing; changing the copy is one line. Before issue 50 only the directory's path was stored."""
    import shutil

    import torch
    from test_models_hf_tokenizer import make_tokenizer_dir
    from zsprob.models import create_model, load, save
    from zsprob.models.fingerprint import model_fingerprint

    directory = make_tokenizer_dir(tmp_path / "tok")
    model = create_model("zsprob-tiny", tokenizer_dir=directory)
    tokens = model.tokenizer(["a red car"])
    ckpt = save(model, tmp_path / "ckpt")
    shutil.rmtree(directory)
    directory.mkdir()  # something else where the tokenizer was
    (directory / "tokenizer.json").write_text("{}")
    again = load(ckpt)
    assert torch.equal(again.tokenizer(["a red car"]), tokens)
    assert model_fingerprint(again) == model_fingerprint(model)  # where the checkpoint lies is not its identity
    vocab = ckpt / "tokenizer" / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"red"', '"rod"'))
    with pytest.raises(UserError, match=r"its tokenizer files differ from those saved with it \(tokenizer.json"):
        load(ckpt)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path):
    from test_models_hf_tokenizer import make_tokenizer_dir
    from zsprob.models import create_model
    directory = make_tokenizer_dir(tmp_path / "tok")
    tiny = {"open_clip_cfg": {"text_cfg": {"vocab_size": 50}}}  # the tokenizer has about 200 tokens
    with pytest.raises(UserError, match="has .* tokens, more than the model's vocabulary of 50"):
        create_model("zsprob-tiny", tokenizer_dir=directory, **tiny)


def test_pool_prompts_cut_to_one_text_for_two_classes_are_refused():
    """CuPL-style pools whose prompts differ only past the tokenizer's context length would give two classes
    one prompt: refused, as templates cut the same way already were. Prompts that fit are taken."""
    from conftest import TINY_TOWERS
    from zsprob.models import create_model
    from zsprob.zeroshot.pools import build_pool_bank
    model = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY_TOWERS)  # a context of 16 tokens
    filler = "a photo of something seen from far away on a grey day in the middle of winter, which is"
    fits = {"cat": ["a cat", "a photo of a cat"], "dog": ["a dog", "a photo of a dog"]}
    assert build_pool_bank(model, ["cat", "dog"], fits, progress=False).mu.shape[:2] == (2, 2)
    cut = {"cat": ["a cat", f"{filler} a cat"], "dog": ["a dog", f"{filler} a dog"]}
    with pytest.raises(UserError, match=r"pools.json: .* \('dog'\) and .* \('cat'\) are cut at the tokenizer's 16 "
                                        r"tokens to the same prompt"):
        build_pool_bank(model, ["cat", "dog"], cut, progress=False, source="pools.json")


@pytest.mark.parametrize("command", ["eval", "zeroshot"])
def test_a_file_that_differs_from_the_worlds_recorded_checksum_is_one_line(tmp_path, command):
    """A world's manifest records every file's SHA-256: evaluation checks the files it reads against it (an
    image edited in place still decodes, and was scored, before issue 50)."""
    from conftest import TINY_TOWERS, small_world
    from PIL import Image
    made = small_world(tmp_path, seed=2, model={**TINY_TOWERS, "embed_dim": 16}, num_pretrain=4,
                       num_classify_select=2, num_classify_eval=4, num_retrieval=3, num_retrieval_val=0)
    folder = "retrieval/images/test" if command == "eval" else "classify/eval"
    image = sorted((made["root"] / folder).rglob("*.jpg"))[0]
    Image.new("RGB", (32, 32), (255, 0, 0)).save(image)  # a valid image, not the world's
    args = ["eval", "synthetic"] if command == "eval" else ["zeroshot", "synthetic", "--strategy", "all"]
    r = run_cli(*args, "--checkpoint", made["ckpt"], "--root", made["root"], "--out", tmp_path / "out.json",
                timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"zsprob: error: {image.resolve()} is not the file this SynthWorld recorded (missing, or its size or "
        "SHA-256 differs from manifest.json); re-run `zsprob data synthetic` with the same arguments to regenerate it")
