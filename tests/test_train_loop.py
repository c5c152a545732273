"""The training loop on real SynthWorld shards: every method learns, exact resume, non-finite
losses, the CLI."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import TINY_TOWERS, read_losses, run_cli, tiny_model_args
from zsprob.errors import UserError

TINY = TINY_TOWERS


def tiny_cfg(shards, **over):
    cfg = {
        "seed": 0,
        "method": "pcmepp",
        "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY},
        "data": {"kind": "synthetic", "shards": str(shards), "batch_size": 16, "num_workers": 0,
                 "shuffle_buffer": 32, "pipeline": {"caption_key": "json:captions"}},
        "optim": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        "schedule": {"name": "constant", "steps": 16, "warmup_steps": 0},
        "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1},
    }
    from zsprob.config import deep_merge
    return deep_merge(cfg, over)


@pytest.mark.slow
@pytest.mark.parametrize("method,extra", [
    ("pcmepp", {"msda": {"enabled": True}}),
    ("pcmepp", {"loss": {"pcmepp": {"distance": "wd"}}}),
    ("pcme", {"loss": {"pcme": {"n_samples": 3}}}),
    ("infonce", {}),
    ("triplet", {}),
    ("prob-triplet", {}),
    ("mu-only", {}),
])
def test_every_method_trains_and_loss_decreases(tiny_world, tmp_path, method, extra):
    from zsprob.models import load, load_meta
    from zsprob.train import train
    cfg = tiny_cfg(tiny_world / "pretrain", method=method, **extra)
    summary = train(cfg, tmp_path / "run", progress=False)
    ls = read_losses(tmp_path / "run")
    assert sorted(ls) == list(range(1, 17))
    first, last = sum(ls[s] for s in (1, 2, 3, 4)) / 4, sum(ls[s] for s in (13, 14, 15, 16)) / 4
    assert last < 0.9 * first, (method, first, last)
    # the checkpoint rebuilds the trained model and records the method
    meta = load_meta(tmp_path / "run" / "model")
    assert meta["method"] == method and meta["step"] == 16
    model = load(tmp_path / "run" / "model")
    from zsprob.prob import needs_sigma
    assert model.deterministic == (not needs_sigma(method))
    assert summary["final_loss"] == pytest.approx(ls[16])


@pytest.mark.slow
def test_resume_continues_exactly(tiny_world, tmp_path):
    """Kill after a mid-epoch checkpoint, resume: the losses and the SWA model match an uninterrupted run."""
    from safetensors.torch import load_file

    from zsprob.train import train
    over = dict(msda={"enabled": True}, data={"noise_ratio": 0.25, "num_workers": 1},
                loss={"pcmepp": {"pp_alpha": 0.1}}, schedule={"name": "cosine", "steps": 10, "warmup_steps": 2},
                swa={"enabled": True, "last_steps": 6, "every_steps": 2},
                train={"checkpoint_every": 3})
    cfg = tiny_cfg(tiny_world / "pretrain", **over)  # 64 samples / batch 16: 4 steps per epoch
    train(cfg, tmp_path / "full", progress=False)

    class Kill(Exception):
        pass

    def kill_at_5(model, step):
        if step == 5:
            raise Kill()
    cut = tiny_cfg(tiny_world / "pretrain", **over)
    cut["train"]["eval_every"] = 5
    with pytest.raises(Kill):
        train(cut, tmp_path / "cut", progress=False, eval_hooks=[kill_at_5])
    assert json.loads((tmp_path / "cut" / "checkpoints" / "latest.json").read_text())["step"] == 3
    assert max(read_losses(tmp_path / "cut")) == 5  # logged past the checkpoint before dying
    train(cut, tmp_path / "cut", resume=True, progress=False)

    a, b = read_losses(tmp_path / "full"), read_losses(tmp_path / "cut")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for s in range(1, 11):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7), (s, a[s], b[s])
    wa = load_file(str(tmp_path / "full" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "model" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    sa = load_file(str(tmp_path / "full" / "model-swa" / "model.safetensors"))
    sb = load_file(str(tmp_path / "cut" / "model-swa" / "model.safetensors"))
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    assert not all(torch.equal(sa[k], wa[k]) for k in sa)  # SWA really averaged
    meta = json.loads((tmp_path / "full" / "model-swa" / "zsprob.json").read_text())
    assert meta["extra"]["swa_n"] == 3  # steps 6, 8, 10


def test_nonfinite_losses_skip_then_stop(tmp_path):
    from zsprob.train import train
    from helpers_train import TensorSource
    g = torch.Generator().manual_seed(0)
    good = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(1, 300, (8, 16), generator=g)) for _ in range(2)]
    bad = [(torch.full((8, 3, 32, 32), float("nan")), torch.randint(1, 300, (8, 16), generator=g)) for _ in range(4)]
    cfg = tiny_cfg("unused", data={"batch_size": 8}, schedule={"steps": 6},
                   train={"max_nonfinite": 3, "checkpoint_every": 0})
    from zsprob.models import create_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match="non-finite in 3 consecutive"):
            train(cfg, tmp_path / "run", source=TensorSource(good + bad), progress=False)
    msgs = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(msgs) == 3 and "update skipped" in msgs[0]
    assert len(read_losses(tmp_path / "run")) == 2  # only the good steps logged a loss
    # skipped updates left the weights finite
    assert create_model is not None


@pytest.mark.slow
def test_cli_errors_and_help(tmp_path):
    r = run_cli("pretrain", "--help")
    assert r.returncode == 0 and "--shards" in r.stdout and "--resume" in r.stdout and "--method" in r.stdout
    r = run_cli("finetune", "coco", "--help")
    assert r.returncode == 0 and "--root" in r.stdout
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "zsprob data synthetic" in r.stderr
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tmp_path), "--out", str(tmp_path / "o"),
                "--resume")
    assert r.returncode == 2 and "nothing to resume" in r.stderr
    r = run_cli("pretrain", "--out", str(tmp_path / "o"), "--set", "optim.name=lion", "--data", "synthetic",
                "--shards", str(tmp_path))
    assert r.returncode == 2


def _tiny_coco(root: Path, n_images: int = 16) -> None:
    """A Karpathy-format COCO train split with real JPEG files (colour = caption)."""
    from PIL import Image
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
    names = list(colours)
    (root / "train2014").mkdir(parents=True)
    images = []
    for i in range(n_images):
        c = names[i % 4]
        fname = f"COCO_train2014_{i:012d}.jpg"
        Image.new("RGB", (40, 36), colours[c]).save(root / "train2014" / fname)
        sents = [{"raw": f"a {c} picture number {j}", "sentid": 5 * i + j} for j in range(5)]
        images.append({"filepath": "train2014", "filename": fname, "cocoid": i, "imgid": i,
                       "split": "train" if i % 2 else "restval", "sentences": sents})
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))


@pytest.mark.slow
def test_finetune_coco_recipe_freezes_then_trains_the_visual_backbone(tmp_path):
    """`zsprob finetune coco` with the B/32 recipe (step schedule, LLRD, tower multipliers, visual
    backbone frozen 2 epochs + 1 epoch warm-up, MSDA, SWA) on a tiny COCO, tiny towers."""
    from safetensors.torch import load_file

    from zsprob.models import create_model
    _tiny_coco(tmp_path / "coco")
    r = run_cli("finetune", "coco", "--config", "finetune_coco_vitb32.yaml", "--root", str(tmp_path / "coco"),
                "--out", str(tmp_path / "run"), *tiny_model_args(), "--batch-size", "16",
                "--epochs", "3", "--precision", "fp32", "--workers", "0", "--log-every", "1",
                "--checkpoint-every", "10", "--set", "train.keep_checkpoints=3", "--no-progress",
                "--set", "train.tensorboard=false", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, 16))           # 80 captions / 16 = 5 steps per epoch
    img_lr = [x["lr_groups"]["image-backbone-d1"] for x in recs]
    txt_lr = [x["lr_groups"]["text-backbone-d1"] for x in recs]
    assert img_lr[:10] == [0.0] * 10 and 0 < img_lr[10] == img_lr[14]  # frozen 2 epochs, then the full lr
    # text backbone: lr x 0.1 x 0.7^(num_layers - depth) = 5e-4 * 0.1 * 0.7^2 (2 blocks + head)
    assert txt_lr[0] == pytest.approx(5e-4 * 0.1 * 0.7 ** 2)
    assert img_lr[14] == pytest.approx(5e-4 * 0.01 * 0.7 ** 2)
    # the visual backbone did not move while frozen; the text backbone did
    init = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY).state_dict()
    at10 = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000010" / "model" / "model.safetensors"))
    k_img = "clip.visual.transformer.resblocks.0.attn.in_proj_weight"
    k_txt = "clip.transformer.resblocks.0.attn.in_proj_weight"
    assert torch.equal(at10[k_img], init[k_img])
    assert not torch.equal(at10[k_txt], init[k_txt])
    final = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert not torch.equal(final[k_img], init[k_img])
    meta = json.loads((tmp_path / "run" / "model-swa" / "zsprob.json").read_text())
    assert meta["extra"]["swa_n"] == 3                                 # end of each epoch (SWA over the last 10)


def test_cnn_image_tower_trains_and_reloads(tiny_world, tmp_path):
    """The timm (BatchNorm) image tower goes through the same loop: loss decreases, SWA averages the
    BN statistics with the weights, and the saved model rebuilds with identical outputs."""
    from zsprob.models import load
    from zsprob.train import train
    over = {"model": {"name": "zsprob-tiny-cnn", "overrides": {"open_clip_cfg": {
        "vision_cfg": {"image_size": 32}, "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}},
        "swa": {"enabled": True, "last_steps": 4, "every_steps": 2}}
    cfg = tiny_cfg(tiny_world / "pretrain", **over)
    train(cfg, tmp_path / "run", progress=False)
    ls = read_losses(tmp_path / "run")
    assert sum(ls[s] for s in (13, 14, 15, 16)) < 0.9 * sum(ls[s] for s in (1, 2, 3, 4))
    m = load(tmp_path / "run" / "model").eval()
    assert m._vision.kind == "timm" and m.config["name"] == "zsprob-tiny-cnn"
    bn = [b for n, b in m.named_buffers() if n.endswith("running_mean")]
    assert bn and any(b.abs().sum() > 0 for b in bn)  # BN statistics were trained and saved
    swa = load(tmp_path / "run" / "model-swa").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.isfinite(swa.encode_image(x)[0]).all()
        a, b = m.encode_image(x), load(tmp_path / "run" / "model").eval().encode_image(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_augment_false_trains_on_the_eval_transform(tiny_world):
    """data.augment=False: the training batches go through model.preprocess_val (no random crop)."""
    from zsprob.train.build import build_model, build_source
    from zsprob.train.defaults import resolve_config
    for augment in (True, False):
        cfg = resolve_config(tiny_cfg(tiny_world / "pretrain", data={"augment": augment}))
        model = build_model(cfg)
        src = build_source(cfg, model, rank=0, world=1)
        assert src.preprocess is (model.preprocess_train if augment else model.preprocess_val)
    assert resolve_config(tiny_cfg(tiny_world / "pretrain")).data.augment is True  # open_clip's default
    with pytest.raises(UserError, match="data.augment must be true or false"):
        resolve_config(tiny_cfg(tiny_world / "pretrain", data={"augment": "maybe"}))


def test_gradient_clip_sets_split_the_log_variance_heads():
    """optim.grad_clip_split: the heads' parameters form their own set; together the sets are every
    trainable parameter, once; a model without heads refuses the option."""
    from zsprob.models import create_model
    from zsprob.prob import PCMEPPLoss, InfoNCELoss
    from zsprob.train.step import ContrastiveStep, gradient_clip_sets
    model = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY)
    raw = ContrastiveStep(model, PCMEPPLoss())
    every = [p for p in raw.parameters() if p.requires_grad]
    (one,) = gradient_clip_sets(raw, split=False)
    assert len(one) == len(every)
    rest, heads = gradient_clip_sets(raw, split=True)
    assert {id(p) for p in rest} | {id(p) for p in heads} == {id(p) for p in every}
    assert not {id(p) for p in rest} & {id(p) for p in heads}
    expected = {id(p) for name, p in model.named_parameters() if name.startswith(("image_sigma.", "text_sigma."))}
    assert {id(p) for p in heads} == expected and expected
    deterministic = ContrastiveStep(create_model("zsprob-tiny", embed_dim=16, seed=0, deterministic=True, **TINY),
                                    InfoNCELoss())
    with pytest.raises(UserError, match="grad_clip_split"):
        gradient_clip_sets(deterministic, split=True)


def test_split_clipping_leaves_the_means_gradient_alone():
    """A set under the bound keeps its gradient however large the other set's is (split); one global
    bound scales both (what coupled the means to the occlusion term's gradients)."""
    from zsprob.train.step import clip_gradient_sets
    means, heads = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    def grads():
        means.grad = torch.tensor([0.3, 0.4, 0.0, 0.0])          # norm 0.5
        heads.grad = torch.tensor([6.0, 8.0, 0.0])               # norm 10
    grads()
    norms = clip_gradient_sets([[means], [heads]], 2.0)
    assert [float(n) for n in norms] == pytest.approx([0.5, 10.0])
    assert torch.equal(means.grad, torch.tensor([0.3, 0.4, 0.0, 0.0]))
    assert float(heads.grad.norm()) == pytest.approx(2.0, rel=1e-5)
    grads()
    (total,) = clip_gradient_sets([[means, heads]], 2.0)
    assert float(total) == pytest.approx((0.25 + 100) ** 0.5)
    assert float(means.grad.norm()) == pytest.approx(0.5 * 2.0 / float(total), rel=1e-5)
