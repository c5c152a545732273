"""zsprob.data.text_augment: text SizeAugment as naver-ai/pcmepp applies it to COCO captions
(20% of caption tokens selected; 50% masked, 10% randomised, 40% deleted), on real open_clip tokens."""
from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch

from zsprob.data.text_augment import CLIP_MASK_TOKEN, TextSizeAugment, mask_token_of, size_augment_tokens
from zsprob.errors import UserError

CAPTIONS = ["a large red striped star next to a small blue circle",
            "a shape", "two green squares and a yellow triangle on a dark background",
            "a photo of many small objects", "a blurry drawing of a purple ellipse"]


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer("ViT-B-16")


@pytest.fixture(scope="module")
def batch(tokenizer):
    return tokenizer(CAPTIONS * 400)  # 2000 captions [2000, 77], padded with 0


def _content(row: torch.Tensor) -> list[int]:
    """The caption's tokens between start and end."""
    ids = row[row != 0].tolist()
    return ids[1:-1]


def test_mask_token_is_clips_M(tokenizer):
    assert mask_token_of(tokenizer) == (tokenizer.encoder["M"], 49408) == (CLIP_MASK_TOKEN, 49408)
    assert tokenizer.decode([CLIP_MASK_TOKEN]).strip() == "M"  # the BPE token of the single character "M"


def test_shares_match_official_rates(batch):
    out, counts = size_augment_tokens(batch, generator=torch.Generator().manual_seed(0), return_counts=True)
    n = counts["candidates"]
    assert n == sum(len(_content(r)) for r in batch)
    for key, rate in (("masked", 0.2 * 0.5), ("random", 0.2 * 0.1), ("deleted", 0.2 * 0.4)):
        assert abs(counts[key] / n - rate) < 4 * np.sqrt(rate * (1 - rate) / n), key
    # the output agrees with the counts: each row shorter by its deletions, masks visible
    deleted = sum(len(_content(a)) - len(_content(b)) for a, b in zip(batch, out))
    assert deleted == counts["deleted"]
    masks_added = int((out == CLIP_MASK_TOKEN).sum() - (batch == CLIP_MASK_TOKEN).sum())
    assert masks_added == counts["masked"]


def test_start_end_padding_untouched_and_order_kept(batch, tokenizer):
    out = size_augment_tokens(batch, share=0.9, masking=0.3, erasing=0.3, generator=torch.Generator().manual_seed(1))
    sot, eot = tokenizer.sot_token_id, tokenizer.eot_token_id
    for a, b in zip(batch, out):
        ids = b[b != 0].tolist()
        assert ids[0] == sot and ids[-1] == eot and eot not in ids[1:-1] and sot not in ids[1:-1]
        assert (b[len(ids):] == 0).all()  # padded with 0 after the end token, no holes
        assert len(ids) <= int((a != 0).sum())
        assert all(0 < t < 49406 for t in ids[1:-1])
    # share 0: the batch comes back unchanged
    assert torch.equal(size_augment_tokens(batch, share=0.0, generator=torch.Generator().manual_seed(1)), batch)


def test_deletion_only_keeps_a_subsequence(tokenizer):
    tokens = tokenizer(CAPTIONS)
    out = size_augment_tokens(tokens, share=0.5, masking=0.0, erasing=0.0, generator=torch.Generator().manual_seed(2))
    for a, b in zip(tokens, out):
        kept, source = _content(b), iter(_content(a))
        assert all(t in source for t in kept)  # an ordered subsequence: deletion shifts the tail left


def test_deterministic_per_seed(batch):
    a = size_augment_tokens(batch, generator=torch.Generator().manual_seed(3))
    b = size_augment_tokens(batch, generator=torch.Generator().manual_seed(3))
    c = size_augment_tokens(batch, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_values_are_user_errors(tokenizer, batch):
    with pytest.raises(UserError, match="masking \\+ erasing must be <= 1"):
        size_augment_tokens(batch[:2], masking=0.7, erasing=0.5)
    with pytest.raises(UserError, match="masking \\+ erasing must be <= 1"):
        TextSizeAugment(0.2, 0.7, 0.5, tokenizer)
    # each share is refused where the config enters (the schema)
    from zsprob.train.defaults import resolve_config
    for key, value in (("text_size_augment", 1.5), ("text_size_augment", 2.0), ("text_size_augment_masking", -0.1)):
        with pytest.raises(UserError, match=f"data.{key} must be"):
            resolve_config({"data": {key: value}})
    with pytest.raises(UserError):
        size_augment_tokens(batch[0])
