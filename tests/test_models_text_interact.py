"""The bag-of-words text tower's word mixers (text_cfg ``mixer``): template and class words interact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zsprob import UserError
from zsprob.models import create_model, load, save
from zsprob.models.bow_text import BagOfWordsText
from zsprob.models.word_mixer import BIGRAM_PRIME, BigramMixer, PooledWordMLP, WordTransformer

MIXERS = ("mlp", "transformer", "bigram")
# token ids: 1 = start, 2 = end; "templates" are words 10-12 / 20-22, "classes" words 30 / 31
TEMPLATES = ([10, 11, 12], [20, 21, 22])
CLASSES = (30, 31)


def _randomise_(module: torch.nn.Module, seed: int = 0) -> None:
    """Give the zero-initialised residual outputs random weights (a trained tower's are not zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 1 and not p.abs().gt(0).any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _tower(mixer: str, seed: int = 0, randomise: bool = True) -> BagOfWordsText:
    torch.manual_seed(seed)
    t = BagOfWordsText(16, vocab_size=40, width=8, context_length=8, mixer=mixer, mixer_heads=2, mixer_buckets=97)
    if randomise and t.mixer is not None:
        _randomise_(t.mixer, seed)
    return t.eval()


def _prompt(template, cls) -> list[int]:
    return [1, *template, cls, 2, 0, 0]


def _template_shift(t: BagOfWordsText) -> torch.Tensor:
    """[classes, D]: embedding(template 2 + class) - embedding(template 1 + class), per class."""
    tok = torch.tensor([_prompt(tp, c) for c in CLASSES for tp in TEMPLATES])
    with torch.no_grad():
        out = t(tok).view(len(CLASSES), len(TEMPLATES), -1)
    return out[:, 1] - out[:, 0]


def test_bag_is_additive_and_mixers_are_not():
    # the bag: changing the template moves every class by one shared vector
    shift = _template_shift(_tower("none"))
    assert torch.allclose(shift[0], shift[1], atol=1e-6)
    for mixer in MIXERS:
        shift = _template_shift(_tower(mixer))
        gap = (shift[0] - shift[1]).norm() / shift.norm(dim=-1).mean()
        assert gap > 0.05, (mixer, float(gap))  # the template moves each class differently


@pytest.mark.parametrize("mixer", MIXERS)
def test_zero_init_starts_as_the_bag(mixer):
    """Fresh mixers add nothing but the transformer's small positions: the bag's output, nearly."""
    bag, mixed = _tower("none", randomise=False), _tower(mixer, randomise=False)
    tok = torch.tensor([_prompt(TEMPLATES[0], CLASSES[0]), _prompt(TEMPLATES[1], CLASSES[1])])
    with torch.no_grad():
        if mixer in ("mlp", "bigram"):
            assert torch.equal(bag(tok), mixed(tok))
        else:
            assert torch.allclose(bag(tok), mixed(tok), atol=0.05)


def test_mlp_mixer_matches_a_float64_hand_computation():
    t = _tower("mlp").double()
    tok = torch.tensor([[1, 10, 11, 30, 2, 0, 0, 0], [1, 31, 2, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        out = t(tok)
        emb = t.token_embedding.weight
        mx = t.mixer
        for i, n in enumerate((5, 3)):
            m = emb[tok[i, :n]].mean(0)
            h = mx.fc2(F.gelu(mx.fc1(F.layer_norm(m, (8,), mx.ln.weight, mx.ln.bias))))
            assert torch.allclose(out[i], t.text_projection(m + h), atol=1e-12, rtol=0)


def test_bigram_mixer_matches_a_float64_hand_computation():
    """pooled = (sum of the caption's word embeddings + sum of its bigrams' rows) / length, each bigram
    (a, b) at row (a * BIGRAM_PRIME + b) mod buckets; the last token starts no bigram, padding none."""
    t = _tower("bigram").double()
    tok = torch.tensor([[1, 10, 11, 30, 2, 0, 0, 0], [1, 31, 2, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        out = t(tok)
        emb, table = t.token_embedding.weight, t.mixer.bigram.weight
        for i, n in enumerate((5, 3, 2)):
            ids = tok[i, :n].tolist()
            total = emb[ids].sum(0) + sum(table[(a * BIGRAM_PRIME + b) % 97] for a, b in zip(ids[:-1], ids[1:]))
            assert torch.allclose(out[i], t.text_projection(total / n), atol=1e-12, rtol=0)


def test_bigram_mixer_unseen_pairs_stay_zero_and_only_seen_rows_learn():
    t = _tower("bigram", randomise=False).train()
    tok = torch.tensor([[1, 10, 30, 2, 0, 0, 0, 0]])
    t(tok).sum().backward()
    rows = t.mixer.bigram_ids(tok)[0, :3]                       # (1, 10), (10, 30), (30, 2)
    grad = t.mixer.bigram.weight.grad
    assert grad[rows].abs().sum(1).gt(0).all()
    others = torch.ones(97, dtype=torch.bool)
    others[rows] = False
    assert not grad[others].any()                               # padding pairs and unseen pairs: no gradient


@pytest.mark.parametrize("mixer", MIXERS)
def test_shapes_dtypes_padding_and_gradients(mixer):
    t = _tower(mixer)
    tok = torch.tensor([_prompt(TEMPLATES[0], CLASSES[0]), [1, 30, 2, 0, 0, 0, 0, 0]])
    out = t(tok)
    assert out.shape == (2, 16) and out.dtype == torch.float32
    assert t.double()(tok).dtype == torch.float64
    t.float()
    with torch.no_grad():  # padding is neither read nor attended to: trailing padding changes nothing
        assert torch.allclose(t(tok[:, :6]), t(tok), atol=1e-6)
    t.train()
    t(tok).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in t.mixer.parameters())


def test_transformer_and_bigram_read_word_order_and_the_mlp_does_not():
    ab, ba = [[1, 10, 30, 2, 0, 0, 0, 0]], [[1, 30, 10, 2, 0, 0, 0, 0]]
    with torch.no_grad():
        tr, mlp, bi = _tower("transformer"), _tower("mlp"), _tower("bigram")
        assert not torch.allclose(tr(torch.tensor(ab)), tr(torch.tensor(ba)), atol=1e-4)
        assert not torch.allclose(bi(torch.tensor(ab)), bi(torch.tensor(ba)), atol=1e-4)
        assert torch.allclose(mlp(torch.tensor(ab)), mlp(torch.tensor(ba)), atol=1e-6)


def test_default_tower_is_the_plain_bag():
    """No key, or mixer "none": the same parameters (drawn in the same order), the same outputs."""
    torch.manual_seed(3)
    plain = BagOfWordsText(16, vocab_size=40, width=8, context_length=8)
    torch.manual_seed(3)
    none = BagOfWordsText(16, vocab_size=40, width=8, context_length=8, mixer="none")
    assert plain.mixer is None
    assert list(plain.state_dict()) == list(none.state_dict()) == ["token_embedding.weight", "text_projection.weight"]
    for a, b in zip(plain.state_dict().values(), none.state_dict().values()):
        assert torch.equal(a, b)
    m0 = create_model("zsprob-tiny-bow", seed=0, sigma_head="unc")
    m1 = create_model("zsprob-tiny-bow", seed=0, sigma_head="unc", open_clip_cfg={"text_cfg": {"mixer": "none"}})
    assert list(m0.state_dict()) == list(m1.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
    assert not any("mixer" in k for k in m0.state_dict())


@pytest.mark.parametrize("mixer", MIXERS)
def test_prob_model_with_mixer_round_trips(tmp_path, mixer):
    m = create_model("zsprob-tiny-bow", seed=0, sigma_head="unc", sigma_detach=True,
                     open_clip_cfg={"text_cfg": {"mixer": mixer}})
    assert isinstance(m.clip.text.mixer, {"mlp": PooledWordMLP, "transformer": WordTransformer,
                                          "bigram": BigramMixer}[mixer])
    _randomise_(m.clip.text.mixer, 1)
    info = m.param_info()
    assert all(info[k]["tower"] == "text" for k in info if ".mixer." in k)
    save(m, tmp_path / "ck")
    r = load(tmp_path / "ck").eval()
    assert r.config["open_clip_cfg"]["text_cfg"]["mixer"] == mixer
    m.eval()
    tok = m.tokenizer(["a photo of a star.", "a sketch of the circle.", "x"])
    with torch.no_grad():
        for a, b in zip(m.encode_text(tok), r.encode_text(tok)):
            assert a.shape == (3, 64) and a.dtype == torch.float32 and torch.equal(a, b)


def test_bad_mixer_options_are_one_line_errors():
    with pytest.raises(UserError, match="mixer must be one of"):
        create_model("zsprob-tiny-bow", open_clip_cfg={"text_cfg": {"mixer": "gru"}})
    with pytest.raises(UserError, match="mixer_buckets"):
        create_model("zsprob-tiny-bow", open_clip_cfg={"text_cfg": {"mixer": "bigram", "mixer_buckets": 0}})
    with pytest.raises(UserError, match="divisible"):
        create_model("zsprob-tiny-bow", open_clip_cfg={"text_cfg": {"mixer": "transformer", "mixer_heads": 3}})
