"""The host reads of the training steps a GPU user reaches, counted on the CPU with
:class:`zsprob.utils.host_sync.HostSyncCounter`: a step of several processes (gloo, the counter on every rank,
from the batch's fetch to the loop's stop check), a jWAE step, a logging step; and the jWAE feature
pass's page-locked copies for a CUDA device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers_train import count_step_syncs

WORKER = textwrap.dedent('''
    import json, os, signal, sys
    import torch
    from accelerate import Accelerator
    from zsprob.errors import Preempted
    from zsprob.train import build, loop, step as step_module
    from zsprob.utils import host_sync
    from zsprob.utils.host_sync import HostSyncCounter
    sys.path.insert(0, sys.argv[2])
    from helpers_train import TensorSource

    out = sys.argv[1]
    torch.set_num_threads(1)
    host_sync.HOST_READ_FREE.clear()  # count the accelerator's path
    acc = Accelerator(cpu=True)
    rank, world = acc.process_index, acc.num_processes
    TINY = {"open_clip_cfg": {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                              "image_size": 32},
                              "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}
    B = 8
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(B, 3, 32, 32, generator=g), torch.randint(1, 400, (B, 16), generator=g))
               for _ in range(6)]

    class Uneven(TensorSource):
        """Rank 1 runs out after 4 batches, rank 0 after 6: every epoch ends for both after 4."""

        def __init__(self, *args):
            super().__init__(*args)
            self.steps_per_epoch = None  # a stream: the end is known when a batch is missing

        def epoch_batches(self, epoch, skip=0):
            it = super().epoch_batches(epoch, skip)
            return (b for i, b in zip(range(skip, 4 if self.rank == 1 else 6), it))

    counters, positions, signal_at = [], [], {}
    real_one_step, real_next_batch, real_stop = step_module.one_step, step_module.next_batch, loop.stop_if_signalled

    def next_batch(run, step):
        batch = real_next_batch(run, step)
        positions.append((run.cursor.epoch, run.cursor.pos))
        return batch

    def one_step(run, step):  # counted from here to the end of the loop's stop_if_signalled
        if signal_at.get(rank) == step:
            os.kill(os.getpid(), signal.SIGUSR1)  # this process only: both stop after this step
        counters.append(HostSyncCounter())
        counters[-1].__enter__()
        return real_one_step(run, step)

    def stop_if_signalled(*args):
        try:
            return real_stop(*args)
        finally:
            counters[-1].__exit__(None, None, None)

    step_module.next_batch = next_batch
    build.one_step = one_step
    loop.stop_if_signalled = stop_if_signalled
    cfg = {"method": "pcmepp", "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY},
           "data": {"batch_size": B}, "optim": {"name": "adamw", "lr": 1e-3}, "schedule": {"steps": 10},
           "train": {"log_every": 100, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    loop.train(cfg, os.path.join(out, "uneven"), source=Uneven(batches, rank, world), progress=False)
    result = {"reads": [c.total for c in counters], "where": [dict(c.where) for c in counters],
              "positions": list(positions)}
    counters.clear()
    signal_at[1] = 2
    try:
        loop.train(cfg, os.path.join(out, "stopped"), source=TensorSource(batches, rank, world), progress=False)
    except Preempted as e:
        result["stopped_after"] = e.step
    json.dump(result, open(os.path.join(out, f"rank{rank}.json"), "w"))
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
''')


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_steps_make_one_host_read_and_end_epochs_and_stop_together(tmp_path):
    """2 CPU processes (torchrun, gloo), the counter on each: every step but the first of an epoch makes one
    host read (the finite check, which also carries "my next batch is missing" and "I received a stop
    signal"); rank 1 runs out first and both start the next epoch together; a SIGUSR1 to rank 1 alone stops
    both after that step with its checkpoint."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29531", str(script), str(tmp_path), str(Path(__file__).parent)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    epochs = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2)]
    for rank, result in enumerate(ranks):
        assert [tuple(p) for p in result["positions"]] == epochs, rank
        # the first batch of an epoch keeps its own reduction; the last step logs
        steady = [(i, n, where) for i, (n, where) in enumerate(zip(result["reads"], result["where"]))
                  if epochs[i][1] != 1 and i != len(epochs) - 1]
        assert len(steady) == 6 and all(n <= 1 for _, n, _ in steady), (rank, steady)
        assert result["stopped_after"] == 3, rank
    assert [p.name for p in (tmp_path / "stopped").rglob("step-*") if p.is_dir()] == ["step-0000003"]
    metrics = [json.loads(x) for x in (tmp_path / "uneven" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 10 and metrics[-1]["epoch"] == 2


# ----------------------------------------------------------------------------- jWAE

def _jwae_cfg(*sets: str):
    from zsprob.train.defaults import load_train_config
    base = ["model.embed_dim=24", "model.jwae.latent_dim=8", "model.jwae.image_hidden=32",
            "model.jwae.text_hidden=32", "data.batch_size=16", "train.tensorboard=false",
            "train.checkpoint_every=0", "train.log_every=100", "train.threads=1"]
    return load_train_config("jwae_synthetic.yaml", base + list(sets))


def _jwae_source(n=96, batch=16):
    import numpy as np

    from zsprob.data.synthetic import paired_split
    from zsprob.train.jwae_data import FeatureStore, SemiSupervisedSource
    g = torch.Generator().manual_seed(0)
    store = FeatureStore(torch.randn(n, 24, generator=g), torch.randn(n, 2, 24, generator=g), np.full(n, 2))
    paired, rest = paired_split(n, 0.5, seed=0)
    return SemiSupervisedSource(store, paired, rest, batch_size=batch, unpaired_batch_size=batch,
                                use_unpaired=True, seed=0)


def test_jwae_step_makes_at_most_one_host_read(tmp_path, monkeypatch):
    """Both halves of the game (discriminator, then autoencoders) under one verdict; labels made on the device."""
    from zsprob.train import jwae_step
    from zsprob.train.loop import train

    counters = count_step_syncs(monkeypatch, jwae_step, jwae_step, "fetch", lambda: train(
        _jwae_cfg("schedule.steps=5"), tmp_path / "run", source=_jwae_source(), progress=False))
    assert len(counters) == 5
    worst = max(counters[1:], key=lambda c: c.total)
    assert worst.total <= 1, dict(worst.where)


def test_a_non_finite_jwae_step_is_skipped_whole_with_the_discriminator_put_back(monkeypatch):
    """The discriminator updates before the verdict (the autoencoders play against the updated one): when its
    loss is NaN, the verdict skips the step and its parameters and optimiser state come back as they were."""
    from accelerate import Accelerator

    from zsprob.train import jwae_step
    from zsprob.train.defaults import resolve_config
    from zsprob.train.run import Counters

    cfg = resolve_config(_jwae_cfg("optim.grad_clip=2.0", "schedule.steps=5"))
    acc = Accelerator(cpu=True)
    model, loss, src, plan, step_module, optimizer, _ = jwae_step.build(cfg, acc, _jwae_source())
    batch = next(iter(src.epoch_batches(0)))
    run = types.SimpleNamespace(acc=acc, cfg=cfg, optimizer=optimizer, world=1, raw=step_module,
                                cursor=types.SimpleNamespace(next=lambda: batch),
                                counters=Counters(loss_sum=torch.zeros(())))
    jwae_step.one_step(run, 0)
    params = {k: v.detach().clone() for k, v in step_module.named_parameters() if v.requires_grad}
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in loss.parameters()}
    real_terms = loss.discriminator_terms
    monkeypatch.setattr(loss, "discriminator_terms", lambda *a, **k: (real_terms(*a, **k)[0] * float("nan"), {}))
    with pytest.warns(UserWarning, match="non-finite jWAE loss"):
        jwae_step.one_step(run, 1)
    assert run.counters.nonfinite_total == 1
    for name, p in step_module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, params[name]), name
    for p in loss.parameters():
        assert optimizer.state[p].keys() == state[id(p)].keys()
        assert all(torch.equal(v, state[id(p)][k]) for k, v in optimizer.state[p].items())


