"""YAML configs: base chains, dotted overrides, malformed input."""
from __future__ import annotations

import pytest

from zsprob import UserError
from zsprob.config import apply_override, read_yaml, to_config


def load_config(path=None, overrides=(), defaults=None):
    """A YAML file (and its base chain) over ``defaults``, patched with ``key=value`` overrides."""
    cfg = to_config({**(defaults or {}), **(read_yaml(path) if path is not None else {})})
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def test_base_chain_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("optim: {lr: 1.0e-3, betas: [0.9, 0.999]}\nmodel: {name: tiny}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\noptim: {lr: 5.0e-4}\n")
    cfg = load_config(tmp_path / "child.yaml", ["optim.wd=0.2", "model.name=ViT-S-16", "train.swa=true"])
    assert cfg.optim.lr == 5e-4 and cfg.optim.betas == [0.9, 0.999] and cfg.optim.wd == 0.2
    assert cfg.model.name == "ViT-S-16" and cfg.train.swa is True


def test_bad_override_and_missing_file(tmp_path):
    cfg = load_config(None, [], defaults={"a": 1})
    with pytest.raises(UserError):
        apply_override(cfg, "no_equals_sign")
    with pytest.raises(UserError):
        apply_override(cfg, "a.b=2")  # a is a value, not a section
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_training_defaults_are_merged_once_from_one_place():
    """load_train_config merges DEFAULTS (zsprob.train.defaults.with_defaults); train()'s resolve_config
    takes that config as it is, and merges the same DEFAULTS into a partial dict from Python."""
    from zsprob.config import deep_merge, read_yaml
    from zsprob.train.defaults import DEFAULTS, TrainConfig, load_train_config, resolve_config, with_defaults
    cfg = load_train_config("synthetic_tiny.yaml", ["optim.lr=0.01", "data.pipeline.caption_key=txt"])
    assert isinstance(cfg, TrainConfig) and resolve_config(cfg) is cfg
    expected = deep_merge(deep_merge(DEFAULTS, read_yaml("synthetic_tiny.yaml")),
                          {"optim": {"lr": 0.01}, "data": {"pipeline": {"caption_key": "txt"}}})
    assert cfg.to_dict() == expected
    partial = resolve_config({"method": "infonce", "data": {"batch_size": 8}})
    assert isinstance(partial, TrainConfig) and partial.data.batch_size == 8
    assert partial.optim.to_dict() == DEFAULTS["optim"] and partial.train.remote_sync is None
    assert with_defaults(partial) is partial
    with pytest.raises(UserError, match="is a value"):
        load_train_config("synthetic_tiny.yaml", ["model.name.x=1"])


def test_the_sigma_recipe_builds_detached_heads_and_a_sigma_only_occlusion_term():
    """configs/synthetic_tiny_sigma.yaml: the demo recipe + the uncertainty changes, all reaching the
    model and the loss."""
    from zsprob.prob import PCMEPPLoss
    from zsprob.train import load_train_config
    from zsprob.train.build import build_loss, build_model
    from zsprob.train.defaults import resolve_config
    base = load_train_config("synthetic_tiny.yaml")
    cfg = resolve_config(load_train_config("synthetic_tiny_sigma.yaml"))
    assert cfg.model.name == base.model.name and cfg.schedule.steps == base.schedule.steps
    assert cfg.model.overrides.sigma_head == "unc" and cfg.model.overrides.sigma_detach is True
    loss = build_loss(cfg)
    assert isinstance(loss, PCMEPPLoss) and loss.text_mask_mode == "delete" and loss.inclusion_scale == 1000.0
    assert loss.occlusion_grad == "sigma" and loss.n_masked(128, step=0) == 64 and loss.distance == "mu"
    assert loss.occlusion_weight(0) == pytest.approx(0.1)
    assert loss.image_mask_mode == "degrade" and loss.inclusion_form == "cover"
    assert (loss.cover_lambda, loss.cover_scale) == (0.002, 1000.0)
    assert (loss.caption_nll_alpha, loss.caption_nll_scale) == (0.1, 3.0)
    assert (loss.image_nll_alpha, loss.image_nll_scale) == (0.1, 3.0)
    assert build_loss(base).caption_nll_alpha == 0.0 and build_loss(base).image_nll_alpha == 0.0
    assert loss.image_degrade_ops == ("cells", "blur", "downsample", "dim", "jpeg", "grayscale", "crop")
    assert cfg.optim.grad_clip_split is True and base.optim.grad_clip_split is False
    model = build_model(cfg)
    assert model.sigma_detach and model.sigma_head == "unc" and model.normalize_mu


