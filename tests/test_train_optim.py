"""Parameter groups (LLRD, tower multipliers, weight-decay groups), schedules, backbone freezing,
SWA, training-state round trips, caption noise and MSDA targets (fast, no data files)."""
from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch
from torch import nn

from zsprob.errors import UserError
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
    from zsprob.train.step import ContrastiveStep
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
    import timm.optim
    from zsprob.train.adamp import AdamP
    assert isinstance(O.create_optimizer(groups, name="adamp", lr=0.1), AdamP)
    assert isinstance(O.create_optimizer(O.param_groups(m, lr=0.1, weight_decay=0.1), name="adamp-timm", lr=0.1),
                      timm.optim.AdamP)
    assert isinstance(O.create_optimizer(O.param_groups(m, lr=0.1, weight_decay=0.1), name="adamw"),
                      torch.optim.AdamW)
    from zsprob.errors import UserError
    from zsprob.train.defaults import load_train_config, resolve_config
    with pytest.raises(UserError, match="unknown optimizer 'lion'"):  # the config's rule, before anything is built
        resolve_config(load_train_config(None, ["optim.name=lion"]))


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_torch_optimisers_run_multi_tensor_and_fused_on_request(name):
    """The default (foreach) gives the per-tensor loop's updates bit for bit; optim.fused the same to
    float rounding; both on two weight-decay groups over several steps."""
    def run(**kwargs):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
        opt = O.create_optimizer(O.param_groups(m, lr=0.05, weight_decay=0.1), name=name, lr=0.05, **kwargs)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return opt, [p.detach().clone() for p in m.parameters()]

    _, loop = run(foreach=False)  # torch's per-tensor loop
    opt, multi = run()
    assert all(group["foreach"] for group in opt.param_groups)
    assert all(torch.equal(a, b) for a, b in zip(loop, multi))
    opt, fused = run(fused=True)
    assert all(group["fused"] for group in opt.param_groups)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(loop, fused))
    with pytest.raises(UserError, match="optim.fused"):
        O.create_optimizer(O.param_groups(nn.Linear(2, 2), lr=0.1, weight_decay=0.1), name="adamp", fused=True)


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
    from zsprob.train.defaults import resolve_config
    c = resolve_config(load_train_config("finetune_coco_vitb32.yaml"))
    assert (c.model.name, c.model.pretrained, c.model.embed_dim) == ("ViT-B-32", "openai", 1024)
    assert (c.optim.name, c.optim.lr, c.optim.weight_decay, c.optim.layer_decay) == ("adamp", 5e-4, 1e-4, 0.7)
    assert (c.optim.image_lr_mult, c.optim.text_lr_mult, c.optim.grad_clip) == (0.01, 0.1, 2.0)
    assert (c.schedule.epochs, c.schedule.milestones_epochs, c.data.batch_size) == (25, [15], 128)
    assert (c.freeze.image_epochs, c.freeze.warmup_epochs) == (2, 1)
    assert c.msda.enabled and c.msda.ratio == 0.25 and c.msda.alpha == 2.0
    assert c.swa.enabled and c.swa.last_epochs == 9  # official swa_start_epoch 16 of epochs 0-24: 9 snapshots
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


# ----------------------------------------------------------------------------- ViT-B/16 lr table

B16_LR, B16_WD, B16_DECAY, B16_IMAGE_MULT, B16_TEXT_MULT = 5e-4, 1e-4, 0.7, 0.01, 0.1
BLOCK_INDEX = re.compile(r"resblocks\.(\d+)\.")
SIGMA_BLOCK_INDEX = re.compile(r"^(image|text)_sigma\.blocks\.(\d+)\.")


def official_lr_wd(name: str, n_blocks: int = 12, n_unc_layers: int = 1) -> tuple[float, float]:
    """naver-ai/pcmepp ``configure_optimizers`` written out on zsprob's parameter names.

    img_enc.backbone = clip.visual.* + the image sigma blocks (uncertainty_transformer);
    txt_enc.backbone = the text tower (token / positional embedding, blocks, ln_final, projection)
    + the text sigma blocks (prob_resblocks); the rest of each encoder (GPO, sigma projection) at
    lr; parameters outside both encoders (loss a, b; logit scale) at lr without weight decay.
    Inside a backbone: lr * backbone_mult * decay^(12 - k) for ``resblocks.k.``,
    decay^(n_unc - j) for sigma block j, no layer decay for everything else.
    """
    name = name.removeprefix("model.")
    sigma = SIGMA_BLOCK_INDEX.match(name)
    if sigma:
        tower = sigma.group(1)
        factor = B16_DECAY ** (n_unc_layers - int(sigma.group(2)))
    elif name.startswith("clip.visual."):
        tower = "image"
        block = BLOCK_INDEX.search(name)
        factor = B16_DECAY ** (n_blocks - int(block.group(1))) if block else 1.0
    elif name.startswith("clip.") and name not in ("clip.logit_scale", "clip.logit_bias"):
        tower = "text"
        block = BLOCK_INDEX.search(name)
        factor = B16_DECAY ** (n_blocks - int(block.group(1))) if block else 1.0
    elif name.startswith(("image_sigma.", "image_gpo.", "text_sigma.", "text_gpo.")):
        return B16_LR, B16_WD
    else:
        return B16_LR, 0.0
    mult = B16_IMAGE_MULT if tower == "image" else B16_TEXT_MULT
    return B16_LR * mult * factor, B16_WD


