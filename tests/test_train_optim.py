"""Parameter groups (LLRD, tower multipliers, weight-decay groups), schedules, backbone freezing,
SWA, training-state round trips, caption noise and MSDA targets (fast, no data files)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from zsprob.train import optim as O
from zsprob.train import state as S
from zsprob.train.data import add_caption_noise, mixed_seed
from zsprob.train.distributed import all_gather_with_grad, block_diag_targets, gather_gaussians

TINY = {"open_clip_cfg": {"vision_cfg": {"layers": 3, "width": 32, "head_width": 16, "patch_size": 8,
                                          "image_size": 32},
                          "text_cfg": {"layers": 3, "width": 32, "heads": 2, "context_length": 16}}}


@pytest.fixture(scope="module")
def step_module():
    from zsprob.models import create_model
    from zsprob.prob import create_loss
    from zsprob.train.loop import ContrastiveStep
    model = create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY)
    return ContrastiveStep(model, create_loss("pcmepp"))


def _group_of(groups, p):
    for g in groups:
        if any(q is p for q in g["params"]):
            return g
    raise AssertionError("parameter in no group")


def test_llrd_multipliers_and_weight_decay_groups(step_module):
    info = step_module.model.param_info()
    lr, decay = 1e-3, 0.7
    groups = O.param_groups(step_module, lr=lr, weight_decay=0.05, param_info=info, prefix="model.",
                            layer_decay=decay, image_lr_mult=0.01, text_lr_mult=0.1)
    seen = {"image": set(), "text": set()}
    n_checked = 0
    for name, p in step_module.named_parameters():
        if not p.requires_grad:
            continue
        g = _group_of(groups, p)
        if name.startswith("model."):
            meta = info[name[len("model."):]]
            if meta["backbone"] and meta["tower"] in ("image", "text"):
                mult = 0.01 if meta["tower"] == "image" else 0.1
                expected = lr * mult * decay ** (meta["num_layers"] - meta["depth"])
                seen[meta["tower"]].add(meta["depth"])
            else:
                expected = lr
        else:  # the loss's a and b
            expected = lr
            assert g["weight_decay"] == 0.0
        assert g["lr"] == pytest.approx(expected, rel=1e-12), name
        n_checked += 1
        if p.ndim < 2 or "bias" in name or "ln_" in name:
            assert g["weight_decay"] == 0.0, name
        else:
            assert g["weight_decay"] == 0.05, name
    # every depth of both towers (embeddings, 3 blocks, head) got its own lr
    assert seen["image"] == {0, 1, 2, 3, 4} and seen["text"] == {0, 1, 2, 3, 4}
    # embeddings of the image tower: 0.01 * 0.7^4
    emb = _group_of(groups, step_module.model.clip.visual.conv1.weight)
    assert emb["lr"] == pytest.approx(lr * 0.01 * decay ** 4)
    assert n_checked == sum(1 for p in step_module.parameters() if p.requires_grad)


def test_schedules():
    f = O.schedule_fn("cosine", total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(1 / 11) and f(9) == pytest.approx(10 / 11)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1)
    g = O.schedule_fn("step", total_steps=100, milestones=[50, 80], gamma=0.1)
    assert g(49) == 1.0 and g(50) == pytest.approx(0.1) and g(85) == pytest.approx(0.01)


def test_freeze_then_warmup_per_group(step_module):
    info = step_module.model.param_info()
    groups = O.param_groups(step_module, lr=1.0, weight_decay=0.0, param_info=info, prefix="model.")
    opt = torch.optim.AdamW(groups, lr=1.0)
    sched = O.GroupSchedule(opt, O.schedule_fn("constant", total_steps=100),
                            freeze={"image": O.freeze_fn(3, 2)})
    lrs = []
    for s in range(7):
        img = [g["lr"] for g in opt.param_groups if g["backbone"] and g["tower"] == "image"]
        txt = [g["lr"] for g in opt.param_groups if g["tower"] == "text"]
        assert len(set(img)) == 1 and set(txt) == {1.0}
        lrs.append(img[0])
        frozen = sched.frozen_groups()
        assert (len(frozen) > 0) == (s < 3)
        sched.step()
    assert lrs == pytest.approx([0, 0, 0, 1 / 3, 2 / 3, 1, 1])
    # frozen parameters neither move nor accumulate optimiser state
    sched.load_state_dict({"step_count": 0})
    w = step_module.model.clip.visual.conv1.weight
    before = w.detach().clone()
    out = step_module.model(torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2, 16)))
    (out["img_mu"].sum() + out["txt_mu"].sum()).backward()
    O.zero_frozen_grads(sched.frozen_groups())
    opt.step()
    opt.zero_grad()
    assert torch.equal(w.detach(), before) and w not in opt.state


def test_adamp_and_adamw_created():
    m = nn.Linear(4, 3)
    groups = O.param_groups(m, lr=0.1, weight_decay=0.1)
    from timm.optim import AdamP
    assert isinstance(O.create_optimizer(groups, name="adamp", lr=0.1), AdamP)
    assert isinstance(O.create_optimizer(O.param_groups(m, lr=0.1, weight_decay=0.1), name="adamw"),
                      torch.optim.AdamW)
    from zsprob.errors import UserError
    with pytest.raises(UserError):
        O.create_optimizer(groups, name="lion")


def test_swa_averages_end_of_interval_weights():
    m = nn.Linear(3, 2)
    swa = O.SWA(m, start=4, every=2)
    snapshots = []
    for step_done in range(1, 11):
        with torch.no_grad():
            m.weight.add_(float(step_done))
        if swa.should_update(step_done):
            swa.update(m)
            snapshots.append(m.weight.detach().clone())
    assert len(snapshots) == 3  # steps 6, 8, 10
    assert torch.allclose(swa.averaged.module.weight, torch.stack(snapshots).mean(0))
    assert swa.n_averaged == 3
    # state round trip
    other = O.SWA(nn.Linear(3, 2), start=4, every=2)
    other.load_state_tensors(swa.state_tensors())
    assert torch.equal(other.averaged.module.weight, swa.averaged.module.weight) and other.n_averaged == 3


def test_training_state_round_trip(tmp_path):
    m = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4))
    from timm.optim import AdamP
    opt = AdamP(O.param_groups(m, lr=0.01, weight_decay=0.1), lr=0.01, betas=(0.9, 0.98))
    for _ in range(2):
        m(torch.randn(3, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    S.save_state(tmp_path / "st", {"optimizer": opt.state_dict(), "rng": S.rng_state(), "step": 7})
    expect = (random.random(), np.random.rand(), torch.rand(3))
    st = S.load_state(tmp_path / "st")
    assert not list(tmp_path.glob("st/*.tmp"))
    S.set_rng_state(st["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    m2 = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4))
    opt2 = AdamP(O.param_groups(m2, lr=0.01, weight_decay=0.1), lr=0.01)
    opt2.load_state_dict(st["optimizer"])
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd2["param_groups"][0]["betas"] == (0.9, 0.98)
    for k, v in sd1["state"].items():
        for kk, vv in v.items():
            assert torch.equal(torch.as_tensor(vv), torch.as_tensor(sd2["state"][k][kk]))
    assert st["step"] == 7
    # a truncated tensor file is a clear user error
    (tmp_path / "st" / "state.safetensors").write_bytes(b"garbage")
    from zsprob.errors import UserError
    with pytest.raises(UserError):
        S.load_state(tmp_path / "st")


def test_caption_noise_rotates_exactly_the_chosen_share():
    tokens = torch.arange(40).unsqueeze(1).repeat(1, 5)
    g = torch.Generator().manual_seed(mixed_seed(0, 3, 0))
    noisy, k = add_caption_noise(tokens, 0.25, g)
    assert k == 10
    changed = (noisy != tokens).any(1)
    assert int(changed.sum()) == 10                  # every chosen row got another row's caption
    assert sorted(noisy[changed, 0].tolist()) == sorted(tokens[changed, 0].tolist())
    assert add_caption_noise(tokens, 0.0, g)[1] == 0


def test_msda_targets_and_single_process_gather():
    from zsprob.prob.msda import mix_batch
    g = torch.Generator().manual_seed(1)
    images = torch.rand(16, 3, 8, 8)
    mixed, matched = mix_batch(images, ratio=0.25, alpha=2.0, generator=g)
    assert matched.shape == (16, 16)
    assert torch.allclose(matched.sum(1), torch.ones(16))          # each image: lam + (1 - lam)
    assert int(((matched > 0) & (matched < 1)).any(1).sum()) == 4  # 25% of the batch is mixed
    assert block_diag_targets(matched) is matched                    # one process: unchanged
    x = torch.randn(4, 3, requires_grad=True)
    assert all_gather_with_grad(x) is x
    (mu, lv), off = gather_gaussians(x, None)
    assert mu is x and lv is None and off == 0


def test_mixed_seed_is_deterministic_and_sensitive():
    assert mixed_seed(0, 1, 2) == mixed_seed(0, 1, 2)
    assert len({mixed_seed(0, s, r) for s in range(50) for r in range(4)}) == 200
    assert 0 <= mixed_seed(2 ** 62, 5) < 2 ** 63
    assert not math.isnan(float(mixed_seed(1)))


def test_recipes_carry_the_paper_settings():
    from zsprob.train import load_train_config
    from zsprob.train.loop import resolve_config
    c = resolve_config(load_train_config("finetune_coco_vitb32.yaml"))
    assert (c.model.name, c.model.pretrained, c.model.embed_dim) == ("ViT-B-32", "openai", 1024)
    assert (c.optim.name, c.optim.lr, c.optim.weight_decay, c.optim.layer_decay) == ("adamp", 5e-4, 1e-4, 0.7)
    assert (c.optim.image_lr_mult, c.optim.text_lr_mult, c.optim.grad_clip) == (0.01, 0.1, 2.0)
    assert (c.schedule.epochs, c.schedule.milestones_epochs, c.data.batch_size) == (25, [15], 128)
    assert (c.freeze.image_epochs, c.freeze.warmup_epochs) == (2, 1)
    assert c.msda.enabled and c.msda.ratio == 0.25 and c.msda.alpha == 2.0
    assert c.swa.enabled and c.swa.last_epochs == 10
    assert c.loss.pcmepp.pp_alpha == 0.1 and c.loss.pcmepp.vib_beta == 1e-4
    b16 = resolve_config(load_train_config("finetune_coco_vitb16.yaml"))
    l14 = resolve_config(load_train_config("finetune_coco_vitl14.yaml", ["optim.lr=1.0e-4"]))
    assert b16.model.name == "ViT-B-16" and b16.swa.enabled and b16.optim.layer_decay == 0.7
    assert l14.model.name == "ViT-L-14" and not l14.swa.enabled and l14.optim.lr == 1e-4
    r = resolve_config(load_train_config("pretrain_redcaps_vits16.yaml"))
    assert (r.model.name, r.model.embed_dim, r.data.batch_size, r.schedule.steps) == ("ViT-S-16-d128", 128, 1536, 100000)
    assert (r.optim.lr, r.optim.betas, r.optim.eps, r.optim.weight_decay) == (5e-4, [0.9, 0.98], 1e-6, 0.2)
    assert r.loss.pcmepp.pp_alpha == 0 and r.loss.pcmepp.vib_beta == 1e-6 and not r.msda.enabled
    t = resolve_config(load_train_config("synthetic_tiny.yaml", ["method=infonce", "schedule.steps=5"]))
    assert t.model.name == "zsprob-tiny-bow" and t.method == "infonce" and t.schedule.steps == 5
    assert t.model.overrides.sigma_bias_init == -6.0 and t.data.augment is False
