"""Bad input to `zsprob eval` and `zsprob index`, end to end through the CLI runner: one line
`zsprob: error: ...`, exit 2, no traceback, and nothing under --out created or changed.

Cases: ranked lists that repeat an id (which would inflate R-Precision / mAP@R / R@K), npz ids that
are strings, floats, 2-D or repeated, npz values that are not numbers or are empty, an index.json
that disagrees with the FAISS file or gallery beside it, --nlist above the gallery, --save-embeddings
with --embeddings, outputs that would overwrite inputs, options a kind of index would ignore. The
inputs that are not errors (-k above the index size, IVF lists that find fewer than k) give the
right result and strict JSON.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from test_retrieval_cli import make_npz


def refused(r, *needles: str) -> str:
    """Exit 2, exactly one stderr line starting `zsprob: error:` that holds every needle, no traceback."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("zsprob: error:"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(*paths) -> dict:
    """Bytes of every file under ``paths`` (None for a path that does not exist)."""
    out = {}
    for p in map(Path, paths):
        if p.is_dir():
            out.update({f: f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()})
            out[p] = "dir"
        else:
            out[p] = p.read_bytes() if p.exists() else None
    return out


def strict_json(path: Path):
    """json.loads that refuses NaN / Infinity (not JSON; jq and browsers reject them)."""
    def no_constant(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=no_constant)


# ----------------------------------------------------------------------------- eval rankings
@pytest.fixture(scope="module")
def official_lists():
    """eccv_caption-style {image id: [caption ids]} and {caption id: [image ids]} for the official 5K
    test ids: each list starts with the query's ground truth (so the metrics would be high)."""
    from zsprob.retrieval.coco import eccv_metrics, official_test_ids

    img_ids, cap_ids = official_test_ids()
    gts = eccv_metrics().coco_gts
    rng = np.random.default_rng(0)
    i2t, t2i = {}, {}
    for i in img_ids.tolist():
        own = [int(c) for c in gts["i2t"][i]][:5]
        rest = [int(c) for c in rng.choice(cap_ids, 12, replace=False) if int(c) not in own][:7]
        i2t[str(i)] = own + rest
    for c in cap_ids.tolist():
        own = int(gts["t2i"][c][0])
        t2i[str(c)] = [own] + [int(x) for x in rng.choice(img_ids, 8, replace=False) if int(x) != own][:5]
    return i2t, t2i


def _rankings(tmp_path, i2t, t2i, i2t_text: str | None = None):
    (tmp_path / "i2t.json").write_text(i2t_text if i2t_text is not None else json.dumps(i2t))
    (tmp_path / "t2i.json").write_text(json.dumps(t2i))
    out = tmp_path / "res" / "m.json"
    before = snapshot(tmp_path / "res")
    r = run_cli("eval", "rankings", "--i2t", tmp_path / "i2t.json", "--t2i", tmp_path / "t2i.json", "--out", out)
    return r, before, snapshot(tmp_path / "res")


def test_rankings_with_a_repeated_id_are_refused_naming_query_and_id(tmp_path, official_lists):
    i2t, t2i = official_lists
    query = next(iter(i2t))
    positive = i2t[query][0]
    bad = dict(i2t)
    bad[query] = [positive, positive] + i2t[query][1:]  # the ground truth listed twice would count twice
    r, before, after = _rankings(tmp_path, bad, t2i)
    refused(r, f"query {query}", f"id {positive}", "more than once")
    assert before == after == {tmp_path / "res": None}


def test_rankings_with_a_repeated_query_are_refused(tmp_path, official_lists):
    i2t, t2i = official_lists
    query = next(iter(i2t))
    text = json.dumps(i2t)
    text = text[:-1] + f', "{query}": {json.dumps(i2t[query])}}}'  # the same key twice: json keeps the last
    r, before, after = _rankings(tmp_path, i2t, t2i, i2t_text=text)
    refused(r, repr(query), "appears twice")
    assert before == after
    # `zsprob index search` output with a query id twice; "07" and "7" name one query
    ids = list(i2t)
    pairs = {"query_ids": [int(q) for q in ids] + [int(ids[0])], "ids": [i2t[q] for q in ids] + [i2t[ids[0]]]}
    r, _, after = _rankings(tmp_path, pairs, t2i)
    refused(r, f"query id {ids[0]} appears twice")
    zero = dict(i2t)
    zero["0" + ids[1]] = i2t[ids[1]]
    r, _, after = _rankings(tmp_path, zero, t2i)
    refused(r, f"query {ids[1]} has two ranked lists")
    assert after == before


