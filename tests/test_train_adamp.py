"""zsprob's AdamP against timm's: equal updates (projected and plain parameters, weight decay on / off,
Nesterov on / off, float32 / float64, zsprob's parameter groups), no host sync in step(), timm's state
dicts load and continue, and the errors timm raises too."""
from __future__ import annotations

import copy

import pytest
import timm.optim
import timm.optim.adamp as timm_adamp
import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.train import optim as O
from zsprob.train import state as S
from zsprob.train.adamp import AdamP
from zsprob.utils.host_sync import HostSyncCounter


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two on a shared machine (and the same on an idle one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(nn.Module):
    """Conv and linear weights that feed a normalisation (scale-invariant: AdamP projects them), a conv
    and a linear weight that do not, biases, norm weights and a 0-d scalar."""

    def __init__(self):
        super().__init__()
        self.conv_bn = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 6, 3)
        self.fc_ln = nn.Linear(6, 16, bias=False)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        x = self.conv(torch.relu(self.bn(self.conv_bn(x)))).relu().mean((2, 3))
        return self.head(torch.relu(self.ln(self.fc_ln(x)))) * self.temperature


def _net(dtype=torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def _loss(net: Net, x, y):
    # the head's L2 term keeps its gradient along its weight: AdamP leaves it unprojected
    return (net(x) - y).square().mean() + 0.5 * net.head.weight.square().sum()


def _batches(n: int, dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 8, 8, generator=gen, dtype=dtype), torch.randn(8, 4, generator=gen, dtype=dtype))
            for _ in range(n)]


def _train(pairs, batches) -> float:
    """Step every (net, optimiser) pair on the same batches; the largest parameter difference to the first."""
    worst = 0.0
    for x, y in batches:
        for net, opt in pairs:
            opt.zero_grad()
            _loss(net, x, y).backward()
            opt.step()
        ref = list(pairs[0][0].parameters())
        for net, _ in pairs[1:]:
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(ref, net.parameters())))
    return worst


