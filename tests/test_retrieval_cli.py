"""`zsprob eval` and `zsprob index` end to end in real subprocesses, and their error paths."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli


def make_npz(path, n_img=30, per=5, d=8, seed=0, sigma=True, **overrides):
    rng = np.random.default_rng(seed)
    cap_img = np.repeat(np.arange(n_img), per)
    img = rng.normal(size=(n_img, d)).astype(np.float32)
    cap = (img[cap_img] + 0.7 * rng.normal(size=(len(cap_img), d))).astype(np.float32)
    arrays = dict(image_ids=np.arange(n_img) + 500, caption_ids=np.arange(len(cap_img)) * 2 + 9000,
                  image_mu=img, caption_mu=cap, caption_image=cap_img)
    if sigma:
        arrays["image_logvar"] = rng.uniform(-3, 0, size=img.shape).astype(np.float32)
        arrays["caption_logvar"] = rng.uniform(-3, 0, size=cap.shape).astype(np.float32)
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return arrays


def expected_metrics(arrays, score="csd"):
    import torch

    from zsprob.prob import score as prob_score
    from zsprob.retrieval import metrics as M

    lv = (lambda k: torch.from_numpy(arrays[k])) if "image_logvar" in arrays else (lambda k: None)
    s = prob_score(score, torch.from_numpy(arrays["image_mu"]), lv("image_logvar"),
                   torch.from_numpy(arrays["caption_mu"]), lv("caption_logvar"))
    pos = M.positives_from_assignment(arrays["caption_image"], len(arrays["image_ids"]))
    return (M.rank_metrics(s, pos, r_metrics=False).mean(),
            M.rank_metrics(s.T.contiguous(), pos.T.tocsr(), r_metrics=False).mean())


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """``zsprob ARGS`` in-process through the real entry point (zsprob.cli.main: same parsing,
    one-line errors and exit codes as the console script, without a 5-10 s interpreter start)."""
    from zsprob.cli import main

    def run(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out = capsys.readouterr()
        return Result(e.value.code, out.out, out.err)

    return run


def one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("zsprob: error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert needle in r.stderr, r.stderr


def test_eval_embeddings_end_to_end(tmp_path):
    arrays = make_npz(tmp_path / "e.npz")
    out = tmp_path / "res" / "m.json"
    r = run_cli("eval", "embeddings", tmp_path / "e.npz", "--out", out)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    i2t, t2i = expected_metrics(arrays)
    for k in ("r@1", "r@5", "r@10"):
        assert got["metrics"]["coco"]["i2t"][k] == pytest.approx(100 * i2t[k])
        assert got["metrics"]["coco"]["t2i"][k] == pytest.approx(100 * t2i[k])
    assert got["metrics"]["setup"]["score"] == "csd"
    assert got["metrics"]["setup"]["method"].startswith("matrix")
    assert "| coco | i2t | r@1 |" in r.stdout and "RSUM" in r.stdout
    assert (tmp_path / "res" / "uncertainty_deciles.png").stat().st_size > 1000
    assert "Spearman" in (tmp_path / "res" / "uncertainty_deciles.md").read_text()
    page = (tmp_path / "res" / "uncertain_queries.md").read_text()
    assert "most uncertain" in page and "image 5" in page
    assert len(got["uncertainty"]["image queries"]["bins"]) == 10


def test_eval_coco_with_embeddings_and_mean_score_without_sigma(tmp_path, cli):
    arrays = make_npz(tmp_path / "d.npz", sigma=False)
    out = tmp_path / "m.json"
    r = cli("eval", "coco", "--embeddings", tmp_path / "d.npz", "--score", "mean", "--out", out)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    i2t, _ = expected_metrics(arrays, "mean")
    assert got["metrics"]["coco"]["i2t"]["r@1"] == pytest.approx(100 * i2t["r@1"])
    assert got["uncertainty"] is None
    # csd on embeddings without sigma is a user error
    one_line_error(cli("eval", "coco", "--embeddings", tmp_path / "d.npz", "--out", out), "needs sigma")


def test_eval_error_paths(tmp_path, cli):
    one_line_error(cli("eval", "embeddings", tmp_path / "missing.npz"), "embeddings file not found")
    make_npz(tmp_path / "bad.npz", image_mu=None)
    one_line_error(cli("eval", "embeddings", tmp_path / "bad.npz"), "lack arrays: image_mu")
    # a misspelled optional array is refused, not dropped (the file would read as deterministic)
    make_npz(tmp_path / "typo.npz", sigma=False, img_logvar=np.zeros((30, 8), np.float32),
             caption_logvar=np.zeros((150, 8), np.float32))
    one_line_error(cli("eval", "embeddings", tmp_path / "typo.npz"), "unknown array 'img_logvar'; did you mean 'image_logvar'?")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    one_line_error(cli("eval", "embeddings", tmp_path / "junk.npz"), "cannot read embeddings")
    make_npz(tmp_path / "noimg.npz", caption_image=None)
    one_line_error(cli("eval", "embeddings", tmp_path / "noimg.npz"), "caption_image")
    one_line_error(cli("eval", "coco", "--checkpoint", tmp_path), "--root COCO_DIR is required")
    one_line_error(cli("eval", "synthetic", "--root", tmp_path / "nowhere", "--model", "x"), "SynthWorld folder not found")
    one_line_error(cli("eval", "embeddings", tmp_path / "bad.npz", "--score", "nope"), "Invalid value")


def test_index_build_and_search_end_to_end(tmp_path, cli):
    arrays = make_npz(tmp_path / "e.npz", n_img=40)
    out = tmp_path / "s.json"
    r = cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "flat", "--out", tmp_path / "idx")
    assert r.returncode == 0, r.stderr
    assert "indexed 200 captions (kind=flat, metric=ip" in r.stdout
    r = run_cli("index", "search", "--index", tmp_path / "idx", "--queries", tmp_path / "e.npz", "-k", "5", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    ids = np.array(res["ids"])
    # exact: equal to the brute-force CSD ranking by zsprob.prob
    import torch

    from zsprob.prob import score
    from zsprob.retrieval.metrics import topk_ranking

    s = score("csd", *(torch.from_numpy(arrays[k]).double() for k in ("image_mu", "image_logvar", "caption_mu", "caption_logvar")))
    ref = arrays["caption_ids"][topk_ranking(s, 5).numpy()]
    assert (ids == ref).mean() > 0.99
    csd = np.array(res["csd"])
    np.testing.assert_allclose(csd, -np.take_along_axis(s.numpy(), topk_ranking(s, 5).numpy(), 1), rtol=1e-4, atol=1e-4)
    one_line_error(cli("index", "search", "--index", tmp_path / "nope", "--queries", tmp_path / "e.npz"),
                   "index directory not found")
    one_line_error(cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "lsh", "--out", tmp_path / "i2"),
                   "Invalid value")


@pytest.mark.slow
def test_eval_rankings_on_official_ids(tmp_path, cli):
    """`zsprob eval rankings`: an eccv_caption-style dict and a `zsprob index search` file give the
    metrics of evaluate_rankings; broken lists are one-line errors."""
    from test_retrieval_eccv import synthetic_official_embeddings
    from zsprob.retrieval import metrics as M
    from zsprob.retrieval.coco import task_for_embeddings
    from zsprob.retrieval.evaluate import evaluate_rankings
    from zsprob.retrieval.scoring import PairScores

    emb, task = task_for_embeddings(synthetic_official_embeddings(d=16, noise=0.6))
    ps = PairScores("csd", emb.image_mu, emb.image_logvar, emb.caption_mu, emb.caption_logvar)
    ri = M.rank_lists(ps.i2t, np.arange(5000), 200).numpy()
    rt = M.rank_lists(ps.t2i, np.arange(25000), 200).numpy()
    expected = evaluate_rankings(ri, rt, task)
    del ps
    i2t = {str(k): v for k, v in zip(emb.image_ids.tolist(), emb.caption_ids[ri].tolist())}
    (tmp_path / "i2t.json").write_text(json.dumps(i2t))
    rng = np.random.default_rng(0)
    order = rng.permutation(25000)  # any query order
    (tmp_path / "t2i.json").write_text(json.dumps({"query_ids": emb.caption_ids[order].tolist(),
                                                   "ids": emb.image_ids[rt[order]].tolist(), "k": 200}))
    out = tmp_path / "m.json"
    r = cli("eval", "rankings", "--i2t", tmp_path / "i2t.json", "--t2i", tmp_path / "t2i.json", "--out", out)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["metrics"]
    for bench in ("coco_1k", "coco_5k", "cxc", "eccv"):
        for d in ("i2t", "t2i"):
            assert got[bench][d] == pytest.approx(expected[bench][d], abs=1e-9)
    assert 5 < got["coco_5k"]["i2t"]["r@1"] < 95
    assert "| eccv | i2t | map_at_r |" in r.stdout and "fold" in r.stdout

    def write(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))
        return tmp_path / name

    t2i_arg = ("--t2i", tmp_path / "t2i.json")
    missing = dict(i2t)
    missing.pop(next(iter(missing)))
    one_line_error(cli("eval", "rankings", "--i2t", write("a.json", missing), *t2i_arg), "have no ranked list")
    bad = dict(i2t)
    bad[next(iter(bad))] = [1, 2, 3] + bad[next(iter(bad))][3:]
    one_line_error(cli("eval", "rankings", "--i2t", write("b.json", bad), *t2i_arg), "not in the official gallery")
    short = {k: v[:20] for k, v in i2t.items()}
    one_line_error(cli("eval", "rankings", "--i2t", write("c.json", short), *t2i_arg), "needs ranked lists of at least")
    one_line_error(cli("eval", "rankings", "--i2t", write("d.json", {k: "x" for k in i2t}), *t2i_arg), "list of integer ids")
    one_line_error(cli("eval", "rankings", "--i2t", tmp_path / "none.json", *t2i_arg), "not found")