@pytest.mark.parametrize("value, needle", [(2.5, "must be integers, got 2.5"), ("x7", "must be integers, got 'x7'"),
                                           (None, "must be integers, got None")])
def test_rankings_with_non_integer_ids_are_refused(tmp_path, official_lists, value, needle):
    i2t, t2i = official_lists
    bad = dict(i2t)
    query = next(iter(bad))
    bad[query] = i2t[query][:3] + [value] + i2t[query][4:]
    r, before, after = _rankings(tmp_path, bad, t2i)
    refused(r, needle)
    assert before == after


def test_rankings_as_a_string_are_refused(tmp_path, official_lists):
    i2t, t2i = official_lists
    bad = dict(i2t)
    query = next(iter(bad))
    bad[query] = "".join(str(c) for c in i2t[query])  # a string of digits is not a list of ids
    r, before, after = _rankings(tmp_path, bad, t2i)
    refused(r, f"query {query} has str")
    assert before == after


def test_library_rankings_refuse_a_repeated_item():
    """evaluate_rankings (index arrays) refuses a list naming an item twice, and it would otherwise
    count: the repeat doubles the hit of that query's R-Precision."""
    import scipy.sparse as sp
    import torch

    from zsprob.retrieval import metrics as M
    from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
    from zsprob.retrieval.evaluate import evaluate_rankings

    pos = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float32))
    task = RetrievalTask("toy", np.arange(2), np.arange(4), np.array([0, 0, 1, 1]),
                         sets=[BenchmarkSet("pm", pos, sp.csr_matrix(pos.T), kind="precision")])
    good_i2t = np.array([[0, 2, 1, 3], [2, 0, 3, 1]])
    t2i = np.array([[0, 1], [0, 1], [1, 0], [1, 0]])
    got = evaluate_rankings(good_i2t, t2i, task, ks=(1,))
    assert got["pm"]["i2t"]["rprecision"] == pytest.approx(50.0)
    repeated = np.array([[0, 0, 1, 3], [2, 0, 3, 1]])
    counted = M.metrics_from_ranking(torch.from_numpy(repeated), pos, ks=(1,), r_metrics=True).values["rprecision"]
    assert counted[0] == pytest.approx(1.0)  # what the repeat would score: its one hit counted twice
    with pytest.raises(ValueError, match="query 0 holds index 0 more than once"):
        evaluate_rankings(repeated, t2i, task, ks=(1,))


# ----------------------------------------------------------------------------- npz inputs
N_IMG, PER, DIM = 12, 3, 6

