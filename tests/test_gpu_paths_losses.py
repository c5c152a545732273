"""PCME's uniformity term in a fixed shape: the value of the boolean-mask form it replaced, no host sync, and
it runs on the meta device (which refuses data-dependent shapes, on which a GPU step would wait)."""
from __future__ import annotations

import math

import pytest
import torch

from zsprob.prob import distances
from zsprob.prob.losses import PCMELoss, _uniformity


def _boolean_mask_form(z: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """The former expression: the off-diagonal entries picked by a boolean index (a nonzero per call)."""
    k = z.shape[0]
    off = ~torch.eye(k, dtype=torch.bool)
    return torch.logsumexp((-t * distances._sq_dist(z, z))[off], dim=0) - math.log(k * (k - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [2, 3, 17, 64])
def test_uniformity_equals_the_boolean_mask_form_exactly(k, dtype):
    """The same entries in the same order: the same value and gradient to the last bit."""
    z = torch.randn(k, 5, generator=torch.Generator().manual_seed(k), dtype=dtype).requires_grad_(True)
    got, reference = _uniformity(z), _boolean_mask_form(z)
    assert torch.equal(got, reference), (got, reference)
    grad, = torch.autograd.grad(got, z)
    reference_grad, = torch.autograd.grad(reference, z)
    assert torch.equal(grad, reference_grad)


def _pcme_inputs(device, n=6, d=8):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, d, generator=g) for _ in range(4)]
    return [t.to(device).requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("form", ["official", "zsprob"])
def test_pcme_with_uniformity_runs_on_the_meta_device(form):
    crit = PCMELoss(form=form, n_samples=3, uniform_weight=0.5, uniform_max_samples=8).to("meta")
    loss, stats = crit(*_pcme_inputs("meta"))
    loss.backward()
    assert loss.device.type == "meta" and stats["uniformity"].shape == ()


@pytest.mark.parametrize("form", ["official", "zsprob"])
def test_pcme_with_uniformity_makes_no_host_sync(form, monkeypatch):
    from zsprob.utils import host_sync
    from zsprob.utils.host_sync import HostSyncCounter

    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())  # count the accelerator's path
    crit = PCMELoss(form=form, n_samples=3, uniform_weight=0.5, uniform_max_samples=8)
    inputs = _pcme_inputs("cpu")
    with HostSyncCounter() as counter:
        loss, _ = crit(*inputs, generator=torch.Generator().manual_seed(1))
        loss.backward()
    assert counter.total == 0, dict(counter.where)
