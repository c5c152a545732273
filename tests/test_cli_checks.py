"""Bad counts and unwritable output locations are one line and exit 2 in EVERY command: the commands are
enumerated from the click group, so a new command is covered (and must use zsprob.cli.types) by itself."""
from __future__ import annotations

import click
import pytest

from conftest import run_cli
from zsprob.cli import cli, main
from zsprob.cli.types import Count, InPath, OutPath

#: parameters that name an existing input (not: --classes / --templates, which also take a name inside prompts/;
#: --pretrained, which also takes an open_clip tag; --shards, a brace pattern or URL; --config, a name in configs/)
INPUTS = {"root", "select_root", "checkpoint", "prompts", "karpathy_json", "embeddings", "index_dir", "queries",
          "i2t_path", "t2i_path", "source", "tokenizer"}
#: integer options that are not counts (any value is meaningful, or checked elsewhere with its own range)
NOT_COUNTS = {"seed", "image_size"}
#: training flags checked through the config (the counts of zsprob.train.defaults.KEYS), with the --set route
TRAIN_COUNT_FLAGS = ["--steps", "--epochs", "--batch-size", "--workers", "--threads", "--log-every",
                     "--checkpoint-every", "--eval-every", "--requeue-exit-code"]


def all_commands() -> list[tuple[list[str], click.Command]]:
    """(command path, command) for every leaf command, sub-commands of groups included."""
    ctx = click.Context(cli)
    found = []

    def walk(group, path):
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if isinstance(cmd, click.Group):
                walk(cmd, path + [name])
            else:
                found.append((path + [name], cmd))
    walk(cli, [])
    return found


