"""The protocol audit: every strategy's registry facts (evaluation labels, transductive, which split's
labels), the rows that carry them, and ProLIP's BPRW in both modes (few-shot shots from a named split,
refused on the evaluation split unless allowed; NN, transductive)."""
from __future__ import annotations


import math

import pytest
import torch


from conftest import run_cli
from test_zeroshot_selection import make_world
from zsprob.errors import UserError
from zsprob.zeroshot import selection as S
from zsprob.zeroshot import strategy_registry as SR
from zsprob.zeroshot.baselines import select_bprw_fewshot
from zsprob.zeroshot.prompts import PromptBank

EXPECTED = {  # name: (reads eval labels, transductive, label split)
    "all": (False, False, None), "single": (False, False, None), "topk": (False, False, None),
    "global": (False, False, "selection split"), "auto": (False, False, "selection split (when given)"),
    "threshold": (False, False, None), "fusion": (False, False, None),
    "fusion-select": (False, False, "selection split"), "poe": (False, False, None),
    "bprw": (False, True, None), "bprw-fewshot": (False, False, "selection split"), "zpe": (False, True, None),
    "carprt": (False, True, None), "carprt-shared": (False, True, None),
    "oracle": (True, False, "evaluation split"), "oracle-global": (True, False, "evaluation split"),
}


def test_every_registry_entry_states_its_protocol():
    for name in SR.strategy_names():
        audit = SR.get_strategy(name).audit()
        assert set(audit) == {"reads_eval_labels", "transductive", "label_split"}, name
        if name in EXPECTED:
            assert tuple(audit.values()) == EXPECTED[name], name
    shots = SR.get_strategy("bprw-fewshot")
    assert shots.audit("eval") == {"reads_eval_labels": True, "transductive": True, "label_split": "evaluation split"}


def test_eval_shots_are_refused_unless_allowed():
    bank, sel_f, ev = make_world()
    given = dict(select=(sel_f.feats, sel_f.labels), pool=ev.feats, eval_=(ev.feats, ev.labels))
    with pytest.raises(UserError, match="--allow-eval-shots") as e:
        S.run_strategy("bprw-fewshot", bank, shots_split="eval", **given)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="shots-split"):
        S.run_strategy("bprw-fewshot", bank, shots_split="train", **given)
    on_select = S.run_strategy("bprw-fewshot", bank, **given)
    assert not on_select.uses_eval_labels and on_select.info["shots_from"] == "selection split"
    on_eval = S.run_strategy("bprw-fewshot", bank, shots_split="eval", allow_eval_shots=True, **given)
    assert on_eval.uses_eval_labels and "EVAL SHOTS" in on_eval.label
    # the shots are the evaluation images of each class: the same as calling the function on them directly
    direct = select_bprw_fewshot(bank, ev.feats, ev.labels, from_eval=True)
    assert torch.equal(on_eval.weights, direct.weights)
    assert on_eval.info["shots_per_class"] == [int((ev.labels == c).sum()) for c in range(bank.num_classes)]
    assert not torch.equal(on_eval.weights, on_select.weights)
    three = S.run_strategy("bprw-fewshot", bank, shots=3, **given)
    assert three.info["shots_per_class"] == [3] * bank.num_classes


def test_fewshot_bprw_upweights_the_prompt_that_explains_the_class_shots():
    D2 = 8
    mu = torch.zeros(2, 3, D2)
    for c in range(2):
        for t in range(3):
            mu[c, t, 2 * c] = 1.0
            mu[c, t, 2 * c + 1] = (-1.0, 0.0, 1.0)[t]
    logvar = torch.full((2, 3, D2), math.log(0.05))
    bank = PromptBank.from_embeddings(mu, logvar, ["a", "b"], ["x {}", "y {}", "z {}"])
    g = torch.Generator().manual_seed(0)
    # class a's shots sit on its template 2, class b's on its template 0
    xa = bank.mu_normed[0, 2] + 0.05 * torch.randn(12, D2, generator=g)
    xb = bank.mu_normed[1, 0] + 0.05 * torch.randn(12, D2, generator=g)
    x = torch.cat([xa, xb])
    y = torch.tensor([0] * 12 + [1] * 12)
    sel = select_bprw_fewshot(bank, (x, torch.full_like(x, math.log(1e-3))), y, alpha=1.0)
    assert sel.weights[0].argmax().item() == 2 and sel.weights[1].argmax().item() == 0
    assert sel.weights[0, 2] > 0.5 and sel.weights[1, 0] > 0.5
    with pytest.raises(UserError, match="no image of class 'b'"):
        select_bprw_fewshot(bank, xa, torch.zeros(12, dtype=torch.long))


def test_compare_rows_and_table_carry_the_audit():
    from zsprob.zeroshot.classify import compare_on_features

    bank, sel_f, ev = make_world()
    names = ["all", "auto", "bprw", "bprw-fewshot", "zpe", "oracle"]
    res = compare_on_features(bank, ev, sel_f, strategies=names)
    rows = {r["name"]: r for r in res["rows"]}
    for name in names:
        assert (rows[name]["reads_eval_labels"], rows[name]["transductive"], rows[name]["label_split"]) \
            == EXPECTED[name], name
    assert "transductive" in res["table"] and "labels from" in res["table"]
    with pytest.raises(UserError, match="--allow-eval-shots"):
        compare_on_features(bank, ev, sel_f, strategies=names, shots_split="eval")
    res = compare_on_features(bank, ev, None, strategies=names, shots_split="eval", allow_eval_shots=True)
    row = {r["name"]: r for r in res["rows"]}["bprw-fewshot"]
    assert row["uses_eval_labels"] and row["reads_eval_labels"] and row["label_split"] == "evaluation split"
    assert row["transductive"]
    assert "YES (eval shots)" in res["table"]
    skipped = compare_on_features(bank, ev, None, strategies=["bprw-fewshot"])["rows"][0]
    assert skipped["skipped"] == "no labelled selection split"


def test_cli_refuses_eval_shots_in_one_line(tmp_path):
    for command in (["zeroshot", "folder", "--root", tmp_path, "--strategy", "bprw-fewshot"],
                    ["select-prompts", "--dataset", "folder", "--root", tmp_path, "--strategy", "bprw-fewshot"],
                    ["zeroshot", "folder", "--root", tmp_path, "--compare"]):
        r = run_cli(*command, "--model", "zsprob-tiny", "--shots-split", "eval", "--out", tmp_path / "o.json")
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("zsprob: error: --shots-split eval") and r.stderr.count("\n") == 1, r.stderr
        assert "--allow-eval-shots" in r.stderr
    assert not (tmp_path / "o.json").exists()

