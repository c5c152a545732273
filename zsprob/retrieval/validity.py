"""Uncertainty-validity evidence on SynthWorld: does sigma^2 mean ambiguity?

Each analysis compares a model's ||sigma^2||_1 (or ProLIP's inclusion test) with SynthWorld's exact ground
truth, with an interval and its count. :func:`uncertainty_validity` runs all five for a model,
:func:`validity_table` prints them; scipy ranks, :mod:`zsprob.prob.distances` does the Gaussian math.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from zsprob.prob import distances

MIN_BIN = 100  # a word-count bin with at least this many captions counts for the acceptance
N_BOOTSTRAP = 300
DEGRADED_CONDITIONS = ("blurry", "pixelated", "low resolution", "dark", "jpeg corrupted", "cropped", "drawing",
                       "many")
CROP_SIMILARITIES = ("kl", "minkl", "w2", "csd")
#: the crop test's four queries, each choosing between the two candidates of the other modality
CROP_QUERIES = ("caption_a", "caption_ab", "image_a", "image_ab")
PAIR_BLOCK = 256


def _rowwise_spearman(x_ranks_rows: np.ndarray, y_ranks_rows: np.ndarray) -> np.ndarray:
    """Pearson correlation of rank rows (each row one resample), NaN where a row is constant."""
    x = x_ranks_rows - x_ranks_rows.mean(1, keepdims=True)
    y = y_ranks_rows - y_ranks_rows.mean(1, keepdims=True)
    denom = np.sqrt((x * x).sum(1) * (y * y).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (x * y).sum(1) / denom, np.nan)


def bootstrap_spearman(x, y, *, n_boot: int = N_BOOTSTRAP, seed: int = 0, level: float = 0.95) -> dict:
    """Spearman's rho of (x, y) with a percentile bootstrap interval over resampled pairs (all resamples
    ranked at once, ties averaged): ``{"rho", "lo", "hi", "n"}``, NaN with fewer than 3 items or a constant input."""
    from scipy.stats import rankdata, spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"rho": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": int(n)}
    rho = float(spearmanr(x, y).statistic)
    rng = np.random.default_rng([int(seed), n])
    idx = rng.integers(0, n, size=(n_boot, n))
    boot = _rowwise_spearman(rankdata(x[idx], axis=1), rankdata(y[idx], axis=1))
    boot = boot[np.isfinite(boot)]
    tail = 100 * (1 - level) / 2
    lo, hi = (np.percentile(boot, [tail, 100 - tail]) if len(boot) else (np.nan, np.nan))
    return {"rho": rho, "lo": float(lo), "hi": float(hi), "n": int(n)}


def ambiguity_spearman(text_uncertainty, caption_ambiguity, captions, *, seed: int = 0,
                       n_boot: int = N_BOOTSTRAP) -> dict:
    """Spearman(text uncertainty, ambiguity) with bootstrap 95% intervals, overall and per word count:
    ``{"overall", "by_word_count": {"3": {..., "counts": bool}, ...}, "min_bin", "positive_in_counted_bins"}``."""
    u = np.asarray(text_uncertainty, dtype=np.float64)
    amb = np.asarray(caption_ambiguity, dtype=np.float64)
    words = np.array([len(c.split()) for c in captions])
    by_bin = {}
    for count in sorted(set(words.tolist())):
        mask = words == count
        stats = bootstrap_spearman(u[mask], amb[mask], n_boot=n_boot, seed=seed + count)
        stats["counts"] = bool(mask.sum() >= MIN_BIN)
        by_bin[str(count)] = stats
    counted = [s["rho"] for s in by_bin.values() if s["counts"]]
    return {"overall": bootstrap_spearman(u, amb, n_boot=n_boot, seed=seed), "by_word_count": by_bin,
            "min_bin": MIN_BIN,
            "positive_in_counted_bins": bool(counted) and all(np.isfinite(r) and r > 0 for r in counted)}


def _binomial(correct: np.ndarray) -> dict:
    n = int(len(correct))
    acc = float(correct.mean()) if n else float("nan")
    return {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / n) if n else float("nan"), "n": n}


def inclusion_accuracy(general_mu, general_logvar, specific_mu, specific_logvar, same_word_count=None,
                       *, eps: float = -10.0) -> dict:
    """Accuracy (with ``se``, ``n``) on (general, specific) rows of the inclusion test (``inclusion``:
    ``inclusion_logit(specific, general) > 0``) and of the sigma comparison (``sigma``: the general caption
    has the larger ||sigma^2||_1); with ``same_word_count`` (bool per pair) also ``by_word_count``."""
    logit = distances.inclusion_logit(specific_mu, specific_logvar, general_mu, general_logvar, eps=eps).numpy()
    plain = (distances.uncertainty(general_logvar) > distances.uncertainty(specific_logvar)).numpy()
    results = {"inclusion": np.asarray(logit > 0), "sigma": np.asarray(plain)}
    out = {name: _binomial(correct) for name, correct in results.items()}
    if same_word_count is not None:
        same = np.asarray(same_word_count, dtype=bool)
        out["by_word_count"] = {label: {name: _binomial(correct[mask]) for name, correct in results.items()}
                                for label, mask in (("same", same), ("different", ~same))}
    return out


def condition_uncertainty(image_uncertainty, conditions, *, reference: str = "normal") -> dict:
    """Mean image uncertainty per condition minus ``reference``'s, with its Welch standard error:
    ``{"by_condition": {cond: {"mean", "diff", "se", "n"}}, "reference", "more_uncertain", "of"}`` (a
    degraded condition absent from the data counts as not more uncertain)."""
    u = np.asarray(image_uncertainty, dtype=np.float64)
    conditions = np.asarray(conditions)
    ref = u[conditions == reference]
    ref_var = ref.var(ddof=1) / len(ref) if len(ref) > 1 else float("nan")
    by = {}
    for cond in sorted(set(conditions.tolist()) - {reference}):
        group = u[conditions == cond]
        var = group.var(ddof=1) / len(group) if len(group) > 1 else float("nan")
        by[cond] = {"mean": float(group.mean()), "diff": float(group.mean() - ref.mean()) if len(ref) else float("nan"),
                    "se": float(math.sqrt(var + ref_var)), "n": int(len(group))}
    more = sum(1 for c in DEGRADED_CONDITIONS if c in by and by[c]["diff"] > 0)
    ref_mean = float(ref.mean()) if len(ref) else float("nan")
    return {"by_condition": by, "reference": {"name": reference, "mean": ref_mean, "n": int(len(ref))},
            "more_uncertain": int(more), "of": len(DEGRADED_CONDITIONS)}


def _pair_similarity(name: str, image_mu, image_logvar, caption_mu, caption_logvar) -> torch.Tensor:
    """Similarity of image row i with caption row i: the diagonal of ``score``, in blocks of ``PAIR_BLOCK`` rows."""
    parts = [distances.score(name, image_mu[s:s + PAIR_BLOCK], image_logvar[s:s + PAIR_BLOCK],
                     caption_mu[s:s + PAIR_BLOCK], caption_logvar[s:s + PAIR_BLOCK]).diagonal()
             for s in range(0, len(image_mu), PAIR_BLOCK)]
    return torch.cat(parts) if parts else torch.zeros(0)


def crop_test(image_a, image_ab, caption_a, caption_ab) -> dict:
    """Pishdad et al.'s crop test on the four (mu, logvar) Gaussians of every trial: mean uncertainty of image
    A vs A+B and caption "A" vs "A and B", and binary selection (each query picks one of the other modality's
    two candidates by each of :data:`CROP_SIMILARITIES`; correct when it picks its own counterpart).
    Returns ``{"uncertainty", "image_ab_more_uncertain", "caption_ab_less_uncertain", "selection"}``."""
    gaussians = {"image_a": image_a, "image_ab": image_ab, "caption_a": caption_a, "caption_ab": caption_ab}
    unc = {name: distances.uncertainty(lv).double().numpy() for name, (mu, lv) in gaussians.items()}
    n = len(unc["image_a"])
    out = {"uncertainty": {name: {"mean": float(v.mean()),
                                  "se": float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"), "n": int(n)}
                           for name, v in unc.items()},
           "image_ab_more_uncertain": _binomial(unc["image_ab"] > unc["image_a"]),
           "caption_ab_less_uncertain": _binomial(unc["caption_ab"] < unc["caption_a"]),
           "selection": {}}
    for name in CROP_SIMILARITIES:
        sim = {(img, cap): _pair_similarity(name, *gaussians[img], *gaussians[cap]).double().numpy()
               for img in ("image_a", "image_ab") for cap in ("caption_a", "caption_ab")}
        out["selection"][name] = {
            "caption_a": _binomial(sim["image_a", "caption_a"] > sim["image_ab", "caption_a"]),
            "caption_ab": _binomial(sim["image_ab", "caption_ab"] > sim["image_a", "caption_ab"]),
            "image_a": _binomial(sim["image_a", "caption_a"] > sim["image_a", "caption_ab"]),
            "image_ab": _binomial(sim["image_ab", "caption_ab"] > sim["image_ab", "caption_a"]),
        }
    return out


def decile_trend(deciles: dict) -> dict:
    """R@1 per uncertainty decile and its Spearman per query direction; ``falling``: Spearman(decile, R@1) < 0."""
    out = {}
    for direction, result in deciles.items():
        rho = result["spearman_bins"]["rho"]
        out[direction] = {"r1": [b["r1"] for b in result["bins"]], "spearman_bins": result["spearman_bins"],
                          "spearman_queries": result["spearman_queries"],
                          "falling": bool(np.isfinite(rho) and rho < 0)}
    return out


# --------------------------------------------------------------------------- one model, one call

class _RenderedScenes:
    """Map-style dataset: SynthWorld scenes rendered (PIL) and passed through ``transform``."""

    def __init__(self, world, scenes: list[dict], transform):
        self.world, self.scenes, self.transform = world, scenes, transform

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, index: int):
        return self.transform(self.world.render(self.scenes[index]).convert("RGB"))


def _encode_captions(model, texts, batch_size, device):
    from zsprob.models.encode import encode_texts

    return encode_texts(model, list(texts), batch_size=max(256, batch_size), device=device, progress=False)


def uncertainty_validity(model, split, embeddings, deciles: dict, *, seed: int = 0, n_pairs: int = 1000,
                         n_crops: int = 300, n_boot: int = N_BOOTSTRAP, batch_size: int = 128, device=None) -> dict:
    """All five analyses for ``model`` on a SynthWorld ``RetrievalSplit``, given its ``embeddings`` and the
    ``deciles`` of the same evaluation; the ``n_pairs`` inclusion pairs and ``n_crops`` crop triplets come
    from ``seed``, their images rendered at the split's image size."""
    from zsprob.data.synthworld.probes import crop_scenes, inclusion_pairs
    from zsprob.data.synthetic import SynthWorld
    from zsprob.models.encode import encode_images

    image_u, text_u = embeddings.uncertainty()
    conditions = [m.get("condition", "unknown") for m in split.image_meta]

    pairs = inclusion_pairs(n_pairs, seed)
    general = _encode_captions(model, [p["general"]["text"] for p in pairs], batch_size, device)
    specific = _encode_captions(model, [p["specific"]["text"] for p in pairs], batch_size, device)
    inclusion = inclusion_accuracy(*general, *specific, [p["same_word_count"] for p in pairs])
    inclusion["by_kind"] = {}
    kinds = np.array([p["kind"] for p in pairs])
    for kind in sorted(set(kinds.tolist())):
        rows = torch.from_numpy(np.flatnonzero(kinds == kind))
        sub = inclusion_accuracy(general[0][rows], general[1][rows], specific[0][rows], specific[1][rows])
        inclusion["by_kind"][kind] = {name: sub[name] for name in ("inclusion", "sigma")}
    inclusion["examples"] = [[p["general"]["text"], p["specific"]["text"]] for p in pairs[:5]]

    trials = crop_scenes(n_crops, seed)
    world = SynthWorld(seed=seed, image_size=int(split.image_meta[0]["image_size"]))
    scenes = [t["scene_a"] for t in trials] + [t["scene_ab"] for t in trials]
    image_mu, image_lv = encode_images(model, _RenderedScenes(world, scenes, model.preprocess_val),
                                       batch_size=batch_size, device=device, progress=False)
    caption_mu, caption_lv = _encode_captions(
        model, [t["caption_a"]["text"] for t in trials] + [t["caption_ab"]["text"] for t in trials], batch_size, device)
    half = len(trials)
    crops = crop_test((image_mu[:half], image_lv[:half]), (image_mu[half:], image_lv[half:]),
                      (caption_mu[:half], caption_lv[:half]), (caption_mu[half:], caption_lv[half:]))
    crops["examples"] = [[t["caption_a"]["text"], t["caption_ab"]["text"]] for t in trials[:3]]

    return {"text_ambiguity": ambiguity_spearman(text_u, split.caption_ambiguity, split.captions, seed=seed,
                                                 n_boot=n_boot),
            "inclusion": inclusion,
            "image_conditions": condition_uncertainty(image_u, conditions),
            "crop_test": crops,
            "deciles": decile_trend(deciles),
            "setup": {"seed": int(seed), "n_pairs": int(n_pairs), "n_crops": int(n_crops), "n_boot": int(n_boot),
                      "uncertainty": "||sigma^2||_1", "interval": "bootstrap 95% percentile (Spearman); "
                      "binomial / Welch standard errors (accuracies, differences)"}}


