"""A model's fingerprint names it in caches, selection files, evaluation results and exports: it must not
depend on the thread count or the summation order (a file made with 2 threads was refused by a process
running 1), it must change with any weight, and ids written before it was made exact are still taken."""
from __future__ import annotations

import torch

from zsprob.models.fingerprint import is_model, legacy_fingerprint, model_fingerprint


class Big(torch.nn.Module):
    """Large enough that torch splits its float64 sums over threads (the old fingerprint's weakness)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)  # seed 2: its float64 sum differs in the last digit at 1 and 2 threads
        self.weight = torch.nn.Parameter(0.02 * torch.randn(49408, 32, generator=g))
        self.low = torch.nn.Parameter(torch.randn(300, 7, generator=g).to(torch.bfloat16), requires_grad=False)
        self.register_buffer("steps", torch.tensor([3, 5], dtype=torch.int64))


def test_the_fingerprint_is_the_same_at_every_thread_count():
    model, threads = Big(), torch.get_num_threads()
    try:
        ids = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ids.add(model_fingerprint(model))
    finally:
        torch.set_num_threads(threads)
    assert len(ids) == 1  # the old one gave 2 ids here on this project's AMD EPYC (not asserted: CPU-dependent)


def test_the_fingerprint_is_an_exact_function_of_the_weights():
    model = Big()
    before = model_fingerprint(model)
    with torch.no_grad():  # one value nudged by one unit in the last place, far from the sampled ones
        i = 12345 * 32 + 17
        flat = model.weight.view(-1)
        flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf")))
    assert model_fingerprint(model) != before
    with torch.no_grad():  # two values swapped: the sum of bits is unchanged, the sample is not
        model.weight[[0, 1]] = model.weight[[1, 0]]
    assert model_fingerprint(model) not in (before,)


def test_ids_written_before_are_still_taken():
    model = Big()
    own = model_fingerprint(model)
    assert is_model(own, model) and is_model(legacy_fingerprint(model), model)
    assert not is_model("0" * 32, model, own)


def test_the_legacy_fingerprint_is_the_one_zsprob_wrote():
    """The id the old code (commit 397c1d9) gave this small model: selection files and results that carry
    it must still be recognised. Eighths: every partial sum is exact, so the float64 sum the old id hashed is the
    same whatever order a CPU's vector units add in."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 8)
        model.bias.copy_(torch.tensor([0.5, -1.25]))
    assert legacy_fingerprint(model) == "6238e450d92ae4f05969bcae3407a24a"
    assert is_model("6238e450d92ae4f05969bcae3407a24a", model) and model_fingerprint(model) != legacy_fingerprint(model)


def test_the_fingerprint_is_the_one_the_per_tensor_code_gave():
    """The id the per-tensor code (one host read per tensor, before issue 49) gave the eighths model above: the
    batched reads hash the same bytes (bit sums are exact, so the id is the same on every machine)."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 8)
        model.bias.copy_(torch.tensor([0.5, -1.25]))
    assert model_fingerprint(model) == "9cb03736b5c7e5e4e936485c3587f9dc"


def test_a_fingerprint_reads_the_device_twice_whatever_the_tensor_count(monkeypatch):
    """On a GPU each host read waits for the device: the samples and the sums are copied to the host once each
    (the counter, told that the CPU is a device, also counts the numpy / list views of those copies)."""
    from zsprob.utils import host_sync
    from zsprob.utils.host_sync import HostSyncCounter

    monkeypatch.setattr(host_sync, "HOST_READ_FREE", set())  # count as on an accelerator
    for model in (torch.nn.Linear(3, 2), Big()):
        with HostSyncCounter() as counter:
            model_fingerprint(model)
        assert counter.by_name == {"cpu": 2, "numpy": 1, "tolist": 1}
