"""Hugging Face tokenizers from a local directory (ProLIP's SigLIP tokenizer), never from the hub.

zsprob finds the directory and keeps the network out; ``transformers`` reads the files and open_clip's
``HFTokenizer`` cleans the text (ProLIP's ``canonicalize``) and pads / truncates.
"""
from __future__ import annotations

import os
from pathlib import Path

from zsprob.errors import UserError
from zsprob.utils.checks import TOKENIZER_FILES, is_tokenizer_dir

PROLIP_CONTEXT_LENGTH = 64
PROLIP_TEXT_CLEANING = "canonicalize"


def find_tokenizer_dir(weights: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None) -> Path:
    """The tokenizer directory: ``tokenizer`` if given, else ``tokenizer/`` beside (or inside) the weights."""
    if tokenizer is not None:
        tokenizer = Path(tokenizer).expanduser()
        if not is_tokenizer_dir(tokenizer):
            raise UserError(f"tokenizer directory {tokenizer} not found or holds none of {', '.join(TOKENIZER_FILES)}")
        return tokenizer
    if weights is None:
        raise UserError("no tokenizer: pass --tokenizer DIR (a saved Hugging Face tokenizer directory)")
    weights = Path(weights).expanduser()
    base = weights if weights.is_dir() else weights.parent
    for candidate in (base / "tokenizer", base):
        if is_tokenizer_dir(candidate):
            return candidate
    raise UserError(f"no Hugging Face tokenizer next to {weights} (looked for {base / 'tokenizer'} and {base}); "
                    "pass --tokenizer DIR, e.g. the tokenizer files of the model's hub page saved locally")


def load_hf_tokenizer(directory: str | os.PathLike, context_length: int = PROLIP_CONTEXT_LENGTH,
                      clean: str = PROLIP_TEXT_CLEANING):
    """open_clip ``HFTokenizer`` over a local directory: ``tok(texts) -> LongTensor [N, context_length]``."""
    from open_clip.tokenizer import HFTokenizer

    directory = find_tokenizer_dir(tokenizer=directory)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tok = HFTokenizer(str(directory), context_length=int(context_length), clean=clean, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a malformed directory is the user's
        raise UserError(f"cannot load the Hugging Face tokenizer in {directory}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if tok.tokenizer.pad_token_id is None:
        raise UserError(f"tokenizer in {directory} has no pad token (tokenizer_config.json / special_tokens_map.json)")
    tok.directory = str(directory)
    return tok
