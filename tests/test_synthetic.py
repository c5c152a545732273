"""SynthWorld: determinism, ground truth, the match predicate, the analytic ambiguity,
the on-disk layout (WebDataset shards, classify folders, retrieval split) and the CLI."""
from __future__ import annotations

import hashlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from zsprob import UserError
from zsprob.data.synthworld import captions as sc
from zsprob.data.synthworld.render import render_scene
from zsprob.data.synthworld.scene import ATTRS, SHAPES as SCENE_SHAPES, VOCAB, sample_scene, scene_rng
from zsprob.data.synthetic import (CONDITIONS, SHAPES, SynthWorld, caption_matches, generate,
                                   load_retrieval_split)

TINY = dict(image_size=48, num_pretrain=60, num_classify_select=1, num_classify_eval=2, num_retrieval=24,
            num_retrieval_val=8, shard_size=25, seed=3, progress=False)


def _digest(sample) -> str:
    h = hashlib.sha256(sample.image.tobytes())
    h.update(json.dumps(sample.meta, sort_keys=True).encode())
    return h.hexdigest()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sw") / "world"
    generate(out, **TINY)
    return out


# ------------------------------------------------------------------ vocabulary and determinism

def test_vocabulary_sizes():
    assert SHAPES == SCENE_SHAPES and len(SHAPES) >= 20 and len(set(SHAPES)) == len(SHAPES)
    assert len(VOCAB["color"]) == 11 and len(VOCAB["size"]) == 3 and len(VOCAB["position"]) == 9
    assert len(VOCAB["fill"]) == 4 and len(CONDITIONS) == 11


