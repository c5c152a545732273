"""The bad-input matrix: every command, every option, every way its value can be wrong.

The rows are generated from the click commands themselves (:func:`test_cli_checks.all_commands`), so
a new command or option is covered without anyone writing a row for it. Each command has a *base*: a
valid invocation on real inputs made here (a tiny SynthWorld with its classification splits, an
embeddings file, a FAISS index, a COCO miniature, a published-format PCME++ directory, ranked lists).
A row replaces one option's value in the base (or adds the option) with a bad value chosen from the
option's type:

=================  ==========================================================================
type               bad values
=================  ==========================================================================
count              text, a fraction, nan, inf, below its minimum
integer            text, a fraction, nan (and out of range for a bounded one)
float              text, nan, inf, -inf
choice             a name not among the choices
input file         missing, a directory, empty, random bytes, not UTF-8, a JSON list
input directory    missing, a file, an empty directory
other paths        by name: class files, cache directories, resume sources
strings            by name: --device, --topk, --k-grid, --templates, --config, --set, --model, ...
=================  ==========================================================================

Every row asserts what the README promises: exit status 2, exactly one stderr line starting
``zsprob: error:`` that names the option, its key or the bad value, no traceback, and nothing created
or changed under ``--out``. The rows run through the fork-server runner (``conftest.run_cli``): one
pre-imported interpreter, a real child process per row. The last test checks that no input the rows
were given changed on disk.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import click
import numpy as np
import pytest

from conftest import run_cli
from test_cli_checks import all_commands

OUT = "{OUT}"

#: a valid invocation per command; "{NAME}" is a path from the ``inputs`` fixture
BASES: dict[str, list[str]] = {
    "data synthetic": ["data", "synthetic", "--out", OUT, "--preset", "quick", "--preview-only", "--no-progress"],
    "pretrain": ["pretrain", "--data", "synthetic", "--shards", "{WORLD}/pretrain", "--out", OUT,
                 "--model", "zsprob-tiny-bow", "--steps", "1", "--batch-size", "4", "--no-progress"],
    "finetune coco": ["finetune", "coco", "--root", "{COCO}", "--out", OUT, "--model", "zsprob-tiny-bow",
                      "--pretrained", "null", "--steps", "1", "--batch-size", "2", "--no-progress"],
    "select-prompts": ["select-prompts", "--checkpoint", "{CKPT}", "--dataset", "synthetic", "--root", "{WORLD}",
                       "--device", "cpu", "--workers", "0", "--out", OUT + "/selection.json"],
    "zeroshot": ["zeroshot", "synthetic", "--checkpoint", "{CKPT}", "--root", "{WORLD}", "--device", "cpu",
                 "--workers", "0", "--out", OUT + "/zeroshot.json"],
    "probe": ["probe", "synthetic", "--checkpoint", "{CKPT}", "--root", "{WORLD}", "--device", "cpu",
              "--workers", "0", "--seeds", "1", "--out", OUT + "/probe.json"],
    "eval coco": ["eval", "coco", "--embeddings", "{EMB}", "--out", OUT + "/metrics.json"],
    "eval embeddings": ["eval", "embeddings", "{EMB}", "--out", OUT + "/metrics.json"],
    "eval rankings": ["eval", "rankings", "--i2t", "{I2T}", "--t2i", "{T2I}", "--out", OUT + "/metrics.json"],
    "eval synthetic": ["eval", "synthetic", "--checkpoint", "{CKPT}", "--root", "{WORLD}", "--device", "cpu",
                       "--workers", "0", "--out", OUT + "/metrics.json"],
    "index build": ["index", "build", "--embeddings", "{EMB}", "--device", "cpu", "--out", OUT + "/index"],
    "index search": ["index", "search", "--index", "{INDEX}", "--queries", "{EMB}", "--device", "cpu",
                     "--out", OUT + "/results.json"],
    "convert": ["convert", "{PUBLISHED}", "--model", "pcmepp-tiny", "--out", OUT],
    "export": ["export", "{CKPT_OPEN_CLIP}", "--out", OUT],
    "posthoc": ["posthoc", "--checkpoint", "{CKPT_OPEN_CLIP}", "--data", "synthetic", "--shards", "{WORLD}/pretrain",
                "--views", "1", "--steps", "2", "--batch-size", "8", "--out", OUT],
    "eval flickr30k": ["eval", "flickr30k", "--checkpoint", "{CKPT}", "--root", "{FLICKR}", "--device", "cpu",
                       "--workers", "0", "--out", OUT + "/metrics.json"],
    "finetune flickr30k": ["finetune", "flickr30k", "--root", "{FLICKR}", "--out", OUT, "--model", "zsprob-tiny-bow",
                           "--pretrained", "null", "--steps", "1", "--batch-size", "2", "--no-progress"],
    "reproduce": ["reproduce", "pcmepp-table1-eval", "--smoke", "--out", OUT],
    "demo": ["demo", "--out", OUT, "--quick"],
}

#: bad files, made once by the ``inputs`` fixture
BAD_FILES = {"{EMPTY_FILE}": "empty", "{GARBAGE}": "random bytes", "{NOT_UTF8}": "not UTF-8",
             "{JSON_LIST}": "a JSON list"}
#: bad values per option of plain string type, by option name
STRINGS: dict[str, list[str]] = {
    "device": ["tpu9", "cuda", "cuda:7", ""],
    "topk": ["abc", "0", "-2", "nan", "1.5"],
    "k_grid": ["a,b", "0,1", "nan", ",", "5-1"],
    "templates": ["{MISSING}", "{EMPTY_FILE}", "{NOT_UTF8}"],
    "config": ["{MISSING}", "{NOT_UTF8}", "{GARBAGE}", "{YAML_LIST}", "{YAML_UNKNOWN_KEY}"],
    "set": ["noequals", "optim.lrr=1", "optim.lr=abc", "optim.lr=nan", "optim.betas=5", "train.precision=fp8",
            "optim.layer_decay=nan", "data.batch_size=inf",
            # a section that is no section; numbers torch would refuse with a traceback or use silently wrongly
            "optim=null", "optim=1", "model.overrides=5", "optim.lr=-1", "optim.lr=0", "optim.betas=[0.9,1.5]",
            "optim.eps=-1", "seed=abc", "optim.grad_clip=-1", "data.noise_ratio=1.5", "model.sigma_depth=-1",
            "schedule.min_lr_ratio=2", "train.threads=100000"],
    "model_name": ["no-such-model-name"],
    "model": ["no-such-model-name"],
    "pretrained": ["{MISSING}", "{GARBAGE}"],
    "shards": ["{MISSING}", "{EMPTY_DIR}"],
    "resume": ["sometimes"],
    "remote_sync": ["nosuchscheme://bucket/run"],
    "classes": ["{MISSING}", "{EMPTY_FILE}", "{NOT_UTF8}", "{DUP_CLASSES}"],
    "cache_dir": ["{A_FILE}"],
    "format": ["no-such-format", ""],
    "feature_file": ["{GARBAGE}", "{EMPTY_FILE}", "{EMPTY_DIR}"],
    "resume_from": ["{MISSING}", "{EMPTY_DIR}"],
    "kshots": ["abc", "0", "1,x", "-2", "1000"],
}
#: commands whose arguments another program parses (CLIP_benchmark's own command line)
PASSED_ON = {"clip-benchmark"}
#: options covered by tests/test_cli_checks.py or that take any value
SKIP = {"out", "help", "debug", "seed"}
#: float options whose every finite value is valid (none today); the rest refuse nan / inf
ANY_FLOAT: set[str] = set()


def _values(param: click.Parameter) -> list[str]:
    from zsprob.cli.types import Count, InPath
    t = param.type
    if isinstance(t, Count):
        return ["abc", "1.5", "nan", "inf", "0" if t.rule == ">=1" else "-1"]
    if isinstance(t, click.Choice):
        return ["no-such-choice"]
    if isinstance(t, InPath):
        if t.kind == "dir":
            return ["{MISSING}", "{A_FILE}", "{EMPTY_DIR}"]
        bad = ["{MISSING}", "{EMPTY_FILE}", "{GARBAGE}", "{NOT_UTF8}", "{JSON_LIST}"]
        return bad + (["{EMPTY_DIR}"] if t.kind == "any" else ["{EMPTY_DIR}"])
    if isinstance(t, click.IntRange):
        low = t.min if t.min is not None else 0
        return ["abc", "1.5", "nan", str(low - 1 if t.min is not None else t.max + 1)]
    if isinstance(t, click.types.IntParamType):
        return ["abc", "1.5", "nan", "-1"]
    if isinstance(t, click.types.FloatParamType):
        return ["abc"] + ([] if param.name in ANY_FLOAT else ["nan", "inf", "-inf"])
    if param.name in STRINGS:
        return STRINGS[param.name]
    return []


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for path, cmd in all_commands():
        name = " ".join(path)
        if name in PASSED_ON:
            continue
        if name not in BASES:
            raise AssertionError(f"`zsprob {name}` has no base invocation in tests/test_cli_matrix.py: add one")
        for p in cmd.params:
            if p.name in SKIP or getattr(p, "is_flag", False):
                continue
            flag = p.opts[-1] if isinstance(p, click.Option) else p.name.upper()
            for value in _values(p):
                rows.append((name, flag, value))
    return rows


ROWS = _rows()


def _with(base: list[str], flag: str, value: str, positional: list[str]) -> list[str]:
    """``base`` with ``flag``'s value replaced by ``value`` (or the option added); an upper-case flag is a
    positional argument, replaced in place."""
    args = list(base)
    if flag.isupper():
        args[len(positional)] = value  # the first argument after the command path
        return args
    if flag in args:
        args[args.index(flag) + 1] = value
        return args
    return args + [flag, value]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_world):
    import torch

    from test_data_coco import make_coco
    from test_data_flickr import make_flickr
    from test_export import _tiny
    from test_models_published import write_pcmepp_hf
    from test_retrieval_cli import make_npz
    from zsprob.data.synthetic import generate
    from zsprob.models import create_model, save

    base = tmp_path_factory.mktemp("matrix")
    world = base / "world"
    generate(world, image_size=32, num_pretrain=32, num_classify_select=2, num_classify_eval=2, num_retrieval=4,
             num_retrieval_val=6, shard_size=32, progress=False)
    make_flickr(world, base / "flickr")
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny-bow"), base / "ckpt")
    open_clip_ckpt = save(_tiny(), base / "ckpt_open_clip")
    emb = base / "emb.npz"
    make_npz(emb)
    make_coco(base / "coco")
    write_pcmepp_hf(base / "published")
    index = base / "index"
    r = run_cli("index", "build", "--embeddings", emb, "--device", "cpu", "--out", index)
    assert r.returncode == 0, r.stderr
    i2t, t2i = _official_rankings(base)
    bad = base / "bad"
    bad.mkdir()
    (bad / "empty_dir").mkdir()
    (bad / "empty").write_bytes(b"")
    (bad / "garbage").write_bytes(np.random.default_rng(0).bytes(512))
    (bad / "not_utf8").write_bytes(b"\xff\xfe\xfa not utf-8 \xc3\x28\n")
    (bad / "list.json").write_text("[1, 2, 3]\n")
    (bad / "a_file").write_text("x\n")
    (bad / "list.yaml").write_text("- optim\n- lr\n")
    (bad / "unknown.yaml").write_text("optim:\n  lrr: 0.1\n")
    (bad / "dup_classes.txt").write_text("cat\ndog\ncat\n")
    paths = {"{WORLD}": world, "{CKPT}": ckpt, "{EMB}": emb, "{COCO}": base / "coco", "{PUBLISHED}": base / "published",
             "{INDEX}": index, "{CKPT_OPEN_CLIP}": open_clip_ckpt, "{FLICKR}": base / "flickr", "{I2T}": i2t, "{T2I}": t2i, "{MISSING}": bad / "missing",
             "{EMPTY_DIR}": bad / "empty_dir", "{EMPTY_FILE}": bad / "empty", "{GARBAGE}": bad / "garbage",
             "{NOT_UTF8}": bad / "not_utf8", "{JSON_LIST}": bad / "list.json", "{A_FILE}": bad / "a_file",
             "{YAML_LIST}": bad / "list.yaml", "{YAML_UNKNOWN_KEY}": bad / "unknown.yaml",
             "{DUP_CLASSES}": bad / "dup_classes.txt"}
    return {"paths": {k: str(v) for k, v in paths.items()}, "base": base, "digest": _digest(base)}


def _official_rankings(base: Path, length: int = 200) -> tuple[Path, Path]:
    """Ranked lists on the official COCO 5K test ids (eccv_caption's) in `zsprob eval rankings`' two
    formats, ranked by CSD on synthetic embeddings (as tests/test_retrieval_cli.py makes them)."""
    from test_retrieval_eccv import synthetic_official_embeddings
    from zsprob.retrieval import metrics as M
    from zsprob.retrieval.coco import task_for_embeddings
    from zsprob.retrieval.scoring import PairScores

    emb, _ = task_for_embeddings(synthetic_official_embeddings(d=16, noise=0.6))
    ps = PairScores("csd", emb.image_mu, emb.image_logvar, emb.caption_mu, emb.caption_logvar)
    ri = M.rank_lists(ps.i2t, np.arange(len(emb.image_ids)), length).numpy()
    rt = M.rank_lists(ps.t2i, np.arange(len(emb.caption_ids)), length).numpy()
    i2t, t2i = base / "i2t.json", base / "t2i.json"
    i2t.write_text(json.dumps({str(k): v for k, v in zip(emb.image_ids.tolist(), emb.caption_ids[ri].tolist())}))
    t2i.write_text(json.dumps({"query_ids": emb.caption_ids.tolist(), "ids": emb.image_ids[rt].tolist(),
                               "k": length}))
    return i2t, t2i


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _resolve(arg: str, paths: dict[str, str], out: Path) -> str:
    arg = arg.replace(OUT, str(out))
    for key, value in paths.items():
        arg = arg.replace(key, value)
    return arg


@pytest.mark.parametrize("command, flag, value", ROWS, ids=[f"{c}|{f}|{v}" for c, f, v in ROWS])
def test_bad_input_is_one_line_exit_2(command, flag, value, inputs, tmp_path):
    paths = inputs["paths"]
    out = tmp_path / "out"
    path = command.split()
    args = [_resolve(a, paths, out) for a in _with(BASES[command], flag, value, path)]
    shown = _resolve(value, paths, out)
    r = run_cli(*args, cwd=tmp_path, timeout=180)
    err = r.stderr
    assert r.returncode == 2, f"exit {r.returncode}: zsprob {' '.join(args)}\n{err[-3000:]}"
    assert err.startswith("zsprob: error:") and err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    key = flag.lstrip("-")
    names = {flag, key, key.replace("-", "_"), shown, os.path.basename(shown) if os.sep in shown else shown}
    if "=" in shown:
        names.add(shown.split("=")[0])
    assert any(n and n.lower() in err.lower() for n in names), f"the line names neither {flag} nor {shown!r}: {err}"
    assert not out.exists() or not any(out.rglob("*")), f"files written under --out: {sorted(out.rglob('*'))}"


@pytest.mark.parametrize("command", [c for c in BASES if c != "demo"])
def test_every_base_is_valid(command, inputs, tmp_path):
    """The rows mean something only if their base runs: each base exits 0 (the demo's is minutes long and
    is run by tests/test_report_demo.py's own invocations)."""
    out = tmp_path / "out"
    args = [_resolve(a, inputs["paths"], out) for a in BASES[command]]
    r = run_cli(*args, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, f"zsprob {' '.join(args)}\n{r.stderr[-3000:]}"


def test_the_matrix_covers_every_command():
    counts: dict[str, int] = {}
    for command, _, _ in ROWS:
        counts[command] = counts.get(command, 0) + 1
    assert set(counts) == set(BASES), set(BASES) ^ set(counts)
    assert {" ".join(p) for p, _ in all_commands()} == set(BASES) | PASSED_ON
    assert len(ROWS) >= 300, counts


def test_the_rows_left_every_input_unchanged(inputs):
    """Runs last in this module: the inputs the rows were given are byte-identical."""
    assert _digest(inputs["base"]) == inputs["digest"]
