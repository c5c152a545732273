"""SizeAugment (image level and token level) and the open_clip transform helpers."""
from __future__ import annotations

import torch
from PIL import Image

from zsprob.data.transforms import (SizeAugment, build_train_transform, build_val_transform,
                                    size_augment_tokens, with_size_augment)


def test_size_augment_masks_whole_patches_with_the_vse_infinity_law():
    g = torch.Generator().manual_seed(0)
    aug = SizeAugment(p=0.2, patch_size=4, generator=g)
    x = torch.randn(3, 32, 32) + 10.0          # no natural zeros
    changed, frac = 0, []
    n = 600
    for i in range(n):
        y = aug(x)
        zero = (y == 0).all(0)
        cells = zero.reshape(8, 4, 8, 4).permute(0, 2, 1, 3).reshape(64, 16)
        if i < 50:  # a cell is either fully masked or untouched; the rest is unchanged
            assert torch.all(cells.all(1) | ~cells.any(1))
            assert torch.equal(y[:, ~zero], x[:, ~zero])
        f = cells.all(1).float().mean().item()
        frac.append(f)
        changed += f > 0
    frac = torch.tensor(frac)
    assert frac.max() <= 0.45                  # per-cell rate is at most 0.2
    assert 0.70 < changed / n < 0.85           # applied to ~80% of the images
    assert abs(frac.mean().item() - 0.096) < 0.012   # E = 0.8 * 0.2 * E[u | u > 0.2] = 0.096
    assert torch.equal(SizeAugment(p=0.0)(x), x)
    batch = SizeAugment(p=0.2, patch_size=8)(x.expand(4, -1, -1, -1))
    assert batch.shape == (4, 3, 32, 32)


def test_size_augment_tokens_drops_packs_and_keeps_cls():
    g = torch.Generator().manual_seed(1)
    b, n, d = 64, 50, 4
    tok = torch.arange(1, n + 1, dtype=torch.float32).view(1, n, 1).expand(b, n, d).clone()
    packed, lengths = size_augment_tokens(tok, p=0.2, generator=g)
    assert packed.shape[0] == b and packed.shape[1] == int(lengths.max()) and packed.shape[2] == d
    assert (lengths < n).any() and (lengths == n).any()
    for i in range(b):
        L = int(lengths[i])
        vals = packed[i, :L, 0]
        assert vals[0] == 1                                    # class token kept
        assert torch.all(vals[1:] > vals[:-1])                 # original order
        assert torch.all(packed[i, L:] == 0)                   # zero padding
        assert L >= 1 + int(0.6 * (n - 1))                     # at most ~20% dropped
    same, ln = size_augment_tokens(tok, p=0.0)
    assert same is tok and torch.all(ln == n)


def test_transform_helpers_follow_open_clip():
    img = Image.new("RGB", (50, 40), (200, 10, 10))
    t = build_train_transform(32, scale=(0.5, 1.0))
    v = build_val_transform(32)
    assert t(img).shape == (3, 32, 32) and v(img).shape == (3, 32, 32)
    import open_clip

    ref = open_clip.image_transform(32, is_train=False)
    assert torch.allclose(v(img), ref(img))
    ts = build_train_transform(32, size_augment=0.2, patch_size=8)
    assert isinstance(ts.transforms[-1], SizeAugment)
    w = with_size_augment(v, 0.2, 8)
    assert isinstance(w.transforms[-1], SizeAugment) and w.transforms[:-1] == v.transforms
    assert with_size_augment(v, 0.0) is v
