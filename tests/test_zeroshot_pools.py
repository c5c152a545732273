"""Per-class prompt pools (CuPL format): the file checks, every strategy on pools of different sizes
(equal to the strategy run on each class alone, or to the template bank when the pools are full), and
`--class-prompts` end to end through the command line on a tiny SynthWorld."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_TOWERS, run_cli
from test_zeroshot_selection import make_world
from zsprob.errors import UserError
from zsprob.zeroshot import selection as S
from zsprob.zeroshot import strategy_registry as SR
from zsprob.zeroshot.pools import load_class_prompts, match_pools, pool_bank_from_embeddings
from zsprob.zeroshot.prompts import PromptBank
from zsprob.zeroshot.selection_base import Selection


def _template_bank_and_full_pools():
    bank, sel_f, ev = make_world(seed=4)
    C, T = bank.num_classes, bank.num_templates
    templates = [f"template {i} of a {{}}." for i in range(T)]          # no "a photo of a {}.": single = first
    tbank = PromptBank.from_embeddings(bank.mu, bank.logvar, bank.classnames, templates)
    pools = [[t.replace("{}", c) for t in templates] for c in bank.classnames]
    pbank = pool_bank_from_embeddings(bank.mu.reshape(C * T, -1), bank.logvar.reshape(C * T, -1),
                                      bank.classnames, pools)
    return tbank, pbank, sel_f, ev


def _run(name, bank, sel_f, ev):
    return S.run_strategy(name, bank, k=3, select=(sel_f.feats, sel_f.labels), pool=ev.feats,
                          eval_=(ev.feats, ev.labels))


def test_full_pools_give_every_strategy_the_template_bank_result():
    tbank, pbank, sel_f, ev = _template_bank_and_full_pools()
    for name in SR.strategy_names():
        a, b = _run(name, tbank, sel_f, ev), _run(name, pbank, sel_f, ev)
        assert torch.allclose(a.weights, b.weights, atol=1e-5), name
        assert torch.allclose(a.class_mu, b.class_mu, atol=1e-5), name
        assert a.k == b.k, name


def _uneven():
    """4 classes with pools of 1, 3, 6 and 2 prompts (D = 8) and images near the class prototypes."""
    g = torch.Generator().manual_seed(7)
    sizes, D = [1, 3, 6, 2], 8
    proto = F.normalize(torch.randn(4, D, generator=g), dim=-1)
    mu = torch.cat([proto[c] + 0.4 * torch.randn(n, D, generator=g) for c, n in enumerate(sizes)])
    logvar = -2.0 + torch.randn(sum(sizes), D, generator=g)
    names = ["cat", "dog", "red car", "oak"]
    pools = [[f"prompt {i} for {c}" for i in range(n)] for c, n in zip(names, sizes)]
    bank = pool_bank_from_embeddings(mu, logvar, names, pools)
    y = torch.arange(4).repeat_interleave(5)
    x = proto[y] + 0.5 * torch.randn(len(y), D, generator=g)
    return bank, mu, logvar, sizes, (x, torch.full_like(x, -3.0)), y


@pytest.mark.filterwarnings("ignore::UserWarning")   # torch.std of the one-prompt class alone
@pytest.mark.parametrize("name", ["all", "topk", "threshold", "fusion", "poe", "bprw-fewshot"])
def test_uneven_pools_equal_each_class_alone(name):
    """Strategies that treat classes independently: class c on the pool bank = a one-class bank of c's pool.
    (The shots are given without sigma^2, so BPRW's EM sees the same points, not different random draws.)"""
    bank, mu, logvar, sizes, (x, _), y = _uneven()
    xlv = None
    got = S.run_strategy(name, bank, k=4, select=((x, xlv), y))
    start = 0
    for c, n in enumerate(sizes):
        one = PromptBank.from_embeddings(mu[start:start + n][None], logvar[start:start + n][None], ["c"],
                                         [f"p{i} {{}}" for i in range(n)])
        start += n
        keep = y == c
        want = S.run_strategy(name, one, k=min(4, n), select=((x[keep], xlv), torch.zeros(int(keep.sum()),
                                                                                               dtype=torch.long)))
        assert torch.allclose(got.weights[c, :n], want.weights[0], atol=1e-5), (name, c)
        assert float(got.weights[c, n:].abs().sum()) == 0.0, (name, c)
        assert torch.allclose(got.class_mu[c], want.class_mu[0], atol=1e-5), (name, c)
        if want.k is not None:
            assert got.k[c] == want.k[0], (name, c)


def test_every_strategy_runs_on_uneven_pools_and_never_weights_an_absent_prompt():
    bank, _, _, sizes, feats, y = _uneven()
    for name in SR.strategy_names():
        sel = S.run_strategy(name, bank, k=2, select=(feats, y), pool=feats, eval_=(feats, y))
        assert torch.isfinite(sel.class_mu).all(), name
        assert torch.allclose(sel.weights.sum(1), torch.ones(4), atol=1e-5), name
        assert float((sel.weights * ~bank.mask).abs().sum()) == 0.0, name
        if sel.k is not None:
            assert all(1 <= k <= n for k, n in zip(sel.k, sizes)), (name, sel.k)
    # uncertainty ranking happens inside each class's pool
    top2 = S.select_topk(bank, 2)
    for c, n in enumerate(sizes):
        order = torch.argsort(bank.uncertainty[c, :n], stable=True)[:2].tolist()
        assert sorted(top2.weights[c].nonzero().flatten().tolist()) == sorted(order)
    doc = top2.to_dict()
    assert doc["classes"][1]["kept"][0]["prompt"].endswith("for dog") and doc["class_prompts"][0] == ["prompt 0 for cat"]
    back = Selection.from_dict(json.loads(json.dumps(doc)))
    assert back.class_prompts == bank.pools and torch.allclose(back.class_mu, top2.class_mu)


def test_pool_file_checks_are_one_line(tmp_path):
    def write(obj, raw=None):
        p = tmp_path / "p.json"
        p.write_text(raw if raw is not None else json.dumps(obj))
        return p

    assert load_class_prompts(write({"cat": [" a cat "], "dog": ["a dog", "two dogs"]})) == \
        {"cat": ["a cat"], "dog": ["a dog", "two dogs"]}
    for bad, what in (([1, 2], "JSON object"), ({}, "JSON object"), ({"cat": "a cat"}, "list of strings"),
                      ({"cat": []}, "empty"), ({"cat": ["ok", " "]}, "empty"), ({"cat": [3]}, "list of strings")):
        with pytest.raises(UserError, match=what) as e:
            load_class_prompts(write(bad))
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not JSON"):
        load_class_prompts(write(None, raw="{cat: [}"))
    with pytest.raises(UserError, match="not found"):
        load_class_prompts(tmp_path / "absent.json")
    with pytest.raises(UserError, match="no prompt pool for class 'dog'"):
        match_pools({"cat": ["a"]}, ["cat", "dog"])
    with pytest.raises(UserError, match="not in the dataset: 'cow'"):
        match_pools({"cat": ["a"], "dog": ["b"], "cow": ["c"]}, ["cat", "dog"])
    assert match_pools({"dog": ["b"], "cat": ["a", "c"]}, ["cat", "dog"]) == [["a", "c"], ["b"]]


# ----------------------------------------------------------------------------- the command line, end to end

@pytest.fixture(scope="module")
def pool_world(tmp_path_factory):
    """A 32 px SynthWorld with 1 selection and 2 evaluation images per class, and a tiny checkpoint."""
    from zsprob.data.classification import build_classification_dataset
    from zsprob.data.synthetic import generate
    from zsprob.models import create_model, save

    base = tmp_path_factory.mktemp("pools")
    generate(base / "sw", image_size=32, num_pretrain=0, num_classify_select=1, num_classify_eval=2,
             num_retrieval=0, num_retrieval_val=0, shard_size=32, progress=False)
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny", embed_dim=16, **TINY_TOWERS), base / "ckpt")
    names = list(build_classification_dataset("synthetic", base / "sw", split="eval").classnames)
    pools = {c: [f"a photo of a {c}."] + [f"a drawing of a {c}, variant {i}." for i in range(j % 4)]
             for j, c in enumerate(names)}
    (base / "pools.json").write_text(json.dumps(pools))
    return {"root": str(base / "sw"), "ckpt": str(ckpt), "pools": pools, "names": names, "base": base}


def _one_line_error(r, text):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1 and text in r.stderr, r.stderr


@pytest.mark.slow
def test_class_prompts_end_to_end(pool_world, tmp_path):
    w = pool_world
    out = tmp_path / "sel.json"
    r = run_cli("select-prompts", "--checkpoint", w["ckpt"], "--dataset", "synthetic", "--root", w["root"],
                "--class-prompts", w["base"] / "pools.json", "--topk", "2",
                "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    for entry in doc["classes"]:
        pool = w["pools"][entry["name"]]
        assert entry["k"] == min(2, len(pool)) and len(entry["kept"]) == entry["k"]
        assert {kept["prompt"] for kept in entry["kept"]} <= set(pool)
    assert "per-class pools" in r.stdout

    res = tmp_path / "cmp" / "results.json"
    r = run_cli("zeroshot", "synthetic", "--checkpoint", w["ckpt"], "--root", w["root"], "--class-prompts",
                w["base"] / "pools.json", "--compare", "--out", res)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(res.read_text())["rows"]}
    assert set(SR.compare_order()) <= set(rows)
    assert not [n for n, row in rows.items() if row.get("skipped")]
    assert rows["all"]["metrics"]["n_images"] == 2 * len(w["names"]) and "paired_vs_all" in rows["carprt"]

    r = run_cli("zeroshot", "synthetic", "--checkpoint", w["ckpt"], "--root", w["root"], "--class-prompts",
                w["base"] / "pools.json", "--strategy", "all", "--out", tmp_path / "one.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "one.json").read_text())["metrics"]["top1"] == rows["all"]["metrics"]["top1"]


@pytest.mark.slow
def test_class_prompts_refusals_end_to_end(pool_world, tmp_path):
    w = pool_world
    pools = dict(w["pools"])
    first = w["names"][0]
    common = ("zeroshot", "synthetic", "--checkpoint", w["ckpt"], "--root", w["root"], "--strategy", "all")

    def attempt(text=None, obj=None):
        p = tmp_path / "bad.json"
        p.write_text(text if text is not None else json.dumps(obj))
        return run_cli(*common, "--class-prompts", p, "--out", tmp_path / "r.json")

    _one_line_error(attempt(obj={k: v for k, v in pools.items() if k != first}), f"no prompt pool for class '{first}'")
    _one_line_error(attempt(obj={**pools, "unicorn": ["a unicorn"]}), "not in the dataset: 'unicorn'")
    _one_line_error(attempt(obj={**pools, first: []}), "is empty")
    _one_line_error(attempt(text="[not json"), "is not JSON")
    r = run_cli(*common, "--class-prompts", w["base"] / "pools.json", "--templates", "imagenet_templates.txt",
                "--out", tmp_path / "r.json")
    _one_line_error(r, "does not take --templates")
    assert not (tmp_path / "r.json").exists()
