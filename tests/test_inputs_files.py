"""Bad input files, end to end through the CLI: one line `zsprob: error: ...` and exit 2 (or the right result),
never a traceback, and nothing the user wrote is lost (files under --out byte-identical, or not created).

Selection files of another shape, repeated class names, a cache folder that is a file, damaged images in a
folder dataset, SynthWorld worlds of zero images and damaged shards, non-UTF-8 configs, damaged training
states and --resume with another --method, published models without their weights (no network), null-default
float keys, and --device values that do not exist here."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from conftest import run_cli, tiny_model_args

CLASSES = ["circle", "square", "triangle"]
TEMPLATES = ["a photo of a {}.", "a drawing of a {}.", "a dark photo of the {}."]


# ------------------------------------------------------------------ helpers

def one_line_error(r, *needles: str) -> str:
    """Exit 2, exactly one stderr line starting `zsprob: error:`, no traceback; returns the line."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zsprob: error:"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (empty when it does not exist)."""
    root = Path(root)
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _image(shape: str, i: int, size: int = 32):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (20 * (i % 7), 90, 200 - 10 * (i % 9)))
    d = ImageDraw.Draw(img)
    box = (6 + i, 6 + i, size - 6, size - 6)
    if shape == "circle":
        d.ellipse(box, fill=(250, 40, 40))
    elif shape == "square":
        d.rectangle(box, fill=(40, 250, 40))
    else:
        d.polygon([(size // 2, 4), (4, size - 4), (size - 4, size - 4)], fill=(40, 40, 250))
    return img


def _folder(root: Path, n: int = 3) -> Path:
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(n):
            _image(c, i).save(root / c / f"{i:03d}.png")
    return root


def _jpeg_bytes(i: int) -> bytes:
    buf = io.BytesIO()
    _image("circle", i, 64).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    import torch

    from zsprob.models import create_model, save

    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny"), root / "ckpt")
    (root / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    _folder(root / "eval")
    return {"root": root, "ckpt": str(ckpt), "eval": str(root / "eval"), "templates": str(root / "templates.txt")}


def zeroshot_args(base, out, *extra):
    return ["zeroshot", "folder", "--checkpoint", base["ckpt"], "--root", base["eval"], "--templates",
            base["templates"], "--topk", "all", "--workers", "0", "--out", out, *extra]


# ------------------------------------------------------------------ 1. selection files of another shape

@pytest.mark.parametrize("doc, needle", [
    ([1, 2], "a JSON list"),
    ({"foo": 1}, "format is None"),
    ({"format": "zsprob-selection/1", "strategy": "all", "templates": ["a {}."],
      "classes": [{"name": "circle", "kept": [{"index": 5, "weight": 1.0}], "mu": [0.1, 0.2]}]}, "template index 5"),
    ({"format": "zsprob-selection/1", "strategy": "all", "templates": ["a {}."], "model": [],
      "classes": [{"name": "circle", "kept": [{"index": 0, "weight": 1.0}], "mu": [0.1]}]}, "'model' must be"),
    ({"format": "zsprob-selection/1", "strategy": "all", "templates": ["a {}."],
      "classes": [{"name": "a", "kept": [], "mu": [0.1]}, {"name": "b", "kept": "x", "mu": [0.1]}]}, "class 2"),
])
def test_a_selection_file_of_another_shape_is_one_line(base, tmp_path, doc, needle):
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(doc))
    out = tmp_path / "out" / "r.json"
    args = ["zeroshot", "folder", "--checkpoint", base["ckpt"], "--root", base["eval"], "--workers", "0",
            "--out", out, "--prompts", sel]  # no --templates / --topk: the selection fixes them (refused beside it)
    one_line_error(run_cli(*args), "not a zsprob selection file", needle)
    assert not (tmp_path / "out").exists()


def test_a_written_selection_passes_the_shape_check():
    import torch

    from zsprob.zeroshot.prompts import check_selection_document
    from zsprob.zeroshot.selection import Selection

    sel = Selection(strategy="all", label="all", classnames=["a", "b"], templates=["x {}.", "y {}."],
                    weights=torch.tensor([[1.0, 0.0], [0.5, 0.5]]), class_mu=torch.randn(2, 4),
                    class_logvar=torch.zeros(2, 4), uncertainty=torch.ones(2, 2), k=[1, 2])
    doc = json.loads(json.dumps(sel.to_dict()))
    assert check_selection_document(doc) is doc
    back = Selection.from_dict(doc)
    assert back.classnames == ["a", "b"] and torch.equal(back.weights, sel.weights)


# ------------------------------------------------------------------ 2. repeated class names

def test_a_class_file_with_a_repeated_name_is_refused_naming_its_lines(base, tmp_path):
    classes = tmp_path / "classes.txt"
    classes.write_text("# my classes\ncircle\nsquare\ncircle\n")
    out = tmp_path / "out" / "r.json"
    one_line_error(run_cli(*zeroshot_args(base, out, "--classes", classes)), "'circle'", "lines 2, 4")
    # select-prompts on ImageNet names takes the file as it is (no folder matching): refused there too
    one_line_error(run_cli("select-prompts", "--checkpoint", base["ckpt"], "--dataset", "imagenet", "--classes",
                           classes, "--templates", base["templates"], "--topk", "all", "--out", out),
                   "'circle'", "lines 2, 4")
    assert not (tmp_path / "out").exists()


def test_clips_imagenet_names_keep_their_known_repeats(tmp_path):
    from zsprob.utils.paths import prompts_dir
    from zsprob.zeroshot.prompts import load_classnames

    names = load_classnames("imagenet_classnames.txt")
    assert len(names) == 1000 and names.count("missile") == 2
    copy = tmp_path / "in.txt"
    shutil.copy(prompts_dir() / "imagenet_classnames.txt", copy)
    assert load_classnames(copy) == names


# ------------------------------------------------------------------ 3. a cache folder that is a file

def test_a_cache_dir_that_is_a_file_is_one_line(base, tmp_path):
    blocker = tmp_path / "cachefile"
    blocker.write_bytes(b"mine")
    out = tmp_path / "out" / "r.json"
    one_line_error(run_cli(*zeroshot_args(base, out, "--cache-dir", blocker)), "--cache-dir", "is a file")
    one_line_error(run_cli("select-prompts", "--checkpoint", base["ckpt"], "--dataset", "folder", "--root",
                           base["eval"], "--templates", base["templates"], "--topk", "all", "--cache-dir", blocker,
                           "--out", out), "--cache-dir", "is a file")
    # the default cache/ next to --out, taken by a file
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "cache").write_bytes(b"also mine")
    one_line_error(run_cli(*zeroshot_args(base, tmp_path / "d" / "r.json")), "cache", "is a file")
    assert blocker.read_bytes() == b"mine" and (tmp_path / "d" / "cache").read_bytes() == b"also mine"
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path / "d")) == ["cache"]


# ------------------------------------------------------------------ 4. damaged images in a folder dataset

def _damaged_folder(root: Path) -> Path:
    from PIL import Image

    _folder(root)
    (root / "circle" / "zz_not_an_image.jpg").write_text("this is text, not a JPEG\n")
    jpeg = _jpeg_bytes(1)
    (root / "square" / "zz_cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (1, 2, 3)).save(png, format="PNG")
    (root / "triangle" / "zz_cut.png").write_bytes(png.getvalue()[:-30])
    (root / "triangle" / "zz_trailer.jpg").write_bytes(jpeg + b"appended by a camera" * 10)  # complete JPEG
    return root


def test_damaged_images_are_skipped_and_counted(base, tmp_path):
    from zsprob.data.classification import FolderDataset

    root = _damaged_folder(tmp_path / "data")
    before = tree(root)
    ds = FolderDataset(root)
    assert len(ds.skipped) == 3 and len(ds) == 3 * 3 + 1
    assert {p.name for p, _ in ds.skipped} == {"zz_not_an_image.jpg", "zz_cut.jpg", "zz_cut.png"}
    assert all(ds[i][0].size for i in range(len(ds)))  # every kept sample decodes
    out = tmp_path / "out" / "r.json"
    args = zeroshot_args(base, out)
    args[args.index("--root") + 1] = str(root)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if ln.startswith("zsprob: warning: skipped")]
    assert len(warnings) == 1 and "skipped 3 unreadable image(s)" in warnings[0] and str(root) in warnings[0]
    assert "Traceback" not in r.stderr
    result = json.loads(out.read_text())
    assert result["metrics"]["n_images"] == 10 and result["dataset"]["skipped_unreadable_images"] == 3
    assert tree(root) == before


def test_a_folder_of_only_damaged_images_is_one_line(base, tmp_path):
    root = tmp_path / "bad"
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        (root / c / "x.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    out = tmp_path / "out" / "r.json"
    args = zeroshot_args(base, out)
    args[args.index("--root") + 1] = str(root)
    one_line_error(run_cli(*args), "no readable images under", "all 3")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 5. worlds of zero images

def test_a_world_of_zero_images_is_refused_when_asked_for(tmp_path):
    zeros = ["--num-pretrain", "0", "--num-classify-select", "0", "--num-classify-eval", "0", "--num-retrieval",
             "0", "--num-retrieval-val", "0"]
    one_line_error(run_cli("data", "synthetic", "--out", tmp_path / "w0", *zeros), "nothing to generate")
    assert not (tmp_path / "w0").exists()


def test_commands_name_what_a_world_lacks(base, tmp_path):
    w = tmp_path / "w"
    r = run_cli("data", "synthetic", "--out", w, "--image-size", "32", "--num-pretrain", "0", "--num-classify-select",
                "1", "--num-classify-eval", "0", "--num-retrieval", "0", "--num-retrieval-val", "0", "--no-progress")
    assert r.returncode == 0, r.stderr
    one_line_error(run_cli("eval", "synthetic", "--checkpoint", base["ckpt"], "--root", w, "--out",
                           tmp_path / "e" / "m.json"), "no retrieval test images", "--num-retrieval")
    one_line_error(run_cli("zeroshot", "synthetic", "--checkpoint", base["ckpt"], "--root", w, "--topk", "all",
                           "--out", tmp_path / "e" / "r.json"), "no classify/eval images", "--num-classify-eval")
    (w / "pretrain").mkdir()
    one_line_error(run_cli("pretrain", "--data", "synthetic", "--shards", w / "pretrain", "--out", tmp_path / "p"),
                   "no pretraining images")
    assert not (tmp_path / "e").exists() and not (tmp_path / "p").exists()


def test_shards_that_hold_nothing_are_one_line(tiny_world, tmp_path):
    import tarfile

    w = tmp_path / "w"
    shutil.copytree(tiny_world, w)
    for shard in (w / "pretrain").glob("*.tar"):
        tarfile.open(shard, "w").close()
    manifest = json.loads((w / "manifest.json").read_text())
    manifest.pop("checksums", None)  # a world written before checksums: the emptiness check alone
    (w / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(run_cli("pretrain", "--data", "synthetic", "--shards", w / "pretrain", "--out", tmp_path / "p",
                           *tiny_model_args(), "--steps", "1"), "hold no samples")
    assert not (tmp_path / "p").exists()


# ------------------------------------------------------------------ 9. SynthWorld re-runs repair damaged files

WORLD = ["--image-size", "32", "--num-pretrain", "40", "--shard-size", "20", "--num-classify-select", "1",
         "--num-classify-eval", "1", "--num-retrieval", "4", "--num-retrieval-val", "0", "--seed", "2",
         "--no-progress"]


def test_a_rerun_regenerates_damaged_files_and_says_which(tmp_path):
    ref, w = tmp_path / "ref", tmp_path / "w"
    assert run_cli("data", "synthetic", "--out", ref, *WORLD).returncode == 0
    manifest = json.loads((ref / "manifest.json").read_text())
    want = {rel: entry["sha256"] for rel, entry in manifest["checksums"].items()}
    assert want == {k: v for k, v in tree(ref).items() if k.startswith(("pretrain/", "classify/", "retrieval/"))}
    assert all(manifest["checksums"][k]["size"] == (ref / k).stat().st_size for k in want)
    shutil.copytree(ref, w)
    shard = w / "pretrain" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    image = sorted((w / "classify" / "eval").rglob("*.jpg"))[3]
    image.write_bytes(b"overwritten")
    # a reader sees the damage before training
    one_line_error(run_cli("pretrain", "--data", "synthetic", "--shards", w / "pretrain", "--out", tmp_path / "p"),
                   "shard-000001.tar is damaged", "re-run `zsprob data synthetic`")
    r = run_cli("data", "synthetic", "--out", w, *WORLD)
    assert r.returncode == 0, r.stderr
    warning = [ln for ln in r.stderr.splitlines() if ln.startswith("zsprob: warning:")]
    assert len(warning) == 1 and "2 file(s)" in warning[0] and "pretrain/shard-000001.tar" in warning[0]
    assert image.relative_to(w).as_posix() in warning[0]
    assert tree(w) == tree(ref)


def test_a_world_without_checksums_is_accepted_and_its_cut_shards_repaired(tmp_path):
    ref, w = tmp_path / "ref", tmp_path / "w"
    assert run_cli("data", "synthetic", "--out", ref, *WORLD).returncode == 0
    shutil.copytree(ref, w)
    manifest = json.loads((w / "manifest.json").read_text())
    del manifest["checksums"]
    (w / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shard = w / "pretrain" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:7000])
    r = run_cli("data", "synthetic", "--out", w, *WORLD)
    assert r.returncode == 0 and "pretrain/shard-000000.tar" in r.stderr, r.stderr
    assert tree(w) == tree(ref)  # checksums recorded again, the shard rewritten from the seed


# ------------------------------------------------------------------ 6, 10. configs

def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_bytes(b"optim:\n  lr: 1.0e-3   # caf\xe9\n")
    one_line_error(run_cli("pretrain", "--config", cfg, "--data", "synthetic", "--shards", tmp_path, "--out",
                           tmp_path / "run"), "not UTF-8", "line 2")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("item, needle", [
    ("optim.layer_decay=nan", "optim.layer_decay"), ("optim.layer_decay=.inf", "optim.layer_decay"),
    ("optim.layer_decay=abc", "optim.layer_decay"), ("optim.layer_decay=true", "optim.layer_decay"),
    ("optim.layer_decay=1.5", "optim.layer_decay"), ("optim.disc_lr=-1", "optim.disc_lr"),
    ("optim.disc_lr=[1]", "optim.disc_lr"), ("model.embed_dim=0", "model.embed_dim"),
    ("train.eval_every_epochs=.nan", "train.eval_every_epochs"),
])
def test_null_default_number_keys_are_checked(tiny_world, tmp_path, item, needle):
    one_line_error(run_cli("pretrain", "--data", "synthetic", "--shards", tiny_world / "pretrain", "--out",
                           tmp_path / "run", "--set", item), needle)
    assert not (tmp_path / "run").exists()


def test_null_default_number_keys_keep_good_values():
    from zsprob.train.defaults import load_train_config

    cfg = load_train_config(None, ["optim.layer_decay=0.7", "optim.disc_lr=2.0e-4"])
    assert cfg.optim.layer_decay == 0.7 and cfg.optim.disc_lr == 2.0e-4
    assert load_train_config(None, []).optim.layer_decay is None


# ------------------------------------------------------------------ 7. resuming from damaged or other-method runs

@pytest.fixture(scope="module")
def trained_run(tiny_world, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    r = run_cli("pretrain", "--data", "synthetic", "--shards", tiny_world / "pretrain", "--out", out,
                *tiny_model_args(), "--steps", "2", "--batch-size", "8", "--checkpoint-every", "2", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _resume(tiny_world, out, *extra):
    return run_cli("pretrain", "--data", "synthetic", "--shards", tiny_world / "pretrain", "--out", out,
                   *tiny_model_args(), "--steps", "4", "--batch-size", "8", "--checkpoint-every", "2", "--resume",
                   "--no-progress", *extra)


@pytest.mark.parametrize("content", [b"", b"garbage{", b"[]", b"{}", b'{"step": "x"}', b"null"])
def test_resume_from_a_damaged_state_json_is_one_line(tiny_world, trained_run, tmp_path, content):
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    state = out / "checkpoints" / "step-0000002" / "state.json"
    state.write_bytes(content)
    before = tree(out)
    one_line_error(_resume(tiny_world, out), "step-0000002/state.json")
    assert tree(out) == before


def test_resume_with_another_method_names_both(tiny_world, trained_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    before = tree(out)
    one_line_error(_resume(tiny_world, out, "--method", "infonce"), "--method pcmepp", "--method infonce")
    assert tree(out) == before


# ------------------------------------------------------------------ 8. published models without weights

def test_a_published_model_without_weights_fails_at_once_without_network(monkeypatch):
    from zsprob.errors import UserError
    from zsprob.models import load_for_inference

    tried = []

    def no_network(*args, **kwargs):
        tried.append(args)
        raise OSError("network access in a test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in ("prolip-ViT-B-16", "pcmepp-ViT-B-16"):
        start = time.perf_counter()
        with pytest.raises(UserError, match="--pretrained") as err:
            load_for_inference(model=name)
        assert time.perf_counter() - start < 0.5
        assert "SanghyukChun/" in str(err.value) and "never downloads" in str(err.value)
    assert not tried


GUARD = """import os, socket
def _refuse(*args, **kwargs):
    with open(os.environ["ZSPROB_TEST_NET_LOG"], "a") as f:
        f.write(repr(args[:2]) + "\\n")
    raise OSError("network access refused by the test")
