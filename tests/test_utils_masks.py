"""zsprob.utils.masks: the one length mask and masked pooling every text tower and head uses."""
import torch

from zsprob.utils.masks import length_mask, masked_mean, masked_sum


def _reference(x, lengths):
    """Row by row, in float64: the sum and mean over each row's first lengths positions."""
    sums = torch.stack([x[b, : int(n)].double().sum(0) for b, n in enumerate(lengths)])
    return sums, sums / lengths[:, None].double()


def test_length_mask_marks_each_rows_first_positions():
    m = length_mask(torch.tensor([1, 3, 0, 4]), 4)
    assert m.tolist() == [[True, False, False, False], [True, True, True, False],
                          [False, False, False, False], [True, True, True, True]]


def test_masked_sum_and_mean_ignore_the_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 3, generator=g)
    lengths = torch.tensor([1, 7, 3, 5, 2])
    poisoned = x.clone()
    for b, n in enumerate(lengths):
        poisoned[b, int(n):] = 1e6                       # padding must not leak into the pool
    ref_sum, ref_mean = _reference(x, lengths)
    torch.testing.assert_close(masked_sum(poisoned, lengths).double(), ref_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_mean(x, lengths).double(), ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_sum(x, lengths).double(), ref_sum, rtol=1e-6, atol=1e-6)
    assert masked_mean(x.double(), lengths).dtype == torch.float64


def test_the_towers_pool_with_the_shared_helper():
    """The bag-of-words tower's pooling is the helper's, bit for bit (no private copy)."""
    from zsprob.models.bow_text import BagOfWordsText

    tower = BagOfWordsText(embed_dim=8, vocab_size=50, width=16)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0], [5, 6, 0, 0, 0, 0]])
    words, _, lengths = tower.embed(tokens)
    assert lengths.tolist() == [6, 1, 4, 2]
    assert torch.equal(tower(tokens), tower.text_projection(masked_mean(words, lengths)))
