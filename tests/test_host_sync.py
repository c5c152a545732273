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


def test_boolean_mask_indexing_is_counted_and_other_indexing_is_not():
    """A boolean mask picks a data-dependent number of rows: the device's nonzero, read by the host."""
    x = torch.randn(5, 3)
    mask = x[:, 0] > 0
    with HostSyncCounter() as counter:
        x[mask]
        x[mask, 1:]  # the mask inside a tuple index
        x.masked_select(mask[:, None])
        torch.argwhere(mask)
        x[torch.arange(2)], x.index_select(0, torch.arange(2)), x[1:], x[None]  # fixed shapes: no sync
        x.masked_fill(mask[:, None], 0.0), torch.where(mask[:, None], x, 0.0)
    assert counter.by_name == {"__getitem__(bool mask)": 2, "masked_select": 1, "argwhere": 1}, counter.where


def test_copies_into_host_memory_are_counted():
    """``.cpu()``, ``.to("cpu")`` and a copy of a device tensor into a CPU tensor, each once. On the CPU
    the counter sees a copy to the host when the call names it as "cpu" (``x.to(device)`` with a CPU
    ``device`` is how device-agnostic code moves data to the run's own device: not counted there); a device
    tensor (a fake CUDA tensor here) is counted whatever names the host."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(4)
    cpu = torch.device("cpu")
    with HostSyncCounter() as on_cpu:
        x.cpu()
        x.to("cpu")
        x.to(device="cpu", dtype=torch.float64)
        x.to(cpu), x.to(x), x.to(torch.float64), torch.zeros(4).copy_(x)  # the run's own device: not counted
        x.to("cpu", non_blocking=True)  # into pinned memory: nothing waits
    assert on_cpu.by_name == {"cpu": 1, "to(cpu)": 2}, on_cpu.where
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_device = torch.randn(4, device="cuda")
        with HostSyncCounter() as counter:
            on_device.to(cpu)
            on_device.to(x)
            x.copy_(on_device)
            on_device.copy_(x)  # host to device: not a read
            on_device.to("cpu", non_blocking=True)
    assert counter.by_name == {"to(cpu)": 2, "copy_(into host)": 1}, counter.where
