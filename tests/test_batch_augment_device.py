"""The batch augmentations of the training step (caption noise, text SizeAugment, MSDA in every mode,
label smoothing, same-image targets) run on the batch's device: bit-identical on the CPU to the
host-side versions they replace (kept below as references, verbatim), drawing the same random numbers
from the same CPU generator, returning results on the batch's device (the meta device stands in for
an accelerator: any read of a batch value there fails) and reading nothing back from a batch tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zsprob.data.text_augment import size_augment_tokens
from zsprob.prob.msda import mix_batch, mix_batch_official, smooth_targets
from zsprob.train.data import add_caption_noise, same_image_targets
from zsprob.utils.host_sync import HostSyncCounter


# ----------------------------------------------------------------------------- references (the host-side code replaced)

def ref_numpy_rng(generator):
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu").item())
    return np.random.default_rng(seed)


def ref_timm_box(shape, lam, seed):
    from timm.data.mixup import cutmix_bbox_and_lam
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        (yl, yh, xl, xh), lam_kept = cutmix_bbox_and_lam(shape, lam, correct_lam=True)
    finally:
        np.random.set_state(state)
    return int(yl), int(yh), int(xl), int(xh), float(lam_kept)


def ref_official_targets(lam, smoothing=0.0):
    bsz = lam.shape[0]
    eye = torch.eye(bsz, dtype=torch.float32, device=lam.device)
    own = (1.0 - smoothing) * eye + smoothing * (1.0 - eye)
    partner = own.flip(0)
    lam = lam.to(torch.float32).unsqueeze(1)
    return own * lam + partner * (1.0 - lam)


def ref_mix_batch_official(images, *, ratio=0.25, alpha=2.0, switch_prob=0.5, smoothing=1e-4, generator=None):
    bsz = images.shape[0]
    rng = ref_numpy_rng(generator)
    use_cutmix = rng.random(bsz) < switch_prob
    lam_draw = rng.beta(alpha, alpha, size=bsz)
    use_mix = rng.random(bsz) < ratio
    lams = np.where(use_mix, lam_draw, 1.0)
    out = images.clone()
    info = {"index": [], "partner": [], "lam": [], "cutmix": []}
    for i in range(bsz):
        j = bsz - 1 - i
        if not use_mix[i] or i == j:
            lams[i] = 1.0
            continue
        if use_cutmix[i]:
            yl, yh, xl, xh, lam = ref_timm_box(images.shape, float(lams[i]), int(rng.integers(0, 2 ** 31 - 1)))
            out[i, :, yl:yh, xl:xh] = images[j, :, yl:yh, xl:xh]
            lams[i] = lam
        else:
            lam = float(lams[i])
            out[i] = lam * images[i] + (1.0 - lam) * images[j]
        info["index"].append(i)
        info["partner"].append(j)
        info["lam"].append(float(lams[i]))
        info["cutmix"].append(bool(use_cutmix[i]))
    matched = ref_official_targets(torch.as_tensor(lams, dtype=torch.float64), smoothing).to(images.device)
    return out, matched, info


def ref_mix_batch(images, *, ratio=0.25, alpha=2.0, mode="random", generator=None):
    bsz = images.shape[0]
    matched = torch.eye(bsz, device=images.device, dtype=torch.float32)
    k = int(round(ratio * bsz)) if bsz >= 2 else 0
    rng = ref_numpy_rng(generator)
    use = mode if mode != "random" else ("cutmix" if rng.random() < 0.5 else "mixup")
    info = {"mode": use, "index": [], "partner": [], "lam": []}
    if k == 0:
        return images.clone(), matched, info
    idx = rng.permutation(bsz)[:k]
    partner = (idx + rng.integers(1, bsz, size=k)) % bsz
    lams = rng.beta(alpha, alpha, size=k)
    out = images.clone()
    for i, j, lam in zip(idx.tolist(), partner.tolist(), lams.tolist()):
        if use == "mixup":
            out[i] = lam * images[i] + (1.0 - lam) * images[j]
        else:
            yl, yh, xl, xh, lam = ref_timm_box(images.shape, lam, int(rng.integers(0, 2 ** 31 - 1)))
            out[i, :, yl:yh, xl:xh] = images[j, :, yl:yh, xl:xh]
        matched[i, i] = lam
        matched[i, j] = 1.0 - lam
        info["index"].append(i)
        info["partner"].append(j)
        info["lam"].append(float(lam))
    return out, matched, info


def ref_add_caption_noise(tokens, ratio, generator):
    n = tokens.shape[0]
    k = int(round(ratio * n))
    if ratio <= 0 or k < 2:
        return tokens, 0
    rows = torch.randperm(n, generator=generator)[:k]
    out = tokens.clone()
    out[rows] = tokens[rows.roll(1)]
    return out, k


def ref_size_augment_tokens(tokens, *, share=0.2, masking=0.5, erasing=0.1, mask_token=44, vocab_size=49408,
                            generator=None):
    bsz, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(bsz, length)
    nonzero = tokens != 0
    last = torch.where(nonzero, positions, torch.zeros_like(positions)).amax(dim=1, keepdim=True)
    candidates = (positions > 0) & (positions < last)
    draw = torch.rand(bsz, length, generator=generator, device=tokens.device)
    random_ids = torch.randint(1, vocab_size - 2, (bsz, length), generator=generator, device=tokens.device)
    selected = candidates & (draw < share)
    within = draw / share if share > 0 else draw
    masked = selected & (within < masking)
    randomised = selected & (within >= masking) & (within < masking + erasing)
    deleted = selected & ~masked & ~randomised
    out = torch.where(masked, torch.full_like(tokens, mask_token), tokens)
    out = torch.where(randomised, random_ids.to(tokens.dtype), out)
    keep = ~deleted
    target_pos = keep.long().cumsum(dim=1) - 1
    rows = torch.arange(bsz, device=tokens.device).unsqueeze(1).expand(bsz, length)
    shortened = torch.zeros_like(tokens)
    shortened[rows[keep], target_pos[keep]] = out[keep]
    return shortened


# ----------------------------------------------------------------------------- inputs

def photo_batch(bsz=12, dtype=torch.float32, seed=0, h=20, w=24):
    """Random pixel values (every bit of the mixing arithmetic shows)."""
    return torch.randn(bsz, 3, h, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


def token_batch(bsz=64, length=30, seed=0):
    """Start 49406, 1..length-3 random ids, end 49407, zero padding: like open_clip's tokens."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(bsz, length, dtype=torch.long)
    lengths = torch.randint(1, length - 2, (bsz,), generator=g)
    for r, n in enumerate(lengths.tolist()):
        out[r, 0] = 49406
        out[r, 1:n + 1] = torch.randint(1, 49000, (n,), generator=g)
        out[r, n + 1] = 49407
    return out


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- bit-identical on the CPU

