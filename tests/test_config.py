"""YAML configs: base chains, dotted overrides, malformed input."""
from __future__ import annotations

import pytest

from zsprob import UserError
from zsprob.config import apply_override, load_config


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
