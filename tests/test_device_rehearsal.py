"""The stand-in device rehearsal (scripts/device_rehearsal.py) in CI: every device path a GPU user reaches, on
the meta device, without a fault; and the rehearsal failing, with the fault's kind and file:line, on each kind
of fault it claims to catch (a CPU tensor, a host read, a boolean index planted in a loss's forward).

A path that still fails is marked ``xfail(strict=True)`` with the fault (those the rehearsal found beyond issue
49's list; the issue's own are fixed). When a fix lands, the strict mark turns red: remove it."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import device_rehearsal as rehearsal  # noqa: E402

FOUND = "found by the rehearsal, not in issue 49's list: "
FAILING: dict[str, str] = {}


def _path_names() -> list[str]:
    return list(rehearsal.all_paths(ROOT, ROOT))  # names only: nothing is driven


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """One tiny world per worker; each path is its own test, so that pytest-xdist spreads them."""
    base = tmp_path_factory.mktemp("rehearsal")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rehearsal.all_paths(rehearsal.make_world(base), base / "runs")


def _marks(name: str) -> list:
    """A path still failing: strict xfail; the slowest (every strategy of ``--compare``): started first."""
    return ([pytest.mark.xfail(strict=True, reason=FAILING[name])] if name in FAILING else []) + \
        ([pytest.mark.slow(seconds=20)] if name == "zeroshot compare" else [])


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in _path_names()])
def test_device_path_has_no_fault(paths, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = rehearsal.run_path(name, paths[name])
    assert found == [], "\n".join(f.line() for f in found)


def test_every_method_and_both_recipes_are_rehearsed():
    from zsprob.methods import METHODS
    from zsprob.prob.method_registry import METHOD_ENTRIES
    names = _path_names()
    for method in METHODS:
        entry = METHOD_ENTRIES[method]
        if entry.step_kind == "jwae":
            assert "pretrain jwae" in names
            continue
        assert f"pretrain recipe {method}" in names
        assert (f"pretrain sigma recipe {method}" in names) == entry.needs_sigma  # its heads need sigma
    assert set(FAILING) <= set(names)


# ----------------------------------------------------------------------------- it catches what it claims to

def _plant(monkeypatch, fault):
    """InfoNCE's forward with ``fault(img_mu)`` added to its loss."""
    from zsprob.prob.losses import InfoNCELoss
    forward = InfoNCELoss.forward

    def planted(self, img_mu, *args, **kwargs):
        loss, stats = forward(self, img_mu, *args, **kwargs)
        return loss + fault(img_mu), stats
    monkeypatch.setattr(InfoNCELoss, "forward", planted)


def _faults(kind: str) -> list:
    found = rehearsal.rehearse(["pretrain recipe infonce"])["pretrain recipe infonce"]
    return [f for f in found if f.kind == kind and "test_device_rehearsal.py:" in f.site]


def test_a_cpu_tensor_in_a_loss_is_a_fault(monkeypatch):
    _plant(monkeypatch, lambda mu: (mu[:, 0] * torch.zeros(mu.shape[0])).sum())
    faults = _faults("cpu tensor meets device")
    assert len(faults) == 1 and "cpu [8]" in faults[0].detail, faults


def test_a_host_read_in_a_loss_is_a_fault_and_the_command_fails(monkeypatch, capsys):
    _plant(monkeypatch, lambda mu: mu.sum() * 0 + float(mu.sum().item() * 0))
    assert rehearsal.main(["--only", "pretrain recipe infonce"]) == 1
    lines = capsys.readouterr().out.splitlines()
    planted = [line for line in lines if "test_device_rehearsal.py:" in line]
    assert len(planted) == 1 and planted[0].startswith("pretrain recipe infonce: host reads at ")
    assert "1 x item in one steady step; 2 in all" in planted[0]


def test_a_boolean_index_in_a_loss_is_a_fault(monkeypatch):
    _plant(monkeypatch, lambda mu: mu[mu[:, 0] > 0].sum() * 0)
    faults = _faults("data-dependent shape")
    assert len(faults) == 1 and faults[0].detail == "__getitem__(bool mask)", faults


def test_a_pageable_copy_is_a_fault_and_a_pinned_one_is_not(monkeypatch):
    from zsprob.utils.host_sync import to_device
    _plant(monkeypatch, lambda mu: (mu[:, 0] * torch.zeros(mu.shape[0]).to(mu.device, non_blocking=True)).sum() * 0
           + (mu[:, 0] * to_device(torch.ones(mu.shape[0]), mu.device)).sum() * 0)
    faults = _faults("extra host-to-device copy")
    assert len(faults) == 1 and "pageable cpu [8]" in faults[0].detail, faults


def test_a_read_per_batch_in_encoding_is_a_fault(monkeypatch):
    """Encoding that copies every batch's results to the host (as it did before issue 49) is caught: more reads
    at one site than the passes made allow."""
    from zsprob.models import encode
    monkeypatch.setattr(encode, "HOST_COPY_EVERY", 1)
    found = rehearsal.rehearse(["eval synthetic"])["eval synthetic"]
    assert found and all(f.kind == "host reads" and f.site.startswith("models/encode.py:") for f in found), found
    assert "a read per batch" in found[0].detail


def test_a_cpu_tensor_meeting_a_fake_cuda_one_is_a_fault(monkeypatch):
    """On the fake ``cuda`` device, a CPU tensor planted in a score's forward is reported at its line."""
    from zsprob.prob import distances
    csd = distances.csd

    def planted(mu_a, *args, **kwargs):
        return csd(mu_a, *args, **kwargs) + torch.zeros(mu_a.shape[0], 1)
    monkeypatch.setattr(distances, "csd", planted)
    found = rehearsal.rehearse(["fake-cuda eval scores"])["fake-cuda eval scores"]
    assert len(found) == 1 and found[0].kind == "cpu tensor meets device", found
    assert "test_device_rehearsal.py:" in found[0].site
