"""A run's config is resolved once, at the edge, and every mistake it can show is refused there:
before the accelerator, the model or the data are built (``train`` resolves, ``train_resolved``
trusts; the command line resolves its own before it imports torch)."""
from __future__ import annotations

import pytest

from test_train_loop import tiny_cfg
from zsprob.errors import UserError
from zsprob.train.defaults import TrainConfig, resolve_config


class Built(Exception):
    """Raised in place of building a run: a check that comes later than it should lets it through."""


@pytest.fixture
def nothing_is_built(monkeypatch):
    import zsprob.train.loop as loop

    def refuse(*a, **k):
        raise Built("the run was built before the mistake was refused")
    monkeypatch.setattr(loop, "make_accelerator", refuse)
    monkeypatch.setattr(loop, "build_run", refuse)


@pytest.mark.parametrize("over, out_name, message", [
    ({"train": {"remote_sync": "pipe:cat"}}, "run", "pipe: command cannot hold checkpoints"),
    ({"train": {"remote_sync": "foo://bucket/run"}}, "run", "unknown URL scheme 'foo'"),
    ({"train": {"remote_sync": "{out}/mirror"}}, "run", "is the run directory"),
    ({"train": {"remote_sync": "{out}"}}, "run", "is the run directory"),
    ({"method": "jwae", "train": {"accum_steps": 2}}, "run", "train.accum_steps applies to the pairwise losses"),
    ({"method": "nope"}, "run", "unknown method 'nope'"),
    ({"train": {"precision": "fp8"}}, "run", "train.precision must be fp32, bf16 or fp16"),
])
def test_config_mistakes_are_refused_by_resolve_config_before_anything_is_built(
        tmp_path, nothing_is_built, over, out_name, message):
    from zsprob.train import train
    out = tmp_path / out_name
    if "train" in over and "remote_sync" in over["train"]:
        over = {"train": {"remote_sync": over["train"]["remote_sync"].format(out=out)}}
    cfg = tiny_cfg(tmp_path / "shards", **over)
    with pytest.raises(UserError, match=message) as e:
        resolve_config(cfg, out)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=message):
        train(cfg, out, progress=False)


def test_a_mirror_is_checked_against_the_run_only_when_the_run_is_named(tmp_path):
    cfg = tiny_cfg(tmp_path / "shards", train={"remote_sync": str(tmp_path / "run" / "mirror")})
    assert isinstance(resolve_config(cfg), TrainConfig)  # no run directory given: nothing to hold it against
    with pytest.raises(UserError, match="is the run directory"):
        resolve_config(cfg, tmp_path / "run")
    assert isinstance(resolve_config(cfg, tmp_path / "elsewhere"), TrainConfig)


@pytest.mark.parametrize("resume, message", [("latest", "nothing to resume"),
                                             ("{out}/checkpoints/step-0000007", "not a checkpoint directory")])
def test_a_resume_without_a_checkpoint_is_refused_before_anything_is_built(tmp_path, nothing_is_built,
                                                                          resume, message):
    from zsprob.train import train
    out = tmp_path / "run"
    with pytest.raises(UserError, match=message):
        train(tiny_cfg(tmp_path / "shards"), out, resume=resume.format(out=out), progress=False)


def test_with_a_mirror_the_resume_is_looked_up_after_its_pull(tmp_path, nothing_is_built):
    """The remote may hold the checkpoint the local directory lacks: the early lookup is skipped, and the
    run goes on to be built (here: refused by the fixture, which proves it got that far)."""
    from zsprob.train import train
    cfg = tiny_cfg(tmp_path / "shards", train={"remote_sync": str(tmp_path / "mirror")})
    with pytest.raises(Built):
        train(cfg, tmp_path / "run", resume="latest", progress=False)


def test_train_resolved_takes_only_a_resolved_config(tmp_path):
    from zsprob.train.loop import train_resolved
    with pytest.raises(TypeError, match="resolve_config"):
        train_resolved(tiny_cfg(tmp_path / "shards"), tmp_path / "run", progress=False)


def test_changed_settings_names_what_changes_the_run_and_not_how_it_is_carried_out():
    from zsprob.train.checkpoints import changed_settings
    saved = {"data": {"batch_size": 16, "num_workers": 0}, "optim": {"lr": 1e-3}, "schedule": {"steps": 4},
             "train": {"log_every": 1}, "loss": {"pcmepp": {"vib_beta": 1e-4}}}
    now = {"data": {"batch_size": 8, "num_workers": 2}, "optim": {"lr": 1e-3}, "schedule": {"steps": 9},
           "train": {"log_every": 5}, "loss": {"pcmepp": {"vib_beta": 0.0}}, "seed": 1}
    assert changed_settings(saved, now) == [("data.batch_size", 16, 8), ("loss.pcmepp.vib_beta", 1e-4, 0.0),
                                            ("seed", None, 1)]
    assert changed_settings(saved, saved) == []


def test_resuming_with_another_batch_size_warns_naming_it(tiny_world, tmp_path):
    """More steps is how a run is continued (no warning); another batch size or learning rate changes what
    it learns, and the one warning line names both with their old and new values."""
    import warnings

    from zsprob.train import train
    cfg = tiny_cfg(tiny_world / "pretrain", schedule={"name": "constant", "steps": 2, "warmup_steps": 0},
                   train={"checkpoint_every": 2})
    train(cfg, tmp_path / "run", progress=False)
    cfg["schedule"]["steps"] = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, tmp_path / "run", resume="latest", progress=False)
    assert not [w for w in caught if "changes" in str(w.message)]
    cfg["schedule"]["steps"], cfg["data"]["batch_size"], cfg["optim"]["lr"] = 4, 8, 1e-3
    with pytest.warns(UserWarning, match=r"changes 2 setting\(s\).*data\.batch_size 16 -> 8, optim\.lr 0\.002 -> 0\.001"):
        summary = train(cfg, tmp_path / "run", resume="latest", progress=False)
    assert summary["steps"] == 4
