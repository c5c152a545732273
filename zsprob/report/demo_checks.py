"""The demo report's checks: yes / no answers computed from the report's own figures (report.json).

Each check returns whether it holds and one line of evidence (the figures, their standard error and the rule);
the list is in docs/demo.md. A claim whose figures the report lacks is "no" (not measured).
"""
from __future__ import annotations

import math
from typing import Any

BASELINE = "infonce"
MIN_SPEARMAN = 0.3
N_SE = 2.0

Check = tuple[bool, str]


def binomial_se(percent: float, n: int) -> float:
    """Standard error, in percent, of a proportion given in percent over ``n`` trials."""
    p = min(max(percent / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1 - p) / n)


def decile_sizes(n_queries: int, n_bins: int) -> list[int]:
    """Sizes of ``n_bins`` equal-count bins of ``n_queries`` items (numpy.array_split's rule)."""
    base, extra = divmod(int(n_queries), int(n_bins))
    return [base + (1 if b < extra else 0) for b in range(n_bins)]


def dig(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...`` of nested JSON dicts; None where a level is missing, null or empty."""
    for key in keys:
        d = (d or {}).get(key)
    return d


def _not_measured(what: str) -> Check:
    return False, f"not measured ({what} missing from the report)"


# ----------------------------------------------------------------------------- claims
def tracks_ambiguity(validity: dict | None) -> Check:
    """Spearman(caption ||sigma^2||_1, exact ambiguity) > 0.3 with its bootstrap 95% interval above 0."""
    overall = dig(validity, "text_ambiguity", "overall") or {}
    rho, lo, hi = overall.get("rho"), overall.get("lo"), overall.get("hi")
    if rho is None or lo is None or not all(math.isfinite(v) for v in (rho, lo, hi)):
        return _not_measured("Spearman(caption sigma^2, ambiguity) with its interval")
    ok = rho > MIN_SPEARMAN and lo > 0
    return ok, (f"Spearman {rho:+.3f} [{lo:+.3f}, {hi:+.3f}] (bootstrap 95%, n {overall.get('n')}); "
                f"rule: > {MIN_SPEARMAN:+.2f} and interval above 0")


def inclusion_above_chance(validity: dict | None) -> Check:
    """The general caption of an exact inclusion pair has the larger ||sigma^2||_1: accuracy - 2 SE > 50%."""
    sigma = dig(validity, "inclusion", "sigma") or {}
    acc, se, n = sigma.get("accuracy"), sigma.get("se"), sigma.get("n")
    if acc is None or se is None or not n or not math.isfinite(acc):
        return _not_measured("inclusion accuracy of the sigma comparison")
    ok = acc - N_SE * se > 0.5
    return ok, (f"general caption more uncertain in {100 * acc:.1f} +- {100 * se:.1f}% of {n} exact inclusion "
                f"pairs (binomial SE); rule: accuracy - 2 SE > 50%")


def r1_falls_with_uncertainty(r1: list | None, n_queries: int | None) -> Check:
    """``r1``: R@1 (percent) per caption uncertainty decile, most certain first, falls: Spearman(decile, R@1) < 0
    and first - last > 2 SE (two binomial SEs, the bins' sizes those of equal-count bins of the queries)."""
    from scipy.stats import spearmanr

    r1 = list(r1 or [])
    if len(r1) < 2 or not n_queries or n_queries < len(r1) or any(v is None for v in r1):
        return _not_measured("R@1 per caption uncertainty decile and the number of caption queries")
    rho = float(spearmanr(range(len(r1)), r1).statistic) if len(set(r1)) > 1 else float("nan")
    sizes = decile_sizes(n_queries, len(r1))
    first, last = r1[0], r1[-1]
    se = math.sqrt(binomial_se(first, sizes[0]) ** 2 + binomial_se(last, sizes[-1]) ** 2)
    ok = bool(math.isfinite(rho) and rho < 0) and first - last > N_SE * se
    return ok, (f"t2i R@1 {first:.1f}% (most certain decile, n {sizes[0]}) -> {last:.1f}% (least certain, "
                f"n {sizes[-1]}): {first - last:+.1f} +- {se:.1f} (SE); Spearman(decile, R@1) {rho:+.2f}; "
                f"rule: Spearman < 0 and difference > 2 SE")


def not_below(model: str, value: float | None, base: str, base_value: float | None, n: int | None) -> Check:
    """``value`` - ``base_value`` > -2 SE, the two binomial SEs combined as if independent (the files keep no
    per-query hits to pair them; the paired SE would be smaller, so the rule leans towards yes)."""
    if value is None or base_value is None or not n:
        return _not_measured(f"{model} / {base} figure or its number of queries")
    diff = value - base_value
    se = math.sqrt(binomial_se(value, n) ** 2 + binomial_se(base_value, n) ** 2)
    return diff > -N_SE * se, (f"{model} {value:.2f}% vs {base} {base_value:.2f}%: {diff:+.2f} +- {se:.2f} "
                               f"(SE of the difference, n {n}, unpaired); rule: > -2 SE")


def _zeroshot_all(z: dict | None) -> float | None:
    return next((row["top1"] for row in (z or {}).get("rows", []) if row.get("name") == "all"), None)


def claim_checks(r: dict) -> dict[str, Check]:
    """The claims about each model with sigma (its retrieval figures carry an ``uncertainty`` section)."""
    out: dict[str, Check] = {}
    base_rt = r["retrieval"].get(BASELINE)
    for m, rt in r["retrieval"].items():
        if not rt or not rt.get("uncertainty"):
            continue
        validity = rt.get("uncertainty_validity")
        out[f"uncertainty_{m}_tracks_ambiguity"] = tracks_ambiguity(validity)
        out[f"uncertainty_{m}_inclusion_above_chance"] = inclusion_above_chance(validity)
        out[f"uncertainty_{m}_r1_falls_with_caption_uncertainty"] = r1_falls_with_uncertainty(
            dig(rt, "uncertainty", "deciles", "caption queries", "r1"), dig(rt, "t2i", "n_queries"))
        if base_rt:
            for d in ("i2t", "t2i"):
                out[f"baseline_{m}_not_below_{BASELINE}_{d}_r1"] = not_below(
                    m, dig(rt, d, "r@1"), BASELINE, dig(base_rt, d, "r@1"), dig(rt, d, "n_queries"))
        zs, base_zs = r["zeroshot"].get(m), r["zeroshot"].get(BASELINE)
        if base_zs:
            out[f"baseline_{m}_not_below_{BASELINE}_zeroshot"] = not_below(
                m, _zeroshot_all(zs), BASELINE, _zeroshot_all(base_zs), dig(zs, "n_eval"))
    return out


# ----------------------------------------------------------------------------- sanity
def _zeroshot_sanity(m: str, z: dict | None) -> dict[str, Check]:
    out: dict[str, Check] = {}
    if z and z.get("chance_top1") is not None:
        best = max((row["top1"] for row in z["rows"] if not row["uses_eval_labels"] and row["top1"] is not None),
                   default=None)
        shown = "-" if best is None else f"{best:.1f}"
        out[f"zeroshot_{m}_above_chance"] = (best is not None and best > 2 * z["chance_top1"],
                                             f"best label-free top-1 {shown}% vs chance {z['chance_top1']:.1f}%; "
                                             f"rule: > 2x chance")
    sep = dig(z, "class_separation") or {}
    if sep.get("mean_pairwise_cosine") is not None:
        out[f"zeroshot_{m}_class_names_separated"] = (not sep["collapsed"], f"mean pairwise cosine of the class "
                                                      f"vectors {sep['mean_pairwise_cosine']:.3f}")
    return out


def _training_sanity(m: str, t: dict) -> dict[str, Check]:
    out: dict[str, Check] = {}
    if t.get("loss_start") is not None and t.get("loss_end") is not None:
        out[f"training_{m}_loss_decreased"] = (t["loss_end"] < t["loss_start"],
                                               f"loss {t['loss_start']:.4f} -> {t['loss_end']:.4f}")
    if t.get("base_rate_loss") is not None and t.get("match_loss_end") is not None:
        out[f"training_{m}_beats_base_rate"] = (t["match_loss_end"] < 0.95 * t["base_rate_loss"],
                                                f"match loss {t['match_loss_end']:.4f} vs base rate "
                                                f"{t['base_rate_loss']:.4f}; rule: < 0.95x")
    return out


def sanity_checks(r: dict) -> dict[str, Check]:
    """The models trained and are well above chance."""
    out: dict[str, Check] = {}
    for m, z in r["zeroshot"].items():
        out.update(_zeroshot_sanity(m, z))
    for m, rt in r["retrieval"].items():
        if rt and rt.get("i2t") and rt.get("chance_r1_i2t") is not None:
            out[f"retrieval_{m}_above_chance"] = (
                rt["i2t"]["r@1"] > 3 * rt["chance_r1_i2t"] and rt["t2i"]["r@1"] > 3 * rt["chance_r1_t2i"],
                f"R@1 i2t {rt['i2t']['r@1']:.1f}% / t2i {rt['t2i']['r@1']:.1f}% vs chance "
                f"{rt['chance_r1_i2t']:.2f}% / {rt['chance_r1_t2i']:.2f}%; rule: > 3x chance")
    for m, t in r["training"].items():
        out.update(_training_sanity(m, t))
    return out


def run_checks(r: dict) -> tuple[dict[str, bool], dict[str, str]]:
    """``(checks, evidence)``: name -> yes / no, and name -> the line of figures it was decided on."""
    found = {**sanity_checks(r), **claim_checks(r)}
    return {k: bool(ok) for k, (ok, _) in found.items()}, {k: why for k, (_, why) in found.items()}


__all__ = ["BASELINE", "MIN_SPEARMAN", "binomial_se", "claim_checks", "decile_sizes", "dig", "inclusion_above_chance",
           "not_below", "r1_falls_with_uncertainty", "run_checks", "sanity_checks", "tracks_ambiguity"]
