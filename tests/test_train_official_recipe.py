"""The PCME++ COCO recipe trained as naver-ai/pcmepp does (optim.grouping official, msda.mode
official, text SizeAugment), end to end through `zsprob finetune coco`, and its config errors."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, tiny_model_args
from test_train_loop import TINY, _tiny_coco


def _finetune(tmp_path, *extra: str, epochs: int = 2):
    return run_cli("finetune", "coco", "--config", "finetune_coco_vitb32.yaml", "--root", str(tmp_path / "coco"),
                   "--out", str(tmp_path / "run"), *tiny_model_args(), "--batch-size", "16",
                   "--epochs", str(epochs), "--precision", "fp32", "--workers", "0", "--log-every", "1",
                   "--checkpoint-every", "0", "--no-progress", "--set", "train.tensorboard=false",
                   "--set", "swa.enabled=false", *extra, timeout=900)


@pytest.mark.slow
def test_official_recipe_freezes_the_image_sigma_block_with_its_backbone(tmp_path):
    """Official groups: the image sigma block sits in the frozen visual backbone (2 epochs frozen),
    the text sigma block trains at text lr x 0.1 x 0.7; MSDA official and text SizeAugment run."""
    from safetensors.torch import load_file

    from zsprob.models import create_model
    _tiny_coco(tmp_path / "coco")
    r = _finetune(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 10
    # the tiny towers have 2 blocks: the sigma block duplicates block 1 (depth 2 of num_layers 3)
    assert recs[0]["lr_groups"]["text-backbone-d2"] == pytest.approx(5e-4 * 0.1 * 0.7)
    assert all(x["lr_groups"]["image-backbone-d2"] == 0.0 for x in recs)
    init = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY).state_dict()
    final = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    sigma_img = [k for k in init if k.startswith("image_sigma.blocks.")]
    sigma_txt = [k for k in init if k.startswith("text_sigma.blocks.")]
    assert sigma_img and sigma_txt
    assert all(torch.equal(final[k], init[k]) for k in sigma_img)
    assert any(not torch.equal(final[k], init[k]) for k in sigma_txt)


@pytest.mark.slow
@pytest.mark.parametrize("setting, message", [("optim.grouping=paper", "optim.grouping"),
                                              ("msda.mode=mosaic", "msda.mode"),
                                              ("msda.switch_prob=1.5", "msda.switch_prob"),
                                              ("data.text_size_augment=1.5", "data.text_size_augment"),
                                              ("optim.fused=maybe", "optim.fused must be true or false"),
                                              ("optim.grad_clip_split=2", "optim.grad_clip_split must be")])
def test_bad_official_settings_are_one_line_errors(tmp_path, setting, message):
    _tiny_coco(tmp_path / "coco", n_images=4)
    r = _finetune(tmp_path, "--set", setting, epochs=1)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr[-2000:]
