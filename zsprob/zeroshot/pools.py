"""Per-class prompt pools (CuPL's ``{"class name": ["prompt", ...]}`` files) as a padded prompt bank.

Each pool is matched to the dataset's classes by name and embedded once (cached) into a
:class:`~zsprob.zeroshot.prompts.PromptBank` whose "templates" are slots padded to the longest pool; an absent
slot has infinite uncertainty (ranked last, never kept) and no weight in any strategy.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from zsprob.errors import UserError
from zsprob.zeroshot.prompts import PromptBank, cache_stem, content_key, cut_apart, read_cache, write_cache

POOL_FORMAT = 1


def load_class_prompts(path) -> dict[str, list[str]]:
    """``{"class name": ["prompt", ...]}`` from a JSON file; anything else is one :class:`UserError` line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"class-prompts file not found: {path}")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"class-prompts file {path} is not JSON ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    if not isinstance(doc, dict) or not doc:
        raise UserError(f"class-prompts file {path} must be a JSON object {{\"class name\": [\"prompt\", ...]}}")
    pools = {}
    for name, prompts in doc.items():
        if not isinstance(prompts, list) or not all(isinstance(t, str) for t in prompts):
            raise UserError(f"class-prompts file {path}: the pool of {name!r} must be a list of strings")
        cleaned = [t.strip() for t in prompts]
        if not cleaned or not all(cleaned):
            raise UserError(f"class-prompts file {path}: the pool of {name!r} is empty or has an empty prompt")
        pools[str(name).strip()] = cleaned
    return pools


def match_pools(pools: dict[str, list[str]], classnames, source: str = "class-prompts file") -> list[list[str]]:
    """The pools in the dataset's class order, matched by name; a class without a pool or a pool for no
    class is one line."""
    names = [str(c).strip() for c in classnames]
    missing = [c for c in dict.fromkeys(names) if c not in pools]
    if missing:
        raise UserError(f"{source} has no prompt pool for class {missing[0]!r}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unknown = [c for c in pools if c not in set(names)]
    if unknown:
        raise UserError(f"{source} names classes that are not in the dataset: {', '.join(map(repr, unknown[:3]))}"
                        + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""))
    return [list(pools[c]) for c in names]


def pool_bank_from_embeddings(mu_flat, logvar_flat, classnames, pools, model_id: str = "") -> PromptBank:
    """The bank of per-class pools from [P, D] embeddings of their prompts, class by class (``mu`` /
    ``logvar`` zero in the absent slots)."""
    import torch

    sizes = [len(p) for p in pools]
    C, T, D = len(pools), max(sizes), int(mu_flat.shape[-1])
    mask = torch.zeros(C, T, dtype=torch.bool)
    mu = torch.zeros(C, T, D)
    logvar = None if logvar_flat is None else torch.zeros(C, T, D)
    start = 0
    for c, n in enumerate(sizes):
        mask[c, :n] = True
        mu[c, :n] = mu_flat[start:start + n].float()
        if logvar is not None:
            logvar[c, :n] = logvar_flat[start:start + n].float()
        start += n
    return PromptBank(list(classnames), [f"[pool prompt {t + 1}]" for t in range(T)], mu, logvar, model_id=model_id,
                      mask=mask, pools=[list(p) for p in pools])


def check_pools_survive(tokens, pools: list[list[str]], classnames, tokenizer, source: str) -> None:
    """One line when the tokenizer's context length cuts prompts of two classes to the same tokens (the text
    that told them apart lies past the cut), as :func:`~zsprob.zeroshot.prompts.check_class_names_survive`
    does for templates; prompts that read alike with room to spare are left alone."""
    owner = [c for c, pool in enumerate(pools) for _ in pool]
    texts = [t for pool in pools for t in pool]
    _, group = tokens.unique(dim=0, return_inverse=True)
    first: dict[int, int] = {}
    for i, g in enumerate(group.tolist()):
        j = first.setdefault(g, i)
        if owner[j] == owner[i]:
            continue
        apart = cut_apart(tokenizer, texts[j], texts[i], tokens.shape[1])
        if apart is None:
            return
        if apart:
            raise UserError(f"{source}: {texts[i][:60]!r} ({classnames[owner[i]]!r}) and {texts[j][:60]!r} "
                            f"({classnames[owner[j]]!r}) are cut at the tokenizer's {tokens.shape[1]} tokens to "
                            "the same prompt; shorten them")


def build_pool_bank(model, classnames, class_prompts: dict, *, cache_dir=None, model_id: str | None = None,
                    batch_size: int = 512, device=None, progress: bool = True, precision: str = "fp32",
                    source: str = "class prompts") -> PromptBank:
    """Embed every prompt of every class's pool (``{"class name": [...]}``, named ``source`` in messages)
    once, cached under ``cache_dir``."""
    from zsprob.models.fingerprint import model_fingerprint

    pools = match_pools(class_prompts, classnames, source)
    model_id = model_id or model_fingerprint(model)
    key = content_key({"format": POOL_FORMAT, "model": model_id if precision == "fp32" else f"{model_id}+{precision}",
                       "classes": list(classnames), "pools": pools})
    stem = cache_stem(cache_dir, "poolbank", key)
    cached = read_cache(stem, key)
    if cached is not None:
        bank = pool_bank_from_embeddings(cached[0]["mu"], cached[0].get("logvar"), classnames, pools, model_id)
        bank.from_cache = True
        return bank
    from zsprob.models.encode import encode_texts

    texts = [t for pool in pools for t in pool]
    t0 = time.perf_counter()
    if callable(getattr(model, "tokenizer", None)):
        texts = model.tokenizer(texts)
        check_pools_survive(texts, pools, classnames, model.tokenizer, source)
    mu, logvar = encode_texts(model, texts, batch_size=batch_size, device=device, progress=progress,
                              precision=precision)
    bank = pool_bank_from_embeddings(mu, logvar, classnames, pools, model_id)
    bank.encode_seconds = time.perf_counter() - t0
    write_cache(stem, {"mu": mu, "logvar": logvar}, {"format": POOL_FORMAT, "key": key, "n_prompts": int(mu.shape[0])})
    return bank

