"""Paired comparison of two classifiers scored on the same images: difference, bootstrap CI, McNemar.

Everything depends only on the discordant counts ``n10`` (the strategy right, the reference wrong), ``n01``
(the reverse) and N; the formulas: docs/zeroshot.md ("Paired statistics").
"""
from __future__ import annotations

import math
import statistics

Z_975 = 1.959963984540054      # standard normal quantile at 0.975 (alpha = 0.05, two-sided)
Z_80 = 0.8416212335729143      # at 0.80 (power 80%)
BOOTSTRAP_SAMPLES = 10000
BOOTSTRAP_SEED = 0


def mcnemar_exact(n10: int, n01: int) -> float:
    """Exact two-sided McNemar p-value: scipy's binomial test of n10 successes in n10 + n01 trials at 1/2
    (1.0 without a discordant image)."""
    from scipy.stats import binomtest

    n10, n01 = int(n10), int(n01)
    if n10 < 0 or n01 < 0:
        raise ValueError("discordant counts must be non-negative")
    if n10 + n01 == 0:
        return 1.0
    return float(binomtest(n10, n10 + n01, 0.5).pvalue)


def bootstrap_ci(n10: int, n01: int, n: int, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> list[float]:
    """Percentile interval of 100 (n10* - n01*) / N over image resamples (see the module docstring)."""
    import numpy as np

    if n <= 0:
        raise ValueError("no images")
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, [n10 / n, n01 / n, (n - n10 - n01) / n], size=samples)
    diffs = 100.0 * (draws[:, 0] - draws[:, 1]) / n
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(diffs, [tail, 100.0 - tail])
    return [float(low), float(high)]


def min_detectable_effect(discordance_rate: float, n: int) -> float:
    """Smallest |top-1 difference| (points) detected with power 80% at alpha 0.05 (normal approximation); a
    discordance rate of 0 counts as one discordant image."""
    rate = max(float(discordance_rate), 1.0 / n)
    return 100.0 * (Z_975 + Z_80) * math.sqrt(rate / n)


def paired_stats(hits, reference_hits, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """The paired comparison of one classifier's per-image top-1 hits (booleans, same images in the same
    order) with the reference's: ``diff``, ``ci95``, ``mcnemar_p``, the counts, ``discordance``, ``mde``."""
    import numpy as np

    a = np.asarray(hits, dtype=bool).reshape(-1)
    r = np.asarray(reference_hits, dtype=bool).reshape(-1)
    if a.shape != r.shape:
        raise ValueError(f"paired hits differ in length: {a.shape[0]} vs {r.shape[0]}")
    n = int(a.shape[0])
    n10 = int((a & ~r).sum())
    n01 = int((~a & r).sum())
    rate = (n10 + n01) / n
    return {"diff": 100.0 * (n10 - n01) / n, "ci95": bootstrap_ci(n10, n01, n, samples=samples, seed=seed),
            "mcnemar_p": mcnemar_exact(n10, n01), "n10": n10, "n01": n01, "n": n, "discordance": rate,
            "mde": min_detectable_effect(rate, n), "bootstrap": {"samples": samples, "seed": seed}}


def detectable_effect_summary(rows: list[dict], n: int) -> dict:
    """The evaluation set's minimum detectable effect, from the median discordance of the label-free rows."""
    rates = [r["paired_vs_all"]["discordance"] for r in rows
             if r.get("paired_vs_all") and r["name"] != "all" and not r.get("uses_eval_labels")]
    if not rates:
        return {}
    median = statistics.median(rates)
    return {"n_images": n, "median_discordance": median, "mde_top1_points": min_detectable_effect(median, n),
            "power": 0.8, "alpha": 0.05,
            "formula": "MDE = (z_0.975 + z_0.80) * sqrt(discordance / N), in top-1 points"}
