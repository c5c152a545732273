"""zsprob.models.hf_tokenizer on a WordPiece tokenizer trained here with the `tokenizers` package."""
from __future__ import annotations

import pytest

from zsprob.errors import UserError
from zsprob.models.hf_tokenizer import find_tokenizer_dir, load_hf_tokenizer

SENTENCES = ["a photo of a red car", "a photo of an oak tree", "a blurry photo of the dog",
             "a drawing of many cats", "the car is red and the tree is green"] * 4


def make_tokenizer_dir(path):
    """Train a tiny WordPiece model and save it as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]",
                                                                                                  "[EOS]"]))
    tok.post_processor = processors.TemplateProcessing(single="$A [EOS]",
                                                       special_tokens=[("[EOS]", tok.token_to_id("[EOS]"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            eos_token="[EOS]").save_pretrained(str(path))
    return path


def test_round_trip_with_prolip_cleaning_and_context(tmp_path):
    directory = make_tokenizer_dir(tmp_path / "weights" / "tokenizer")
    (tmp_path / "weights" / "open_clip_model.safetensors").write_bytes(b"")
    assert find_tokenizer_dir(tmp_path / "weights" / "open_clip_model.safetensors") == directory
    tok = load_hf_tokenizer(directory)
    ids = tok(["A Photo of a RED car!!", "the   oak tree, green."])
    assert tuple(ids.shape) == (2, 64) and ids.dtype.is_floating_point is False
    hf = tok.tokenizer
    # canonicalize: lower case, punctuation gone, whitespace collapsed; then [EOS] and padding to 64
    texts = hf.batch_decode(ids.tolist(), skip_special_tokens=True)
    assert texts == ["a photo of a red car", "the oak tree green"]
    eos, pad = hf.eos_token_id, hf.pad_token_id
    first = ids[0].tolist()
    assert first[6] == eos and set(first[7:]) == {pad} and pad not in first[:6]
    assert tok(["word " * 100]).shape == (1, 64)


def test_missing_or_empty_tokenizer_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer directory"):
        load_hf_tokenizer(tmp_path / "nope")
    (tmp_path / "w").mkdir()
    with pytest.raises(UserError, match="pass --tokenizer DIR"):
        find_tokenizer_dir(tmp_path / "w")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load the Hugging Face tokenizer"):
        load_hf_tokenizer(tmp_path / "broken")
