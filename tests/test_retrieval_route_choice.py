"""``zsprob eval --method auto``: the route follows the device the scores are computed on.

The screen (zsprob.retrieval.screen) is a CPU kernel: on a GPU it would copy the embeddings to the
host and rank there, so ``auto`` takes it only where the scores are computed on the CPU and takes
the score matrix (computed on the device) elsewhere. No GPU here: the decision is tested with the
device named, and the wiring of ``evaluate_embeddings`` on the CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_retrieval_screen import gaussians, small_task
from zsprob.retrieval import evaluate
from zsprob.retrieval.evaluate import resolve_method


@pytest.mark.parametrize("device, route", [(None, "screen"), ("cpu", "screen"), (torch.device("cpu"), "screen"),
                                           ("cuda", "matrix"), ("cuda:1", "matrix"), (torch.device("cuda", 0), "matrix"),
                                           ("mps", "matrix")])
def test_auto_follows_the_scoring_device(device, route):
    for score in ("csd", "mean", "cosine"):
        assert resolve_method("auto", score, device=device) == route
    assert resolve_method("auto", "w2", device=device) == "matrix"                  # not linear: the matrix anywhere
    assert resolve_method("auto", "csd", device=device, n_samples=3) == "matrix"    # score options: the matrix
    assert resolve_method("screen", "csd", device=device) == "screen"               # asked by name: kept
    assert resolve_method("matrix", "cosine", device=device) == "matrix"
    with pytest.raises(ValueError, match="linear score"):
        resolve_method("screen", "kl", device=device)


def test_evaluate_embeddings_asks_about_the_device_it_scores_on(monkeypatch):
    """None means where the embeddings live (here the CPU): the screen, with the CPU results."""
    from zsprob.retrieval.embeddings import Embeddings
    asked = []

    def spy(method, score, **kw):
        asked.append(kw.get("device"))
        return resolve_method(method, score, **kw)

    monkeypatch.setattr(evaluate, "resolve_method", spy)
    rng = np.random.default_rng(8)
    task = small_task(rng, n_img=20)
    mi, li = gaussians(task.n_images, 8, rng)
    mc, lc = gaussians(task.n_captions, 8, rng)
    emb = Embeddings(task.image_ids, task.caption_ids, mi, mc, li, lc)
    auto = evaluate.evaluate_embeddings(emb, task, score="csd")
    on_cpu = evaluate.evaluate_embeddings(emb, task, score="csd", device="cpu")
    assert asked == [torch.device("cpu")] * 2
    for res in (auto, on_cpu):
        assert res.metrics["setup"]["method"].startswith("screen")
    assert {k: v for k, v in auto.metrics.items() if k != "setup"} == \
        {k: v for k, v in on_cpu.metrics.items() if k != "setup"}
