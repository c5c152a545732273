"""The post-hoc paths a GPU user reaches, rehearsed on a stand-in device: ``--method laplace`` under
FakeTensorMode with a fake ``cuda`` device (which raises on CPU/CUDA mixing), and the feature pass's
loaders asking for page-locked memory when the device is CUDA."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zsprob.posthoc import features as features_module
from zsprob.posthoc.adapter import AdapterSettings


class _Stop(Exception):
    pass


class _PooledStub:
    """What fit_laplace asks of a head adapter (a pooled CNN tower's): the projection on the device, its input."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias

    def projection(self):
        return self.weight, self.bias

    def projection_input(self, features):
        return features


def test_laplace_meets_the_cached_cpu_features_on_the_models_device(monkeypatch):
    """The feature file is read on the CPU and the model sits on CUDA: every product of the Laplace fit is
    on one device (FakeTensorMode raises FakeTensorDeviceMismatchError otherwise), and the exact
    log-variances handed to the heads' training are on the model's device."""
    from zsprob.posthoc import adapter, laplace

    seen = {}

    def train_heads(adapters, targets, settings, device, **kw):
        seen.update({k: v.device for k, v in targets.items()})
        raise _Stop

    monkeypatch.setattr(adapter, "train_heads", train_heads)
    # a CPU build runs no backward on a fake CUDA tensor: the curvature's gradients are the meta test's below
    monkeypatch.setattr(laplace, "infonce_output_grads", lambda zi, zt, scale: (torch.randn_like(zi),
                                                                                 torch.randn_like(zt)))
    n, width, dim = 32, 6, 4
    cached = {f"{part}_{kind}": torch.randn(n, width if kind == "features" else dim)
              for part in features_module.PARTS for kind in ("features", "mu")}
    with FakeTensorMode(allow_non_fake_inputs=True):
        adapters = {side: _PooledStub(torch.randn(dim, width, device="cuda"), torch.randn(dim, device="cuda"))
                    for side in ("image", "text")}
        with pytest.raises(_Stop):
            laplace.fit_laplace(adapters, cached, AdapterSettings(prior_precision=1.0), torch.device("cuda"),
                                progress=False)
    assert {f"{part}_laplace" for part in features_module.PARTS} <= set(seen)
    assert {d.type for d in seen.values()} == {"cuda"}


def test_laplace_curvature_gradients_run_on_the_device():
    """The per-pair InfoNCE gradients of the curvature, on the meta device (which runs backward): labels and
    gradients stay on the device of the projections' outputs."""
    from zsprob.posthoc.laplace import infonce_output_grads

    z_img, z_txt = torch.randn(10, 4, device="meta"), torch.randn(10, 4, device="meta")
    grads = infonce_output_grads(z_img, z_txt, logit_scale=5.0, batch_size=4)
    assert [(g.device.type, tuple(g.shape)) for g in grads] == [("meta", (10, 4))] * 2


def test_feature_pass_loaders_pin_memory_for_cuda(monkeypatch):
    """The COCO DataLoader and the shard pipeline of the feature pass pin their batches for a CUDA device,
    and only for it."""
    from zsprob.data import coco, webdataset

    made = []

    class Loader:
        def __init__(self, *args, pin_memory=False, **kwargs):
            self.pin_memory = pin_memory
            made.append(self)

        def __iter__(self):
            return iter(())

    monkeypatch.setattr(torch.utils.data, "DataLoader", Loader)
    monkeypatch.setattr(webdataset, "build_wds_pipeline", Loader)
    monkeypatch.setattr(coco, "CocoCaptions", lambda *a, **k: None)
    monkeypatch.setattr(coco, "CocoPairs", lambda *a, **k: type("P", (), {"set_epoch": lambda self, e: None})())
    model = type("M", (), {"preprocess_val": None, "tokenizer": None})()
    for kind in ("coco", "synthetic"):
        for device, pinned in (("cuda", True), ("cpu", False), ("meta", False)):
            spec = features_module.DataSpec(kind, "/nowhere")
            list(features_module.pair_batches(spec, model, 4, 0, 0, device=device))
            assert made[-1].pin_memory is pinned, (kind, device)
