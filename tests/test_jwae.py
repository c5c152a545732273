"""jWAE as a trainable system: the model, the discriminator game, the semi-supervised streams, the CLI.

Small worlds: features are synthetic (a shared latent seen through two random linear maps) where
the test is about the game or the terms; the CLI tests generate a tiny SynthWorld.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from conftest import run_cli
from zsprob.data.synthetic import paired_split
from zsprob.errors import UserError
from zsprob.prob.jwae import JWAEObjective
from zsprob.train.defaults import load_train_config, resolve_config
from zsprob.train.jwae_data import FeatureStore, SemiSupervisedSource

FEAT = 24


def jwae_cfg(*sets: str):
    base = ["model.embed_dim=24", "model.jwae.latent_dim=8", "model.jwae.image_hidden=32",
            "model.jwae.text_hidden=32", "data.batch_size=16", "train.tensorboard=false",
            "train.checkpoint_every=0", "train.log_every=10"]
    return load_train_config("jwae_synthetic.yaml", base + list(sets))


def feature_store(n=240, seed=0, n_caps=2) -> FeatureStore:
    """Image and caption features of n samples that share a 4-d latent (captions: two noisy views)."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 4, generator=g)
    a, b = torch.randn(4, FEAT, generator=g), torch.randn(4, FEAT, generator=g)
    img = latent @ a + 0.05 * torch.randn(n, FEAT, generator=g)
    txt = torch.stack([latent @ b + 0.05 * torch.randn(n, FEAT, generator=g) for _ in range(n_caps)], 1)
    return FeatureStore(img, txt, np.full(n, n_caps))


def source(fraction=0.5, unpaired=True, n=240, batch=16) -> SemiSupervisedSource:
    paired, rest = paired_split(n, fraction, seed=0)
    return SemiSupervisedSource(feature_store(n), paired, rest, batch_size=batch, unpaired_batch_size=batch,
                                use_unpaired=unpaired, seed=0)


# ----------------------------------------------------------------------------- data

def test_paired_split_nests_partitions_and_the_config_rejects_fractions_outside_0_1():
    p10, u10 = paired_split(1000, 0.1, seed=3)
    p50, u50 = paired_split(1000, 0.5, seed=3)
    assert len(p10) == 100 and len(p50) == 500 and set(p10) <= set(p50)
    assert not set(p10) & set(u10) and len(set(p10) | set(u10)) == 1000
    assert len(paired_split(1000, 1.0)[1]) == 0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(UserError, match=r"data.paired_fraction must be in \(0, 1\]"):
            resolve_config(jwae_cfg(f"data.paired_fraction={bad}"))


def test_unpaired_streams_draw_only_from_the_unpaired_share_and_resume_exactly():
    src = source(0.25)
    img_rows = {tuple(r.tolist()): i for i, r in enumerate(src.store.image_feats)}
    batches = list(src.epoch_batches(0))
    assert len(batches) == src.steps_per_epoch == 60 // 16
    paired, unpaired = set(src.paired.tolist()), set(src.unpaired.tolist())
    for b in batches:
        assert {img_rows[tuple(r.tolist())] for r in b["img"]} <= paired
        assert {img_rows[tuple(r.tolist())] for r in b["u_img"]} <= unpaired
        assert b["features"] and b["u_txt"].shape == (16, FEAT)
    again = list(src.epoch_batches(0, skip=2))  # a resumed epoch reads the same batches
    for k in ("img", "txt", "u_img", "u_txt"):
        assert torch.equal(again[0][k], batches[2][k])
    off = next(iter(source(0.25, unpaired=False).epoch_batches(0)))
    assert off["u_img"] is None and off["u_txt"] is None and torch.equal(off["img"], batches[0]["img"])


# ----------------------------------------------------------------------------- the objective

def test_unpaired_rows_reach_only_the_terms_of_their_modality():
    torch.manual_seed(0)
    obj = JWAEObjective(latent_dim=8, preset="jwae-mse")

    def rows(n, d=FEAT):
        return (torch.randn(n, d), torch.randn(n, d), torch.randn(n, 8, requires_grad=True))
    img, txt, u_img, u_txt = rows(6), rows(6), rows(5), rows(4)
    _, base = obj.generator_terms(img, txt)
    _, with_img = obj.generator_terms(img, txt, u_img=u_img)
    _, with_txt = obj.generator_terms(img, txt, u_txt=u_txt)
    for k in ("align", "rec_txt", "adv_txt"):      # unpaired images: image terms only
        assert torch.equal(with_img[k], base[k]), k
    assert with_img["rec_img"] != base["rec_img"] and with_img["adv_img"] != base["adv_img"]
    for k in ("align", "rec_img", "adv_img"):      # unpaired captions: text terms only
        assert torch.equal(with_txt[k], base[k]), k
    assert with_txt["rec_txt"] != base["rec_txt"] and with_txt["adv_txt"] != base["adv_txt"]
    # and by gradient: the alignment never reaches an unpaired code, the prior term does
    align = obj.alignment(img[2], txt[2])
    assert torch.autograd.grad(align, u_img[2], allow_unused=True)[0] is None
    loss, _ = obj.generator_terms(img, txt, u_img=u_img, u_txt=u_txt)
    g_img, g_txt = torch.autograd.grad(loss, [u_img[2], u_txt[2]])
    assert g_img.abs().sum() > 0 and g_txt.abs().sum() > 0
    d_loss, d_stats = obj.discriminator_terms(torch.cat([img[2], u_img[2]]), torch.cat([txt[2], u_txt[2]]))
    assert torch.autograd.grad(d_loss, u_img[2], allow_unused=True)[0] is None  # codes are detached for D


