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


def test_copies_of_host_data_to_the_device_are_counted():
    """Two calls that read nothing back but still make an accelerator wait for a copy from host memory
    (what CUDA's sync debug mode reported on an H200): a tensor made from a Python list for a device,
    and an indexed write of a Python number through a tensor index."""
    x = torch.zeros(4, 4)
    with HostSyncCounter() as counter:
        torch.tensor([0, 1], device=x.device)
        x[torch.arange(2), torch.arange(2)] = 1.0
        torch.tensor([0, 1])  # a host tensor: no device named, nothing to copy
        x[:, 0] = 2.0  # a fill of a view: the number travels as a kernel argument
        x[torch.arange(2)] = torch.ones(4)  # a tensor value: already on its device
    assert counter.by_name == {"tensor(host data, device=)": 1, "__setitem__(tensor index, number)": 1}


def test_identity_targets_and_pooled_rows_make_no_host_copy():
    from open_clip.transformer import ResidualAttentionBlock

    from zsprob.models.prob_clip import _run_block_rows
    from zsprob.prob.pairs import PairBatch
    g = torch.Generator().manual_seed(0)
    mu, lv = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    all_mu, all_lv = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)
    block = ResidualAttentionBlock(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16, generator=g)
    with HostSyncCounter() as counter, torch.no_grad():
        pairs = PairBatch(mu, lv, mu, lv, None, (all_mu, all_lv), (all_mu, all_lv), 2, need_sigma=True)
        rows = _run_block_rows(block, x, [3, 4], None)
    assert counter.total == 0, counter.where
    assert torch.equal(pairs.t_i2t, torch.eye(7)[2:5]) and torch.equal(pairs.t_t2i, torch.eye(7)[2:5])
    with torch.no_grad():
        torch.testing.assert_close(rows, block(x)[:, 3:5], rtol=1e-5, atol=1e-6)