NPZ_CASES = {
    "string image ids": (dict(image_ids=np.array([f"img{i}" for i in range(N_IMG)])), "image_ids", "dtype <U"),
    "float image ids": (dict(image_ids=np.arange(N_IMG) + 0.5), "image_ids", "dtype float64"),
    "2-D caption ids": (dict(caption_ids=np.arange(N_IMG * PER).reshape(-1, 1)), "caption_ids", "shape"),
    "repeated caption ids": (dict(caption_ids=np.arange(N_IMG * PER) // 2), "caption_ids", "id 0 more than once"),
    "string means": (dict(image_mu=np.full((N_IMG, DIM), "a")), "image_mu", "real numbers"),
    "NaN in logvar": (dict(caption_logvar=np.full((N_IMG * PER, DIM), np.nan, np.float32)), "caption_logvar",
                      "NaN"),
    "no images": (dict(image_ids=np.zeros(0, np.int64), image_mu=np.zeros((0, DIM), np.float32),
                       image_logvar=np.zeros((0, DIM), np.float32), caption_image=None), "image_mu", "empty"),
    "zero-width means": (dict(image_mu=np.zeros((N_IMG, 0), np.float32), caption_mu=np.zeros((N_IMG * PER, 0)),
                              image_logvar=None, caption_logvar=None), "image_mu", "empty"),
    "logvar above 88": (dict(image_logvar=np.full((N_IMG, DIM), 200.0, np.float32)), "image_logvar",
                        "overflows float32"),
    "float caption_image": (dict(caption_image=np.repeat(np.arange(N_IMG), PER) * 1.0), "caption_image", "float64"),
    "ids shorter than means": (dict(image_ids=np.arange(N_IMG - 1)), "image_ids", "11 ids for 12 rows"),
}


def _npz(path, case: str) -> Path:
    overrides, _, _ = NPZ_CASES[case]
    make_npz(path, n_img=N_IMG, per=PER, d=DIM, **overrides)
    return path


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_bad_npz_in_eval_embeddings(tmp_path, case):
    _, key, needle = NPZ_CASES[case]
    e = _npz(tmp_path / "e.npz", case)
    out = tmp_path / "res" / "m.json"
    out.parent.mkdir()
    out.write_text("earlier results\n")  # a file the user has: kept byte for byte
    before = snapshot(tmp_path)
    refused(run_cli("eval", "embeddings", e, "--out", out), str(e), key, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", ["string image ids", "float image ids", "repeated caption ids", "no images"])
def test_bad_npz_in_index_build_and_search(tmp_path, case):
    _, key, needle = NPZ_CASES[case]
    e = _npz(tmp_path / "bad.npz", case)
    refused(run_cli("index", "build", "--embeddings", e, "--out", tmp_path / "idx"), str(e), key, needle)
    assert not (tmp_path / "idx").exists()
    make_npz(tmp_path / "good.npz", n_img=N_IMG, per=PER, d=DIM)
    r = run_cli("index", "build", "--embeddings", tmp_path / "good.npz", "--out", tmp_path / "good")
    assert r.returncode == 0, r.stderr
    if key.startswith("image"):  # the default query side
        before = snapshot(tmp_path)
        r = run_cli("index", "search", "--index", tmp_path / "good", "--queries", e, "--out", tmp_path / "s.json")
        refused(r, str(e), key, needle)
        assert snapshot(tmp_path) == before


def test_queries_of_another_dimension_are_refused(tmp_path):
    make_npz(tmp_path / "g.npz", n_img=N_IMG, per=PER, d=DIM)
    make_npz(tmp_path / "q.npz", n_img=N_IMG, per=PER, d=DIM + 2)
    assert run_cli("index", "build", "--embeddings", tmp_path / "g.npz", "--out", tmp_path / "idx").returncode == 0
    before = snapshot(tmp_path)
    r = run_cli("index", "search", "--index", tmp_path / "idx", "--queries", tmp_path / "q.npz", "--out",
                tmp_path / "s.json")
    refused(r, f"shape ({N_IMG}, {DIM + 2})", f"expects dimension {DIM}")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- index.json vs the index
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Indexes of one gallery (kinds flat, hnsw, torch ip / l2) and a flat index of another dimension."""
    root = tmp_path_factory.mktemp("indexes")
    make_npz(root / "e.npz", n_img=N_IMG, per=PER, d=DIM)
    make_npz(root / "e4.npz", n_img=N_IMG, per=PER, d=4)
    for name, args in {"flat": ["--kind", "flat"], "hnsw": ["--kind", "hnsw"], "torch": ["--kind", "torch"],
                       "torch_l2": ["--kind", "torch", "--metric", "l2"]}.items():
        r = run_cli("index", "build", "--embeddings", root / "e.npz", *args, "--out", root / name)
        assert r.returncode == 0, r.stderr
    assert run_cli("index", "build", "--embeddings", root / "e4.npz", "--out", root / "flat4").returncode == 0
    return root


def _edit_meta(**changes):
    def edit(d: Path):
        meta = json.loads((d / "index.json").read_text())
        for k, v in changes.items():
            if v is None:
                meta.pop(k)
            else:
                meta[k] = v
        (d / "index.json").write_text(json.dumps(meta))
    return edit


def _copy_from(src: str, name: str):
    return lambda d: shutil.copy(d.parent / src / name, d / name)


INDEX_CASES = {
    "no dim": ("flat", _edit_meta(dim=None), "index.json lacks dim"),
    "no kind": ("flat", _edit_meta(kind=None), "index.json lacks kind"),
    "dim disagrees": ("flat", _edit_meta(dim=4), "index.faiss holds vectors of dimension 7 (embedding dim 6), "
                                                 "but index.json says dim 4"),
    "dim as a string": ("flat", _edit_meta(dim="6"), "dim must be an integer >= 1, got '6'"),
    "metric disagrees": ("flat", _edit_meta(metric="l2"), "index.faiss uses metric 'ip', but index.json says metric 'l2'"),
    "kind disagrees": ("flat", _edit_meta(kind="hnsw"), "index.faiss holds a FAISS IndexFlatIP, but index.json says "
                                                        "kind 'hnsw'"),
    "size disagrees": ("flat", _edit_meta(size=5), f"holds {N_IMG * PER} ids, but index.json says size 5"),
    "ntotal disagrees": ("flat", lambda d: (_edit_meta(size=N_IMG * PER - 1)(d),
                                            np.save(d / "ids.npy", np.arange(N_IMG * PER - 1))),
                         f"index.faiss holds {N_IMG * PER} vectors, but index.json says size {N_IMG * PER - 1}"),
    "another dimension's index.faiss": ("flat", _copy_from("flat4", "index.faiss"), "dimension 5 (embedding dim 4)"),
    "an hnsw index.faiss": ("flat", _copy_from("hnsw", "index.faiss"), "holds a FAISS IndexHNSWFlat"),
    "torch gallery of the other metric": ("torch", _copy_from("torch_l2", "gallery.npy"),
                                          "gallery.npy holds l2-augmented vectors but index.json says metric 'ip'"),
    "torch gallery of another shape": ("torch", lambda d: np.save(d / "gallery.npy", np.zeros((4, 3), np.float32)),
                                       "gallery.npy holds a float32 array of shape (4, 3)"),
    "float ids.npy": ("flat", lambda d: np.save(d / "ids.npy", np.arange(N_IMG * PER) * 1.0), "ids.npy: ids must hold "
                                                                                               "integer ids"),
    "repeated ids.npy": ("flat", lambda d: np.save(d / "ids.npy", np.zeros(N_IMG * PER, np.int64)), "more than once"),
    "bad params": ("hnsw", _edit_meta(params={"ef_search": -3}), "params.ef_search must be an integer >= 1"),
    "not an object": ("flat", lambda d: (d / "index.json").write_text("[1, 2]"), "not a zsprob CSD index"),
    "newer version": ("flat", _edit_meta(version=7), "version 7 is not one this zsprob reads"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_index_json_disagreeing_with_the_index_is_refused(tmp_path, built, case):
    src, edit, needle = INDEX_CASES[case]
    d = tmp_path / "idx"
    shutil.copytree(built / src, d)
    for other in ("flat4", "hnsw", "torch_l2"):
        (tmp_path / other).symlink_to(built / other)
    edit(d)
    out = tmp_path / "res.json"
    out.write_text("{}\n")
    before = snapshot(tmp_path)
    refused(run_cli("index", "search", "--index", d, "--queries", built / "e.npz", "--out", out), needle)
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- build options
def test_nlist_above_the_gallery_is_refused_naming_the_largest(tmp_path):
    make_npz(tmp_path / "e.npz", n_img=N_IMG, per=PER, d=DIM)
    n = N_IMG * PER
    refused(run_cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "ivf", "--nlist", n + 1,
                    "--out", tmp_path / "idx"), f"nlist {n + 1} is larger than the gallery ({n} items)",
            f"nlist <= {n}")
    assert not (tmp_path / "idx").exists()
    # the largest allowed builds, and searches exactly with every list probed
    r = run_cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "ivf", "--nlist", n, "--nprobe", n,
                "--out", tmp_path / "idx")
    assert r.returncode == 0, r.stderr
    assert f"nlist={n}" in r.stdout
    r = run_cli("index", "search", "--index", tmp_path / "idx", "--queries", tmp_path / "e.npz", "-k", 3)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind, option", [("flat", "--nlist"), ("hnsw", "--nprobe"), ("ivf", "--ef-search"),
                                          ("torch", "--hnsw-m")])
def test_an_option_the_kind_ignores_is_refused(tmp_path, kind, option):
    make_npz(tmp_path / "e.npz", n_img=N_IMG, per=PER, d=DIM)
    refused(run_cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", kind, option, 4,
                    "--out", tmp_path / "idx"), f"{option} applies to --kind", f"not to kind {kind}")
    assert not (tmp_path / "idx").exists()


def test_search_override_the_index_ignores_is_refused(tmp_path, built):
    refused(run_cli("index", "search", "--index", built / "flat", "--queries", built / "e.npz", "--nprobe", 4,
                    "--out", tmp_path / "s.json"), "--nprobe applies to --kind ivf")
    assert not (tmp_path / "s.json").exists()


# ----------------------------------------------------------------------------- outputs and inputs
def test_save_embeddings_with_embeddings_is_refused(tmp_path):
    make_npz(tmp_path / "e.npz", n_img=N_IMG, per=PER, d=DIM)
    before = snapshot(tmp_path)
    refused(run_cli("eval", "coco", "--embeddings", tmp_path / "e.npz", "--save-embeddings", tmp_path / "s.npz",
                    "--out", tmp_path / "res" / "m.json"), "--save-embeddings", "with --embeddings")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["eval embeddings", "eval coco", "index search", "index search into the index",
                                     "eval rankings"])
def test_an_output_that_is_an_input_is_refused(tmp_path, built, command):
    e = tmp_path / "e.npz"
    shutil.copy(built / "e.npz", e)
    idx = tmp_path / "idx"
    shutil.copytree(built / "flat", idx)
    (tmp_path / "r.json").write_text("{}")
    args = {"eval embeddings": ["eval", "embeddings", e, "--out", e],
            "eval coco": ["eval", "coco", "--embeddings", e, "--out", e],
            "index search": ["index", "search", "--index", idx, "--queries", e, "--out", e],
            "index search into the index": ["index", "search", "--index", idx, "--queries", e, "--out",
                                            idx / "index.json"],
            "eval rankings": ["eval", "rankings", "--i2t", tmp_path / "r.json", "--t2i", tmp_path / "r.json",
                              "--out", tmp_path / "r.json"]}[command]
    before = snapshot(tmp_path)
    refused(run_cli(*args), "--out would write", "choose another path")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- not errors: the right result
def test_k_above_the_index_returns_every_item_as_strict_json(tmp_path, built):
    out = tmp_path / "s.json"
    n = N_IMG * PER
    r = run_cli("index", "search", "--index", built / "flat", "--queries", built / "e.npz", "-k", n + 20,
                "--out", out)
    assert r.returncode == 0, r.stderr
    assert f"returning all {n} items" in r.stdout
    res = strict_json(out)
    ids = np.array(res["ids"])
    assert ids.shape == (N_IMG, n) and res["k"] == n
    assert all(sorted(row) == sorted(np.load(built / "flat" / "ids.npy").tolist()) for row in ids.tolist())
    csd = np.array(res["csd"], dtype=np.float64)
    assert np.isfinite(csd).all() and (np.diff(csd, axis=1) >= -1e-4).all()


def test_missing_neighbours_are_null_not_infinity(tmp_path):
    """An IVF index probing one of many lists finds fewer than k items for some queries: their ids are
    -1 and their CSD null, so the file stays JSON."""
    make_npz(tmp_path / "e.npz", n_img=40, per=5, d=DIM)
    r = run_cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "ivf", "--nlist", 100,
                "--nprobe", 1, "--out", tmp_path / "idx")
    assert r.returncode == 0, r.stderr
    r = run_cli("index", "search", "--index", tmp_path / "idx", "--queries", tmp_path / "e.npz", "-k", 20,
                "--out", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    res = strict_json(tmp_path / "s.json")
    ids, csd = np.array(res["ids"]), res["csd"]
    missing = ids == -1
    assert missing.any()
    assert all((c is None) == m for row_c, row_m in zip(csd, missing.tolist()) for c, m in zip(row_c, row_m))
