"""Prompt templates, class names and the prompt bank (every class x template, embedded once).

zsprob parses and checks template / class-name and selection files, and holds the :class:`PromptBank` (``mu`` /
``logvar`` [C, T, D], ``||sigma^2||_1`` per prompt), embedded class-major in one call by open_clip's text tower
and cached on disk (safetensors) keyed by (model fingerprint, templates, class names).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from zsprob.errors import UserError

BANK_FORMAT = 1
DEFAULT_TEMPLATES = "imagenet_templates.txt"
SINGLE_TEMPLATE = "a photo of a {}."


# ----------------------------------------------------------------------------- text files

def _resolve(path, what: str) -> Path:
    from zsprob.utils.paths import prompts_dir, resolve_resource

    p = resolve_resource(path, prompts_dir())
    if not p.is_file():
        raise UserError(f"{what} not found: {path} (give a text file with one entry per line, "
                        f"or a name inside {prompts_dir()})")
    return p


def _numbered_lines(p: Path, what: str) -> list[tuple[int, str]]:
    """(line number, entry) of every non-empty, non-comment line of a UTF-8 text file."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} is not UTF-8 text: {p}") from None
    lines = [(n, ln.strip()) for n, ln in enumerate(text.splitlines(), 1)]
    return [(n, ln) for n, ln in lines if ln and not ln.startswith("#")]


def _read_lines(p: Path, what: str) -> list[str]:
    return [ln for _, ln in _numbered_lines(p, what)]


def validate_templates(templates: Sequence[str], source: str = "templates") -> list[str]:
    """Every template must contain exactly one ``{}`` placeholder; duplicates are refused."""
    out = [str(t) for t in templates]
    if not out:
        raise UserError(f"{source}: no prompt templates")
    for i, t in enumerate(out):
        if t.count("{}") != 1 or t.replace("{}", "").count("{") or t.replace("{}", "").count("}"):
            raise UserError(f"{source}: template {i + 1} must contain exactly one '{{}}' for the class "
                            f"name: {t!r}")
    dup = sorted({t for t in out if out.count(t) > 1})
    if dup:
        raise UserError(f"{source}: duplicate templates: {dup[:3]}")
    return out


def validate_classnames(classnames: Sequence[str], source: str = "class names") -> list[str]:
    out = [str(c).strip() for c in classnames]
    if not out:
        raise UserError(f"{source}: no class names")
    if any(not c for c in out):
        raise UserError(f"{source}: empty class name")
    # duplicates are allowed: CLIP's ImageNet names repeat ("missile", "sunglasses")
    return out


def load_templates(path=None) -> list[str]:
    """Templates from a text file (one per line, ``{}`` for the class name; ``#`` comments); ``None``: the
    80 CLIP ImageNet templates shipped in ``prompts/``."""
    p = _resolve(path or DEFAULT_TEMPLATES, "prompt template file")
    return validate_templates(_read_lines(p, "prompt template file"), str(p))


def load_classnames(path) -> list[str]:
    """Class names from a text file (one per line, ``#`` comments). A repeated name is refused (two classes
    with one name get the same prompts), except in CLIP's ImageNet list as shipped in ``prompts/``."""
    p = _resolve(path, "class-name file")
    numbered = _numbered_lines(p, "class-name file")
    names = validate_classnames([ln for _, ln in numbered], str(p))
    _refuse_duplicate_names(numbered, p)
    return names


def _refuse_duplicate_names(numbered: list[tuple[int, str]], p: Path) -> None:
    lines_of: dict[str, list[int]] = {}
    for number, name in numbered:
        lines_of.setdefault(name, []).append(number)
    repeated = {name: lines for name, lines in lines_of.items() if len(lines) > 1}
    if not repeated or [name for _, name in numbered] == _shipped_imagenet_names():
        return
    name, lines = next(iter(repeated.items()))
    more = f" ({len(repeated) - 1} more repeated name(s))" if len(repeated) > 1 else ""
    raise UserError(f"class-name file {p}: class name {name!r} appears on lines {', '.join(map(str, lines))}{more}; "
                    "class names must be unique (two classes with one name get the same prompts)")


def _shipped_imagenet_names() -> list[str]:
    from zsprob.utils.paths import prompts_dir

    return _read_lines(prompts_dir() / "imagenet_classnames.txt", "class-name file")


def render(template: str, classname: str) -> str:
    return template.replace("{}", classname)


def prompt_texts(classnames: Sequence[str], templates: Sequence[str]) -> list[str]:
    """All prompts, class-major: index ``c * T + t`` is ``templates[t]`` applied to ``classnames[c]``."""
    return [render(t, c) for c in classnames for t in templates]


# ----------------------------------------------------------------------------- selection files

SELECTION_FORMAT = "zsprob-selection/1"


def check_selection_document(doc, source: str = "selection") -> dict:
    """``doc`` (a parsed selection.json) if it has the shape ``zsprob select-prompts`` writes; anything else
    is one :class:`UserError` line."""
    problem = _selection_problem(doc)
    if problem:
        raise UserError(f"{source} is not a zsprob selection file ({problem}); make one with zsprob select-prompts")
    return doc


