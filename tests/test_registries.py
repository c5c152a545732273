"""The method and strategy registries: every entry carries its facts and the facts match what the code does;
the command line's choices, the training defaults and the --compare order are read from them; an unknown
name is one UserError line with the choices; a strategy or method registered here reaches every caller."""
from __future__ import annotations

import inspect
import subprocess
import sys

import click
import pytest
import torch

from test_zeroshot_selection import make_world
from zsprob.errors import UserError
from zsprob.prob import method_registry as MR
from zsprob.zeroshot import selection as S
from zsprob.zeroshot import strategy_registry as SR
from zsprob.zeroshot.classify import compare_on_features
from zsprob.zeroshot.selection_base import NeedsSigma


@pytest.fixture
def strategy_sandbox(monkeypatch):
    """Strategies registered inside a test disappear after it."""
    monkeypatch.setattr(SR, "_REGISTRY", dict(SR._REGISTRY))


@pytest.fixture
def method_sandbox(monkeypatch):
    monkeypatch.setattr(MR, "_REGISTRY", dict(MR._REGISTRY))
    monkeypatch.setattr(MR, "_ALIASES", dict(MR._ALIASES))


def _sigma_strategies() -> tuple[str, ...]:
    return tuple(name for name in SR.strategy_names() if SR.get_strategy(name).sigma)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- strategies

def test_every_strategy_has_its_facts_and_a_function():
    assert SR.strategy_names() == ("all", "single", "topk", "global", "auto", "threshold", "fusion", "fusion-select",
                                   "poe", "bprw", "bprw-fewshot", "zpe", "carprt", "carprt-shared", "oracle",
                                   "oracle-global")
    for name in SR.strategy_names():
        entry = SR.get_strategy(name)
        assert callable(entry.run), name
        assert set(entry.reads) <= set(SR.DATA_KINDS) and set(entry.needs) <= set(entry.reads), name
        assert isinstance(entry.sigma, bool) and isinstance(entry.needs_k, bool), name
        assert (entry.compare is None) == entry.needs_k, name  # --compare passes no K
    assert [n for n in SR.strategy_names() if SR.get_strategy(n).reads_eval_labels] == ["oracle", "oracle-global"]
    assert SR.compare_order() == ("all", "single", "global", "auto", "threshold", "fusion", "fusion-select", "poe",
                                  "bprw", "bprw-fewshot", "zpe", "carprt", "carprt-shared", "oracle-global", "oracle")


def test_the_sigma_and_eval_label_facts_are_what_the_strategies_do():
    """With every input given: a deterministic bank is refused exactly by the sigma strategies, and a
    selection says it used evaluation labels exactly when its entry reads them."""
    full = dict(k=3)
    bank, sel_f, ev = make_world(det=True)
    refused = []
    for name in SR.strategy_names():
        try:
            S.run_strategy(name, bank, select=(sel_f.feats, sel_f.labels), pool=ev.feats, eval_=(ev.feats, ev.labels),
                           **full)
        except NeedsSigma:
            refused.append(name)
    assert tuple(refused) == _sigma_strategies()
    bank, sel_f, ev = make_world()
    for name in SR.strategy_names():
        sel = S.run_strategy(name, bank, select=(sel_f.feats, sel_f.labels), pool=ev.feats,
                             eval_=(ev.feats, ev.labels), **full)
        assert sel.uses_eval_labels == SR.get_strategy(name).reads_eval_labels, name
        assert sel.strategy == name


def test_a_missing_needed_input_names_its_flag_and_optional_inputs_fall_back():
    bank, sel_f, ev = make_world()
    for name in SR.strategy_names():
        entry = SR.get_strategy(name)
        if not entry.needs:
            continue
        with pytest.raises(UserError) as e:
            S.run_strategy(name, bank, k=3)
        assert _one_line(e).startswith(f"strategy '{name}' needs"), name
    assert "--select-root" in str(pytest.raises(UserError, S.run_strategy, "global", bank).value)
    assert S.run_strategy("auto", bank).info["variant"] == "label-free (no selection split)"


def test_topk_needs_k_is_one_rule_for_the_library_and_the_command_line():
    from zsprob.zeroshot.options import strategy_from_topk

    bank, _, _ = make_world()
    with pytest.raises(UserError) as library:
        S.run_strategy("topk", bank)
    with pytest.raises(UserError) as cli:
        strategy_from_topk(None, "topk")
    assert _one_line(library) == _one_line(cli) == "strategy 'topk' needs K: pass --topk N (a number)"
    assert strategy_from_topk("5", "topk") == ("topk", 5) and strategy_from_topk("5", "zpe") == ("zpe", None)