@pytest.mark.parametrize("mode", ["mixup", "cutmix", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_paper_msda_is_bit_identical_to_the_row_by_row_version(mode, dtype):
    for seed, bsz, ratio in ((0, 12, 0.25), (1, 7, 0.5), (2, 16, 1.0), (3, 2, 0.5), (4, 9, 0.0)):
        images = photo_batch(bsz, dtype, seed)
        before = images.clone()
        gen_new, gen_old = seeded(seed), seeded(seed)
        for _ in range(3):  # consecutive calls on one generator: the same draws in the same order
            out, matched, info = mix_batch(images, ratio=ratio, mode=mode, generator=gen_new, return_info=True)
            ref_out, ref_matched, ref_info = ref_mix_batch(images, ratio=ratio, mode=mode, generator=gen_old)
            assert torch.equal(out, ref_out) and out.dtype == ref_out.dtype
            assert torch.equal(matched, ref_matched) and matched.dtype == torch.float32
            assert info == ref_info
        assert torch.equal(images, before)
        assert torch.equal(gen_new.get_state(), gen_old.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_official_msda_is_bit_identical_to_the_row_by_row_version(dtype):
    for seed, bsz, ratio, smoothing in ((0, 16, 0.25, 1e-4), (1, 9, 0.75, 0.1), (2, 12, 1.0, 0.0), (3, 1, 1.0, 1e-4)):
        images = photo_batch(bsz, dtype, seed)
        gen_new, gen_old = seeded(seed), seeded(seed)
        for _ in range(3):
            out, matched, info = mix_batch_official(images, ratio=ratio, smoothing=smoothing, generator=gen_new,
                                                    return_info=True)
            ref_out, ref_matched, ref_info = ref_mix_batch_official(images, ratio=ratio, smoothing=smoothing,
                                                                    generator=gen_old)
            assert torch.equal(out, ref_out)
            assert torch.equal(matched, ref_matched)
            assert info == ref_info
        assert torch.equal(gen_new.get_state(), gen_old.get_state())
    # mix_batch's "official" mode is the same function
    images = photo_batch(16)
    a = mix_batch(images, mode="official", ratio=0.5, generator=seeded(7))
    b = ref_mix_batch_official(images, ratio=0.5, generator=seeded(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_caption_noise_and_text_size_augment_are_bit_identical():
    tokens = token_batch(64, 30)
    for seed, ratio in ((0, 0.2), (1, 0.5), (2, 0.01), (3, 1.0)):
        gen_new, gen_old = seeded(seed), seeded(seed)
        got, k = add_caption_noise(tokens, ratio, gen_new)
        ref, ref_k = ref_add_caption_noise(tokens, ratio, gen_old)
        assert torch.equal(got, ref) and k == ref_k
        assert torch.equal(gen_new.get_state(), gen_old.get_state())
    assert add_caption_noise(tokens, 0.2, seeded(0))[1] == 13 and add_caption_noise(tokens, 0.0, seeded(0))[1] == 0
    for seed, share, masking, erasing in ((0, 0.2, 0.5, 0.1), (1, 0.9, 0.0, 0.0), (2, 1.0, 0.3, 0.3),
                                          (3, 0.5, 0.0, 1.0), (4, 0.0, 0.5, 0.1)):
        for dtype in (torch.long, torch.int32):
            batch = tokens.to(dtype)
            gen_new, gen_old = seeded(seed), seeded(seed)
            kw = dict(share=share, masking=masking, erasing=erasing)
            got = size_augment_tokens(batch, generator=gen_new, **kw)
            ref = ref_size_augment_tokens(batch, generator=gen_old, **kw)
            assert torch.equal(got, ref) and got.dtype == dtype
            assert torch.equal(gen_new.get_state(), gen_old.get_state())
    # the deletion path is really exercised: some rows got shorter
    short = size_augment_tokens(tokens, share=1.0, masking=0.0, erasing=0.0, generator=seeded(0))
    assert ((short != 0).sum(1) < (tokens != 0).sum(1)).all()


def test_label_smoothing_and_same_image_targets_unchanged():
    ids = torch.tensor([3, 1, 3, 0, 1, 2])
    hard = same_image_targets(ids)
    assert torch.equal(hard, (ids[:, None] == ids[None, :]).float())
    for s in (0.0, 1e-4, 0.1):
        assert torch.equal(smooth_targets(hard, s), (1.0 - s) * hard + s * (1.0 - hard))


# ----------------------------------------------------------------------------- on the batch's device, nothing read back

class BatchSyncCounter(HostSyncCounter):
    """Counts the host-synchronising calls that touch a tensor off the CPU (the batch's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def off_cpu(x):
            return isinstance(x, torch.Tensor) and x.device.type != "cpu"
        if any(off_cpu(a) for a in args) or any(off_cpu(v) for v in (kwargs or {}).values()):
            return super().__torch_function__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def all_augmentations(images, tokens, ids, generator):
    """The training step's augmentation chain in its order, on whatever device the batch is."""
    noisy, _ = add_caption_noise(tokens, 0.25, generator)
    augmented = size_augment_tokens(noisy, generator=generator)
    paper = [mix_batch(images, mode=m, ratio=0.5, generator=generator) for m in ("mixup", "cutmix")]
    official = mix_batch_official(images, ratio=0.5, generator=generator)
    smooth = smooth_targets(same_image_targets(ids), 0.1)
    return augmented, paper, official, smooth


def test_augmentations_run_on_the_batch_device_and_read_nothing_back():
    images, tokens, ids = photo_batch(16), token_batch(16), torch.arange(16) // 2
    with BatchSyncCounter() as on_device:
        augmented, paper, official, smooth = all_augmentations(images.to("meta"), tokens.to("meta"), ids.to("meta"),
                                                               seeded(0))
    assert on_device.total == 0, on_device.where
    assert augmented.device.type == "meta" and augmented.shape == tokens.shape
    for out, matched in paper + [official]:
        assert out.device.type == matched.device.type == "meta"
        assert out.shape == images.shape and matched.shape == (16, 16) and matched.dtype == torch.float32
    assert smooth.device.type == "meta"
    # on the CPU the same chain makes exactly one host read per MSDA call: the seed drawn from the CPU generator
    with HostSyncCounter() as on_cpu:
        all_augmentations(images, tokens, ids, seeded(0))
    assert on_cpu.by_name == {"item": 3}, on_cpu.where
    assert all("prob/msda.py" in where for where in on_cpu.where), on_cpu.where
    assert len(on_cpu.where) == 1  # one line: the seed draw


def test_device_results_match_the_cpu_draws():
    """The same generator gives the same plan wherever the batch is: the meta run and the CPU run
    consume the generator identically and report the same rows, partners and lambdas."""
    images = photo_batch(16)
    g_cpu, g_meta = seeded(5), seeded(5)
    _, _, info_cpu = mix_batch_official(images, ratio=0.5, generator=g_cpu, return_info=True)
    _, _, info_meta = mix_batch_official(images.to("meta"), ratio=0.5, generator=g_meta, return_info=True)
    assert info_cpu == info_meta and torch.equal(g_cpu.get_state(), g_meta.get_state())
    tokens = token_batch(16)
    g_cpu, g_meta = seeded(6), seeded(6)
    add_caption_noise(tokens, 0.5, g_cpu)
    add_caption_noise(tokens.to("meta"), 0.5, g_meta)
    size_augment_tokens(tokens, generator=g_cpu)
    size_augment_tokens(tokens.to("meta"), generator=g_meta)
    assert torch.equal(g_cpu.get_state(), g_meta.get_state())
