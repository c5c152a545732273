"""Option parsing shared by the zero-shot CLI commands (no torch import: errors stay instant)."""
from __future__ import annotations

from zsprob.errors import UserError
from zsprob.zeroshot.strategy_registry import get_strategy


def parse_k_grid(text: str | None, T: int | None = None):
    """``"1,2,4,8"`` or ``"1-80"`` -> list of ints (``None`` -> all K)."""
    if text is None or str(text).strip() == "":
        return None
    out = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise UserError(f"--k-grid must be comma-separated integers or ranges like 1-80, got {text!r}") from None
    if any(int(a) > int(b) for a, b in (p.strip().split("-", 1) for p in str(text).split(",") if "-" in p)):
        raise UserError(f"--k-grid ranges go from low to high (like 1-80), got {text!r}")
    out = sorted(set(out))
    if not out or out[0] < 1 or (T is not None and out[-1] > T):
        bound = f"the number of templates ({T})" if T is not None else "the number of templates"
        raise UserError(f"--k-grid values must be between 1 and {bound}, got {text!r}")
    if T is not None and out[-1] != T:
        out.append(T)  # 'all' is always a candidate
    return out


def strategy_from_topk(topk: str | None, strategy: str | None):
    """Map ``--topk auto|N|all|oracle`` and ``--strategy`` to (strategy name, K or None).

    ``--strategy`` is checked against the registry; a strategy that needs K takes ``--topk N``."""
    if strategy is not None:
        entry = get_strategy(strategy)
        if not entry.needs_k:
            return strategy, None
        k = int(topk) if topk is not None and str(topk).isdigit() else None
        entry.check_k(k)
        return strategy, k
    t = (topk or "auto").strip().lower()
    if t in ("auto", "all", "oracle"):
        return t, None
    if t.isdigit() and int(t) >= 1:
        return "topk", int(t)
    raise UserError(f"--topk must be auto, all, oracle or a positive number, got {topk!r}")
