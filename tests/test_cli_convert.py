"""`zsprob convert` in a real subprocess on a Hugging Face directory in the exact PCME++ HF layout.

Phase 1 of issue 18: the mean branch maps onto today's ProbCLIP; the official sigma heads (no
LayerNorm before the projection, no separate bias) land with ``model.sigma_head``, so today the
conversion must stop, strictly, at the first zsprob parameter the official file cannot fill.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from test_models_convert import official_state


def _hf_dir(path, **replace):
    from safetensors.torch import save_file

    state = official_state("pcmepp-ViT-B-16", device="cpu", generator=torch.Generator().manual_seed(0))
    state.update(replace)
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"embed_dim": 512}))
    return path


def _one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.slow
def test_convert_is_strict_with_one_line_errors(tmp_path):
    err = _one_line_error(run_cli("convert", tmp_path / "missing", "--out", tmp_path / "o"))
    assert "not found" in err
    # a mis-shaped official key is named
    bad = _hf_dir(tmp_path / "bad", text_projection=torch.zeros(512, 256))
    err = _one_line_error(run_cli("convert", bad, "--out", tmp_path / "o1", timeout=600))
    assert "key 'text_projection' has shape (512, 256)" in err
    # the right layout: the mean branch is filled; the first sigma parameter the official head lacks stops it
    good = _hf_dir(tmp_path / "good")
    err = _one_line_error(run_cli("convert", good, "--out", tmp_path / "o2", timeout=600))
    assert "missing key for 'image_sigma." in err and "clip." not in err
    assert not (tmp_path / "o2").exists()