# ----------------------------------------------------------------------------- the game

def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(module, before):
    return {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}


def test_discriminator_and_autoencoder_updates_touch_only_their_own_parameters():
    from accelerate import Accelerator

    from zsprob.train import jwae_step
    cfg = resolve_config(jwae_cfg("optim.grad_clip=2.0", "schedule.steps=5"))
    src = source(0.5)
    acc = Accelerator(cpu=True)
    model, loss, src, plan, step_module, optimizer, _ = jwae_step.build(cfg, acc, src)
    run = types.SimpleNamespace(acc=acc, cfg=cfg, optimizer=optimizer, world=1)
    batch = next(iter(src.epoch_batches(0)))
    codes = step_module.codes(batch)
    before = _snapshot(step_module)
    d_loss, _ = step_module.discriminator_loss(codes, step=0)
    jwae_step._backward_check(run, d_loss, list(loss.parameters()), model.trainable_parameters())
    jwae_step.optimizer_step(run)
    optimizer.zero_grad(set_to_none=True)
    changed = _changed(step_module, before)
    assert changed and all(n.startswith("loss.discriminator.") for n in changed), changed
    before = _snapshot(step_module)
    g_loss, _ = step_module.generator_loss(codes)
    assert jwae_step.apply_if_finite(run, jwae_step._backward_check(run, g_loss, model.trainable_parameters(),
                                                                    list(loss.parameters())))
    changed = _changed(step_module, before)
    assert {n.split(".")[1] for n in changed} == {"image_encoder", "image_decoder", "text_encoder", "text_decoder"}
    assert all(n.startswith("model.") and not n.startswith("model.tower.") for n in changed), changed
    assert {g["group_name"]: g["lr"] for g in optimizer.param_groups} == {"autoencoders": 1e-4, "discriminator": 5e-5}


def test_training_lowers_reconstruction_and_aligns_pairs_and_saves_a_loadable_model(tmp_path):
    from zsprob.models import load
    from zsprob.train.loop import train
    cfg = jwae_cfg("schedule.steps=150", "optim.lr=1e-3", "optim.disc_lr=5e-4", "loss.jwae.preset=jwae-mse")
    train(cfg, tmp_path / "run", source=source(1.0, n=240), progress=False)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = recs[0], recs[-1]
    assert last["step"] == 150 and last["nonfinite_total"] == 0
    assert last["rec_img"] < 0.7 * first["rec_img"] and last["rec_txt"] < 0.7 * first["rec_txt"], (first, last)
    assert last["align"] < 0.5 * first["align"], (first, last)
    model = load(tmp_path / "run" / "model")
    assert type(model).__name__ == "JWAEModel" and model.embed_dim == 8 and model.deterministic
    tokens = model.tokenizer(["a red circle", "two stars"])
    mu, lv = model.encode_text(tokens)
    assert lv is None and mu.shape == (2, 8) and torch.allclose(mu.norm(dim=1), torch.ones(2), atol=1e-5)


# ----------------------------------------------------------------------------- CLI

@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    from zsprob.data.synthetic import generate
    world = tmp_path_factory.mktemp("jwae") / "sw"
    generate(world, num_pretrain=200, num_classify_select=0, num_classify_eval=0, num_retrieval=40,
             num_retrieval_val=0, shard_size=100, progress=False)
    return world


def test_cli_pretrain_jwae_with_unpaired_streams_then_eval_synthetic(tiny_world, tmp_path):
    out = tmp_path / "run"
    r = run_cli("pretrain", "--config", "jwae_synthetic.yaml", "--data", "synthetic", "--shards",
                tiny_world / "pretrain", "--out", out, "--steps", 6, "--batch-size", 16, "--no-progress",
                "--log-every", 3, "--set", "data.paired_fraction=0.5", "--set", "model.embed_dim=32",
                "--set", f"data.feature_cache={tmp_path / 'feats.safetensors'}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["data"] == {"paired": 100, "unpaired": 100} and rec["n_unpaired_img"] == 16
    assert (tmp_path / "feats.safetensors").is_file()
    r = run_cli("eval", "synthetic", "--checkpoint", out / "model", "--root", tiny_world, "--score", "cosine",
                "--no-analysis", "--out", tmp_path / "eval" / "metrics.json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"]
    assert 0 <= metrics["caption"]["i2t"]["r@1"] <= 100


@pytest.mark.parametrize("args, message", [
    (("--config", "synthetic_tiny.yaml", "--method", "jwae"), "decoder config"),
    (("--config", "jwae_synthetic.yaml", "--set", "data.paired_fraction=1.5"), "paired_fraction must be in (0, 1]"),
    (("--config", "jwae_synthetic.yaml", "--set", "data.paired_fraction=0"), "paired_fraction must be in (0, 1]"),
])
def test_cli_bad_jwae_input_is_one_line_and_exit_2(tmp_path, tiny_world, args, message):
    r = run_cli("pretrain", *args, "--data", "synthetic", "--shards", tiny_world / "pretrain",
                "--out", tmp_path / "run", "--steps", 2, "--no-progress", "--set", "model.embed_dim=16", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    from safetensors.torch import load_file

    from zsprob.train.loop import train
    cfg = jwae_cfg("schedule.steps=12", "train.checkpoint_every=5", "train.keep_checkpoints=5")
    train(cfg, tmp_path / "full", source=source(0.5), progress=False)
    train(cfg, tmp_path / "part", resume=str(tmp_path / "full" / "checkpoints" / "step-0000005"),
          source=source(0.5), progress=False)
    a = load_file(str(tmp_path / "full" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # autoencoders and discriminator