socket.getaddrinfo = _refuse
socket.socket.connect = _refuse
"""


def test_select_prompts_with_a_published_name_and_no_weights_never_reaches_the_network(base, tmp_path):
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "net.log"
    env = {"PYTHONPATH": os.pathsep.join([str(guard), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "ZSPROB_TEST_NET_LOG": str(log)}
    out = tmp_path / "out" / "s.json"
    line = one_line_error(run_cli("select-prompts", "--model", "prolip-ViT-B-16", "--dataset", "folder", "--root",
                                  base["eval"], "--out", out, env=env), "--pretrained DIR", "timm/ViT-B-16-SigLIP")
    assert "SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B" in line
    assert not log.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 11. devices that do not exist here

def _embeddings(path: Path) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, image_ids=np.arange(4), caption_ids=np.arange(8), caption_image=np.repeat(np.arange(4), 2),
             image_mu=rng.normal(size=(4, 8)).astype("float32"), caption_mu=rng.normal(size=(8, 8)).astype("float32"))
    return path


def _device_commands(base, tiny_world, tmp_path) -> dict[str, list]:
    npz = _embeddings(tmp_path / "E.npz")
    (tmp_path / "index").mkdir()
    out = tmp_path / "out"
    return {
        "select-prompts": ["select-prompts", "--checkpoint", base["ckpt"], "--dataset", "folder", "--root",
                           base["eval"], "--topk", "all", "--out", out / "s.json"],
        "zeroshot": zeroshot_args(base, out / "r.json"),
        "eval synthetic": ["eval", "synthetic", "--checkpoint", base["ckpt"], "--root", tiny_world, "--out",
                           out / "m.json"],
        "eval coco": ["eval", "coco", "--embeddings", npz, "--out", out / "m.json"],
        "eval embeddings": ["eval", "embeddings", npz, "--out", out / "m.json"],
        "index build": ["index", "build", "--embeddings", npz, "--out", out / "ix"],
        "index search": ["index", "search", "--index", tmp_path / "index", "--queries", npz, "--out", out / "h.json"],
    }


@pytest.mark.parametrize("device, needle", [("tpu9", "unknown device 'tpu9'"), ("cuda", "no CUDA GPU")])
def test_devices_that_do_not_exist_are_one_line_in_every_command(base, tiny_world, tmp_path, device, needle):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for name, args in _device_commands(base, tiny_world, tmp_path).items():
        r = run_cli(*args, "--device", device)
        assert r.returncode == 2, (name, r.stderr[-2000:])
        one_line_error(r, needle)
        assert not (tmp_path / "out").exists(), name
