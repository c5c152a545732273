"""``zsprob posthoc`` as a library call: frozen model + data -> ``OUT/model``, a probabilistic zsprob checkpoint.

:func:`posthoc` builds the post-hoc copy (:func:`zsprob.posthoc.heads.probabilistic_copy`), reads or
computes the feature file (:mod:`zsprob.posthoc.features`), runs the method's entry of
:data:`METHODS` on it and saves the model with :func:`zsprob.models.checkpoint.save`, with the
run's facts in ``zsprob.json``'s ``extra.posthoc`` and in ``OUT/summary.json``. Every check a user
can fail (method, source, data) runs before anything is written.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable


from zsprob.errors import UserError
from zsprob.posthoc.adapter import AdapterSettings, train_heads
from zsprob.posthoc.features import DataSpec, extract, feature_key, load_features, save_features
from zsprob.posthoc.heads import adapter_for, probabilistic_copy


@dataclass(frozen=True)
class Method:
    """One post-hoc method: what it does to the heads and what its sigma^2 means."""

    name: str
    fit: Callable  # fit(model, adapters, features, settings, device, progress) -> dict
    sigma: str


def _fit_adapter(model, adapters, features, settings, device, progress):
    return train_heads(adapters, features, settings, device, progress=progress)


def _fit_laplace(model, adapters, features, settings, device, progress):
    from zsprob.posthoc.laplace import fit_laplace

    return fit_laplace(adapters, features, settings, device, progress=progress)


METHODS = {
    "adapter": Method("adapter", _fit_adapter, "aleatoric: trained to say how vague an input is (the sigma recipe's "
                                               "terms on the frozen means)"),
    "laplace": Method("laplace", _fit_laplace, "epistemic: K-FAC Laplace posterior of the projections, propagated to "
                                               "the normalised mean (how unfamiliar the features are), distilled into "
                                               "the heads"),
}


def check_method(method: str) -> Method:
    if method not in METHODS:
        raise UserError(f"unknown post-hoc method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method]


def posthoc(frozen, data: DataSpec, out: str | Path, *, method: str = "adapter", views: int = 2,
            encode_batch_size: int = 256, settings: AdapterSettings | None = None, device="cpu",
            feature_file: str | Path | None = None, source: dict | None = None, progress: bool = True) -> dict:
    """Give ``frozen`` trained log-variance heads; write ``out/model`` and ``out/summary.json``; return the summary.

    ``views``: passes over the data, each with its own caption draw and copies; ``feature_file``: where
    the cached features live (default ``out/features.safetensors``; reused when it holds the same
    source, data and draws); ``source``: how the frozen model was named, for the record.
    """
    from zsprob.models.checkpoint import save
    from zsprob.utils.io import atomic_write_json

    chosen = check_method(method)
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
    fitted = chosen.fit(model, adapters, features, settings, device, progress)
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


def load_source(checkpoint=None, model=None, pretrained=None, *, device="cpu", **create_kwargs):
    """The frozen model a post-hoc run starts from (any spec ``zsprob.models.load_for_inference`` takes)
    and its description for the record."""
    from zsprob.models import load_for_inference

    frozen = load_for_inference(checkpoint=checkpoint, model=model, pretrained=pretrained, device=device,
                                **create_kwargs)
    source = {"checkpoint": None if checkpoint is None else str(checkpoint), "model": model,
              "pretrained": None if pretrained is None else str(pretrained)}
    return frozen, source


__all__ = ["METHODS", "Method", "posthoc", "load_source", "check_method"]