def test_an_unknown_strategy_is_one_line_with_the_choices_everywhere():
    from zsprob.zeroshot.classify import run_selection
    from zsprob.zeroshot.options import strategy_from_topk

    bank, _, _ = make_world()
    expected = f"unknown strategy 'nope'; choose from {', '.join(SR.strategy_names())}"
    for call in (lambda: SR.get_strategy("nope"), lambda: S.run_strategy("nope", bank),
                 lambda: strategy_from_topk(None, "nope"),
                 lambda: run_selection(None, dataset="synthetic", strategy="nope")):  # refused before any model work
        with pytest.raises(UserError) as e:
            call()
        assert _one_line(e) == expected


def test_a_registered_strategy_reaches_dispatch_and_compare_and_sees_only_its_data(strategy_sandbox):
    seen = {}

    def run(bank, given):
        seen.update(select=given.select, pool=given.pool, eval_=given.eval_, beta=given.request.beta)
        sel = S.select_fusion(bank, 2.0, strategy="mine", label="mine")
        sel.info["data_used"] = given.select_data
        return sel

    SR.register_strategy("mine", run=run, needs=(SR.SELECTION_LABELS,), sigma=True, compare=45)
    assert SR.strategy_names()[-1] == "mine"
    order = SR.compare_order()
    assert order[order.index("auto") + 1] == "mine" and order.index("mine") < order.index("threshold")
    assert "mine" in _sigma_strategies() and not SR.get_strategy("mine").reads_eval_labels

    bank, sel_f, ev = make_world()
    sel = S.run_strategy("mine", bank, select=(sel_f.feats, sel_f.labels), pool=ev.feats,
                         eval_=(ev.feats, ev.labels), beta=3.0)
    assert torch.equal(sel.class_mu, S.select_fusion(bank, 2.0).class_mu)
    assert seen["select"] is not None and seen["pool"] is None and seen["eval_"] is None and seen["beta"] == 3.0

    res = compare_on_features(bank, ev, sel_f)
    names = [row["name"] for row in res["rows"]]
    assert names == [*order, "linear-probe", "tip-adapter"] and not res["rows"][names.index("mine")].get("skipped")
    without_split = compare_on_features(bank, ev, None)
    assert {r["name"]: r.get("skipped") for r in without_split["rows"]}["mine"] == "no labelled selection split"


def test_registering_a_strategy_wrongly_is_a_programming_error(strategy_sandbox):
    with pytest.raises(ValueError, match="already registered"):
        SR.register_strategy("all")
    with pytest.raises(ValueError, match="unknown data"):
        SR.register_strategy("x", needs=("labels",))
    with pytest.raises(ValueError, match="needs K"):
        SR.register_strategy("y", needs_k=True, compare=5)
    with pytest.raises(ValueError, match="no function"):
        SR.register_strategy("z", sigma=True)


def test_the_strategy_names_everyone_reads_are_a_view_of_the_registry(strategy_sandbox):
    import zsprob.methods

    SR.register_strategy("late", run=lambda bank, given: S.select_all(bank))
    assert zsprob.methods.STRATEGIES == SR.strategy_names() and SR.strategy_names()[-1] == "late"
    assert _sigma_strategies() == ("topk", "global", "auto", "threshold", "fusion", "fusion-select", "poe", "bprw",
                                   "bprw-fewshot", "oracle", "oracle-global")


# ----------------------------------------------------------------------------- the command line

def _choices(path, option):
    from zsprob.cli import cli

    ctx = click.Context(cli)
    cmd = cli
    for name in path:
        cmd = cmd.get_command(ctx, name)
    (param,) = [p for p in cmd.params if option in p.opts]
    return tuple(param.type.choices)


def test_the_command_line_choices_are_the_registries():
    for path in (["zeroshot"], ["select-prompts"]):
        assert _choices(path, "--strategy") == SR.strategy_names(), path
    for path in (["pretrain"], ["finetune", "coco"]):
        assert _choices(path, "--method") == MR.method_names(), path