class _HostToDeviceCopies(torch.overrides.TorchFunctionMode):
    """Records every ``.to`` that moves a CPU tensor to another device (a copy a GPU step waits for)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "to" and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "cpu" and out.device.type != "cpu":
            self.copies.append(tuple(args[0].shape))
        return out


def test_jwae_terms_make_their_labels_on_the_device():
    """The discriminator's and the encoders' adversarial terms on the meta device: no label made on the CPU
    and copied over."""
    from zsprob.prob.jwae import JWAEObjective

    objective = JWAEObjective(latent_dim=8).to("meta")
    codes = [(torch.randn(6, 5, device="meta"), torch.randn(6, 5, device="meta"), torch.randn(6, 8, device="meta"))
             for _ in range(2)]
    with _HostToDeviceCopies() as recorder:
        d_loss, _ = objective.discriminator_terms(codes[0][2], codes[1][2])
        g_loss, _ = objective.generator_terms(*codes)
    assert recorder.copies == [] and d_loss.device.type == g_loss.device.type == "meta"


class _RawStub:
    """A RawStore of 10 samples with 2 captions each, its images and tokens 5 numbers each."""

    def __len__(self):
        return 10

    def images(self, idx):
        return torch.randn(len(idx), 5)

    def texts(self, idx, which):
        return torch.randn(len(idx), 5)

    def n_captions(self, i):
        return 2


def test_jwae_feature_pass_pins_memory_for_cuda(monkeypatch):
    """The feature cache's copies to a CUDA device come from page-locked memory (under FakeTensorMode with a
    fake ``cuda`` device), and the features come back to the CPU."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zsprob.train.jwae_data import FeatureStore

    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append(tuple(self.shape))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    raw = _RawStub()
    features = types.SimpleNamespace(image_features=lambda x: 2 * x, text_features=lambda x: 3 * x)
    with FakeTensorMode(allow_non_fake_inputs=True):
        store = FeatureStore.build(features, raw, batch_size=4, device=torch.device("cuda"))
    assert len(pinned) == 3 + 2  # 10 images in batches of 4, 20 captions in batches of 16
    assert store.image_feats.device.type == "cpu" and store.text_feats.device.type == "cpu"
    assert np.array_equal(store.n_caps, np.full(10, 2))


