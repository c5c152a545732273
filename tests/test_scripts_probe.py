"""The learning probes in experiments/ run end to end (tiny sizes) and reject bad options with exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "probe_contrastive.py"


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--text", "bow", "--captions", "shape", "--center", "batchnorm"],
                                   ["--text-lr-mult", "0", "--image-tower", "model"]])
def test_probe_contrastive_runs(extra):
    r = _run("--steps", 2, "--batch-size", 8, "--num-pretrain", 32, "--num-eval", 60, "--threads", 1, *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1].startswith("init: zero-shot") and lines[-1].startswith("end: zero-shot")
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert [ln.split("|")[1].strip() for ln in rows] == ["1", "2"]
    cosine = float(rows[-1].split("|")[6])
    assert -1.0 <= cosine <= 1.0


def test_probe_contrastive_bad_options():
    r = _run("--steps", 2, "--batch-size", 64, "--num-pretrain", 32)
    assert r.returncode == 2 and r.stderr.startswith("probe_contrastive: error:") and r.stderr.count("\n") == 1
    r = _run("--text-lr-mult", -1)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


TEXT_HEAD = SCRIPT.parent / "probe_text_sigma_head.py"


def _world_and_demo_model(tmp_path, *, num_pretrain: int, num_retrieval: int):
    """A small generated SynthWorld (30 val images) and a random demo-recipe model (bag of words,
    [UNC] pooled heads reading the towers detached) saved at tmp_path / "model"."""
    from zsprob.data.synthetic import generate
    from zsprob.models import create_model
    from zsprob.models.checkpoint import save

    world = tmp_path / "sw"
    generate(world, image_size=32, num_pretrain=num_pretrain, num_classify_select=0, num_classify_eval=0,
             num_retrieval=num_retrieval, num_retrieval_val=30, shard_size=16, progress=False)
    model = create_model("zsprob-tiny-bow", sigma_head="unc", sigma_detach=True, sigma_bias_init=-6.0,
                         pooling="native", seed=0)
    save(model, tmp_path / "model")
    return world, model


def _script_runner(script: Path):
    def run(*args):
        return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                              timeout=300)
    return run


@pytest.mark.slow(seconds=40)
def test_probe_text_sigma_head_reports_what_the_model_says(tmp_path):
    """experiments/probe_text_sigma_head.py on a generated world and a demo-recipe model (bag of words,
    [UNC] pooled head): with --steps 0 its val Spearman is the model's own, computed here from
    encode_texts; a short --reinit run trains; a model without that head is one line and exit 2."""
    import json

    import numpy as np
    from scipy.stats import spearmanr

    from zsprob.models import create_model
    from zsprob.models.checkpoint import save

    world, model = _world_and_demo_model(tmp_path, num_pretrain=96, num_retrieval=4)
    run = _script_runner(TEXT_HEAD)

    r = run(tmp_path / "model", "--root", world, "--steps", 0, "--held-shards", 2, "--min-count", 5,
            "--word-deletions", 20)
    assert r.returncode == 0, r.stderr[-2000:]
    val = next(line for line in r.stdout.splitlines() if line.startswith("val "))
    meta = json.loads((world / "retrieval" / "val_meta.json").read_text())
    texts = [c["text"] for c in meta["caption_meta"]]
    _, logvar = model.eval().encode_text(model.tokenizer(texts))
    rho = spearmanr(logvar.exp().sum(-1).detach().numpy(), np.array(meta["caption_ambiguity"]))[0]
    assert f"Spearman {rho:+.3f}" in val, (val, rho)
    assert "log sigma^2 on mentions: shape" in r.stdout and "ambiguity   on mentions: shape" in r.stdout
    deletions = r.stdout.split("single-word deletions in the first 20 held captions:")[1].split()
    assert "shape" in deletions and "filler" in deletions, r.stdout
    r = run(tmp_path / "model", "--root", world, "--steps", 3, "--reinit", "--drop-prob", "0.1,0.9",
            "--held-shards", 2, "--min-count", 5, "--form", "tight")
    assert r.returncode == 0 and "steps 3, form tight" in r.stdout, r.stderr[-2000:]
    r = run(tmp_path / "model", "--root", world, "--steps", 3, "--reinit", "--held-shards", 2, "--min-count", 5,
            "--form", "cover+nll")  # reads the training shards' images too
    assert r.returncode == 0 and "steps 3, form cover+nll" in r.stdout, r.stderr[-2000:]
    save(create_model("zsprob-tiny-bow", pooling="native", seed=0), tmp_path / "block")
    r = run(tmp_path / "block", "--root", world, "--steps", 0, "--held-shards", 2)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "sigma_head: unc" in r.stderr, r.stderr
    r = run(tmp_path / "model", "--root", world, "--drop-prob", "1.5")
    assert r.returncode == 2 and r.stderr.startswith("probe_text_sigma_head: error: --steps"), r.stderr
    r = run(tmp_path / "model", "--root", world, "--form", "nll", "--nll-scale", "0")
    assert r.returncode == 2 and r.stderr.startswith("probe_text_sigma_head: error: --nll-scale"), r.stderr
    r = run(tmp_path / "model", "--root", tmp_path / "nowhere")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


IMAGE_RESIDUAL = SCRIPT.parent / "probe_image_residual.py"


def test_probe_image_residual_reports_the_residual_and_the_head(tmp_path):
    """experiments/probe_image_residual.py on a generated world: the head's Spearman with the
    per-image residual equals one computed here from encode_split; a deterministic model, equal
    splits and bad penalties are one line and exit 2."""
    import numpy as np
    import torch
    from scipy.stats import spearmanr

    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.models import create_model
    from zsprob.models.checkpoint import save
    from zsprob.retrieval.synthetic import encode_split

    world, model = _world_and_demo_model(tmp_path, num_pretrain=16, num_retrieval=40)
    run = _script_runner(IMAGE_RESIDUAL)

    r = run(tmp_path / "model", "--root", world, "--penalties", "1,10")
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.no_grad():
        emb = encode_split(model.eval(), load_retrieval_split(world, "val"))
    owner = torch.as_tensor(emb.caption_image)
    sq = (emb.image_mu.double()[owner] - emb.caption_mu.double()).square().sum(1)
    residual = torch.zeros(len(emb.image_mu), dtype=torch.float64).index_add_(0, owner, sq).numpy()
    residual /= np.bincount(owner.numpy(), minlength=len(residual))
    rho = spearmanr(emb.image_logvar.double().exp().sum(1).numpy(), residual)[0]
    first = r.stdout.splitlines()[0]
    assert first.startswith("val: 30 images") and f"Spearman(head, residual) {rho:+.3f}" in first, (first, rho)
    assert "penalty 1: R^2" in r.stdout and "penalty 10: R^2" in r.stdout
    assert "| condition | n | residual - normal (SE)" in r.stdout
    assert "| condition | n (fit / scored) | linear probe AUC | head ||sigma^2||_1 AUC |" in r.stdout
    save(create_model("zsprob-tiny-bow", pooling="native", deterministic=True, seed=0), tmp_path / "det")
    for args, where in (((tmp_path / "det", "--root", world), "no image log-variance head"),
                        ((tmp_path / "model", "--root", world, "--fit-split", "val"), "must differ"),
                        ((tmp_path / "model", "--root", world, "--penalties", "a"), "--penalties")):
        r = run(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and where in r.stderr, r.stderr


def test_probe_image_residual_separability_against_sklearn_by_hand():
    """The per-condition table: a condition the features show perfectly gets probe AUC 1, the head's
    AUC is roc_auc_score of its ||sigma^2||_1, and conditions with too few images are left out."""
    import importlib.util

    import numpy as np
    from sklearn.metrics import roc_auc_score

    spec = importlib.util.spec_from_file_location("probe_image_residual", IMAGE_RESIDUAL)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rng = np.random.default_rng(0)

    def split(n_normal, n_blurry, n_rare):
        cond = np.array(["normal"] * n_normal + ["blurry"] * n_blurry + ["rare"] * n_rare)
        x = rng.normal(size=(len(cond), 6))
        x[cond == "blurry", 2] += 8.0            # feature 2 shows blurry plainly
        return x, cond

    fx, fcond = split(40, 20, 3)
    x, cond = split(30, 15, 2)
    u = rng.normal(size=len(cond)) + 0.5 * (cond == "blurry")
    rows = probe.separability(fx, fcond, x, cond, u)
    assert rows[0].startswith("| condition |") and len(rows) == 3          # "rare" (< 5 images) left out
    name, counts, probe_auc, head_auc = [c.strip() for c in rows[2].strip("|").split("|")]
    keep = np.isin(cond, ["normal", "blurry"])
    assert name == "blurry" and counts == "20 / 15" and probe_auc == "1.000"
    assert head_auc == f"{roc_auc_score(cond[keep] == 'blurry', u[keep]):.3f}"