def test_names_and_defaults_are_read_without_torch():
    code = ("import sys\nfrom zsprob.methods import METHODS, STRATEGIES\nfrom zsprob.train.defaults import DEFAULTS\n"
            "from zsprob.zeroshot.options import strategy_from_topk\nimport zsprob.cli.zeroshot, zsprob.cli.pretrain\n"
            "assert strategy_from_topk('3', 'topk') == ('topk', 3) and set(DEFAULTS['loss']) == set(METHODS)\n"
            "assert 'torch' not in sys.modules\nprint(len(METHODS), len(STRATEGIES))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == [str(len(MR.method_names())), str(len(SR.strategy_names()))], \
        r.stderr


# ----------------------------------------------------------------------------- methods

def test_every_method_has_its_facts_and_its_defaults_build_its_loss():
    from zsprob.prob import create_loss, needs_sigma

    assert MR.method_names() == ("pcmepp", "pcme", "infonce", "triplet", "prob-triplet", "mu-only", "prolip", "jwae")
    for name in MR.method_names():
        entry = MR.get_method(name)
        assert entry.loss is not None and entry.step_kind in MR.STEP_KINDS, name
        assert needs_sigma(name) is entry.needs_sigma, name
        extra = {"latent_dim": 8} if name == "jwae" else {}
        loss = create_loss(name, **entry.default_options(), **extra)  # the defaults are options the loss takes
        assert isinstance(loss, entry.loss), name
        signature = inspect.signature(entry.loss).parameters  # ... and the loss's own defaults, declared twice
        assert {k: signature[k].default for k in entry.loss_defaults} == dict(entry.loss_defaults), name
    assert [n for n in MR.method_names() if MR.get_method(n).step_kind == "jwae"] == ["jwae"]
    assert [n for n in MR.method_names() if MR.get_method(n).needs_sigma] == ["pcmepp", "pcme", "prob-triplet",
                                                                              "prolip"]


def test_the_training_defaults_read_the_loss_options_from_the_registry():
    from zsprob.train import METHODS
    from zsprob.train.defaults import DEFAULTS, with_defaults

    assert METHODS == MR.method_names()
    assert list(DEFAULTS["loss"]) == list(MR.method_names())
    assert DEFAULTS["loss"] == MR.default_loss_options() == dict(with_defaults({}).loss)
    DEFAULTS["loss"]["pcmepp"]["pp_alpha"] = 0.5  # the config is a copy: the registry keeps its defaults
    try:
        assert MR.get_method("pcmepp").loss_defaults["pp_alpha"] == 0.1
    finally:
        DEFAULTS["loss"]["pcmepp"]["pp_alpha"] = 0.1


def test_pcme_implies_its_sigma_parameterisation_from_its_loss_form():
    pcme = MR.get_method("pcme")
    assert pcme.model_defaults({"loss": {"pcme": {"form": "official"}}}) == {"sigma_param": "logsigma"}
    assert pcme.model_defaults({"loss": {}}) == {"sigma_param": "logsigma"}  # official is the form's default
    assert pcme.model_defaults({"loss": {"pcme": {"form": "zsprob"}}}) == {"sigma_param": "logvar"}
    assert all(MR.get_method(n).model_defaults({"loss": {}}) == {} for n in MR.method_names() if n != "pcme")


def test_an_unknown_method_is_one_line_with_the_choices():
    from zsprob.prob import create_loss, needs_sigma

    choices = ", ".join(MR.method_names())
    with pytest.raises(UserError) as e:
        MR.get_method("arcface")
    assert _one_line(e) == f"unknown method 'arcface' (choose from {choices})"
    for call in (create_loss, needs_sigma):
        with pytest.raises(UserError) as e:
            call("arcface")
        assert _one_line(e) == f"unknown loss 'arcface' (choose from {choices})"
    assert MR.get_method("PCME++") is MR.get_method("pcmepp") and MR.get_method("prob_triplet").name == "prob-triplet"


def test_a_registered_method_reaches_the_factory_the_defaults_and_the_choices(method_sandbox):
    import zsprob.methods
    from zsprob.prob import create_loss, needs_sigma
    from zsprob.prob.losses import InfoNCELoss

    def factory(init_temperature=0.07, **kwargs):
        return InfoNCELoss(init_temperature=init_temperature, **kwargs)

    MR.register_method("mine", factory, needs_sigma=False, loss_defaults={"init_temperature": 0.05},
                       aliases=("my-clip",))
    assert zsprob.methods.METHODS[-1] == "mine" and MR.default_loss_options()["mine"] == {"init_temperature": 0.05}
    loss = create_loss("MY_CLIP", **MR.get_method("mine").default_options())
    assert isinstance(loss, InfoNCELoss) and needs_sigma("mine") is False
    with pytest.raises(UserError, match="bad options for loss 'mine'.*accepted: init_temperature, kwargs"):
        create_loss("mine", temperature=3)
    with pytest.raises(ValueError, match="already registered"):
        MR.register_method("clip", factory, needs_sigma=False)
    with pytest.raises(ValueError, match="step_kind"):
        MR.register_method("other", factory, needs_sigma=False, step_kind="gan")