def test_sample_is_pure_function_of_seed_split_index():
    a, b = SynthWorld(7, 64), SynthWorld(7, 64)
    for i in (0, 5, 123):
        assert _digest(a.sample("pretrain", i)) == _digest(b.sample("pretrain", i))
    # order of calls does not matter, other split / seed / index differ
    d = _digest(a.sample("pretrain", 5))
    assert d == _digest(SynthWorld(7, 64).sample("pretrain", 5))
    assert d != _digest(a.sample("retrieval-test", 5))
    assert d != _digest(SynthWorld(8, 64).sample("pretrain", 5))
    assert d != _digest(a.sample("pretrain", 6))
    # identical in another process
    code = ("import hashlib, json; from zsprob.data.synthetic import SynthWorld; "
            "s = SynthWorld(7, 64).sample('pretrain', 5); h = hashlib.sha256(s.image.tobytes()); "
            "h.update(json.dumps(s.meta, sort_keys=True).encode()); print(h.hexdigest())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == d


def test_image_size_bounds():
    for s in (32, 224):
        assert SynthWorld(0, s).sample("pretrain", 0).image.size == (s, s)
    for bad in (16, 31, 225, 1000):
        with pytest.raises(UserError):
            SynthWorld(0, bad)


def test_generate_byte_identical_and_independent_of_workers(tmp_path, world_dir):
    generate(tmp_path / "w2", workers=2, **TINY)
    a, b = _tree(world_dir), _tree(tmp_path / "w2")
    a.pop(".synthworld-params.json"), b.pop(".synthworld-params.json")
    assert a.keys() == b.keys()
    diff = [k for k in a if a[k] != b[k]]
    assert not diff, diff[:5]
    assert not [k for k in a if k.endswith(".tmp")]


def test_resume_rewrites_missing_shard_and_refuses_other_arguments(tmp_path):
    kw = dict(TINY, num_pretrain=50, num_classify_eval=1, num_retrieval=10, num_retrieval_val=0)
    out = tmp_path / "w"
    generate(out, **kw)
    shard = out / "pretrain" / "shard-000001.tar"
    before = shard.read_bytes()
    shard.unlink()
    m = generate(out, **kw)
    assert shard.read_bytes() == before
    assert m["stats"]["rendered"] < 50 + 20 + 10  # the complete shard 0 and images were skipped
    with pytest.raises(UserError, match="other arguments"):
        generate(out, **dict(kw, seed=4))
    generate(out, overwrite=True, **dict(kw, seed=4))
    assert json.loads((out / "manifest.json").read_text())["seed"] == 4


# ------------------------------------------------------------------ scenes and rendering

def test_scene_prior_properties():
    n_obj, conds = [], []
    for i in range(1500):
        s = sample_scene(scene_rng(0, "t", i))
        conds.append(s["condition"])
        objs = s["objects"]
        cells = [o["position"] for o in objs]
        assert len(set(cells)) == len(cells)  # distinct grid cells: never fully hidden
        if s["condition"] == "many":
            assert 3 <= len(objs) <= 5 and len({(o["shape"], o["color"], o["fill"]) for o in objs}) == 1
        else:
            n_obj.append(len(objs))
            assert len({o["shape"] for o in objs}) == len(objs)
        if s["condition"] in ("black and white", "drawing"):
            assert all(o["color"] is None for o in objs)
        if s["condition"] == "drawing":
            assert s["background"] == "plain" and all(o["fill"] == "outline" for o in objs)
        if s["condition"] == "cropped":
            assert objs[0]["position"] != "center"
    frac = np.bincount(n_obj, minlength=4)[1:] / len(n_obj)
    assert np.allclose(frac, [0.6, 0.3, 0.1], atol=0.05)
    assert abs(conds.count("normal") / len(conds) - 0.5) < 0.05
    assert set(conds) == set(CONDITIONS)


def _with(scene, cond):
    s = json.loads(json.dumps(scene))
    s["condition"] = cond
    return s


def test_conditions_are_real_image_operations():
    base = sample_scene(scene_rng(1, "t", 0), condition="normal")
    base["background"] = "noise"
    S = 64
    normal = np.asarray(render_scene(base, S), dtype=np.float32)

    def img(c):
        return np.asarray(render_scene(_with(base, c), S), dtype=np.float32)

    def hf(a):  # high-frequency energy
        return float(np.abs(np.diff(a, axis=1)).mean())

    assert img("dark").mean() < 0.4 * normal.mean()
    assert img("bright").mean() > normal.mean() + 30
    bw = img("black and white")
    assert np.array_equal(bw[..., 0], bw[..., 1]) and np.array_equal(bw[..., 1], bw[..., 2])
    assert hf(img("blurry")) < 0.5 * hf(normal)
    assert hf(img("low resolution")) < 0.6 * hf(normal)
    pix = img("pixelated")
    k = S // 16
    blocks = pix.reshape(S // k, k, S // k, k, 3)
    assert np.abs(blocks - blocks[:, :1, :, :1]).max() == 0  # constant blocks
    jp = img("jpeg corrupted")
    assert np.abs(jp - normal).mean() > 5
    assert np.array_equal(img("normal"), normal)


def test_drawing_and_many_and_cropped_render():
    w = SynthWorld(0, 64)
    d = np.asarray(w.sample("t", 0, condition="drawing").image, dtype=np.float32)
    assert (d.mean(-1) > 200).mean() > 0.8 and d.min() < 120  # white paper, dark strokes
    m = w.sample("t", 1, condition="many")
    assert m.meta["num_objects"] >= 3 and m.meta["condition"] == "many"
    c = w.sample("t", 2, condition="cropped")
    assert c.meta["objects"][0]["position"] != "center"


def test_classify_split_has_single_object_of_the_class():
    w = SynthWorld(0, 48)
    for i in range(40):
        s = w.sample("classify-eval", i)
        assert {o["shape"] for o in s.meta["objects"]} == {SHAPES[i % len(SHAPES)]}
        if s.meta["condition"] != "many":
            assert s.meta["num_objects"] == 1


# ------------------------------------------------------------------ captions and predicate

def test_every_clean_caption_is_true_of_its_image_and_noise_is_flagged():
    w = SynthWorld(2, 32)
    kinds = set()
    noisy = 0
    for i in range(300):
        sc_, rng = w.scene("pretrain", i)
        cms = w.captions_for(sc_, rng, "pretrain", i, noise=0.3)
        assert len(cms) == 5
        for cm in cms:
            kinds.add(cm["kind"])
            assert cm["ambiguity"] <= 0
            if not cm["noisy"]:
                assert caption_matches(cm, sc_), (cm, sc_)
            else:
                noisy += 1
    assert kinds == {"full", "partial", "scene", "condition", "vague"}
    assert 0.22 < noisy / 1500 < 0.38
    # clean captions do not depend on the noise rate
    a = w.sample("pretrain", 11, noise=0.0)
    b = w.sample("pretrain", 11, noise=0.3)
    for ca, cb in zip(a.meta["captions"], b.meta["captions"]):
        if not cb["noisy"]:
            assert ca["text"] == cb["text"]


def test_caption_grammar_covers_the_spec():
    w = SynthWorld(0, 32)
    texts = [c for i in range(400) for c in w.sample("pretrain", i).captions]
    joined = "\n".join(texts)
    for frag in ("a blurry photo of", "a drawing of", "a black and white photo of", "a photo of many",
                 "a pixelated photo of", "a low resolution photo of", "a jpeg corrupted photo of",
                 "a cropped photo of", "a dark photo of", "a bright photo of", " and ", "background",
                 "an image of", "there is", "a picture of something"):
        assert frag in joined, frag
    vague = sum(t in ("a shape", "an object", "a picture of something", "something") for t in texts)
    assert 0.02 < vague / len(texts) < 0.09
    # in multi-object images some captions mention only one object
    single_mention = 0
    for i in range(200):
        s = w.sample("pretrain", i)
        if s.meta["num_objects"] >= 2 and s.meta["condition"] != "many":
            single_mention += any(len(c["objects"]) == 1 for c in s.meta["captions"])
    assert single_mention > 10


SCENE = {"condition": "blurry", "background": "noise", "objects": [
    {"shape": "star", "color": "red", "size": "large", "position": "top left", "fill": "striped"},
    {"shape": "circle", "color": "blue", "size": "small", "position": "center", "fill": "solid"}]}


@pytest.mark.parametrize("caption,expected", [
    ({"objects": [{"shape": "star"}]}, True),
    ({"objects": [{"shape": "star", "color": "red"}]}, True),
    ({"objects": [{"shape": "star", "color": "blue"}]}, False),       # attributes of different objects
    ({"objects": [{"color": "blue", "size": "small"}]}, True),
    ({"objects": [{"shape": "star"}, {"shape": "circle", "position": "center"}]}, True),
    ({"objects": [{"shape": "star"}, {"shape": "heart"}]}, False),
    ({"objects": [{"shape": "star"}], "condition": "blurry"}, True),
    ({"objects": [{"shape": "star"}], "condition": "dark"}, False),
    ({"objects": [], "background": "noise", "count": 2}, True),
    ({"objects": [], "background": "plain"}, False),
    ({"objects": [], "count": 1}, False),
    ({"objects": [{}]}, True),                                          # "a shape"
    ({"objects": []}, True),                                            # "something"
    ({"objects": [{"shape": "star", "color": "red", "size": "large", "position": "top left",
                   "fill": "striped"}]}, True),
    ({"objects": [{"shape": "star", "color": "red", "size": "large", "position": "top right",
                   "fill": "striped"}]}, False),
])
def test_match_predicate_hand_made(caption, expected):
    assert caption_matches(caption, SCENE) is expected
    enc = sc.encode_scenes([SCENE])
    assert bool(sc.match_vector(caption, enc)[0]) is expected


def test_colourless_conditions_match_no_colour_caption():
    s = {"condition": "black and white", "background": "plain",
         "objects": [{"shape": "star", "color": None, "size": "large", "position": "top", "fill": "solid"}]}
    assert caption_matches({"objects": [{"shape": "star"}]}, s)
    assert not caption_matches({"objects": [{"shape": "star", "color": "red"}]}, s)


def test_match_matrix_equals_scalar_predicate():
    w = SynthWorld(0, 32)
    scenes = [w.scene("pretrain", i)[0] for i in range(60)]
    caps = [cm for i in range(60) for cm in w.sample("pretrain", i).meta["captions"]]
    m = sc.match_matrix(caps, scenes).toarray()
    ref = np.array([[caption_matches(c, s) for c in caps] for s in scenes])
    assert np.array_equal(m, ref)


# ------------------------------------------------------------------ ambiguity

def test_ambiguity_closed_forms_equal_the_dynamic_programme():
    import random

    rnd = random.Random(0)
    for _ in range(60):
        ph = tuple(sorted((a, rnd.choice(VOCAB[a])) for a in ATTRS if rnd.random() < 0.5))
        shapes = rnd.sample(SHAPES, 3)
        multi = tuple(sorted(tuple(sorted({**dict((a, rnd.choice(VOCAB[a])) for a in ATTRS
                                                  if a != "shape" and rnd.random() < 0.4),
                                           "shape": shapes[k]}.items())) for k in range(rnd.choice([2, 3]))))
        for reg in ("standard", "cropped", "drawing", "black and white"):
            for n in (1, 2, 3):
                # one phrase: closed form vs the DP (a phrase repeated twice is the same event)
                assert math.isclose(sc._single_phrase_prob(dict(ph), reg, n), sc._dp_prob((ph, ph), reg, n),
                                    rel_tol=1e-9, abs_tol=1e-15)
                assert math.isclose(sc._distinct_shapes_prob([dict(p) for p in multi], reg, n),
                                    sc._dp_prob(multi, reg, n), rel_tol=1e-9, abs_tol=1e-15)


def test_ambiguity_matches_monte_carlo_frequency():
    N = 8000
    enc = sc.encode_scenes([sample_scene(scene_rng(99, "mc", i)) for i in range(N)])
    w = SynthWorld(0, 32)
    caps = [cm for i in range(40) for cm in w.sample("pretrain", i).meta["captions"]]
    z = []
    for cm in caps:
        p = math.exp(cm["ambiguity"])
        f = sc.match_vector(cm, enc).mean()
        if p * N >= 30:
            z.append((f - p) / math.sqrt(p * (1 - p) / N + 1e-300))
    assert len(z) > 40
    assert np.abs(np.mean(z)) < 0.6 and np.std(z) < 1.6 and np.abs(z).max() < 5
    # specific captions are less ambiguous (more negative) than vague ones
    assert sc.ambiguity({"objects": [{}]}) == 0.0
    a_star = sc.ambiguity({"objects": [{"shape": "star"}]})
    a_red_star = sc.ambiguity({"objects": [{"shape": "star", "color": "red"}]})
    assert a_red_star < a_star < 0


# ------------------------------------------------------------------ on-disk layout

def test_manifest(world_dir):
    m = json.loads((world_dir / "manifest.json").read_text())
    assert m["seed"] == 3 and m["image_size"] == 48 and m["classes"] == SHAPES
    assert m["counts"]["pretrain"] == 60 and m["counts"]["pretrain_shards"] == 3
    assert "analytic" in m["ambiguity_method"] and m["zsprob_version"]


@pytest.mark.slow  # importing webdataset imports torch (~10 s on a busy 2-core machine)
def test_shards_readable_by_plain_webdataset(world_dir):
    import webdataset as wds

    shards = sorted(str(p) for p in (world_dir / "pretrain").glob("shard-*.tar"))
    assert [Path(s).name for s in shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    ds = wds.WebDataset(shards, shardshuffle=False).decode("pil")
    keys = []
    for s in ds:
        keys.append(s["__key__"])
        assert s["jpg"].size == (48, 48) and s["jpg"].mode == "RGB"
        assert isinstance(s["txt"], str) and s["txt"] == s["json"]["captions"][0]["text"]
        assert len(s["json"]["captions"]) == 5 and s["json"]["objects"]
        assert caption_matches(s["json"]["captions"][0], s["json"]) or s["json"]["captions"][0]["noisy"]
    assert len(keys) == 60 and len(set(keys)) == 60


def test_classify_layout_and_disjointness(world_dir):
    from PIL import Image

    root = world_dir / "classify"
    assert (root / "classnames.txt").read_text().split("\n")[:-1] == SHAPES
    digests = {}
    for part, per_class in (("select", 1), ("eval", 2)):
        assert sorted(p.name for p in (root / part).iterdir()) == sorted(SHAPES)
        for cls in SHAPES:
            files = sorted((root / part / cls).glob("*.jpg"))
            assert len(files) == per_class
            for f in files:
                assert Image.open(f).size == (48, 48)
                digests.setdefault(part, set()).add(hashlib.sha256(f.read_bytes()).hexdigest())
    assert not digests["select"] & digests["eval"]


def test_retrieval_split(world_dir):
    import scipy.sparse as sp

    r = load_retrieval_split(world_dir, "test")
    n_img, n_cap = 24, 120
    assert len(r.image_paths) == n_img and len(r.captions) == n_cap and all(p.is_file() for p in r.image_paths)
    assert isinstance(r.positives, sp.csr_matrix) and r.positives.dtype == bool
    assert r.positives.shape == (n_img, n_cap)
    assert np.array_equal(r.caption_image, np.repeat(np.arange(n_img), 5))
    # positives include the five source captions, and equal the predicate everywhere
    assert r.positives[r.caption_image, np.arange(n_cap)].all()
    ref = np.array([[caption_matches(c, im) for c in r.caption_meta] for im in r.image_meta])
    assert np.array_equal(r.positives.toarray(), ref)
    assert r.positives.sum() > n_cap  # many-to-many
    assert len(set(r.caption_ids)) == n_cap and len(set(r.image_ids)) == n_img
    assert np.allclose(r.caption_ambiguity, [c["ambiguity"] for c in r.caption_meta])
    assert [c["text"] for c in r.caption_meta] == r.captions
    # Karpathy-format JSON
    kj = json.loads((world_dir / "retrieval" / "dataset_synthworld.json").read_text())
    test = [im for im in kj["images"] if im["split"] == "test"]
    assert len(test) == n_img and len(kj["images"]) == n_img + 8
    im = test[0]
    assert {"filepath", "filename", "imgid", "cocoid", "sentids", "sentences", "split"} <= set(im)
    assert im["sentids"] == [s["sentid"] for s in im["sentences"]] and im["sentences"][0]["tokens"]
    v = load_retrieval_split(world_dir, "val")
    assert len(v.image_paths) == 8 and not set(v.image_ids) & set(r.image_ids)
    with pytest.raises(UserError):
        load_retrieval_split(world_dir, "train")
    with pytest.raises(UserError):
        load_retrieval_split(world_dir / "nope")


# ------------------------------------------------------------------ CLI

@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    out = tmp_path / "cli"
    args = ["data", "synthetic", "--out", out, "--image-size", "40", "--num-pretrain", "30", "--shard-size", "20",
            "--num-classify-select", "1", "--num-classify-eval", "1", "--num-retrieval", "10",
            "--num-retrieval-val", "5", "--seed", "1", "--noise", "0.2", "--workers", "2", "--preview",
            "--no-progress"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "samples/s" in r.stdout
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["rendered"] == 30 + 40 + 15 and stats["samples_per_second"] > 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["noise"] == 0.2 and m["image_size"] == 40 and m["counts"]["pretrain_shards"] == 2
    from PIL import Image

    assert Image.open(out / "preview.png").size[1] > 11 * 100  # a row per condition
    # same arguments again: resumes, nothing to render
    r2 = run_cli(*args)
    assert r2.returncode == 0 and json.loads(r2.stdout.strip().splitlines()[-1])["rendered"] == 0


@pytest.mark.parametrize("bad", [["--image-size", "16"], ["--noise", "1.5"], ["--num-pretrain", "-1"]])
def test_cli_bad_input_one_line_exit_2(tmp_path, bad):
    r = run_cli("data", "synthetic", "--out", tmp_path / "x", *bad)
    assert r.returncode == 2
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cli_data_group_help():
    r = run_cli("data", "--help")
    assert r.returncode == 0 and "synthetic" in r.stdout


def _ustar_reference(members) -> bytes:
    """The shard layout zsprob wrote before it used tarfile's PAX format: plain USTAR, fixed metadata."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 0
            ti.mode = 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_tar_writer_writes_plain_ustar_for_short_names():
    from zsprob.data.synthworld.files import tar_bytes as _tar_bytes

    rnd = np.random.default_rng(0)
    members = [(f"{i:09d}.{ext}", rnd.integers(0, 256, size=int(rnd.integers(0, 1500)), dtype=np.uint8).tobytes())
               for i in range(40) for ext in ("jpg", "txt", "json")]
    for k in (0, 1, 2, 7, len(members)):
        assert _tar_bytes(members[:k]) == _ustar_reference(members[:k])
    # names USTAR cannot hold get a PAX header
    import tarfile

    long = [("x" * 120 + ".txt", b"abc")]
    with tarfile.open(fileobj=io.BytesIO(_tar_bytes(long))) as tf:
        assert tf.getnames() == [long[0][0]] and tf.extractfile(tf.getmembers()[0]).read() == b"abc"


def test_positives_npz_is_deterministic_and_scipy_readable(tmp_path):
    import scipy.sparse as sp

    from zsprob.data.synthworld.files import sparse_npz_bytes as _sparse_npz_bytes

    m = sp.random(30, 70, density=0.1, random_state=0, format="csr").astype(bool)
    b1, b2 = _sparse_npz_bytes(m), _sparse_npz_bytes(m.copy())
    assert b1 == b2
    (tmp_path / "p.npz").write_bytes(b1)
    back = sp.load_npz(tmp_path / "p.npz")
    assert back.format == "csr" and back.shape == (30, 70) and (back != m).nnz == 0


def test_make_scene_for_controlled_tests():
    from zsprob.data.synthetic import make_scene

    w = SynthWorld(0, 64)
    a = make_scene([{"shape": "star"}])
    ab = make_scene([{"shape": "star"}, {"shape": "circle", "color": "blue"}])
    cap_a = {"objects": [{"shape": "star"}]}
    cap_ab = {"objects": [{"shape": "star"}, {"shape": "circle"}]}
    assert caption_matches(cap_a, a) and caption_matches(cap_a, ab)
    assert not caption_matches(cap_ab, a) and caption_matches(cap_ab, ab)
    ia, iab = np.asarray(w.render(a)), np.asarray(w.render(ab))
    assert ia.shape == (64, 64, 3) and np.array_equal(ia, np.asarray(w.render(make_scene([{"shape": "star"}]))))
    assert sc.ambiguity(cap_ab) < sc.ambiguity(cap_a)
    with pytest.raises(UserError):
        make_scene([{"shape": "blob"}])
    with pytest.raises(UserError):
        make_scene([{"shape": "star", "position": "left"}, {"shape": "ring", "position": "left"}])


def test_interrupted_generation_leaves_no_partial_files_and_resumes(tmp_path, monkeypatch):
    import zsprob.data.synthworld.writer as S

    kw = dict(TINY, num_pretrain=50, num_classify_eval=1, num_retrieval=6, num_retrieval_val=0)
    ref = tmp_path / "ref"
    generate(ref, **kw)
    out = tmp_path / "w"
    real = S._jpeg
    calls = {"n": 0}

    def flaky(image, quality):
        calls["n"] += 1
        if calls["n"] == 40:  # in the middle of shard 1
            raise KeyboardInterrupt
        return real(image, quality)

    monkeypatch.setattr(S, "_jpeg", flaky)
    with pytest.raises(KeyboardInterrupt):
        generate(out, **kw)
    assert (out / "pretrain" / "shard-000000.tar").is_file()
    assert not (out / "pretrain" / "shard-000001.tar").exists()
    assert not (out / "manifest.json").exists()
    assert not list(out.rglob("*.tmp"))
    monkeypatch.setattr(S, "_jpeg", real)
    generate(out, **kw)
    a, b = _tree(ref), _tree(out)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_five_captions_say_different_things():
    w = SynthWorld(1, 32)
    for i in range(150):
        cms = w.sample("pretrain", i).meta["captions"]
        assert len({sc.caption_key(c) for c in cms}) == 5


def test_objects_never_hide_each_other(monkeypatch):
    """Render each object alone and in its scene (unique colours): part of it is always visible."""
    from zsprob.data.synthworld import render as R

    monkeypatch.setitem(R.COLORS, "id0", (40, 0, 0))
    for k in range(1, 6):
        monkeypatch.setitem(R.COLORS, f"id{k}", (40 * (k + 1), 0, 0))
    w = SynthWorld(0, 64)
    worst = 1.0
    checked = 0
    for i in range(400):
        sc_ = json.loads(json.dumps(w.scene("pretrain", i)[0]))
        if sc_["num_objects"] < 2 or sc_["condition"] == "drawing":
            continue
        if sc_["condition"] != "cropped":
            sc_["condition"] = "normal"
        sc_["background"] = "plain"
        sc_["render"]["bg_color"] = [0, 0, 255]
        for k, o in enumerate(sc_["objects"]):
            o["color"], o["fill"] = f"id{k}", "solid"
        full = np.asarray(R.render_scene(sc_, 64))[..., 0]
        for k in range(sc_["num_objects"]):
            alone = json.loads(json.dumps(sc_))
            alone["objects"] = [sc_["objects"][k]]
            alone["render"]["objects"] = [sc_["render"]["objects"][k]]
            if k > 0:
                alone["condition"] = "normal"  # only object 0 is pushed out of a cropped frame
            area = (np.asarray(R.render_scene(alone, 64))[..., 0] == 40 * (k + 1)).sum()
            visible = (full == 40 * (k + 1)).sum()
            assert area > 0
            worst = min(worst, visible / area)
            checked += 1
    assert checked > 150 and worst > 0.1
