"""No output destroys an input: the README's promise that nothing a user wrote is lost.

Every command that writes refuses, in one line (exit 2) and before anything is written, an ``--out`` (or a
file written beside it) that is one of its input files, lies inside an input model directory (--checkpoint,
--pretrained, --tokenizer, convert's SOURCE), replaces an existing index or checkpoint without
``--overwrite``, or is not a regular file (a named pipe: ``zsprob.utils.io.atomic_write`` would rename a
plain file over it). The CLI rows run end to end in child processes (``conftest.run_cli``); each checks that
the inputs are byte-identical afterwards. Special files are made with ``os.mkfifo`` under ``tmp_path`` only
(never /dev/null or /dev/full: the tests may run as root).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import run_cli

CPU = ["--device", "cpu", "--workers", "0"]


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (symlinks and FIFOs by what they are, never read) -> its SHA-256."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def refused(r, *needles: str) -> str:
    """Exit 2, exactly one stderr line starting `zsprob: error:` holding every needle, no traceback."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("zsprob: error:"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A SynthWorld with classification splits, a tiny zsprob checkpoint, a published PCME++ directory,
    an embeddings file and a flat index, all made once (the tests copy what they may touch)."""
    import torch

    from test_models_published import write_pcmepp_hf
    from test_retrieval_cli import make_npz
    from zsprob.data.synthetic import generate
    from zsprob.models import create_model, save

    base = tmp_path_factory.mktemp("guard")
    generate(base / "world", image_size=32, num_pretrain=32, num_classify_select=2, num_classify_eval=2,
             num_retrieval=4, num_retrieval_val=0, shard_size=32, progress=False)
    torch.manual_seed(0)
    save(create_model("zsprob-tiny-bow"), base / "ckpt")
    write_pcmepp_hf(base / "published")
    make_npz(base / "e.npz")
    r = run_cli("index", "build", "--embeddings", base / "e.npz", "--device", "cpu", "--out", base / "index")
    assert r.returncode == 0, r.stderr
    return base


@pytest.fixture
def work(made, tmp_path):
    """Copies of the checkpoint, the published directory, the embeddings and the index under tmp_path."""
    for name in ("ckpt", "published", "index"):
        shutil.copytree(made / name, tmp_path / name)
    shutil.copy(made / "e.npz", tmp_path / "e.npz")
    return tmp_path


# ----------------------------------------------------------------- 1-3: an output inside a model / an input file
@pytest.mark.parametrize("command", ["select-prompts", "eval synthetic", "zeroshot"])
@pytest.mark.parametrize("target", ["zsprob.json", "model.safetensors", "results.json", "sub/results.json"])
def test_an_output_inside_the_checkpoint_directory_is_refused(made, work, command, target):
    ck = work / "ckpt"
    out = ck / target
    args = {"select-prompts": ["select-prompts", "--checkpoint", ck, "--dataset", "synthetic"],
            "eval synthetic": ["eval", "synthetic", "--checkpoint", ck, "--no-analysis"],
            "zeroshot": ["zeroshot", "synthetic", "--checkpoint", ck]}[command]
    before = digest(work)
    line = refused(run_cli(*args, "--root", made / "world", *CPU, "--out", out, cwd=work),
                   f"--out {out} is inside the --checkpoint directory {ck}", "write the results elsewhere")
    assert "Traceback" not in line
    assert digest(work) == before


def test_a_checkpoint_file_names_its_directory(made, work):
    """--checkpoint ck/model.safetensors: ck is the model directory, so ck/zsprob.json is refused too."""
    ck = work / "ckpt"
    before = digest(work)
    refused(run_cli("eval", "synthetic", "--checkpoint", ck / "model.safetensors", "--root", made / "world", *CPU,
                    "--no-analysis", "--out", ck / "zsprob.json", cwd=work), "inside the --checkpoint directory")
    assert digest(work) == before


def test_an_explicit_cache_inside_the_checkpoint_is_refused(made, work):
    before = digest(work)
    refused(run_cli("select-prompts", "--checkpoint", work / "ckpt", "--dataset", "synthetic", "--root",
                    made / "world", *CPU, "--cache-dir", work / "ckpt" / "cache", "--out", work / "sel.json",
                    cwd=work), "--cache-dir", "inside the --checkpoint directory")
    assert digest(work) == before and not (work / "sel.json").exists()


def test_zeroshot_out_equal_to_its_prompts_is_refused(made, work):
    p = work / "p.json"
    r = run_cli("select-prompts", "--checkpoint", made / "ckpt", "--dataset", "synthetic", "--root", made / "world",
                *CPU, "--out", p, cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    before = digest(work)
    refused(run_cli("zeroshot", "synthetic", "--checkpoint", made / "ckpt", "--root", made / "world", "--prompts", p,
                    *CPU, "--out", p, cwd=work), f"--out would write {p}, the file given as --prompts")
    link = work / "link.json"
    link.symlink_to(p)  # a symlink to the input is the input (writes go through symlinks)
    before = digest(work)
    refused(run_cli("zeroshot", "synthetic", "--checkpoint", made / "ckpt", "--root", made / "world", "--prompts", p,
                    *CPU, "--out", link, cwd=work), "the file given as --prompts")
    assert digest(work) == before


@pytest.mark.parametrize("option", ["--templates", "--classes"])
def test_an_output_equal_to_a_prompt_file_is_refused(made, work, option):
    f = work / "lines.txt"
    f.write_text("a photo of a {}.\n" if option == "--templates" else "circle\nsquare\ntriangle\n")
    before = digest(work)
    refused(run_cli("select-prompts", "--checkpoint", made / "ckpt", "--dataset", "synthetic", "--root",
                    made / "world", *CPU, option, f, "--out", f, cwd=work), f"the file given as {option}")
    assert digest(work) == before


def test_eval_writes_nothing_into_a_world(made, tmp_path):
    """A SynthWorld is written only by `data synthetic` (docs/ownership.md): neither its files nor new ones."""
    world = tmp_path / "world"
    shutil.copytree(made / "world", world)
    before = digest(world)
    for out in (world / "manifest.json", world / "results.json"):
        refused(run_cli("eval", "synthetic", "--checkpoint", made / "ckpt", "--root", world, *CPU, "--no-analysis",
                        "--out", out, cwd=tmp_path), str(out), "inside the SynthWorld")
    assert digest(world) == before


def test_eval_coco_save_embeddings_inside_the_checkpoint_is_refused(made, work):
    before = digest(work)
    refused(run_cli("eval", "coco", "--checkpoint", work / "ckpt", "--root", work, *CPU, "--save-embeddings",
                    work / "ckpt" / "e.npz", "--out", work / "m.json", cwd=work),
            "--save-embeddings", "inside the --checkpoint directory")
    assert digest(work) == before


# ----------------------------------------------------------------- 4-5: convert
def test_convert_into_its_own_source_is_refused_with_or_without_overwrite(work):
    pub = work / "published"
    before = digest(work)
    for extra in ([], ["--overwrite"]):
        refused(run_cli("convert", pub, "--model", "pcmepp-tiny", "--out", pub, *extra, cwd=work),
                f"--out {pub} is the SOURCE directory")
        refused(run_cli("convert", pub, "--model", "pcmepp-tiny", "--out", pub / "converted", *extra, cwd=work),
                "inside the SOURCE directory")
    refused(run_cli("convert", pub / "model.safetensors", "--model", "pcmepp-tiny", "--out", pub, "--overwrite",
                    cwd=work), "the file given as SOURCE")
    assert digest(work) == before


def test_convert_into_a_non_empty_directory_needs_overwrite(work):
    before = digest(work)
    refused(run_cli("convert", work / "published", "--model", "pcmepp-tiny", "--out", work / "ckpt", cwd=work),
            f"--out {work / 'ckpt'} is not empty", "--overwrite")
    assert digest(work) == before
    r = run_cli("convert", work / "published", "--model", "pcmepp-tiny", "--out", work / "ckpt", "--overwrite",
                cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    from zsprob.models import load_meta
    assert load_meta(work / "ckpt")["name"] == "pcmepp-tiny"


# ----------------------------------------------------------------- 6: index build
def test_index_build_over_an_index_needs_overwrite(work):
    before = digest(work)
    refused(run_cli("index", "build", "--embeddings", work / "e.npz", "--gallery", "image", "--device", "cpu",
                    "--out", work / "index", cwd=work), "already holds an index", "--overwrite")
    assert digest(work) == before
    r = run_cli("index", "build", "--embeddings", work / "e.npz", "--gallery", "image", "--device", "cpu",
                "--out", work / "index", "--overwrite", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert digest(work)["index/ids.npy"] != before["index/ids.npy"]  # the image side now (30 ids, not 150)


def test_index_build_into_a_directory_without_an_index_is_fine(work):
    (work / "notes").mkdir()
    (work / "notes" / "readme.txt").write_text("mine\n")
    r = run_cli("index", "build", "--embeddings", work / "e.npz", "--device", "cpu", "--out", work / "notes",
                cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "notes" / "readme.txt").read_text() == "mine\n" and (work / "notes" / "index.json").is_file()


# ----------------------------------------------------------------- 7: special files
@pytest.mark.parametrize("command", ["zeroshot", "eval embeddings", "index search", "eval synthetic"])
def test_a_fifo_out_is_refused_and_kept(made, work, command):
    fifo = work / "f"
    os.mkfifo(fifo)
    args = {"zeroshot": ["zeroshot", "synthetic", "--checkpoint", made / "ckpt", "--root", made / "world", *CPU],
            "eval embeddings": ["eval", "embeddings", work / "e.npz"],
            "index search": ["index", "search", "--index", work / "index", "--queries", work / "e.npz", "--device",
                             "cpu"],
            "eval synthetic": ["eval", "synthetic", "--checkpoint", made / "ckpt", "--root", made / "world", *CPU,
                               "--no-analysis"]}[command]
    before = digest(work)
    refused(run_cli(*args, "--out", fifo, cwd=work), str(fifo), "named pipe")
    assert fifo.is_fifo() and digest(work) == before


def test_a_fifo_where_a_file_beside_out_goes_is_refused_before_anything_is_written(work):
    os.mkfifo(work / "table.md")  # eval writes table.md beside --out
    before = digest(work)
    refused(run_cli("eval", "embeddings", work / "e.npz", "--device", "cpu", "--out", work / "m.json", cwd=work),
            "table.md", "named pipe")
    assert digest(work) == before and not (work / "m.json").exists()


def test_a_symlink_to_a_fifo_is_refused(work):
    os.mkfifo(work / "f")
    (work / "link").symlink_to(work / "f")
    before = digest(work)
    refused(run_cli("eval", "embeddings", work / "e.npz", "--out", work / "link", cwd=work), "named pipe")
    assert digest(work) == before


def test_a_symlinked_out_is_written_through(work):
    """--out LINK -> results/m.json: the results go to the file the link names; the link stays a link."""
    (work / "results").mkdir()
    target = work / "results" / "m.json"
    target.write_text("old\n")
    link = work / "m.json"
    link.symlink_to(Path("results") / "m.json")
    r = run_cli("eval", "embeddings", work / "e.npz", "--no-analysis", "--device", "cpu", "--out", link, cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert link.is_symlink() and os.readlink(link) == str(Path("results") / "m.json")
    assert '"metrics"' in target.read_text()


# ----------------------------------------------------------------- atomic_write itself
def test_atomic_write_refuses_what_is_not_a_regular_file(tmp_path):
    from zsprob.errors import UserError
    from zsprob.utils.io import atomic_write_bytes, atomic_write_text

    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(fifo)
    folder.mkdir()
    (folder / "keep.txt").write_text("keep\n")
    (tmp_path / "to-fifo").symlink_to(fifo)
    for path, kind in ((fifo, "named pipe"), (folder, "directory"), (tmp_path / "to-fifo", "named pipe")):
        with pytest.raises(UserError, match=kind) as e:
            atomic_write_bytes(path, b"new")
        assert "\n" not in str(e.value)
    assert fifo.is_fifo() and (folder / "keep.txt").read_text() == "keep\n"
    assert (tmp_path / "to-fifo").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "to-fifo"]  # no temporary file left
    regular = tmp_path / "r.txt"
    regular.write_text("old")
    assert atomic_write_text(regular, "new") == regular and regular.read_text() == "new"


def test_atomic_write_writes_through_a_symlink(tmp_path):
    from zsprob.utils.io import atomic_write_text

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "t.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(Path("real") / "t.txt")
    assert atomic_write_text(link, "new") == link
    assert link.is_symlink() and target.read_text() == "new" and link.read_text() == "new"
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(Path("real") / "made.txt")  # a link to a file not yet there: the file is created
    atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "real" / "made.txt").read_text() == "made"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["made.txt", "t.txt"]


def test_check_output_refuses_a_fifo_and_passes_a_symlinked_file(tmp_path):
    from zsprob.errors import UserError
    from zsprob.utils.checks import check_output

    os.mkfifo(tmp_path / "f")
    with pytest.raises(UserError, match="named pipe"):
        check_output(tmp_path / "f", kind="file")
    with pytest.raises(UserError, match="named pipe"):
        check_output(tmp_path / "f", kind="dir")
    (tmp_path / "t.json").write_text("{}")
    (tmp_path / "l.json").symlink_to(tmp_path / "t.json")
    assert check_output(tmp_path / "l.json", kind="file") == tmp_path / "l.json"
