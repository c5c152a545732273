"""`zsprob convert` in a real subprocess on a Hugging Face directory in the exact PCME++ HF layout
(tiny random weights, ``pcmepp-tiny``): strict one-line errors, and a checkpoint that computes the
official forward (the float64 reference of tests/test_models_published.py)."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from test_models_published import _assert_matches, _inputs, pcmepp_hf_reference, write_pcmepp_hf


def _one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.slow
def test_convert_is_strict_with_one_line_errors(tmp_path):
    from safetensors.torch import save_file

    from zsprob.models import load, load_extra_tensors

    err = _one_line_error(run_cli("convert", tmp_path / "missing", "--out", tmp_path / "o"))
    assert "not found" in err
    state = write_pcmepp_hf(tmp_path / "good")
    # a mis-shaped official key is named, and nothing is written
    (tmp_path / "bad").mkdir()
    save_file(dict(state, text_projection=torch.zeros(32, 16)), str(tmp_path / "bad" / "model.safetensors"))
    err = _one_line_error(run_cli("convert", tmp_path / "bad", "--model", "pcmepp-tiny", "--out", tmp_path / "o1"))
    assert "key 'text_projection' has shape (32, 16)" in err and not (tmp_path / "o1").exists()
    # the right layout converts; the checkpoint computes the official mu and log sigma^2
    r = run_cli("convert", tmp_path / "good", "--model", "pcmepp-tiny", "--out", tmp_path / "o2")
    assert r.returncode == 0, r.stderr[-2000:]
    model = load(tmp_path / "o2")
    assert model.config["official_layout"] == "pcmepp-hf" and model.sigma_depth == 2
    assert torch.equal(load_extra_tensors(tmp_path / "o2")["loss.shift"], state["shift"])
    images, tokens = _inputs(model)
    _assert_matches(model, pcmepp_hf_reference(state, images, tokens), images, tokens)
