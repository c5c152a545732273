"""The command line: help, version, and the one-line error policy, in real subprocesses."""
from __future__ import annotations

import pytest

from conftest import run_cli
from zsprob import __version__
from zsprob.cli import COMMANDS

EXPECTED = ["data", "pretrain", "finetune", "select-prompts", "zeroshot", "eval", "demo"]


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0
    assert __version__ in r.stdout


def test_help_lists_every_command():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for name in EXPECTED:
        assert f"  {name}" in r.stdout, name


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_has_help(name):
    r = run_cli(name, "--help")
    assert r.returncode == 0, r.stderr
    assert "Usage:" in r.stdout


def test_unknown_command_is_one_line_exit_2():
    r = run_cli("no-such-command")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("zsprob: error:")
    assert "Traceback" not in r.stderr


def test_unknown_option_is_one_line_exit_2():
    r = run_cli("--no-such-option")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("zsprob: error:") and r.stderr.count("\n") == 1


def test_user_error_and_debug_traceback(tmp_path):
    from zsprob.config import read_yaml  # noqa: F401  (imported to fail fast if broken)
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\nb: :\n")
    code = ("import sys; from zsprob.cli import main, cli\n"
            "import click\n"
            "@cli.command('yaml-check')\n"
            "@click.argument('path')\n"
            "def yaml_check(path):\n"
            "    from zsprob.config import read_yaml; read_yaml(path)\n"
            "main(sys.argv[1:])\n")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code, "yaml-check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("zsprob: error: malformed YAML") and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, "-c", code, "--debug", "yaml-check", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr
