"""GPO's fixed-length pooling (zsprob.models.heads) against the packed-sequence GPO it replaced.

``PackedGPO`` below is zsprob's previous GPO, kept verbatim as the reference: it ran the
bidirectional ``nn.GRU`` once per distinct length with packed sequences (four host syncs per
forward). The new GPO must give the same pooled features and the same gradients for every input,
with no host sync, and ``torch.compile(fullgraph=True)`` must trace it.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from zsprob.models.heads import GPO, RankGRU, sinusoid_encoding
from zsprob.utils.host_sync import HostSyncCounter


class PackedGPO(nn.Module):
    """zsprob's GPO before the fixed-length rewrite (verbatim but for the class name)."""

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1):
        super().__init__()
        self.d_pe = int(d_pe)
        self.d_hidden = int(d_hidden)
        self.temperature = float(temperature)
        self.gru = nn.GRU(self.d_pe, self.d_hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.score = nn.Linear(self.d_hidden, 1, bias=False)

    def rank_weights(self, lengths: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [B, max_len] over sorted ranks (zero beyond each length) and the valid mask."""
        uniq, inverse = torch.unique(lengths, return_inverse=True)
        n_u = uniq.numel()
        w_dtype = self.gru.weight_ih_l0.dtype
        pe = sinusoid_encoding(max_len, self.d_pe, device=lengths.device, dtype=w_dtype)
        mask_u = torch.arange(max_len, device=lengths.device)[None, :] < uniq[:, None]  # [U, T]
        x = pe[None].expand(n_u, max_len, self.d_pe) * mask_u[..., None].to(w_dtype)
        with torch.autocast(device_type=lengths.device.type, enabled=False):
            if bool((uniq == max_len).all()):
                out, _ = self.gru(x)
            else:
                packed = pack_padded_sequence(x, uniq.cpu(), batch_first=True, enforce_sorted=False)
                out, _ = self.gru(packed)
                out, _ = pad_packed_sequence(out, batch_first=True, total_length=max_len)
            h = 0.5 * (out[..., : self.d_hidden] + out[..., self.d_hidden:])
            s = self.score(h).squeeze(-1) / self.temperature  # [U, T]
            s = s.masked_fill(~mask_u, float("-inf"))
            w = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=1)
        return w[inverse], mask_u[inverse]

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = features.shape
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.long, device=features.device)
        lengths = lengths.to(device=features.device, dtype=torch.long).clamp(1, t)
        max_len = int(lengths.max())
        feats = features[:, :max_len]
        w, mask = self.rank_weights(lengths, max_len)
        if bool(mask.all()):
            srt = feats.sort(dim=1, descending=True).values
        else:
            m = mask[..., None]
            srt = feats.masked_fill(~m, float("-inf")).sort(dim=1, descending=True).values
            srt = srt.masked_fill(~m, 0.0)  # after a descending sort the padding sits at the end
        return (srt * w[..., None].to(srt.dtype)).sum(dim=1)


def _pair(d_pe=16, d_hidden=12, dtype=torch.float32, seed=0):
    """The new GPO and the reference with the same parameters (loaded through the state dict)."""
    torch.manual_seed(seed)
    new = GPO(d_pe, d_hidden).to(dtype)
    ref = PackedGPO(d_pe, d_hidden).to(dtype)
    ref.load_state_dict(new.state_dict())
    return new, ref


def _lengths_cases(t: int, b: int, g: torch.Generator):
    return {
        "random": torch.randint(1, t + 1, (b,), generator=g),
        "all equal": torch.full((b,), max(1, t // 2)),
        "all full": torch.full((b,), t),
        "length 1": torch.ones(b, dtype=torch.long),
        "mixed with 1 and T": torch.tensor([1, t] * (b // 2) + [1] * (b % 2)),
        "out of range (clamped)": torch.tensor([0, t + 5] * (b // 2) + [3] * (b % 2)),
        "None": None,
    }


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("t,b", [(9, 6), (1, 3), (17, 1), (5, 2), (33, 4)])
def test_pooled_features_and_gradients_equal_the_packed_gpo(dtype, tol, t, b):
    new, ref = _pair(dtype=dtype, seed=t * 10 + b)
    g = torch.Generator().manual_seed(t + b)
    for name, lengths in _lengths_cases(t, b, g).items():
        x = torch.randn(b, t, 7, generator=g, dtype=dtype)
        x_new, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y_new, y_ref = new(x_new, lengths), ref(x_ref, lengths)
        torch.testing.assert_close(y_new, y_ref, atol=tol, rtol=0, msg=f"{name}: pooled")
        upstream = torch.randn(b, 7, generator=g, dtype=dtype)
        new.zero_grad(), ref.zero_grad()
        (y_new * upstream).sum().backward()
        (y_ref * upstream).sum().backward()
        torch.testing.assert_close(x_new.grad, x_ref.grad, atol=tol, rtol=0, msg=f"{name}: d features")
        ref_params = dict(ref.named_parameters())
        for pname, p in new.named_parameters():
            expected = ref_params[pname].grad
            expected = torch.zeros_like(p) if expected is None else expected
            got = torch.zeros_like(p) if p.grad is None else p.grad
            # parameter gradients sum over every sample and rank (through 1 / temperature): in float32
            # the GRU's matrix products round differently for other batch shapes, so 1e-5 of their scale
            scale = max(1.0, float(expected.abs().max()))
            torch.testing.assert_close(got, expected, atol=10 * tol * scale, rtol=0, msg=f"{name}: d {pname}")


def test_weight_table_rows_equal_a_gru_run_on_each_length_alone():
    """Row n-1 of the table: the reference's weights for a batch holding only length n."""
    new, ref = _pair(d_pe=8, d_hidden=6, dtype=torch.float64, seed=4)
    t = 11
    table = new.weight_table(t)
    assert table.shape == (t, t)
    for n in range(1, t + 1):
        w, _ = ref.rank_weights(torch.tensor([n]), n)
        torch.testing.assert_close(table[n - 1, :n], w[0], atol=1e-12, rtol=0)
        assert (table[n - 1, n:] == 0).all()
    torch.testing.assert_close(new.weight_table(t, every_length=False), table[-1:], atol=1e-12, rtol=0)


def test_rank_gru_is_nn_gru_with_the_same_names_initialisation_and_outputs():
    torch.manual_seed(3)
    gru = nn.GRU(8, 5, batch_first=True, bidirectional=True)
    torch.manual_seed(3)
    ours = RankGRU(8, 5)
    assert list(ours.state_dict()) == list(gru.state_dict())
    for key, value in gru.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    x = torch.randn(4, 6, 8)
    out, _ = gru(x)
    torch.testing.assert_close(ours.direction(x), out[..., :5], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.direction(x.flip(1), reverse=True).flip(1), out[..., 5:], atol=1e-6, rtol=0)
    # a GPO built under a seed draws the same parameters as the nn.GRU-based GPO did
    torch.manual_seed(11)
    new = GPO(16, 16)
    torch.manual_seed(11)
    ref = PackedGPO(16, 16)
    for key, value in ref.state_dict().items():
        assert torch.equal(new.state_dict()[key], value), key


def test_autocast_keeps_the_weights_in_float32():
    new, ref = _pair(seed=5)
    x = torch.randn(4, 9, 7)
    lengths = torch.tensor([9, 3, 1, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table = new.weight_table(9)
        y_new, y_ref = new(x, lengths), ref(x, lengths)
        y_none, y_none_ref = new(x), ref(x)
    assert table.dtype == torch.float32
    torch.testing.assert_close(y_new, y_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(y_none, y_none_ref, atol=1e-6, rtol=0)
    assert y_new.dtype == y_ref.dtype == torch.float32


def test_the_cpu_shortcut_equals_the_fixed_length_path(monkeypatch):
    """On the CPU a host read is free, so GPO cuts the batch at its longest sequence; the accelerator's
    fixed-length path gives the same pooled features."""
    from zsprob.utils import host_sync
    new, _ = _pair(seed=8)
    x = torch.randn(6, 17, 7)
    lengths = torch.tensor([17, 3, 1, 6, 3, 9])
    cut = new(x, lengths)
    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())
    torch.testing.assert_close(new(x, lengths), cut, atol=1e-6, rtol=0)


@pytest.mark.parametrize("with_lengths", [True, False])
def test_forward_and_backward_make_no_host_sync(with_lengths, monkeypatch):
    from zsprob.utils import host_sync
    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())  # the accelerator's path, counted on the CPU
    new, _ = _pair(seed=6)
    x = torch.randn(5, 9, 7, requires_grad=True)
    lengths = torch.tensor([9, 3, 1, 6, 3]) if with_lengths else None
    with HostSyncCounter() as counter:
        new(x, lengths).square().sum().backward()
    assert counter.total == 0, counter.where
    assert x.grad is not None and new.score.weight.grad is not None
    # the reference pays four per forward (unique, int(max), bool(all), .cpu())
    _, ref = _pair(seed=6)
    with HostSyncCounter() as counter:
        ref(x, torch.tensor([9, 3, 1, 6, 3]))
    assert counter.total >= 3


def _compiler_usable() -> str | None:
    """Why torch.compile cannot run here (None if it can): inductor's CPU backend needs a C compiler."""
    if shutil.which("gcc") is None and shutil.which("cc") is None and shutil.which("clang") is None:
        return "no C compiler on this machine (inductor's CPU backend needs one)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_compiler_usable() is not None, reason=str(_compiler_usable()))
def test_torch_compile_fullgraph_traces_gpo():
    """Four ranks are enough to hold full, partial and length-1 rows; each rank is an unrolled GRU step to compile."""
    new, ref = _pair(seed=7)
    compiled = torch.compile(new, fullgraph=True, dynamic=False)
    x = torch.randn(4, 4, 7)
    lengths = torch.tensor([4, 3, 1, 2])
    torch.testing.assert_close(compiled(x, lengths), ref(x, lengths), atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled(x, None), ref(x), atol=1e-5, rtol=0)
