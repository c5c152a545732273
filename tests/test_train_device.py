"""The training run's device switches, tested on the CPU: TF32 and its full-precision opt-out, the
process group's timeout, the CUDA RNG state of the current device only, torch.compile and its
one-line errors, and ``train.cpu=false`` without a GPU."""
from __future__ import annotations

import pytest
import torch

from conftest import read_losses, run_cli, tiny_model_args
from test_train_loop import tiny_cfg
from zsprob.errors import UserError


def test_tf32_switch_and_the_full_precision_block_restore_the_flags():
    from zsprob.train.build import set_tf32
    from zsprob.train.step import full_precision_matmuls
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with full_precision_matmuls():
            assert not torch.backends.cuda.matmul.allow_tf32  # losses and CSD: full fp32
        assert torch.backends.cuda.matmul.allow_tf32
        set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_accelerator_gets_the_configured_process_group_timeout(tmp_path):
    from zsprob.train.build import make_accelerator
    from zsprob.train.defaults import resolve_config
    cfg = resolve_config(tiny_cfg(tmp_path, train={"dist_timeout_s": 123, "tensorboard": False}))
    acc, _ = make_accelerator(cfg, tmp_path)
    assert acc.init_handler is not None and acc.init_handler.timeout.total_seconds() == 123


def test_rng_state_keeps_the_current_cuda_device_and_old_lists_resume_on_fewer_devices(monkeypatch):
    from zsprob.train import state
    seen = {}
    current = torch.tensor([7, 7], dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, *a: seen.setdefault("set", s))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every device's state was read"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("every device's state was set"))
    st = state.rng_state()
    assert torch.equal(st["cuda"], current)
    state.set_rng_state(st)
    assert torch.equal(seen.pop("set"), current)
    # a checkpoint of an 8-GPU-visible process, resumed where one GPU is visible: device 0's entry
    old = dict(st, cuda=[torch.full((2,), i, dtype=torch.uint8) for i in range(8)])
    state.set_rng_state(old)
    assert torch.equal(seen.pop("set"), torch.zeros(2, dtype=torch.uint8))


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    from zsprob.train import build
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="train.compile on the CPU needs a C\\+\\+ compiler"):
        build.compile_model(torch.nn.Linear(2, 2), torch.device("cpu"))


@pytest.mark.slow(seconds=30)
def test_compiled_training_matches_eager(tiny_world, tmp_path):
    import shutil
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler for torch.compile on the CPU")
    from zsprob.train.loop import train
    steps = {"name": "constant", "steps": 3, "warmup_steps": 0}
    # the smallest towers that keep every part of the model (a block in each head, GPO on both sides):
    # inductor compiles a kernel per GPO rank, so one patch and four tokens keep the compile short
    smallest = {"overrides": {"open_clip_cfg": {"vision_cfg": {"layers": 1, "image_size": 8},
                                                "text_cfg": {"layers": 1, "context_length": 4}}}}
    train(tiny_cfg(tiny_world / "pretrain", schedule=steps, model=smallest), tmp_path / "eager", progress=False)
    train(tiny_cfg(tiny_world / "pretrain", schedule=steps, model=smallest,
                   train={"compile": True, "log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1}),
          tmp_path / "compiled", progress=False)
    eager, compiled = read_losses(tmp_path / "eager"), read_losses(tmp_path / "compiled")
    assert sorted(compiled) == [1, 2, 3]
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4, abs=1e-5)


def test_bad_device_settings_for_training_are_one_line(tiny_world, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    base = ["pretrain", "--data", "synthetic", "--shards", str(tiny_world / "pretrain"), *tiny_model_args(),
            "--steps", "1", "--batch-size", "16", "--workers", "0", "--no-progress"]
    for extra, message in ((["--set", "train.cpu=false"], "asks for a GPU"),
                           (["--precision", "fp16"], "fp16 needs a GPU")):
        r = run_cli(*base, *extra, "--out", str(tmp_path / "run"))
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("zsprob: error:") and message in lines[0], r.stderr
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize("compile_on", [True, False])
def test_a_compile_that_fails_on_this_machine_is_one_line(tiny_world, tmp_path, monkeypatch, compile_on):
    """A C++ compile error raised by inductor at the first step (as a machine without working headers
    gives): one line naming train.compile with train.compile on; the error itself without it."""
    from torch._inductor.exc import CppCompileError

    from zsprob.train import build
    from zsprob.train.loop import train

    def fails(run, step_index):
        raise CppCompileError(["g++", "x.cpp"], "x.cpp:1: fatal error: Python.h: No such file or directory")
    monkeypatch.setattr(build, "one_step", fails)
    monkeypatch.setattr(build, "compile_model", lambda model, device: None)  # no real compile: the error is given
    cfg = tiny_cfg(tiny_world / "pretrain", schedule={"name": "constant", "steps": 2, "warmup_steps": 0},
                   train={"compile": compile_on, "tensorboard": False})
    if compile_on:
        with pytest.raises(UserError, match=r"train.compile: torch.compile failed on this machine \(CppCompileError: x.cpp:1: fatal error: Python.h"):
            train(cfg, tmp_path / "run", progress=False)
    else:
        with pytest.raises(CppCompileError):
            train(cfg, tmp_path / "run", progress=False)