def _is_num(x) -> bool:
    import math

    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _selection_problem(doc) -> str:
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    if doc.get("format") != SELECTION_FORMAT:
        return f"format is {doc.get('format')!r}, not {SELECTION_FORMAT!r}"
    if not isinstance(doc.get("strategy"), str):
        return "no strategy name"
    templates, classes = doc.get("templates"), doc.get("classes")
    if not (isinstance(templates, list) and templates and all(isinstance(t, str) for t in templates)):
        return "'templates' must be a non-empty list of strings"
    if not (isinstance(classes, list) and classes):
        return "'classes' must be a non-empty list"
    for key in ("model", "how", "data"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            return f"{key!r} must be an object"
    dims = set()
    for c, entry in enumerate(classes):
        problem = _class_entry_problem(entry, len(templates))
        if problem:
            return f"class {c + 1}: {problem}"
        dims.add(len(entry["mu"]))
    return "" if len(dims) == 1 else f"the class means have different lengths {sorted(dims)}"


def _class_entry_problem(entry, num_templates: int) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return "not an object with a 'name'"
    kept = entry.get("kept")
    if not isinstance(kept, list) or not all(isinstance(k, dict) for k in kept):
        return "'kept' must be a list of objects"
    for k in kept:
        index = k.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_templates:
            return f"template index {index!r} is not in 0..{num_templates - 1}"
        if not _is_num(k.get("weight")) or (k.get("uncertainty") is not None and not _is_num(k["uncertainty"])):
            return f"template {index}: weight / uncertainty must be finite numbers"
    mu, sigma2 = entry.get("mu"), entry.get("sigma2")
    if not (isinstance(mu, list) and mu and all(_is_num(v) for v in mu)):
        return "'mu' must be a non-empty list of finite numbers"
    if sigma2 is not None and not (isinstance(sigma2, list) and len(sigma2) == len(mu)
                                   and all(_is_num(v) and v >= 0 for v in sigma2)):
        return "'sigma2' must be null or a list of non-negative numbers as long as 'mu'"
    k = entry.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        return f"'k' must be null or an integer, got {k!r}"
    return ""


def content_key(payload: dict) -> str:
    """The key a cache entry is kept under: sha256 of ``payload`` as sorted JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- the bank

@dataclass
class PromptBank:
    """Embeddings of every (class, template) prompt: ``mu`` [C, T, D] float32 text means as the model
    returns them, ``logvar`` [C, T, D] (log sigma^2) or ``None`` for a deterministic model. A bank of
    per-class pools (:mod:`zsprob.zeroshot.pools`) holds class c's prompts ``pools[c]`` in its "template"
    slots, padded to the longest pool, with ``mask`` [C, T] of the slots that exist."""

    classnames: list[str]
    templates: list[str]
    mu: "object"
    logvar: "object | None" = None
    model_id: str = ""
    encode_seconds: float = 0.0
    from_cache: bool = False
    mask: "object | None" = None
    pools: list | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classnames)

    @property
    def num_templates(self) -> int:
        return len(self.templates)

    @property
    def deterministic(self) -> bool:
        return self.logvar is None

    @property
    def mu_normed(self):
        import torch.nn.functional as F

        return F.normalize(self.mu.float(), dim=-1)

    @property
    def var(self):
        return None if self.logvar is None else self.logvar.float().exp()

    @property
    def uncertainty(self):
        """``||sigma^2||_1`` per prompt, [C, T] (``inf`` in absent pool slots, so they rank last); None for
        deterministic models."""
        if self.logvar is None:
            return None
        unc = self.logvar.float().exp().sum(-1)
        return unc if self.mask is None else unc.masked_fill(~self.mask, float("inf"))

    @classmethod
    def from_embeddings(cls, mu, logvar, classnames, templates, model_id: str = "") -> "PromptBank":
        """A bank from precomputed [C*T, D] (class-major) or [C, T, D] tensors."""
        C, T = len(classnames), len(templates)
        mu = mu.float().reshape(C, T, -1)
        logvar = None if logvar is None else logvar.float().reshape(C, T, -1)
        return cls(list(classnames), list(templates), mu, logvar, model_id=model_id)


def cache_stem(cache_dir, kind: str, key: str) -> Path | None:
    """Where the cache entry ``key`` of ``kind`` lives under ``cache_dir`` (None: no cache)."""
    return None if cache_dir is None else Path(cache_dir) / f"{kind}-{key[:24]}"


def read_cache(stem: Path | None, key: str) -> tuple[dict, dict] | None:
    """``(tensors, meta)`` of the cache entry ``stem`` written under ``key``; None when there is no cache
    or the entry is absent, torn or another key's (a miss, not an error)."""
    if stem is None:
        return None
    try:
        from safetensors.torch import load_file

        meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
        return (load_file(str(stem.with_suffix(".safetensors"))), meta) if meta.get("key") == key else None
    except Exception:
        return None


def write_cache(stem: Path | None, tensors: dict, meta: dict) -> None:
    """Write ``<stem>.safetensors`` (``tensors``; ``None`` ones left out) and ``<stem>.json`` (``meta``),
    atomically; nothing without a cache."""
    from safetensors.torch import save_file

    from zsprob.utils.io import atomic_write, atomic_write_json

    if stem is None:
        return
    tensors = {name: t.contiguous() for name, t in tensors.items() if t is not None}
    atomic_write(stem.with_suffix(".safetensors"), lambda tmp: save_file(tensors, tmp))
    atomic_write_json(stem.with_suffix(".json"), meta)


def cut_apart(tokenizer, a: str, b: str, length: int) -> bool | None:
    """Whether texts that read alike at ``length`` tokens differ when tokenised with room to spare (the cut hid
    what told them apart); None for a tokenizer without the keyword, which cannot tell a cut from a shared
    reading."""
    try:
        roomy = tokenizer([a, b], context_length=max(4096, 4 * length))
    except TypeError:
        return None
    return bool((roomy[0] != roomy[1]).any())


def check_class_names_survive(tokens, classnames: Sequence[str], templates: Sequence[str], tokenizer) -> None:
    """One UserError line when the tokenizer's context length cuts a template before the class names differ
    (two classes would get one prompt). ``tokens``: [C * T, L], class-major, from ``tokenizer``. Rows that
    agree are tokenised again with room to spare: only those that then differ were cut (names that repeat
    or read alike are left alone)."""
    C, T = len(classnames), len(templates)
    if C < 2:
        return
    grid = tokens.reshape(C, T, -1)
    for t in range(T):
        rows = grid[:, t]
        _, group, counts = rows.unique(dim=0, return_inverse=True, return_counts=True)
        for g in (counts > 1).nonzero().flatten().tolist():
            members = (group == g).nonzero().flatten().tolist()
            names = list(dict.fromkeys(classnames[i] for i in members))
            if len(names) < 2:
                continue
            apart = cut_apart(tokenizer, *(render(templates[t], name) for name in names[:2]), rows.shape[1])
            if apart is None:
                return
            if not apart:
                continue
            raise UserError(f"template {t + 1} ({templates[t][:60]!r}) is cut at the tokenizer's {rows.shape[1]} "
                            f"tokens before the class names differ: {names[0]!r} and {names[1]!r} get the same "
                            "prompt; shorten the template or the class names")


def build_prompt_bank(model, classnames: Sequence[str], templates: Sequence[str] | None = None, *,
                      cache_dir=None, model_id: str | None = None, batch_size: int = 512,
                      device=None, progress: bool = True, precision: str = "fp32") -> PromptBank:
    """Embed every class x template prompt once (batched; default templates: the 80 CLIP ones), cached under
    ``cache_dir`` by (``model_id``, default the model's fingerprint; precision; templates; class names)."""
    import time

    from zsprob.models.encode import encode_texts

    classnames = validate_classnames(classnames)
    templates = validate_templates(templates if templates is not None else load_templates())
    if model_id is None:
        from zsprob.models.fingerprint import model_fingerprint
        model_id = model_fingerprint(model)
    key = content_key({"format": BANK_FORMAT, "model": model_id if precision == "fp32" else f"{model_id}+{precision}",
                       "templates": templates, "classes": classnames})
    stem = cache_stem(cache_dir, "promptbank", key)
    cached = read_cache(stem, key)
    if cached is not None and cached[1].get("format") == BANK_FORMAT:
        tensors, meta = cached
        return PromptBank(list(meta["classnames"]), list(meta["templates"]), tensors["mu"], tensors.get("logvar"),
                          model_id=meta.get("model_id", ""), encode_seconds=float(meta.get("encode_seconds", 0.0)),
                          from_cache=True)
    texts = prompt_texts(classnames, templates)
    t0 = time.perf_counter()
    if callable(getattr(model, "tokenizer", None)):
        # Tokenise once, sort by length (longest first) so every batch is cut to its own longest
        # prompt by the text tower's exact causal truncation, then restore the class-major order.
        import torch

        tokens = model.tokenizer(texts)
        check_class_names_survive(tokens, classnames, templates, model.tokenizer)
        order = torch.argsort((tokens != 0).sum(1), descending=True, stable=True)
        mu_s, lv_s = encode_texts(model, tokens[order], batch_size=batch_size, device=device, progress=progress,
                                  precision=precision)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order))
        mu, logvar = mu_s[inv], (None if lv_s is None else lv_s[inv])
    else:
        mu, logvar = encode_texts(model, texts, batch_size=batch_size, device=device, progress=progress,
                                  precision=precision)
    seconds = time.perf_counter() - t0
    bank = PromptBank.from_embeddings(mu, logvar, classnames, templates, model_id=model_id)
    bank.encode_seconds = seconds
    write_cache(stem, {"mu": bank.mu, "logvar": bank.logvar}, {
        "format": BANK_FORMAT, "key": key, "model_id": model_id, "classnames": bank.classnames,
        "templates": bank.templates, "deterministic": bank.deterministic, "shape": list(bank.mu.shape),
        "encode_seconds": seconds})
    return bank