def run_main(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


def test_the_walk_finds_every_command():
    paths = {" ".join(p) for p, _ in all_commands()}
    assert {"pretrain", "finetune coco", "demo", "data synthetic", "eval coco", "index build", "index search",
            "select-prompts", "zeroshot", "convert"} <= paths


@pytest.mark.parametrize("bad", ["/proc/forbidden/x", "FILE/sub"])
def test_every_out_that_cannot_be_written_is_one_line_exit_2(bad, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad = bad.replace("FILE", str(a_file))
    with_out = [(p, c) for p, c in all_commands() if any(x.name == "out" for x in c.params)]
    assert len(with_out) >= 10
    for path, cmd in with_out:
        param = next(x for x in cmd.params if x.name == "out")
        assert isinstance(param.type, OutPath), f"{' '.join(path)} --out must use zsprob.cli.types.OUT_DIR / OUT_FILE"
        # --out first: click converts options in command-line order, so it is checked before anything else
        code, err = run_main([*path, "--out", bad], capsys)
        assert code == 2 and err.count("\n") == 1 and "'--out'" in err, (path, code, err)
        assert "Traceback" not in err and ("cannot" in err or "not a directory" in err), (path, err)
    assert not (tmp_path / "a_file").is_dir()


def test_every_count_option_refuses_values_below_its_minimum(tmp_path, capsys):
    checked = 0
    for path, cmd in all_commands():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name in NOT_COUNTS:
                continue
            if isinstance(p.type, Count):
                bad = "0" if p.type.rule == ">=1" else "-1"
                code, err = run_main([*path, p.opts[-1], bad], capsys)
                assert code == 2 and err.count("\n") == 1 and p.opts[-1] in err and "must be" in err, (path, p.opts, err)
                checked += 1
            elif isinstance(p.type, click.types.IntParamType) and not isinstance(p.type, click.IntRange):
                # plain integers: only the training flags, which the config check covers (next test)
                assert path[-1] in ("pretrain", "coco", "flickr30k") and p.opts[-1] in TRAIN_COUNT_FLAGS, (path, p.opts)
    assert checked >= 15


@pytest.mark.parametrize("command", [["pretrain"], ["finetune", "coco", "--root", "TMP"]])
def test_training_counts_are_checked_in_one_place(command, tmp_path, capsys):
    command = [str(tmp_path) if a == "TMP" else a for a in command]
    out = tmp_path / "run"
    for flag in TRAIN_COUNT_FLAGS:
        bad = "-1" if flag in ("--workers", "--checkpoint-every", "--eval-every", "--requeue-exit-code") else "0"
        code, err = run_main([*command, "--out", out, flag, bad], capsys)
        assert code == 2 and err.count("\n") == 1 and f"{flag} (" in err and "must be" in err, (flag, err)
    code, err = run_main([*command, "--out", out, "--set", "train.keep_checkpoints=-2"], capsys)
    assert code == 2 and "train.keep_checkpoints must be 0 or more" in err
    code, err = run_main([*command, "--out", out, "--set", "schedule.steps=2.5"], capsys)
    assert code == 2 and "must be an integer" in err
    assert not out.exists()  # nothing was written


def test_every_missing_input_is_one_line_exit_2_before_torch(tmp_path, capsys):
    """A mistyped --root / --checkpoint / ... fails at parse time: one line naming the option, exit 2,
    before torch is imported (5-15 s on a small CPU) or any other option is acted on."""
    missing, a_file = tmp_path / "missing", tmp_path / "a_file"
    a_file.write_text("x")
    checked = set()
    for path, cmd in all_commands():
        for p in cmd.params:
            if p.name not in INPUTS:
                continue
            assert isinstance(p.type, InPath), f"{' '.join(path)} {p.opts[-1]} must use zsprob.cli.types.InPath"
            flag = [p.opts[-1]] if isinstance(p, click.Option) else []  # an argument: the path alone
            name = p.opts[-1] if flag else p.name.upper()
            code, err = run_main([*path, *flag, missing], capsys)
            assert code == 2 and err.count("\n") == 1 and f"'{name}'" in err and f"not found: {missing}" in err, \
                (path, p.opts, err)
            if p.type.kind == "dir":
                code, err = run_main([*path, *flag, a_file], capsys)
                assert code == 2 and "is a file, not a directory" in err, (path, p.opts, err)
            checked.add(" ".join(path) + " " + name)
    assert {"eval coco --root", "eval synthetic --checkpoint", "finetune coco --root", "zeroshot --select-root",
            "select-prompts --checkpoint", "zeroshot --prompts", "eval embeddings EMBEDDINGS", "convert SOURCE",
            "index search --index", "index build --embeddings", "zeroshot --tokenizer",
            "eval rankings --t2i"} <= checked, checked
    # in a fresh interpreter, the way a user meets it: torch is never imported
    code = ("import sys\nfrom zsprob.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 2, e.code\nassert 'torch' not in sys.modules\nprint('no torch')")
    import subprocess
    import sys
    coco = f"zsprob: error: Invalid value for '--root': COCO root directory not found: {missing}"
    for args, message in (
            (["eval", "coco", "--checkpoint", tmp_path, "--root", missing], coco),
            (["finetune", "coco", "--root", missing, "--out", tmp_path / "run"], coco),
            (["pretrain", "--data", "synthetic", "--shards", missing, "--out", tmp_path / "run"],
             f"zsprob: error: SynthWorld shards not found: {missing} (make them with `zsprob data synthetic --out DIR`, "
             "then pass --shards DIR/pretrain)")):
        r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "no torch", (args, r.stdout, r.stderr)
        assert r.stderr.strip() == message
    assert not (tmp_path / "run").exists()


def test_input_check_kinds_and_home(tmp_path, monkeypatch):
    from zsprob.errors import UserError
    from zsprob.utils.checks import check_input
    (tmp_path / "d").mkdir()
    (tmp_path / "f.npz").write_bytes(b"x")
    assert check_input(tmp_path / "d", "x") == tmp_path / "d" and check_input(tmp_path / "f.npz", "x", "file")
    assert check_input(tmp_path / "f.npz", "x", "any") and check_input(tmp_path / "d", "x", "any")
    with pytest.raises(UserError, match="is a directory, not a file"):
        check_input(tmp_path / "d", "embeddings file", "file")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_input("~/d", "x") == str(tmp_path / "d")  # a quoted ~ reaches the command expanded
    with pytest.raises(UserError, match=f"data root not found: {tmp_path / 'nope'} \\(a hint\\)"):
        check_input("~/nope", "data root", hint="a hint")


def test_the_library_checks_the_same_counts(tmp_path):
    from zsprob.errors import UserError
    from zsprob.train import train
    with pytest.raises(UserError, match=r"--batch-size \(data.batch_size\) must be at least 1, got -4"):
        train({"data": {"batch_size": -4}, "schedule": {"steps": 3}}, tmp_path / "run", progress=False)


def test_the_output_probe_leaves_nothing_behind(tmp_path):
    from zsprob.utils.checks import check_output
    target = tmp_path / "a" / "b" / "c"
    assert check_output(target) == target and not (tmp_path / "a").exists()
    assert check_output(tmp_path / "x" / "m.json", kind="file") and not (tmp_path / "x").exists()
    assert list(tmp_path.iterdir()) == []
    assert check_output("s3://bucket/run") == "s3://bucket/run"  # URLs are their writers' business


def test_subprocess_one_line_exit_2(tmp_path):
    """What a user types, end to end: a write-protected --out and a negative --steps."""
    r = run_cli("demo", "--out", "/proc/forbidden")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "/proc/forbidden" in r.stderr, r.stderr
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tmp_path), "--out", str(tmp_path / "o"),
                "--steps", "-3")
    assert r.returncode == 2 and r.stderr.strip() == "zsprob: error: --steps (schedule.steps) must be at least 1, got -3"
    assert not (tmp_path / "o").exists()