def zsprob_lr_wd(name: str, p: torch.Tensor, n_blocks: int = 12) -> tuple[float, float]:
    """zsprob's earlier grouping on the same names: every open_clip parameter layer-decayed by its
    depth (embeddings 0, block k at k + 1, final LN / projection at 13), added modules at lr, no
    weight decay on norms / biases / scalars."""
    name = name.removeprefix("model.")
    wd = 0.0 if O.no_weight_decay(name, p) else B16_WD
    if name.startswith("clip.") and name not in ("clip.logit_scale", "clip.logit_bias"):
        mult = B16_IMAGE_MULT if name.startswith("clip.visual.") else B16_TEXT_MULT
        block = BLOCK_INDEX.search(name)
        if block:
            depth = int(block.group(1)) + 1
        elif any(k in name for k in ("ln_post", "ln_final", "proj")):
            depth = n_blocks + 1
        else:
            depth = 0
        return B16_LR * mult * B16_DECAY ** (n_blocks + 1 - depth), wd
    return B16_LR, wd


@pytest.fixture(scope="module")
def b16_step():
    """A ViT-B/16 ProbCLIP (one sigma block per tower) on the meta device, with PCME++'s loss."""
    from zsprob.models import create_model
    from zsprob.prob import create_loss
    from zsprob.train.step import ContrastiveStep
    with torch.device("meta"):
        model = create_model("ViT-B-16", None, sigma_depth=1, seed=0)
        return ContrastiveStep(model, create_loss("pcmepp"))


def _b16_groups(step, grouping):
    return O.param_groups(step, lr=B16_LR, weight_decay=B16_WD, param_info=step.model.param_info(),
                          prefix="model.", layer_decay=B16_DECAY, image_lr_mult=B16_IMAGE_MULT,
                          text_lr_mult=B16_TEXT_MULT, grouping=grouping)


@pytest.mark.parametrize("grouping", ["official", "zsprob"])
def test_vitb16_every_group_lr_and_weight_decay(b16_step, grouping):
    groups = _b16_groups(b16_step, grouping)
    named = [(n, p) for n, p in b16_step.named_parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in groups) == len(named)
    sigma_blocks = [n for n, _ in named if SIGMA_BLOCK_INDEX.match(n.removeprefix("model."))]
    assert {n.split("_")[0].removeprefix("model.") for n in sigma_blocks} == {"image", "text"}
    assert any(n.startswith("loss.") for n, _ in named)  # the loss's a, b are grouped too
    for name, p in named:
        g = _group_of(groups, p)
        want_lr, want_wd = official_lr_wd(name) if grouping == "official" else zsprob_lr_wd(name, p)
        assert g["lr"] == pytest.approx(want_lr, rel=1e-12), (grouping, name, g["group_name"])
        assert g["weight_decay"] == want_wd, (grouping, name, g["group_name"])


def test_vitb16_official_vs_zsprob_rates(b16_step):
    """ViT-B/16, zsprob's grouping against the official one: sigma blocks 143x / 14x faster, embeddings ~1/100."""
    params = dict(b16_step.named_parameters())
    official = {id(p): g for g in _b16_groups(b16_step, "official") for p in g["params"]}
    zsprob = {id(p): g for g in _b16_groups(b16_step, "zsprob") for p in g["params"]}

    def lr_ratio(name):
        p = params[name]
        return zsprob[id(p)]["lr"] / official[id(p)]["lr"]

    sigma_image = "model.image_sigma.blocks.0.attn.in_proj_weight"
    sigma_text = "model.text_sigma.blocks.0.attn.in_proj_weight"
    assert official[id(params[sigma_image])]["lr"] == pytest.approx(5e-4 * 0.01 * 0.7)  # 3.5e-6
    assert official[id(params[sigma_text])]["lr"] == pytest.approx(5e-4 * 0.1 * 0.7)    # 3.5e-5
    assert lr_ratio(sigma_image) == pytest.approx(1 / (0.01 * 0.7)) and round(lr_ratio(sigma_image)) == 143
    assert lr_ratio(sigma_text) == pytest.approx(1 / (0.1 * 0.7)) and round(lr_ratio(sigma_text)) == 14
    for emb in ("model.clip.visual.conv1.weight", "model.clip.visual.positional_embedding",
                "model.clip.token_embedding.weight", "model.clip.positional_embedding"):
        assert lr_ratio(emb) == pytest.approx(0.7 ** 13)  # 0.0097, about 1/103
    # the sigma blocks sit in the backbone groups: a frozen image backbone freezes them too
    assert official[id(params[sigma_image])]["backbone"] and not zsprob[id(params[sigma_image])]["backbone"]


def test_grouping_and_layer_decay_validated():
    """Checked with the config, where they enter (zsprob.train.defaults.KEYS); param_groups trusts them."""
    from zsprob.train.defaults import resolve_config
    with pytest.raises(UserError, match="optim.grouping"):
        resolve_config({"optim": {"grouping": "paper"}})
    with pytest.raises(UserError, match="layer_decay"):
        resolve_config({"optim": {"layer_decay": 1.5, "grouping": "official"}})


def test_official_groups_freeze_the_sigma_blocks(step_module):
    """Official: a frozen image backbone freezes the image sigma blocks; the heads keep training."""
    info = step_module.model.param_info()
    groups = O.param_groups(step_module, lr=1e-3, weight_decay=0.1, param_info=info, prefix="model.",
                            layer_decay=0.7, grouping="official")
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = O.GroupSchedule(opt, lambda s: 1.0, freeze={"image": O.freeze_fn(2, 0)})
    frozen = {id(p) for g in sched.frozen_groups() for p in g["params"]}
    params = dict(step_module.named_parameters())
    sigma = [n for n in params if n.startswith("model.image_sigma.blocks.")]
    assert sigma and all(id(params[n]) in frozen for n in sigma)
    assert all(id(params[n]) not in frozen for n in params if n.startswith(("model.image_gpo.", "model.text_")))
