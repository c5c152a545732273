"""Uncertainty analyses and the SynthWorld evaluation (real SynthWorld files, a tiny real model)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zsprob.retrieval import analysis as A

TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
}


def test_uncertainty_deciles_against_direct_computation():
    rng = np.random.default_rng(0)
    u = rng.random(1000)
    correct = (rng.random(1000) > u).astype(float)  # more uncertain -> less often correct
    d = A.uncertainty_deciles(u, correct)
    assert len(d["bins"]) == 10 and all(b["n"] == 100 for b in d["bins"])
    order = np.argsort(u)
    for b in range(10):
        idx = order[b * 100:(b + 1) * 100]
        assert d["bins"][b]["r1"] == pytest.approx(100 * correct[idx].mean())
        assert d["bins"][b]["lo"] == pytest.approx(u[idx].min())
    assert d["spearman_bins"]["rho"] < -0.8 and d["spearman_queries"]["rho"] < -0.3
    table = A.deciles_table({"image queries": d})
    assert "| 10 |" in table and "Spearman" in table


def test_corruptions_are_exact_fractions():
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(np.full((20, 10, 3), 200, dtype=np.uint8))
    out = np.array(A.erase_pixels(img, 0.3, rng))
    assert (out.reshape(-1, 3) == 0).all(1).sum() == 60
    cap = "one two three four five six seven eight nine ten"
    assert len(A.mask_words(cap, 0.5, rng).split()) == 5
    assert len(A.mask_words("single", 0.9, rng).split()) == 1
    assert A.mask_words(cap, 0.0, rng) == cap


@pytest.fixture(scope="module")
def synthworld(tmp_path_factory):
    from zsprob.data.synthetic import generate

    root = tmp_path_factory.mktemp("sw")
    generate(root, image_size=32, num_pretrain=4, num_classify_select=1, num_classify_eval=1, num_retrieval=40,
             num_retrieval_val=4, shard_size=4, progress=False, seed=1)
    return root


@pytest.mark.slow
def test_evaluate_synthetic_end_to_end(synthworld, tmp_path):
    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.models import create_model
    from zsprob.prob import score
    from zsprob.retrieval import metrics as M
    from zsprob.retrieval.synthetic import encode_split, evaluate_synthetic

    torch.manual_seed(0)
    model = create_model("zsprob-tiny", open_clip_cfg=TINY, seed=0).eval()
    out = tmp_path / "eval"
    res = evaluate_synthetic(model, synthworld, "test", "csd", out, n_corruption=6, batch_size=16)
    m = res["metrics"]
    assert m["caption"]["i2t"]["n_queries"] == 40 and m["caption"]["t2i"]["n_queries"] == 200
    assert m["plausible"]["t2i"]["n_queries"] == 200

    # the numbers are the metrics of the model's own CSD scores with SynthWorld's exact positives
    rs = load_retrieval_split(synthworld, "test")
    emb = encode_split(model, rs)
    s = score("csd", emb.image_mu, emb.image_logvar, emb.caption_mu, emb.caption_logvar)
    five = M.positives_from_assignment(rs.caption_image, 40)
    pm = (rs.positives.astype(bool) + five).astype(bool).tocsr()
    exp = M.rank_metrics(s.T.contiguous(), pm.T.tocsr(), ks=(1,)).mean()
    assert m["plausible"]["t2i"]["map_at_r"] == pytest.approx(100 * exp["map_at_r"], abs=1e-6)
    assert m["plausible"]["t2i"]["rprecision"] == pytest.approx(100 * exp["rprecision"], abs=1e-6)
    exp5 = M.rank_metrics(s, five, r_metrics=False).mean()
    assert m["caption"]["i2t"]["r@5"] == pytest.approx(100 * exp5["r@5"], abs=1e-6)
    sel = res["selective"]  # R@1 misses flagged per direction, the accuracy that of R@1 itself
    assert sel["i2t"]["n"] == 40 and sel["i2t"]["accuracy"] == pytest.approx(m["caption"]["i2t"]["r@1"] / 100)
    assert set(sel["t2i"]["scores"]) == {"msp", "entropy", "margin", "top1_score", "query_sigma2"}

    unc = res["uncertainty"]
    gt = unc["ground_truth"]
    assert -1 <= gt["text_uncertainty_vs_ambiguity"]["rho"] <= 1 and gt["text_uncertainty_vs_ambiguity"]["n"] == 200
    assert sum(v["n"] for v in gt["image_uncertainty_by_condition"].values()) == 40
    by_n = gt["image_uncertainty_by_num_objects"]  # 1-3 objects, or 3-5 copies for the "many" condition
    assert set(by_n) <= {"1", "2", "3", "4", "5"} and sum(v["n"] for v in by_n.values()) == 40
    assert len(unc["corruption"]["image"]["mean_sigma2"]) == len(unc["corruption"]["fractions"])
    assert unc["corruption"]["n_images"] == 6
    assert len(unc["deciles"]["caption queries"]["bins"]) == 10

    for name in ("metrics.json", "table.md", "uncertainty_deciles.png", "uncertainty_deciles.md",
                 "uncertain_queries.md", "corruption.png", "uncertainty_groups.png"):
        assert (out / name).stat().st_size > 100, name
    page = (out / "uncertain_queries.md").read_text()
    assert "](thumbs/img" in page and any((out / "thumbs").glob("img*.jpg"))
    assert rs.captions[0].split()[0] in page or "Caption queries" in page
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics"]["plausible"]["t2i"]["map_at_r"] == pytest.approx(m["plausible"]["t2i"]["map_at_r"])
