"""Masked copies on any device (zsprob.data.masking) against the CPU-only functions they replaced.

The ``reference_*`` functions below are zsprob's previous masking code, kept verbatim (docstrings
cut): the new ones must give BIT-IDENTICAL copies on the CPU from the same generator, consume the
same draws (the generator ends in the same state), call nothing that waits on a device
(``HostSyncCounter``), and run on tensors that hold no values at all (the meta device), which
proves they never read a value of the tokens or images on the host. The counts and statistics of
the masks are tested in tests/test_prob_prolip.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from zsprob.data.masking import (TEXT_MASK_MODES, TextMaskSpec, cells_to_mask, delete_tokens, mask_image_cells,
                                 mask_tokens, text_mask_spec)
from zsprob.utils.host_sync import HostSyncCounter


# ----------------------------------------------------------------------------- today's code, the reference

def reference_mask_tokens(tokens, drop_prob, spec, generator=None):
    device = generator.device if generator is not None else tokens.device
    draws = torch.rand(tokens.shape, generator=generator, device=device).to(tokens.device)
    protected = torch.isin(tokens, torch.tensor(spec.protected_ids, dtype=tokens.dtype, device=tokens.device))
    replace = (draws < drop_prob) & ~protected
    return tokens.masked_fill(replace, spec.mask_id)


def reference_delete_tokens(tokens, drop_prob, spec, generator=None, pad_id=0):
    device = generator.device if generator is not None else tokens.device
    draws = torch.rand(tokens.shape, generator=generator, device=device).to(tokens.device)
    protected = torch.isin(tokens, torch.tensor(spec.protected_ids, dtype=tokens.dtype, device=tokens.device))
    keep = ~((draws < drop_prob) & ~protected) & (tokens != pad_id)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept positions first, in order
    return torch.where(keep, tokens, torch.full_like(tokens, pad_id)).gather(1, order)


def reference_mask_image_cells(images, drop_prob, cell, generator=None, fill=0.0):
    batch, _, height, width = images.shape
    rows, cols = -(-height // cell), -(-width // cell)
    n_drop = cells_to_mask(rows * cols, drop_prob)
    device = generator.device if generator is not None else images.device
    scores = torch.rand(batch, rows * cols, generator=generator, device=device)
    dropped = torch.zeros(batch, rows * cols, dtype=torch.bool, device=device)
    if n_drop > 0:
        dropped.scatter_(1, scores.topk(n_drop, dim=1).indices, True)
    cell_mask = dropped.view(batch, 1, rows, cols).to(images.device)
    pixel_mask = cell_mask.repeat_interleave(cell, dim=2).repeat_interleave(cell, dim=3)[..., :height, :width]
    return images.masked_fill(pixel_mask, fill)


REFERENCE_TEXT = {"replace": reference_mask_tokens, "delete": reference_delete_tokens}


# ----------------------------------------------------------------------------- inputs

@functools.lru_cache(maxsize=1)
def _clip_tokenizer():
    import open_clip
    return open_clip.get_tokenizer("ViT-B-32", context_length=16)


def _clip_spec_and_tokens(batch: int = 24, seed: int = 0):
    tokenizer = _clip_tokenizer()
    words = ["a", "red", "star", "and", "large", "blue", "striped", "circle", "shape", "two", "small", "green"]
    g = torch.Generator().manual_seed(seed)
    captions = [" ".join(words[i] for i in torch.randint(len(words), (int(n),), generator=g))
                for n in torch.randint(0, 14, (batch,), generator=g)]
    return text_mask_spec(tokenizer), tokenizer(captions)


SPECS = {
    "clip": None,                                                     # built from open_clip's tokenizer
    "many protected ids": TextMaskSpec(7, tuple(range(0, 200, 3)) + (5000, 49407)),
    "no protected ids": TextMaskSpec(1, ()),
    "unsorted, repeated": TextMaskSpec(2, (49407, 0, 49406, 0)),
}


def _spec_and_tokens(name: str, seed: int = 0):
    spec, tokens = _clip_spec_and_tokens(seed=seed)
    return (spec if SPECS[name] is None else SPECS[name]), tokens


# ----------------------------------------------------------------------------- bit-identical on the CPU

@pytest.mark.parametrize("mode", sorted(TEXT_MASK_MODES))
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("drop", [0.0, 0.3, 0.75, 1.0])
def test_text_masks_are_bit_identical_to_the_cpu_reference(mode, spec_name, drop):
    spec, tokens = _spec_and_tokens(spec_name, seed=int(drop * 10))
    for seed in range(3):
        g_new, g_ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        new = TEXT_MASK_MODES[mode](tokens, drop, spec, g_new)
        ref = REFERENCE_TEXT[mode](tokens, drop, spec, g_ref)
        assert new.dtype == ref.dtype and torch.equal(new, ref)
        assert torch.equal(g_new.get_state(), g_ref.get_state())         # the same draws were consumed
    # without a generator: the global generator, as before
    torch.manual_seed(5)
    new = TEXT_MASK_MODES[mode](tokens, drop, spec)
    torch.manual_seed(5)
    assert torch.equal(new, REFERENCE_TEXT[mode](tokens, drop, spec))


def test_protected_ids_agree_with_isin_for_any_ids():
    from zsprob.data.masking import _protected
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(-5, 300, (40, 20), generator=g)
    for ids in [(), (0,), (299,), (-3, 7, 7, 250), tuple(torch.randint(-10, 400, (150,), generator=g).tolist())]:
        for dtype in (torch.long, torch.int32):
            expected = torch.isin(tokens.to(dtype), torch.tensor(ids, dtype=dtype))
            assert torch.equal(_protected(tokens.to(dtype), TextMaskSpec(1, ids)), expected), ids
    # a non-contiguous view
    assert torch.equal(_protected(tokens.t(), TextMaskSpec(1, (3, 4))), torch.isin(tokens.t(), torch.tensor([3, 4])))


@pytest.mark.parametrize("height,width,cell", [(32, 32, 8), (30, 27, 8), (64, 48, 16), (16, 16, 16), (9, 13, 4)])
@pytest.mark.parametrize("drop", [0.0, 0.25, 0.75, 1.0])
def test_image_cells_are_bit_identical_to_the_cpu_reference(height, width, cell, drop):
    images = torch.randn(5, 3, height, width, generator=torch.Generator().manual_seed(height + width))
    for seed, fill in [(0, 0.0), (1, -1.5)]:
        g_new, g_ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        new = mask_image_cells(images, drop, cell, g_new, fill=fill)
        ref = reference_mask_image_cells(images, drop, cell, g_ref, fill=fill)
        assert torch.equal(new, ref)
        assert torch.equal(g_new.get_state(), g_ref.get_state())


# ----------------------------------------------------------------------------- no host sync, no host read

def test_no_host_sync_with_a_cpu_generator():
    spec, tokens = _clip_spec_and_tokens()
    images = torch.randn(4, 3, 32, 32)
    g = torch.Generator().manual_seed(0)
    assert TEXT_MASK_MODES == {"replace": mask_tokens, "delete": delete_tokens}
    with HostSyncCounter() as counter:
        for fn in TEXT_MASK_MODES.values():
            fn(tokens, 0.5, spec, g)
        mask_image_cells(images, 0.5, 8, g)
    assert counter.total == 0, counter.where


def test_tensors_without_values_are_masked_on_their_device():
    """The meta device holds shapes and no values: anything that read a token or a pixel on the
    host would raise. The draws come from the CPU generator and are copied there."""
    spec, tokens = _clip_spec_and_tokens()
    meta_tokens = tokens.to("meta")
    for mode, fn in TEXT_MASK_MODES.items():
        out = fn(meta_tokens, 0.5, spec, torch.Generator().manual_seed(0))
        assert out.device.type == "meta" and out.shape == tokens.shape and out.dtype == tokens.dtype, mode
    images = torch.empty(3, 3, 30, 20, device="meta")
    out = mask_image_cells(images, 0.5, 8, torch.Generator().manual_seed(0))
    assert out.device.type == "meta" and out.shape == images.shape