# ----------------------------------------------------------------------------- logging

def test_a_logging_step_reads_its_scalars_in_one_host_read(tmp_path, monkeypatch):
    """The interval's loss, the last step's terms, the loss's scalars: one stacked read per logging step."""
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_train import TensorSource

    from conftest import TINY_TOWERS
    from zsprob.train import loop
    from zsprob.utils import host_sync
    from zsprob.utils.host_sync import HostSyncCounter

    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())
    counters, records = [], []
    real_log_record = loop.log_record

    def log_record(*args):
        counters.append(HostSyncCounter())
        with counters[-1]:
            records.append(real_log_record(*args))
        return records[-1]

    monkeypatch.setattr(loop, "log_record", log_record)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(1, 400, (8, 16), generator=g))
               for _ in range(4)]
    cfg = {"method": "pcmepp", "model": {"name": "zsprob-tiny", "embed_dim": 16, "overrides": TINY_TOWERS},
           "data": {"batch_size": 8}, "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 2.0},
           "schedule": {"steps": 4, "warmup_steps": 1},
           "train": {"log_every": 2, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    loop.train(cfg, tmp_path / "run", source=TensorSource(batches), progress=False)
    assert [c.total for c in counters] == [1, 1], [dict(c.where) for c in counters]
    assert {"loss", "scale", "shift", "grad_norm", "img_sigma2"} <= set(records[-1])
    assert all(isinstance(records[-1][k], float) for k in ("loss", "scale", "grad_norm"))
