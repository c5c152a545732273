"""``zsprob posthoc`` as a library call: frozen model + data -> ``OUT/model``, a probabilistic zsprob checkpoint.

:func:`posthoc` builds the post-hoc copy, reads or computes the feature file, runs the method of
:data:`zsprob.posthoc.METHODS` on it and saves the model with the run's record in ``zsprob.json``
(``extra.posthoc``) and ``OUT/summary.json``.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import asdict
from pathlib import Path

from zsprob.posthoc import get_method
from zsprob.posthoc.adapter import AdapterSettings
from zsprob.posthoc.features import DataSpec, extract, feature_key, load_features, save_features
from zsprob.posthoc.heads import adapter_for, probabilistic_copy


def posthoc(frozen, data: DataSpec, out: str | Path, *, method: str = "adapter", views: int = 2,
            encode_batch_size: int = 256, settings: AdapterSettings | None = None, device="cpu",
            feature_file: str | Path | None = None, source: dict | None = None, progress: bool = True) -> dict:
    """Give ``frozen`` trained log-variance heads; write ``out/model`` and ``out/summary.json``; return the summary.
    ``feature_file`` (default ``out/features.safetensors``) is reused when it holds the same source, data and draws;
    ``source``: how the frozen model was named, for the record."""
    from zsprob.models.checkpoint import save
    from zsprob.utils.io import atomic_write_json

    chosen = get_method(method)
    module, name = chosen.fit.split(":")
    fit = getattr(importlib.import_module(module), name)
    settings = settings or AdapterSettings()
    start = time.perf_counter()
    model, trainable = probabilistic_copy(frozen, seed=settings.seed)
    model.posthoc_source = source
    model = model.to(device).eval()
    adapters = {side: adapter_for(model, side) for side in ("image", "text")}
    out = Path(out)
    cache = Path(feature_file) if feature_file else out / "features.safetensors"
    key = feature_key(model, data, adapters, views=views, seed=settings.seed)
    features = load_features(cache, key)
    reused = features is not None
    if features is None:
        features = extract(model, adapters, data, views=views, batch_size=encode_batch_size, seed=settings.seed,
                           device=device, progress=progress)
    feature_seconds = time.perf_counter() - start
    fitted = fit(adapters, features, settings, device, progress=progress)
    if not reused:
        save_features(cache, features, key)
    record = {"method": method, "sigma": chosen.sigma, "source": source, "data": data.key(), "views": views,
              "rows": int(features["image_mu"].shape[0]), "features_reused": reused,
              "feature_seconds": feature_seconds, "settings": asdict(settings),
              "trainable_parameters": sorted(trainable), **fitted}
    record["total_seconds"] = time.perf_counter() - start
    save(model.cpu(), out / "model", extra={"method": f"posthoc-{method}", "step": settings.steps, "posthoc": record})
    atomic_write_json(out / "summary.json", record)
    return record


__all__ = ["posthoc"]
