"""A config file is data: it cannot hang the tool (aliases that expand exponentially, nesting past the
parser's recursion) or run commands (a ``pipe:`` data source) unless the command line says so. Each case
hung, gave a 2,999-line traceback, or ran its command silently before issue 50."""
from __future__ import annotations

import pytest

from conftest import run_cli
from zsprob.config import load_yaml, read_yaml
from zsprob.errors import UserError

#: 9 levels of 9 aliases: 378 bytes that stand for 9^9 (387 million) numbers
BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
TINY = ["--data", "synthetic", "--batch-size", "4", "--steps", "1", "--no-progress"]


def _pretrain(config, world, out, *extra):
    return run_cli("pretrain", "--config", config, "--shards", world / "pretrain", "--out", out, *TINY, *extra,
                   timeout=120)


@pytest.mark.parametrize("text, why", [
    (BOMB, "its aliases expand to more than 100,000 values"),
    ("a: " + "[" * 50_000 + "]" * 50_000 + "\n", "it is nested more than 64 levels deep"),
    ("a: &a [1, *a]\n", "an alias refers to a collection that holds it"),
])
def test_a_config_that_would_hang_or_overflow_is_one_line(tmp_path, tiny_world, text, why):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    r = _pretrain(config, tiny_world, tmp_path / "run")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"zsprob: error: config file {config} is refused: {why}"]


def test_anchors_and_aliases_within_the_budget_still_read(tmp_path):
    config = tmp_path / "ok.yaml"
    config.write_text("lr: &lr 0.001\noptim: {lr: *lr}\nsched: &s {steps: 3}\nother: *s\n")
    assert read_yaml(config) == {"lr": 0.001, "optim": {"lr": 0.001}, "sched": {"steps": 3}, "other": {"steps": 3}}
    assert load_yaml("[" * 60 + "]" * 60) is not None  # deep, but within the limit


def test_a_pipe_in_a_config_file_is_refused_without_allow_pipe(tmp_path, tiny_world):
    marker = tmp_path / "ran"
    config = tmp_path / "recipe.yaml"
    shard = sorted((tiny_world / "pretrain").glob("*.tar"))[0]
    config.write_text(f"base: synthetic_tiny.yaml\ndata:\n  shards: 'pipe:touch {marker} && cat {shard}'\n")
    r = run_cli("pretrain", "--config", config, "--out", tmp_path / "run", *TINY, timeout=120)
    assert r.returncode == 2 and not marker.exists(), r.stderr[-2000:]
    assert "data.shards runs a shell command" in r.stderr and "--allow-pipe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("pretrain", "--config", config, "--out", tmp_path / "run2", "--allow-pipe", *TINY, timeout=300)
    assert r.returncode == 0 and marker.exists(), r.stderr[-2000:]


def test_a_pipe_named_on_the_command_line_needs_no_flag(tmp_path, tiny_world):
    shard = sorted((tiny_world / "pretrain").glob("*.tar"))[0]
    r = run_cli("pretrain", "--config", "synthetic_tiny.yaml", "--shards", f"pipe:cat {shard}",
                "--out", tmp_path / "run", *TINY, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_python_api_refuses_a_pipe_in_a_recipe_unless_allowed(tmp_path):
    from zsprob.train.defaults import load_train_config
    config = tmp_path / "recipe.yaml"
    config.write_text("data:\n  shards: 'pipe:cat x.tar'\n")
    with pytest.raises(UserError, match="runs a shell command"):
        load_train_config(config)
    assert load_train_config(config, allow_pipe=True).data.shards == "pipe:cat x.tar"


@pytest.mark.slow(seconds=25)
def test_a_tiny_run_and_its_evaluation_print_no_raw_python_warning(tmp_path, tiny_world):
    """stderr holds zsprob's own lines only (``zsprob: warning: ...``), never a library's raw warning with its
    file and line, in a fresh interpreter (no warning registry shared with the test's process)."""
    run = tmp_path / "run"
    for args in (["pretrain", "--config", "synthetic_tiny.yaml", "--shards", tiny_world / "pretrain", "--out", run,
                  *TINY], ["eval", "synthetic", "--checkpoint", run / "model", "--root", tiny_world,
                           "--out", tmp_path / "eval.json"]):
        r = run_cli(*args, cold=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        raw = [line for line in r.stderr.splitlines() if "Warning" in line or "warnings.warn" in line]
        assert raw == [], raw
