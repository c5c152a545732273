"""The COCO recipe details of PCME++'s official code, by inspecting one batch / one schedule:
same-image captions as positives, the official transforms, the loss-scaling embedding warm-up,
SWA with the official snapshot count and a, b averaged, model selection by validation RSUM."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_TOWERS
from zsprob import UserError
from zsprob.train.data import same_image_targets

TINY = TINY_TOWERS


def _tiny_coco(root: Path, n_train: int = 8, n_val: int = 4) -> None:
    """Karpathy JSON with real JPEGs (colour = caption), train and val images."""
    from PIL import Image
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
    names = list(colours)
    (root / "train2014").mkdir(parents=True)
    images = []
    for i in range(n_train + n_val):
        c = names[i % 4]
        fname = f"COCO_train2014_{i:012d}.jpg"
        Image.new("RGB", (40, 36), colours[c]).save(root / "train2014" / fname)
        sents = [{"raw": f"a {c} picture number {j}", "sentid": 5 * i + j} for j in range(5)]
        images.append({"filepath": "train2014", "filename": fname, "cocoid": i, "imgid": i,
                       "split": "train" if i < n_train else "val", "sentences": sents})
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))


def _cfg(root, **over):
    from zsprob.config import deep_merge
    cfg = {"seed": 0, "method": "pcmepp", "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY},
           "data": {"kind": "coco", "root": str(root), "batch_size": 8, "num_workers": 0},
           "optim": {"name": "adamw", "lr": 2e-3}, "schedule": {"name": "constant", "epochs": 2},
           "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    return deep_merge(cfg, over)


def test_same_image_captions_are_positives_in_one_batch(tmp_path):
    from zsprob.train.build import build_model, build_source
    from zsprob.train.defaults import resolve_config
    from zsprob.train.step import next_batch
    _tiny_coco(tmp_path / "coco", n_train=2, n_val=0)  # 10 captions of 2 images: every batch repeats images
    cfg = resolve_config(_cfg(tmp_path / "coco"))
    model = build_model(cfg)
    source = build_source(cfg, model, 0, 1)
    images, tokens, ids = next(iter(source.epoch_batches(0)))
    assert images.shape[0] == tokens.shape[0] == ids.shape[0] == 8 and len(set(ids.tolist())) <= 2
    torch.testing.assert_close(same_image_targets(ids), (ids[:, None] == ids[None, :]).float())

    def run_with(**kw):
        base = dict(cfg=cfg, noise=0, text_aug=None, label_smoothing=0.0, rank=0,
                    counters=SimpleNamespace(data_time=0.0, noisy_rows=0),
                    acc=SimpleNamespace(device=torch.device("cpu")),
                    cursor=SimpleNamespace(next=lambda: (images, tokens, ids)))
        base.update(kw)
        return SimpleNamespace(**base)

    _, _, matched = next_batch(run_with(), 0)
    assert torch.equal(matched, same_image_targets(ids)) and matched.sum() > 8  # off-diagonal positives
    _, _, smoothed = next_batch(run_with(label_smoothing=0.1), 0)
    torch.testing.assert_close(smoothed, 0.9 * matched + 0.1 * (1 - matched))
    off = resolve_config(_cfg(tmp_path / "coco", data={"same_image_positives": False}))
    _, _, none = next_batch(run_with(cfg=off), 0)
    assert none is None  # the identity: same-image captions are negatives again


def test_official_transforms_crop_flip_squash_and_imagenet_normalisation(tmp_path):
    from PIL import Image

    from zsprob.data.transforms import IMAGENET_MEAN, IMAGENET_STD, OfficialCocoTrainTransform
    from zsprob.models import load, save
    from zsprob.train.build import build_model
    from zsprob.train.defaults import resolve_config
    cfg = resolve_config(_cfg(tmp_path, data={"preprocess": "official"}))
    model = build_model(cfg)
    assert isinstance(model.preprocess_train, OfficialCocoTrainTransform)
    # evaluation squashes the whole (non-square) image: left half red, right half blue survive both
    img = Image.new("RGB", (80, 40), (255, 0, 0))
    img.paste((0, 0, 255), (40, 0, 80, 40))
    x = model.preprocess_val(img)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None], torch.tensor(IMAGENET_STD)[:, None]
    torch.testing.assert_close(x[:, 16, 2], ((torch.tensor([1.0, 0, 0])[:, None] - mean) / std)[:, 0], atol=1e-2, rtol=0)
    torch.testing.assert_close(x[:, 16, 29], ((torch.tensor([0, 0, 1.0])[:, None] - mean) / std)[:, 0], atol=1e-2, rtol=0)
    # training: a horizontal ramp; every crop keeps >= 60% of the width and half the draws are flipped
    ramp = Image.fromarray((torch.arange(100).repeat(50, 1) * 2.5).to(torch.uint8).numpy()).convert("RGB")
    import random
    random.seed(0)
    flips, widths = 0, []
    for _ in range(40):
        t = model.preprocess_train(ramp)
        assert t.shape == (3, 32, 32)
        row = t[0, 16] * IMAGENET_STD[0] + IMAGENET_MEAN[0]
        flips += int(row[0] > row[-1])
        widths.append(float(abs(row[-1] - row[0])) * 255 / 2.5)
    assert 8 <= flips <= 32 and min(widths) > 0.55 * 100 and max(widths) <= 100
    save(model, tmp_path / "m")  # a saved model evaluates with the official transform
    assert load(tmp_path / "m").config["preprocess_cfg"]["resize_mode"] == "squash"


def test_embedding_warmup_scales_the_loss_not_the_lr():
    from zsprob.train.defaults import resolve_config
    from zsprob.train.schedule import resolve_schedule
    cfg = resolve_config({"schedule": {"steps": 50}, "freeze": {"image_steps": 20, "warmup_steps": 10,
                                                                "warmup_mode": "loss"}})
    plan = resolve_schedule(cfg, 10)
    assert [plan.freeze["image"](s) for s in (19, 20, 25)] == [0.0, 1.0, 1.0]  # no lr ramp
    assert [plan.loss_scale(s) for s in (0, 19, 20, 24, 29, 30)] == [1.0, 1.0, 0.1, 0.5, 1.0, 1.0]
    lr = resolve_schedule(resolve_config({"schedule": {"steps": 50},
                                          "freeze": {"image_steps": 20, "warmup_steps": 10}}), 10)
    assert lr.loss_scale is None and lr.freeze["image"](24) == pytest.approx(5 / 11)
    with pytest.raises(Exception, match="warmup_mode"):
        resolve_schedule(resolve_config({"schedule": {"steps": 5}, "freeze": {"warmup_mode": "both"}}), 10)


def test_swa_averages_a_and_b_with_the_weights(tmp_path):
    from zsprob.models import load_extra_tensors, load_meta
    from zsprob.prob import PCMEPPLoss
    from zsprob.train import optim
    from zsprob.train.build import build_model
    from zsprob.train.defaults import resolve_config
    from zsprob.train.checkpoints import save_model
    from zsprob.train.step import ContrastiveStep
    cfg = resolve_config({"model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY}})
    step = ContrastiveStep(build_model(cfg), PCMEPPLoss())
    swa = optim.SWA(step.model, start=0, every=1, loss=step.loss)
    for a in (4.0, 6.0, 11.0):
        with torch.no_grad():
            step.loss.scale.fill_(a)
            step.loss.shift.fill_(a / 2)
        swa.update(step.model, step.loss)
    assert swa.averaged_loss.module.scale.item() == pytest.approx(7.0)
    save_model(step, tmp_path / "swa", cfg, 3, swa=swa)
    assert float(load_extra_tensors(tmp_path / "swa")["loss.scale"]) == pytest.approx(7.0)
    assert load_meta(tmp_path / "swa")["extra"]["loss_params"]["shift"] == pytest.approx(3.5)
    restored = optim.SWA(step.model, start=0, every=1, loss=step.loss)
    restored.load_state_tensors(swa.state_tensors())
    assert restored.averaged_loss.module.scale.item() == pytest.approx(7.0)


def test_official_recipe_keeps_nine_swa_snapshots():
    from zsprob.train import load_train_config
    from zsprob.train.build import build_swa
    from zsprob.train.schedule import resolve_schedule
    cfg = load_train_config("finetune_coco_vitb32.yaml", [])
    plan = resolve_schedule(cfg, 100)  # 25 epochs of 100 steps
    swa = build_swa(cfg, torch.nn.Linear(2, 2), plan, torch.nn.Linear(1, 1))
    updates = [s for s in range(1, plan.total_steps + 1) if swa.should_update(s)]
    assert updates == [100 * e for e in range(17, 26)]  # the ends of epochs 17..25, as swa_start_epoch 16
    assert cfg.freeze.warmup_mode == "loss" and cfg.data.preprocess == "official"


def test_model_selection_keeps_the_best_val_rsum(tmp_path, monkeypatch):
    from zsprob.data import classification
    from zsprob.models import load
    from zsprob.retrieval.coco import CocoValSelection
    from zsprob.train import train
    _tiny_coco(tmp_path / "coco")
    checked, real = [], classification.readable_images
    monkeypatch.setattr(classification, "readable_images", lambda paths: checked.append(len(paths)) or real(paths))
    hook = CocoValSelection(tmp_path / "coco", tmp_path / "run", method="pcmepp", batch_size=8)
    train(_cfg(tmp_path / "coco", train={"eval_every_epochs": 1}), tmp_path / "run", eval_hooks=[hook], progress=False)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [5, 10]  # 40 captions / 8 = 5 steps per epoch: once per epoch
    assert checked == [4]  # the 4 val images are checked once, when the hook is built, not at every evaluation
    rsums = [e["eval"]["val_rsum"] for e in evals]
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["val_rsum"] == max(rsums) and best["step"] == evals[rsums.index(max(rsums))]["step"]
    assert load(tmp_path / "run" / "model-best").checkpoint_meta["extra"]["val_rsum"] == max(rsums)


def test_model_selection_refuses_an_unreadable_val_image_when_the_hook_is_built(tmp_path):
    from zsprob.retrieval.coco import CocoValSelection
    _tiny_coco(tmp_path / "coco")
    (tmp_path / "coco" / "train2014" / "COCO_train2014_000000000009.jpg").write_bytes(b"not a jpeg")  # a val image
    with pytest.raises(UserError, match="1 of 4 images of the val split cannot be read"):
        CocoValSelection(tmp_path / "coco", tmp_path / "run", method="pcmepp", batch_size=8)
