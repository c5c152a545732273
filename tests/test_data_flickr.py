"""Flickr30k (Karpathy split file dataset_flickr30k.json, flickr30k-images/): the dataset, `zsprob eval
flickr30k` (equal to SynthWorld's own evaluation of the same pairs) and `zsprob finetune flickr30k`, on a
miniature in the real format made from a SynthWorld retrieval split."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import TINY_TOWERS, tiny_model_args
from zsprob import UserError
from zsprob.data.coco import CocoPairs
from zsprob.data.flickr import Flickr30kCaptions, karpathy_captions


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from zsprob.data.synthetic import generate

    out = tmp_path_factory.mktemp("sw_f30k")
    generate(out, image_size=32, num_pretrain=0, num_classify_select=0, num_classify_eval=0, num_retrieval=12,
             num_retrieval_val=20, shard_size=32, progress=False)
    return out


def make_flickr(world, root):
    """SynthWorld's test images as Flickr30k test, its val images as val (4) and train (the rest), in the
    Karpathy file's layout (filename, imgid, split, sentids, sentences with tokens / raw / sentid)."""
    (root / "flickr30k-images").mkdir(parents=True)
    src = json.loads((world / "retrieval" / "dataset_synthworld.json").read_text())
    images, n_val = [], 0
    for i, im in enumerate(src["images"]):
        shutil.copyfile(world / "retrieval" / "images" / im["filepath"] / im["filename"],
                        root / "flickr30k-images" / im["filename"])
        split = "test" if im["split"] == "test" else ("val" if n_val < 4 else "train")
        n_val += im["split"] == "val"
        sents = [{"tokens": s["raw"].split(), "raw": s["raw"], "imgid": i, "sentid": 5 * i + j}
                 for j, s in enumerate(im["sentences"])]
        images.append({"sentids": [s["sentid"] for s in sents], "imgid": i, "sentences": sents, "split": split,
                       "filename": im["filename"]})
    (root / "dataset_flickr30k.json").write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    return root


@pytest.fixture(scope="module")
def flickr(world, tmp_path_factory):
    return make_flickr(world, tmp_path_factory.mktemp("flickr30k"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from zsprob.models import create_model, save

    model = create_model("zsprob-tiny", embed_dim=16, seed=2, **TINY_TOWERS)
    return save(model, tmp_path_factory.mktemp("f30k_ckpt") / "model")


def test_the_karpathy_file_is_read_like_coco(flickr, world):
    test = Flickr30kCaptions(flickr, "test")
    assert len(test) == 12 and test.num_captions == 60 and test.instance_labels is None
    src = [im for im in json.loads((world / "retrieval" / "dataset_synthworld.json").read_text())["images"]
           if im["split"] == "test"]
    assert test.image_ids == [int(im["filename"][:-4]) for im in src]          # the photo id of the file name
    assert test.captions == [s["raw"] for im in src for s in im["sentences"]]
    assert test.caption_image.tolist() == [i for i in range(12) for _ in range(5)]
    assert test.caption_ids == list(range(0, 60)) and all(p.is_file() for p in test.image_paths)
    assert len(karpathy_captions("flickr30k", flickr, "train")) == 16 and len(Flickr30kCaptions(flickr, "val")) == 4
    image, index = test.image_dataset(lambda im: im.size)[3]
    assert image == (32, 32) and index == 3
    pairs = CocoPairs(test, mode="all")
    assert len(pairs) == 60 and pairs[7][1:] == (test.captions[7], 1, 7)


def test_missing_or_malformed_files_are_one_error(flickr, tmp_path):
    with pytest.raises(UserError, match="dataset_flickr30k.json"):
        Flickr30kCaptions(tmp_path, "test")
    with pytest.raises(UserError, match="unknown Flickr30k split 'restval'"):
        Flickr30kCaptions(flickr, "restval")
    (tmp_path / "dataset_flickr30k.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        Flickr30kCaptions(tmp_path, "test")
    shutil.copyfile(flickr / "dataset_flickr30k.json", tmp_path / "dataset_flickr30k.json")
    with pytest.raises(UserError, match="flickr30k-images"):  # no images under the root
        Flickr30kCaptions(tmp_path, "test")


def test_eval_flickr30k_equals_synthworld_evaluation_of_the_same_pairs(flickr, world, ckpt, tmp_path, cli_run):
    r = cli_run("eval", "flickr30k", "--checkpoint", ckpt, "--root", flickr, "--score", "cosine", "--no-analysis",
                "--workers", "0", "--out", tmp_path / "f" / "metrics.json")
    assert r.returncode == 0, r.stderr
    ours = json.loads((tmp_path / "f" / "metrics.json").read_text())["metrics"]["coco"]
    r = cli_run("eval", "synthetic", "--checkpoint", ckpt, "--root", world, "--score", "cosine", "--no-analysis",
                "--workers", "0", "--out", tmp_path / "s" / "metrics.json")
    assert r.returncode == 0, r.stderr
    ref = json.loads((tmp_path / "s" / "metrics.json").read_text())["metrics"]["caption"]
    for d in ("i2t", "t2i"):
        for k in ("r@1", "r@5", "r@10"):
            assert ours[d][k] == pytest.approx(ref[d][k], abs=1e-9), (d, k)
    assert ours["rsum"] == pytest.approx(ref["rsum"], abs=1e-9) and 0 < ours["rsum"] < 600


def test_a_root_without_the_split_file_is_one_line(tmp_path, ckpt, cli_run):
    empty = tmp_path / "f30k"
    (empty / "flickr30k-images").mkdir(parents=True)
    for args in (["eval", "flickr30k", "--checkpoint", ckpt, "--root", empty, "--out", tmp_path / "m.json"],
                 ["finetune", "flickr30k", "--root", empty, "--out", tmp_path / "run"]):
        r = cli_run(*args)
        assert r.returncode == 2 and r.stderr.startswith("zsprob: error:") and "dataset_flickr30k.json" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "m.json").exists()


@pytest.mark.slow
def test_finetune_flickr30k_trains_with_val_selection(flickr, tmp_path, cli_run):
    r = cli_run("finetune", "flickr30k", "--config", "finetune_coco_vitb32.yaml", "--root", flickr,
                "--out", tmp_path / "run", *tiny_model_args(), "--batch-size", "16", "--epochs", "1", "--val",
                "--precision", "fp32", "--workers", "0", "--log-every", "1", "--no-progress",
                "--set", "train.tensorboard=false", "--set", "swa.enabled=false", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if "loss" in x] == [1, 2, 3, 4, 5]   # 16 train images x 5 captions / 16
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["split"] == "val" and best["step"] == 5
    assert (tmp_path / "run" / "model-best" / "zsprob.json").is_file()
    assert (tmp_path / "run" / "config.yaml").read_text().count("kind: flickr30k") == 1


def test_an_unreadable_evaluation_image_is_one_line(flickr, ckpt, tmp_path, cli_run):
    """A benchmark split is scored whole: a test image that is not an image (or is cut short) stops the
    evaluation with one line naming it, before any encoding, and --out is not written."""
    root = tmp_path / "f30k"
    shutil.copytree(flickr, root)
    test_images = [im["filename"] for im in json.loads((root / "dataset_flickr30k.json").read_text())["images"]
                   if im["split"] == "test"]
    (root / "flickr30k-images" / test_images[1]).write_bytes(b"not a jpeg")
    out = tmp_path / "out" / "metrics.json"
    r = cli_run("eval", "flickr30k", "--checkpoint", ckpt, "--root", root, "--device", "cpu", "--workers", "0",
                "--out", out)
    assert r.returncode == 2 and r.stderr.startswith("zsprob: error: 1 of ") and r.stderr.count("\n") == 1, r.stderr
    assert test_images[1] in r.stderr and "cannot be read" in r.stderr and not out.parent.exists()