@pytest.fixture
def timm_decisions(monkeypatch):
    """timm's projection branch, recorded on the side: one bool per (step, weight matrix), True = projected."""
    seen = []
    original = timm_adamp.projection

    def spy(p, grad, perturb, delta, wd_ratio, eps, *args):
        perturb, wd = original(p, grad, perturb, delta, wd_ratio, eps, *args)
        seen.append(wd != 1.0)
        return perturb, wd

    monkeypatch.setattr(timm_adamp, "projection", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("nesterov", [False, True])
def test_equal_to_timm_over_50_steps(dtype, weight_decay, nesterov, timm_decisions):
    nets = [_net(dtype), _net(dtype)]
    opts = [cls(O.param_groups(net, lr=1e-2, weight_decay=weight_decay), lr=1e-2, weight_decay=weight_decay,
                nesterov=nesterov) for cls, net in zip((timm.optim.AdamP, AdamP), nets)]
    worst = _train(list(zip(nets, opts)), _batches(50, dtype))
    assert worst <= 1e-6
    # both branches of the projection were taken, and the weights moved
    assert sum(timm_decisions) >= 50 and len(timm_decisions) - sum(timm_decisions) >= 50
    assert (nets[1].conv_bn.weight - _net(dtype).conv_bn.weight.to(dtype)).abs().max() > 1e-2
    state = opts[1].state[nets[1].conv.weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"] == 50 and type(state["step"]) is int


def test_projection_removes_the_radial_part_of_a_scale_invariant_update():
    """Through BatchNorm the gradient is orthogonal to the weight; the update must be too."""
    net = _net(torch.float64)
    opt = AdamP([net.conv_bn.weight], lr=0.1)
    before = net.conv_bn.weight.detach().clone()
    x, y = _batches(1, torch.float64)[0]
    _loss(net, x, y).backward()
    opt.step()
    step = (net.conv_bn.weight - before).reshape(8, -1).detach()
    radial = (step * before.reshape(8, -1)).sum(1) / before.reshape(8, -1).norm(dim=1)
    # what is left comes from the eps in 1 / (|w| + eps)
    assert (radial.abs() / step.norm(dim=1)).max() < 1e-6
    plain = torch.optim.Adam([before.clone().requires_grad_()], lr=0.1)  # Adam's step, unprojected
    plain.param_groups[0]["params"][0].grad = net.conv_bn.weight.grad
    plain.step()
    adam_step = (plain.param_groups[0]["params"][0] - before).reshape(8, -1).detach()
    assert ((adam_step * before.reshape(8, -1)).sum(1).abs() / before.reshape(8, -1).norm(dim=1)
            / adam_step.norm(dim=1)).max() > 1e-3


def test_no_host_sync_in_step_timm_has_them():
    counts = {}
    for name, cls in (("zsprob", AdamP), ("timm", timm.optim.AdamP)):
        net = _net()
        opt = cls(O.param_groups(net, lr=1e-2, weight_decay=0.1), lr=1e-2, weight_decay=0.1, nesterov=True)
        total = 0
        for x, y in _batches(3, torch.float32):  # the first step (state initialisation) included
            opt.zero_grad()
            _loss(net, x, y).backward()
            with HostSyncCounter() as counter:
                opt.step()
            total += counter.total
        counts[name] = total
    assert counts["zsprob"] == 0
    assert counts["timm"] >= 3 * 4  # at least one per weight matrix and step


@pytest.mark.parametrize("nesterov", [False, True])
def test_timm_state_dict_loads_and_continues_like_timm(tmp_path, nesterov):
    """A timm AdamP state saved through zsprob's checkpoint format resumes in zsprob's AdamP (and the
    other way round) with the updates timm would have made."""
    batches = _batches(12, torch.float32)
    net = _net()
    opt = timm.optim.AdamP(O.param_groups(net, lr=1e-2, weight_decay=0.1), lr=1e-2, weight_decay=0.1,
                           nesterov=nesterov)
    _train([(net, opt)], batches[:6])
    S.save_state(tmp_path / "st", {"optimizer": opt.state_dict()})
    saved = S.load_state(tmp_path / "st")["optimizer"]
    resumed = copy.deepcopy(net)
    ours = AdamP(O.param_groups(resumed, lr=1e-2, weight_decay=0.1), lr=1e-2, weight_decay=0.1)
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["nesterov"] is nesterov
    assert _train([(net, opt), (resumed, ours)], batches[6:]) <= 1e-6
    # and back: zsprob's state continues in timm's
    back = copy.deepcopy(resumed)
    theirs = timm.optim.AdamP(O.param_groups(back, lr=1e-2, weight_decay=0.1), lr=1e-2, weight_decay=0.1)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch would share the moment tensors
    assert _train([(resumed, ours), (back, theirs)], batches[:4]) <= 1e-6
    assert ours.state[resumed.conv.weight]["step"] == 16


TINY = {"open_clip_cfg": {"vision_cfg": {"layers": 3, "width": 32, "head_width": 16, "patch_size": 8,
                                          "image_size": 32},
                          "text_cfg": {"layers": 3, "width": 32, "heads": 2, "context_length": 16}}}


def test_zsprob_param_groups_with_different_lr_and_weight_decay_match_timm(timm_decisions):
    """The official grouping of a real zsprob model: layer-decayed lrs, tower multipliers, groups with and
    without weight decay; a few parameters with no gradient (skipped by both). In float64: the key biases
    of attention get gradients that are rounding noise (softmax ignores them), which Adam scales up to
    full steps, so in float32 any two implementations part there by about lr after a few steps."""
    from zsprob.models import create_model
    from zsprob.prob import create_loss
    from zsprob.train.step import ContrastiveStep

    modules = [ContrastiveStep(create_model("zsprob-tiny", embed_dim=16, seed=0, **TINY), create_loss("pcmepp"))
               .double() for _ in range(2)]
    opts = []
    for cls, module in zip((timm.optim.AdamP, AdamP), modules):
        groups = O.param_groups(module, lr=1e-3, weight_decay=0.2, param_info=module.model.param_info(),
                                prefix="model.", layer_decay=0.7, image_lr_mult=0.1, text_lr_mult=0.5,
                                grouping="official")
        opts.append(cls(groups, lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2))
    assert len({(g["lr"], g["weight_decay"]) for g in opts[1].param_groups}) >= 4
    gen = torch.Generator().manual_seed(2)
    for _ in range(8):
        images = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
        tokens = torch.randint(0, 100, (4, 16), generator=gen)
        for module, opt in zip(modules, opts):
            opt.zero_grad(set_to_none=True)
            loss, _ = module(images, tokens)
            loss.backward()
            module.model.clip.visual.conv1.weight.grad = None  # e.g. a frozen group
            opt.step()
    pairs = list(zip(modules[0].parameters(), modules[1].parameters()))
    assert max((a - b).abs().max().item() for a, b in pairs) <= 1e-10
    assert modules[1].model.clip.visual.conv1.weight not in opts[1].state
    assert any(timm_decisions) and not all(timm_decisions)


def test_sparse_gradients_fail_as_in_timm_and_bad_arguments_are_user_errors():
    for cls in (timm.optim.AdamP, AdamP):
        emb = nn.Embedding(5, 3, sparse=True)
        opt = cls(emb.parameters(), lr=0.1)
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError):
            opt.step()
    with pytest.raises(UserError, match="lr"):
        AdamP(nn.Linear(2, 2).parameters(), lr=-1.0)
    with pytest.raises(UserError, match="betas"):
        AdamP(nn.Linear(2, 2).parameters(), betas=(0.9, 1.5))
    net = nn.Linear(2, 2)
    opt = AdamP(net.parameters())
    opt.param_groups[0]["caution"] = True  # as a timm state dict saved with caution=True would set it
    net(torch.randn(3, 2)).sum().backward()
    with pytest.raises(UserError, match="caution"):
        opt.step()


@pytest.mark.slow
def test_a_run_checkpointed_with_timms_adamp_resumes_with_zsprobs(tiny_world, tmp_path):
    """The training loop end to end: a run saved with ``optim.name: adamp-timm`` (the optimiser of every
    checkpoint before this one) resumes with ``adamp``, and its losses follow the uninterrupted timm run."""
    from conftest import TINY_TOWERS, read_losses
    from zsprob.config import deep_merge
    from zsprob.train import train

    def cfg(name: str) -> dict:
        return deep_merge({
            "seed": 0, "method": "pcmepp",
            "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY_TOWERS},
            "data": {"kind": "synthetic", "shards": str(tiny_world / "pretrain"), "batch_size": 16,
                     "num_workers": 0, "shuffle_buffer": 32, "pipeline": {"caption_key": "json:captions"}},
            "optim": {"name": name, "lr": 2e-3, "weight_decay": 0.1, "grouping": "official"},
            "schedule": {"name": "cosine", "steps": 8, "warmup_steps": 2},
            "train": {"log_every": 1, "checkpoint_every": 3, "eval_every": 5, "tensorboard": False, "threads": 1},
        }, {})

    class Kill(Exception):
        pass

    def kill_at_5(model, step):
        if step == 5:
            raise Kill()

    train(cfg("adamp-timm"), tmp_path / "full", progress=False)
    with pytest.raises(Kill):
        train(cfg("adamp-timm"), tmp_path / "cut", progress=False, eval_hooks=[kill_at_5])
    train(cfg("adamp"), tmp_path / "cut", resume=True, progress=False)
    full, cut = read_losses(tmp_path / "full"), read_losses(tmp_path / "cut")
    assert sorted(full) == sorted(cut) == list(range(1, 9))
    for step in range(1, 9):
        assert cut[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), (step, full[step], cut[step])


def test_parameters_without_gradient_are_skipped_and_keep_their_own_step_count():
    """A weight with no gradient every other step (e.g. a frozen group) lags the others' step count: both
    optimisers skip it and bias-correct it with its own count (zsprob's AdamP: a second bucket)."""
    nets = [_net(), _net()]
    opts = [cls(O.param_groups(net, lr=1e-2, weight_decay=0.1), lr=1e-2, weight_decay=0.1)
            for cls, net in zip((timm.optim.AdamP, AdamP), nets)]
    worst = 0.0
    for step, (x, y) in enumerate(_batches(20, torch.float32)):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            _loss(net, x, y).backward()
            if step % 2:
                net.conv.weight.grad = None
                net.head.bias.grad = None
            opt.step()
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(nets[0].parameters(),
                                                                           nets[1].parameters())))
    assert worst <= 1e-6
    assert opts[1].state[nets[1].conv.weight]["step"] == 10 and opts[1].state[nets[1].conv_bn.weight]["step"] == 20