def _num(v, spec: str) -> str:
    """``v`` formatted, or "n/a" where it is undefined (NaN / None)."""
    return format(v, spec) if v is not None and math.isfinite(v) else "n/a"


def _fmt_interval(stats: dict) -> str:
    return (f"{_num(stats['rho'], '+.3f')} [{_num(stats['lo'], '+.3f')}, {_num(stats['hi'], '+.3f')}] "
            f"(n {stats['n']})")


def _fmt_acc(stats: dict) -> str:
    se = stats["se"]
    return f"{100 * stats['accuracy']:.1f} +- {_num(None if se is None else 100 * se, '.1f')}% (n {stats['n']})"


def validity_table(validity: dict, label: str = "model") -> str:
    """A compact markdown table of :func:`uncertainty_validity`'s result."""
    amb, inc = validity["text_ambiguity"], validity["inclusion"]
    cond, crops, dec = validity["image_conditions"], validity["crop_test"], validity["deciles"]
    rows = [("Spearman(text u, ambiguity), all", _fmt_interval(amb["overall"]))]
    for words, stats in amb["by_word_count"].items():
        if stats["counts"]:
            rows.append((f"  ... {words} words", _fmt_interval(stats)))
    rows.append(("  positive in every bin >= %d captions" % amb["min_bin"], str(amb["positive_in_counted_bins"])))
    rows.append(("inclusion accuracy, inclusion test", _fmt_acc(inc["inclusion"])))
    rows.append(("inclusion accuracy, sigma comparison", _fmt_acc(inc["sigma"])))
    for label_wc, sub in inc.get("by_word_count", {}).items():
        if sub["sigma"]["n"]:
            rows.append((f"  ... {label_wc} word count (test / sigma)",
                         f"{_fmt_acc(sub['inclusion'])} / {_fmt_acc(sub['sigma'])}"))
    diffs = ", ".join(f"{c} {cond['by_condition'][c]['diff']:+.3g}+-{_num(cond['by_condition'][c]['se'], '.2g')}"
                      for c in DEGRADED_CONDITIONS if c in cond["by_condition"])
    rows.append(("image u: conditions more uncertain than normal", f"{cond['more_uncertain']} of {cond['of']}"))
    rows.append(("  ... u(condition) - u(normal)", diffs or "n/a"))
    unc = crops["uncertainty"]
    rows.append(("crop test: image u, A vs A+B", f"{unc['image_a']['mean']:.4g} vs {unc['image_ab']['mean']:.4g}"))
    rows.append(("crop test: caption u, A vs A+B",
                 f"{unc['caption_a']['mean']:.4g} vs {unc['caption_ab']['mean']:.4g}"))
    for name, sel in crops["selection"].items():
        rows.append((f"  selection -{name} (cap A / cap A+B / img A / img A+B)",
                     " / ".join(f"{100 * sel[q]['accuracy']:.1f}" for q in CROP_QUERIES)
                     + f" (n {unc['image_a']['n']})"))
    for direction, trend in dec.items():
        rows.append((f"R@1 per u decile, {direction}",
                     " ".join(f"{r:.1f}" for r in trend["r1"]) + f"; Spearman {trend['spearman_bins']['rho']:+.3f}"))
    lines = [f"| uncertainty validity ({label}) | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"
