"""README.md is a manual whose commands run as written: every ``zsprob`` command in its fenced shell
blocks exists, and every option it uses is one the command accepts (checked against ``--help`` in a
real subprocess); the commands that need no real data run end to end; the README stays short."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: commands with sub-commands: the words after ``zsprob`` that name the command
GROUPS = {"data", "finetune", "eval", "index"}


def shell_commands(text: str) -> list[str]:
    """The ``zsprob ...`` command lines of the fenced bash blocks (continuation lines joined,
    comments dropped; ``accelerate launch ... -m zsprob`` and ``torchrun ... -m zsprob`` included)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("#") or not line:
                continue
            if " -m zsprob " in line:
                line = "zsprob " + line.split(" -m zsprob ", 1)[1]
            line = line.replace(".venv/bin/zsprob ", "zsprob ")
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("zsprob "):
                    commands.append(part)
    return commands


def command_and_options(line: str) -> tuple[list[str], list[str]]:
    words = shlex.split(line)[1:]
    name = words[:2] if words and words[0] in GROUPS else words[:1]
    options = [w.split("=")[0] for w in words if w.startswith("--")]
    return name, options


def test_readme_is_a_short_manual():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350
    for page in re.findall(r"\]\((docs/[^)]+)\)", README.read_text()):
        assert (ROOT / page.split("#")[0]).is_file(), page  # anchors: test_links_between_the_manuals_...


def test_the_extractor_finds_commands_across_continuations_and_launchers():
    text = ("```bash\nzsprob pretrain --config a.yaml \\\n    --out runs/x   # note\n"
            "torchrun --nproc_per_node 8 -m zsprob finetune coco --root r --out o\n```\n")
    assert shell_commands(text) == ["zsprob pretrain --config a.yaml --out runs/x",
                                    "zsprob finetune coco --root r --out o"]
    assert command_and_options("zsprob eval coco --score csd --out m.json") == (["eval", "coco"], ["--score", "--out"])


README_COMMANDS = shell_commands(README.read_text())


def test_the_readme_has_every_command_of_the_table():
    named = {" ".join(command_and_options(c)[0][:1]) for c in README_COMMANDS}
    assert {"data", "pretrain", "finetune", "select-prompts", "zeroshot", "eval", "index", "demo"} <= named


@pytest.mark.parametrize("line", sorted(set(README_COMMANDS)))
def test_each_readme_command_exists_with_the_options_it_uses(line):
    name, options = command_and_options(line)
    result = run_cli(*name, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for option in options:
        assert re.search(rf"(^|[\s,/\[]){re.escape(option)}\b", result.stdout, flags=re.M), (option, line)


def test_the_synthworld_quick_start_runs_with_its_options(tmp_path):
    """The SynthWorld quick start as the README writes it, plus --preview-only (the preview alone: seconds)."""
    line = next(c for c in README_COMMANDS if c.startswith("zsprob data synthetic") and "--preset quick" in c)
    args = shlex.split(line)[1:]
    out = args[args.index("--out") + 1]
    args = [*args, "--preview-only"] if "--preview-only" not in args else args  # the preview alone: seconds
    result = run_cli(*args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / out / "preview.png").stat().st_size > 0


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_the_manuals_reach_their_files_and_headings():
    """Every relative link of README.md and docs/ to a markdown page names a file that exists and,
    with ``#anchor``, a heading of that page (pages move and headings get renamed)."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s:]*\.md)?(?:#([^)\s]+))?\)", page.read_text()):
            if not target and not anchor:
                continue
            path = (page.parent / target) if target else page
            if not path.is_file():
                broken.append((page.name, target))
                continue
            if anchor:
                headings = re.findall(r"^#{1,6} (.+)$", path.read_text(), flags=re.M)
                if anchor not in {github_anchor(h) for h in headings}:
                    broken.append((page.name, f"{target}#{anchor}"))
    assert not broken, broken
    assert github_anchor("How the demo's towers were chosen") == "how-the-demos-towers-were-chosen"
    assert github_anchor("PCME++ App. A.2: the 2-D toy") == "pcme-app-a2-the-2-d-toy"
