"""The host-sync counter sees every host-synchronising call, skips torch.optim's host-side step counters."""
from __future__ import annotations

import torch

from zsprob.utils.host_sync import HostSyncCounter


def test_counts_each_host_synchronising_call_and_where():
    x = torch.randn(5)
    with HostSyncCounter() as counter:
        y = (x * 2).sum()
        y.item()
        bool(y > 0)
        torch.unique(x)
        x.nonzero()
        x.cpu()
        float(y)
        x.tolist()
        z = x + 1  # no sync
    assert z.shape == (5,)
    assert counter.total == 7
    assert counter.by_name == {"item": 1, "__bool__": 1, "unique": 1, "nonzero": 1, "cpu": 1, "__float__": 1,
                               "tolist": 1}
    assert all("test_host_sync.py:" in key for key in counter.where), counter.where


def test_torch_optim_step_counters_are_not_counted():
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([w], lr=0.1)
    (w ** 2).sum().backward()
    with HostSyncCounter() as counter:
        opt.step()
    assert counter.total == 0