def _from_cli(stderr: str) -> str:
    """A traceback from zsprob.cli.main's frame on (the frames above it are the launcher's)."""
    if not stderr.startswith("Traceback"):
        return stderr
    lines = stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if "zsprob/cli/__init__.py" in line)
    return "\n".join(lines[:1] + lines[first:])


def test_forked_cli_calls_behave_as_fresh_interpreters(tmp_path):
    """run_cli forks from tests/cli_forkserver.py's pre-imported interpreter: the same exit status, stdout
    and stderr as a fresh ``python -m zsprob`` for a success, a one-line error, a --debug traceback
    (uncaught exception, exit 1), click's usage error and a file the command wrote in its cwd."""
    cases = [("--version",), ("eval", "coco", "--root", str(tmp_path / "none"), "--model", "zsprob-tiny-bow"),
             ("--debug", "eval", "coco", "--root", str(tmp_path / "none"), "--model", "zsprob-tiny-bow"),
             ("pretrain", "--no-such-option"),
             ("data", "synthetic", "--out", "world", "--preset", "quick", "--preview-only")]
    fork_dir, cold_dir = tmp_path / "a", tmp_path / "b"
    fork_dir.mkdir()
    cold_dir.mkdir()
    for args in cases:
        forked = run_cli(*args, cwd=fork_dir)
        cold = run_cli(*args, cwd=cold_dir, cold=True)
        assert forked.returncode == cold.returncode, (args, forked.stderr, cold.stderr)
        assert forked.stdout.replace(str(fork_dir), str(cold_dir)) == cold.stdout, args
        assert _from_cli(forked.stderr.replace(str(fork_dir), str(cold_dir))) == _from_cli(cold.stderr), args
    assert sorted(p.name for p in (fork_dir / "world").iterdir()) == \
        sorted(p.name for p in (cold_dir / "world").iterdir()) != []


@pytest.mark.parametrize("value, low, high, low_open", [("x", 0.0, 1.0, False), (-1, 0.0, 1.0, False),
                                                        (float("nan"), 0.0, 1.0, False), (2, 0.0, 1.0, False),
                                                        (0, 0.0, float("inf"), True), (None, 0.0, 1.0, False)])
def test_check_range_refuses_with_one_line_naming_the_interval(value, low, high, low_open):
    from zsprob.errors import UserError, check_range
    with pytest.raises(UserError) as err:
        check_range(value, "PCME++ w", low, high, low_open)
    bound = "> 0" if low_open else ">= 0 and <= 1"
    assert str(err.value) == f"PCME++ w must be a number {bound}, got {value!r}"


def test_check_range_returns_floats_at_the_bounds():
    from zsprob.errors import check_range
    assert check_range("0.5", "w", 0.0, 1.0) == 0.5
    assert check_range(0, "w", 0.0) == 0.0 and check_range(1, "w", 0.0, 1.0) == 1.0
    assert check_range(-20, "eps", float("-inf")) == -20.0
