"""CLIP_benchmark model type "zsprob": CLIP_benchmark's own zero-shot and retrieval evaluate() on a zsprob
model give zsprob's own answers (zeroshot --topk all per image; eval R@K), and `zsprob clip-benchmark`
runs its command line."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("clip_benchmark")

from zsprob.integrations.clip_benchmark import MeanEncoder, register, topk_accuracy  # noqa: E402
from zsprob.models import create_model, save  # noqa: E402

TOWERS = {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8, "image_size": 32},
          "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}
TEMPLATES = ["a photo of a {}.", "a drawing of a {}.", "a {} shape.", "an image with one {} in it."]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from zsprob.data.synthetic import generate

    out = tmp_path_factory.mktemp("sw_cb")
    generate(out, image_size=32, num_pretrain=0, num_classify_select=0, num_classify_eval=3, num_retrieval=24,
             num_retrieval_val=0, shard_size=32, progress=False)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = create_model("zsprob-tiny", embed_dim=16, pooling="gpo", seed=5, open_clip_cfg=TOWERS)
    return save(model, tmp_path_factory.mktemp("cb_ckpt") / "model")


@pytest.fixture(scope="module")
def loaded(ckpt):
    import clip_benchmark.models as cbm

    register()
    return cbm.load_clip("zsprob", model_name=str(ckpt), pretrained="", cache_dir=None, device="cpu")


def test_register_adds_the_type_and_the_loader_gives_means_and_sigma2(loaded, ckpt):
    import clip_benchmark.models as cbm

    from zsprob.models import load

    register()  # idempotent
    assert cbm.MODEL_TYPES.count("zsprob") == 1 and "zsprob" in cbm.TYPE2FUNC
    model, transform, tokenizer = loaded
    ref = load(ckpt).eval()
    x = torch.rand(3, 3, 32, 32)
    tok = tokenizer(["a red circle", "two squares"])
    with torch.no_grad():
        mu_i, lv_i = ref.encode_image(x)
        mu_t, lv_t = ref.encode_text(tok)
        assert torch.equal(model.encode_image(x), mu_i) and torch.equal(model.encode_text(tok), mu_t)
        assert torch.equal(model.encode_image_sigma2(x), lv_i.exp())
        assert torch.equal(model.encode_text_sigma2(tok), lv_t.exp())
    assert transform is not None and isinstance(model, MeanEncoder)


def test_topk_accuracy_matches_a_direct_count():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(50, 7, generator=g), torch.randint(0, 7, (50,), generator=g)
    order = logits.argsort(dim=1, descending=True)
    for k, got in zip((1, 3, 5), topk_accuracy(logits, target, topk=(1, 3, 5))):
        assert got == pytest.approx(float((order[:, :k] == target[:, None]).any(1).double().mean()), abs=1e-12)


def test_clip_benchmark_zeroshot_equals_zsprob_topk_all_per_image(world, ckpt, loaded, tmp_path, cli_run):
    from clip_benchmark.metrics import zeroshot_classification as zsc

    from zsprob.data.classification import build_classification_dataset
    from zsprob.models import load
    from zsprob.zeroshot.classify import prepare
    from zsprob.zeroshot.metrics import class_scores
    from zsprob.zeroshot.selection import select_all

    model, transform, tokenizer = loaded
    tfile = tmp_path / "templates.txt"
    tfile.write_text("\n".join(TEMPLATES) + "\n")
    r = cli_run("zeroshot", "synthetic", "--checkpoint", ckpt, "--root", world, "--topk", "all", "--templates",
                tfile, "--out", tmp_path / "zs" / "results.json", "--workers", "0")
    assert r.returncode == 0, r.stderr
    ours = json.loads((tmp_path / "zs" / "results.json").read_text())["metrics"]

    ds = build_classification_dataset("synthetic", world, "eval", transform=transform)
    ds.classes = list(ds.classnames)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)
    templates = [t.replace("{}", "{c}") for t in TEMPLATES]
    theirs = zsc.evaluate(model, loader, tokenizer, ds.classes, templates, device="cpu", amp=False)
    assert theirs["acc1"] * 100 == pytest.approx(ours["top1"], abs=1e-9)
    assert theirs["acc5"] * 100 == pytest.approx(ours["top5"], abs=1e-9)
    assert theirs["mean_per_class_recall"] * 100 == pytest.approx(ours["mean_per_class"], abs=1e-9)

    # image by image: CLIP_benchmark's classifier and logits against zsprob's "all" selection
    classifier = zsc.zero_shot_classifier(model, tokenizer, ds.classes, templates, "cpu", amp=False)
    logits, target = zsc.run_classification(model, classifier, loader, "cpu", amp=False)
    bank, feats, _, _ = prepare(load(ckpt).eval(), root=world, dataset="synthetic", templates=str(tfile),
                                need_select=False, progress=False)
    zs_scores = class_scores(feats.mu, feats.logvar, select_all(bank), score="cosine")
    assert torch.equal(target, feats.labels)
    assert torch.equal(logits.argmax(1), zs_scores.argmax(1))
    assert len(target) == 3 * len(ds.classes)


def _captions_collate(batch):
    """Images stacked, captions kept as one list per image (CLIP_benchmark's image_captions_collate_fn contract)."""
    images, captions = zip(*batch)
    return torch.stack(images), captions


def _needs_cli():
    """CLIP_benchmark's command line imports its dataset builder, which imports requests (undeclared by
    clip-benchmark 1.6.2; zsprob's test extra installs it)."""
    try:
        import clip_benchmark.cli  # noqa: F401
    except ImportError as e:
        pytest.skip(f"CLIP_benchmark's command line cannot be imported here: {e}")


def _flickr_annotations(world, path):
    """SynthWorld's retrieval test split in CLIP_benchmark's Flickr annotation format (image,caption)."""
    doc = json.loads((world / "retrieval" / "dataset_synthworld.json").read_text())
    lines = ["image,caption"]
    for im in doc["images"]:
        if im["split"] == "test":
            lines += [f"{im['filename']},{s['raw']}" for s in im["sentences"]]
    path.write_text("\n".join(lines) + "\n")
    return world / "retrieval" / "images" / "test"


@pytest.fixture(scope="module")
def retrieval(world, loaded, tmp_path_factory):
    """CLIP_benchmark's retrieval evaluate() on SynthWorld's test pairs, read by its Flickr dataset class."""
    from clip_benchmark.datasets.flickr import Flickr
    from clip_benchmark.metrics import zeroshot_retrieval

    model, transform, tokenizer = loaded
    ann = tmp_path_factory.mktemp("cb_ann") / "ann.txt"
    images = _flickr_annotations(world, ann)
    ds = Flickr(str(images), str(ann), transform=transform)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, collate_fn=_captions_collate)
    metrics = zeroshot_retrieval.evaluate(model, loader, tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
    return images, ann, ds, metrics


def test_clip_benchmark_retrieval_equals_zsprob_eval_recall(world, ckpt, retrieval, tmp_path, cli_run):
    _, _, ds, theirs = retrieval
    r = cli_run("eval", "synthetic", "--checkpoint", ckpt, "--root", world, "--score", "cosine", "--no-analysis",
                "--workers", "0", "--out", tmp_path / "ev" / "metrics.json")
    assert r.returncode == 0, r.stderr
    ours = json.loads((tmp_path / "ev" / "metrics.json").read_text())["metrics"]["caption"]
    n_img, n_cap = len(ds), sum(len(c) for _, c in ds.data)
    for k in (1, 5, 10):  # the same number of hits (CLIP_benchmark averages in float32)
        assert round(theirs[f"text_retrieval_recall@{k}"] * n_img) == round(ours["i2t"][f"r@{k}"] * n_img / 100)
        assert round(theirs[f"image_retrieval_recall@{k}"] * n_cap) == round(ours["t2i"][f"r@{k}"] * n_cap / 100)
        assert theirs[f"image_retrieval_recall@{k}"] * 100 == pytest.approx(ours["t2i"][f"r@{k}"], abs=1e-4)
    assert 0 < theirs["text_retrieval_recall@1"] < 1  # a non-trivial ranking was compared


def test_cli_clip_benchmark_eval_runs_its_own_command_line(ckpt, retrieval, tmp_path, cli_run):
    """`zsprob clip-benchmark eval`: CLIP_benchmark's command line and dataset builder, the same figures."""
    _needs_cli()
    images, ann, _, theirs = retrieval
    out = tmp_path / "cb.json"
    r = cli_run("clip-benchmark", "eval", "--dataset", "flickr30k", "--dataset_root", images, "--annotation_file",
                ann, "--model", ckpt, "--task", "zeroshot_retrieval", "--no_amp", "--recall_k",
                "1", "5", "10", "--num_workers", "0", "--batch_size", "8", "--output", out, "--quiet")
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["metrics"]
    assert got == pytest.approx(theirs, abs=1e-9)


def test_cli_errors_are_one_line(tmp_path, cli_run):
    _needs_cli()
    r = cli_run("clip-benchmark", "eval", "--dataset", "cifar10", "--model", tmp_path / "missing",
                "--dataset_root", tmp_path, "--output", tmp_path / "o.json", "--quiet")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("zsprob: error:"), r.stderr
    assert r.stderr.count("\n") == 1


def test_an_unknown_dataset_is_one_line(ckpt, tmp_path, cli_run):
    _needs_cli()
    r = cli_run("clip-benchmark", "eval", "--dataset", "no_such_set", "--model", ckpt, "--dataset_root", tmp_path,
                "--output", tmp_path / "o.json", "--quiet")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("zsprob: error: clip-benchmark: Unsupported dataset: no_such_set"), r.stderr


@pytest.mark.parametrize("error, hint", [("network", True), ("missing file", False)])
def test_a_download_that_cannot_reach_its_server_or_a_missing_file_is_one_line(monkeypatch, error, hint):
    """CLIP_benchmark downloads a dataset missing under --dataset_root; without a network that is a URLError
    deep in torchvision (here raised by a stand-in for its command line, so no test ever downloads)."""
    import urllib.error

    from clip_benchmark import cli as cb_cli

    from zsprob.errors import UserError
    from zsprob.integrations.clip_benchmark import run_cli

    def fails():
        if error == "network":
            raise urllib.error.URLError("[Errno -2] Name or service not known")
        raise FileNotFoundError(2, "No such file or directory", "/data/cifar10/batches.meta")
    monkeypatch.setattr(cb_cli, "main", fails)
    with pytest.raises(UserError) as e:
        run_cli(["eval", "--dataset", "cifar10"])
    assert "\n" not in str(e.value) and str(e.value).startswith("clip-benchmark: ")
    assert ("give that folder as --dataset_root" in str(e.value)) == hint