def test_every_true_false_key_refuses_other_values():
    """Keys whose default is true / false take YAML booleans only; bool('maybe') would be true."""
    from zsprob.errors import UserError
    from zsprob.train.defaults import load_train_config, resolve_config
    from zsprob.train.schema import Key, check

    for setting, key in [("msda.enabled=2", "msda.enabled"), ("optim.fused=1", "optim.fused"),
                         ("train.tensorboard=off-ish", "train.tensorboard"), ("data.augment=maybe", "data.augment")]:
        with pytest.raises(UserError, match=f"^{key} must be true or false, got "):
            resolve_config(load_train_config(None, [setting]))
    resolve_config(load_train_config(None, ["msda.enabled=true", "optim.fused=false"]))
    keys = (Key("a.b", False, "a switch"), Key("c", "default", "a name"), Key("d", True, "another switch"))
    with pytest.raises(UserError, match=r"^a\.b must be true or false, got None$"):
        check({"a": {"b": None}}, keys, {"a": {"b": False}, "c": "default", "d": True})
    check({"a": {"b": True}, "c": "text"}, keys, {"a": {"b": False}, "c": "default", "d": True})


def test_a_run_config_is_resolved_and_checked_in_one_place():
    """resolve_config merges the defaults and runs every check of the schema, the first mistake (unknown keys,
    then each key in declaration order, then the keys that exclude each other) as one line."""
    from zsprob.errors import UserError
    from zsprob.train.defaults import resolve_config

    cases = [
        ({"schedule": {"steps": 5, "epochs": 2}},
         "schedule.steps (5) and schedule.epochs (2) are both set: drop one (--steps / schedule.steps counts "
         "optimiser steps, --epochs passes over the data)"),
        ({"optim": {"layer_decay": "nan"}}, "optim.layer_decay must be null or a number > 0 and <= 1, got 'nan'"),
        ({"optim": {"disc_lr": [1]}}, "optim.disc_lr must be null or a number > 0, got [1]"),
        ({"schedule": {"steps": 0, "epochs": 2}}, "--steps (schedule.steps) must be at least 1, got 0"),
        ({"schedule": {"stepz": 0, "steps": 0}}, "unknown config key schedule.stepz (did you mean schedule.steps?)"),
        ({"method": "arcface"}, "unknown method 'arcface'; choose one of "),
        ({"train": {"precision": "fp64"}}, "train.precision must be fp32, bf16 or fp16, got 'fp64'"),
    ]
    for cfg, message in cases:
        with pytest.raises(UserError) as e:
            resolve_config(cfg)
        assert str(e.value).startswith(message), (cfg, str(e.value))
    cfg = resolve_config({"optim": {"layer_decay": "7e-1"}})
    assert cfg.optim.layer_decay == 0.7  # a string spelling a number is stored as the float
    assert resolve_config({"optim": {"layer_decay": None}}).optim.layer_decay is None  # null stays allowed


def test_the_docs_table_of_keys_is_the_schemas():
    """docs/training.md's table of keys is generated from the schema: regenerate it with
    ``zsprob.train.schema.table(KEYS)`` between its markers when a key changes."""
    from pathlib import Path

    from zsprob.train.defaults import KEYS
    from zsprob.train.schema import table
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    start = "<!-- keys: generated by zsprob.train.schema.table(KEYS) -->\n"
    block = text[text.index(start) + len(start):text.index("<!-- /keys -->")]
    assert block == table(KEYS)
    assert all(f"`{key.name}`" in block for key in KEYS) and block.count("\n") == len(KEYS) + 2
