"""Bad inputs found by a sweep of the command line (tracebacks, silent wrong runs, lost work), each held to
the README's promise: one stderr line ``zsprob: error: ...``, exit 2, nothing a user wrote changed.
The ``--set`` values of the sweep (a section set to null, a negative learning rate, betas out of range, ...)
are rows of tests/test_cli_matrix.py."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY_TOWERS, run_cli, small_world, tiny_model_args


def one_line_error(r, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, \
        r.stderr[-2000:]
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A small SynthWorld (classification and retrieval splits) and an untrained tiny zsprob checkpoint."""
    return small_world(tmp_path_factory.mktemp("sweep"), seed=2, model={**TINY_TOWERS, "embed_dim": 16},
                       num_pretrain=16, num_classify_select=1, num_classify_eval=2, num_retrieval=8,
                       num_retrieval_val=0, shard_size=8)


def _pretrain(world, out, *extra):
    return run_cli("pretrain", "--data", "synthetic", "--shards", world["root"] / "pretrain", "--out", out,
                   *tiny_model_args(), "--batch-size", "8", "--workers", "0", "--steps", "1", "--no-progress",
                   "--set", "train.tensorboard=false", "--set", "schedule.warmup_steps=0", *extra)


# ----------------------------------------------------------------------------- configs
def test_a_base_chain_that_loops_or_is_not_one_path_is_one_line(world, tmp_path):
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    (tmp_path / "list.yaml").write_text("base: [a.yaml, b.yaml]\n")
    (tmp_path / "number.yaml").write_text("base: 5\n")
    for name, words in (("self", ["already in its own base chain"]), ("a", ["a.yaml", "b.yaml", "base chain"]),
                        ("list", ["base must be the path of one config file"]),
                        ("number", ["base must be the path of one config file"])):
        one_line_error(_pretrain(world, tmp_path / "out", "--config", tmp_path / f"{name}.yaml"), *words)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the command line itself
def test_debug_after_the_command_and_false_debug_values(world):
    r = run_cli("eval", "embeddings", world["base"] / "missing.npz", "--debug")
    one_line_error(r, "No such option", "--debug goes before the command")
    for value in ("no", "false"):
        r = run_cli("eval", "embeddings", world["base"] / "missing.npz", env={"ZSPROB_DEBUG": value})
        one_line_error(r, "embeddings file not found")
    r = run_cli("eval", "embeddings", world["base"] / "missing.npz", env={"ZSPROB_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_what_the_machine_refuses_is_one_line(tmp_path):
    """A name longer than the file system allows, memory that cannot be had: one line each."""
    r = run_cli("data", "synthetic", "--out", tmp_path / ("n" * 300), "--preset", "quick", "--no-progress")
    one_line_error(r, "File name too long")
    from zsprob.cli import _environment_error

    assert _environment_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                           "4915200000000 bytes")).startswith("out of memory:")
    assert _environment_error(PermissionError(13, "Permission denied", "/x/a.tmp", None, "/x/a")) == \
        "Permission denied: /x/a.tmp -> /x/a"
    assert _environment_error(RuntimeError("a bug")) is None and _environment_error(ValueError("x")) is None


# ----------------------------------------------------------------------------- training
def test_a_run_that_stopped_before_training_may_run_again_and_warnings_are_single_lines(world, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "shard-000000.tar").write_bytes(os.urandom(4096))
    out = tmp_path / "run"
    r = _pretrain(world, out, "--shards", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert lines[-1].startswith("zsprob: error: the training data yielded no full batch"), r.stderr
    assert all(line.startswith("zsprob: warning: ") for line in lines[:-1]) and len(set(lines)) == len(lines), r.stderr
    assert not out.exists()  # nothing trained: the refused run leaves nothing (docs/ownership.md)
    r = _pretrain(world, out)  # the same --out, now with good shards: no --overwrite needed
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained pcmepp for 1 step " in r.stdout


def test_shards_given_on_the_command_line_are_taken_verbatim(world, tmp_path):
    """'::' joins shard sources; YAML would have read 'DIR::' as a mapping (a traceback before)."""
    r = _pretrain(world, tmp_path / "run", "--shards", f"{world['root'] / 'pretrain'}::")
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_huge_batch_is_one_line(world, tmp_path):
    one_line_error(_pretrain(world, tmp_path / "run", "--batch-size", "100000000"))


# ----------------------------------------------------------------------------- files a command reads
def test_damaged_checkpoint_metadata_is_one_line(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(world["ckpt"], ckpt)
    meta = json.loads((ckpt / "zsprob.json").read_text())
    for key, value in (("config", [1, 2]), ("weights", "x"), ("format_version", "2")):
        (ckpt / "zsprob.json").write_text(json.dumps({**meta, key: value}))
        r = run_cli("eval", "synthetic", "--checkpoint", ckpt, "--root", world["root"], "--no-analysis",
                    "--device", "cpu", "--workers", "0", "--out", tmp_path / "m.json")
        one_line_error(r, "is damaged", repr(key))


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_truncated_retrieval_image_is_one_line_naming_it(world, tmp_path, workers):
    root = tmp_path / "sw"
    shutil.copytree(world["root"], root)
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["checksums"]  # a world without recorded checksums: the decoder is what finds the damage
    (root / "manifest.json").write_text(json.dumps(manifest))
    image = sorted((root / "retrieval" / "images" / "test").glob("*.jpg"))[0]
    image.write_bytes(image.read_bytes()[:100])
    r = run_cli("eval", "synthetic", "--checkpoint", world["ckpt"], "--root", root, "--no-analysis", "--device", "cpu",
                "--workers", workers, "--out", tmp_path / "m.json")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("zsprob: error:")]  # beside the progress bar
    assert len(errors) == 1 and f"image {image} cannot be read" in errors[0], r.stderr[-2000:]
    assert r.stderr.rstrip().splitlines()[-1] == errors[0] and not (tmp_path / "m.json").exists()


def test_a_selection_whose_classes_are_not_the_datasets_is_refused(world, tmp_path):
    common = ["--checkpoint", world["ckpt"], "--root", world["root"], "--device", "cpu", "--workers", "0"]
    sel = tmp_path / "selection.json"
    r = run_cli("select-prompts", "--dataset", "synthetic", *common, "--out", sel)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(sel.read_text())
    first, second = doc["classes"][0]["name"], doc["classes"][1]["name"]
    for name, edit in (("renamed", lambda d: d["classes"][0].update(name="zebra")),
                       ("reordered", lambda d: d["classes"].__setitem__(slice(0, 2), d["classes"][1::-1]))):
        bad = json.loads(sel.read_text())
        edit(bad)
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        r = run_cli("zeroshot", "synthetic", *common, "--prompts", tmp_path / f"{name}.json",
                    "--out", tmp_path / f"{name}-results.json")
        words = ["class 0 is 'zebra'", f"'{first}' in the dataset"] if name == "renamed" else \
            [f"class 0 is '{second}'", "2 of"]
        one_line_error(r, *words)
    r = run_cli("zeroshot", "synthetic", *common, "--prompts", sel, "--out", tmp_path / "ok.json")
    assert r.returncode == 0, r.stderr[-2000:]
    # options a finished selection makes moot, and shots without a few-shot strategy, are refused, not ignored
    for extra, words in ((["--topk", "5"], ["--topk has no effect with --prompts"]),
                         (["--classes", world["root"] / "classify" / "classnames.txt", "--shots", "2"],
                          ["--classes and --shots have no effect with --prompts"])):
        one_line_error(run_cli("zeroshot", "synthetic", *common, "--prompts", sel, *extra,
                               "--out", tmp_path / "moot.json"), *words)
    one_line_error(run_cli("select-prompts", "--dataset", "synthetic", *common, "--topk", "all", "--shots", "2",
                           "--out", tmp_path / "s2.json"), "--shots has no effect with --strategy all")
    assert not (tmp_path / "moot.json").exists() and not (tmp_path / "s2.json").exists()


def test_a_pickle_that_runs_code_is_one_line_and_never_run(tmp_path):
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"state_dict": Payload()}, f, protocol=4)
    r = run_cli("convert", tmp_path / "evil.pt", "--model", "pcmepp-tiny", "--out", tmp_path / "out")
    one_line_error(r, "without unpickling code")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_the_demo_refuses_a_training_run_directory_and_a_setting_given_twice(world, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("method: pcmepp\n")
    one_line_error(run_cli("demo", "--out", run, "--quick"), "is the training run", "does not own")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]
    # model.sigma_head and model.overrides.sigma_head disagreeing: the override would win silently
    one_line_error(_pretrain(world, tmp_path / "o", "--set", "model.sigma_head=block",
                             "--set", "model.overrides.sigma_head=unc"),
                   "model.sigma_head ('block') and model.overrides.sigma_head ('unc') are both set")


# ----------------------------------------------------------------------------- a third sweep (2026-11-28)
def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_posthoc_never_writes_into_the_model_it_reads_and_refuses_the_other_methods_options(world, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(world["ckpt"], run / "model")
    before = _digest(run)
    base = ["posthoc", "--checkpoint", run / "model", "--data", "synthetic", "--shards", world["root"] / "pretrain",
            "--views", "1", "--steps", "1", "--batch-size", "4", "--threads", "1"]
    one_line_error(run_cli(*base, "--out", run / "model"), "is the --checkpoint directory")
    one_line_error(run_cli(*base, "--out", run, "--overwrite"), "--out (its model/)", "is the --checkpoint directory")
    one_line_error(run_cli(*base, "--prior-precision", "1", "--out", tmp_path / "a"), "--prior-precision",
                   "no effect with --method adapter")
    one_line_error(run_cli(*base, "--method", "laplace", "--inclusion-alpha", "0.2", "--out", tmp_path / "b"),
                   "--inclusion-alpha", "no effect with --method laplace")
    assert _digest(run) == before and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _exportable(path: Path) -> Path:
    from test_export import _tiny

    from zsprob.models import save
    return save(_tiny(), path)


def test_export_and_convert_replace_only_their_own_kind_of_directory(tmp_path):
    ckpt = _exportable(tmp_path / "ckpt")
    before = _digest(ckpt)
    one_line_error(run_cli("export", ckpt, "--out", ckpt, "--overwrite"), "is the checkpoint directory")
    one_line_error(run_cli("export", ckpt, "--out", ckpt / "exp"), "is inside the checkpoint directory")
    user = tmp_path / "user"
    user.mkdir()
    (user / "README.md").write_text("my notes\n")
    one_line_error(run_cli("export", ckpt, "--out", user, "--overwrite"), "no earlier zsprob export")
    assert (user / "README.md").read_text() == "my notes\n" and _digest(ckpt) == before
    exported = tmp_path / "exported"
    assert run_cli("export", ckpt, "--out", exported).returncode == 0
    r = run_cli("export", ckpt, "--out", exported, "--overwrite")  # an earlier export: replaced
    assert r.returncode == 0, r.stderr[-2000:]
    other = _exportable(tmp_path / "other_ckpt")
    one_line_error(run_cli("export", ckpt, "--out", other, "--overwrite"), "no earlier zsprob export")


def test_convert_refuses_a_directory_holding_an_export(tmp_path):
    from test_models_published import write_pcmepp_hf
    write_pcmepp_hf(tmp_path / "published")
    exported = tmp_path / "exported"
    assert run_cli("export", _exportable(tmp_path / "ckpt"), "--out", exported).returncode == 0
    before = _digest(exported)
    one_line_error(run_cli("convert", tmp_path / "published", "--model", "pcmepp-tiny", "--out", exported,
                           "--overwrite"), "holds an open_clip export")
    assert _digest(exported) == before


def test_a_flickr_split_file_given_to_coco_is_one_line(tmp_path):
    from test_data_coco import make_coco
    make_coco(tmp_path / "coco")
    flickr = tmp_path / "dataset_flickr30k.json"
    flickr.write_text(json.dumps({"dataset": "flickr30k", "images": [
        {"imgid": 0, "filename": "1.jpg", "split": "train", "sentences": [{"raw": "a dog", "sentid": 0}] * 5}]}))
    r = run_cli("finetune", "coco", "--root", tmp_path / "coco", "--karpathy-json", flickr,
                "--out", tmp_path / "o", *tiny_model_args(), "--steps", "1", "--batch-size", "2", "--no-progress",
                "--threads", "1", "--workers", "0")
    one_line_error(r, "is not COCO's Karpathy split", "Flickr30k")


def test_a_set_key_given_twice_or_with_an_empty_part_and_a_mirror_inside_the_run(world, tmp_path):
    one_line_error(_pretrain(world, tmp_path / "a", "--set", "optim.lr=1e-3", "--set", "optim.lr=2e-3"),
                   "both set optim.lr", "give it once")
    one_line_error(_pretrain(world, tmp_path / "b", "--set", "optim..lr=1"), "empty part")
    one_line_error(_pretrain(world, tmp_path / "c", "--remote-sync", tmp_path / "c" / "mirror"),
                   "train.remote_sync", "give a mirror elsewhere")
    assert not any((tmp_path / n).exists() and any((tmp_path / n).iterdir()) for n in "abc")


def test_a_classes_file_of_another_length_is_refused_before_encoding_on_a_line_of_its_own(world, tmp_path):
    """With stderr a pipe (a log), no self-erasing progress bar runs into the error line."""
    names = tmp_path / "classes.txt"
    names.write_text("circle\nsquare\n")
    r = run_cli("zeroshot", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--device", "cpu",
                "--workers", "0", "--topk", "all", "--classes", names, "--out", tmp_path / "zs" / "r.json")
    one_line_error(r, "--classes", "names 2 classes")
    assert "\r" not in r.stderr and not (tmp_path / "zs").exists()


def test_transient_bars_are_off_when_the_command_line_logs_to_a_file(monkeypatch):
    from zsprob.models.encode import transient_bars
    monkeypatch.delenv("ZSPROB_TRANSIENT_BARS", raising=False)
    assert transient_bars(True) and not transient_bars(False)
    monkeypatch.setenv("ZSPROB_TRANSIENT_BARS", "0")
    assert not transient_bars(True)


@pytest.mark.parametrize("command, words", [
    (("select-prompts", "--dataset", "synthetic", "--strategy", "all", "--beta", "2"),
     ("--beta has no effect with --strategy all", "fusion")),
    (("select-prompts", "--dataset", "synthetic", "--topk", "5", "--k-grid", "1-10"),
     ("--k-grid has no effect with --strategy topk", "auto")),
    (("select-prompts", "--dataset", "synthetic", "--strategy", "fusion", "--threshold-c", "2"),
     ("--threshold-c has no effect with --strategy fusion", "threshold")),
    (("zeroshot", "synthetic", "--topk", "all", "--k-grid", "1-3"), ("--k-grid has no effect with --strategy all",)),
    (("zeroshot", "synthetic", "--unc-weight", "1"), ("--unc-weight has no effect with --score cosine",)),
])
def test_a_tuning_option_the_strategy_or_score_never_reads_is_refused(world, tmp_path, command, words):
    """The strategy registry says which strategies read --k-grid / --threshold-c / --beta; given to another
    strategy (or --unc-weight without --score unc), the option would be silently ignored."""
    r = run_cli(*command, "--checkpoint", world["ckpt"], "--root", world["root"], "--device", "cpu",
                "--out", tmp_path / "o" / "r.json")
    one_line_error(r, *words)
    assert not (tmp_path / "o").exists()


def test_the_tuning_options_are_taken_by_the_strategies_that_read_them(world, tmp_path):
    from zsprob.zeroshot.strategy_registry import get_strategy, readers_of
    assert "fusion" in readers_of("beta") and "threshold" in readers_of("threshold_c")
    assert set(readers_of("k_grid")) >= {"auto", "global", "oracle"} and not get_strategy("all").options
    assert readers_of("shots") == readers_of("shots_split") == ("bprw-fewshot",)  # from its few-shot fact
    r = run_cli("select-prompts", "--dataset", "synthetic", "--strategy", "fusion", "--beta", "2",
                "--checkpoint", world["ckpt"], "--root", world["root"], "--device", "cpu", "--workers", "0",
                "--out", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "s.json").read_text())["how"]["beta"] == 2.0


def test_a_template_cut_before_the_class_name_is_refused_before_encoding(world, tmp_path):
    """77 tokens of 'very' leave no room for the class name: every class would get the same prompt."""
    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\na photo of a " + "very " * 80 + "{}.\n")
    r = run_cli("select-prompts", "--dataset", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"],
                "--templates", templates, "--strategy", "all", "--device", "cpu", "--workers", "0",
                "--out", tmp_path / "o" / "s.json")
    one_line_error(r, "template 2", "before the class names differ", "get the same prompt")
    assert not (tmp_path / "o").exists()


class WordTokenizer:
    """Words to ids (new words get new ids, or one unknown id), cut at ``context_length``, padded with 0."""

    def __init__(self, known=None):
        self.ids, self.known = {}, known

    def __call__(self, texts, context_length=6):
        import torch
        out = torch.zeros(len(texts), context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            words = [w if self.known is None or w in self.known else "<unk>" for w in text.lower().split()]
            ids = [self.ids.setdefault(w, len(self.ids) + 1) for w in words][:context_length]
            out[i, :len(ids)] = torch.tensor(ids)
        return out


def _tokens(tokenizer, classnames, templates):
    from zsprob.zeroshot.prompts import prompt_texts
    return tokenizer(prompt_texts(classnames, templates))


def test_class_names_that_differ_only_past_the_cut_are_named():
    from zsprob.errors import UserError
    from zsprob.zeroshot.prompts import check_class_names_survive
    tok = WordTokenizer()
    names, templates = ["red kite", "red fox", "blue jay"], ["{}", "a b c d e {}"]  # template 2: cut after 'red'
    with pytest.raises(UserError, match=r"template 2 .* 'red kite' and 'red fox' get the same prompt"):
        check_class_names_survive(_tokens(tok, names, templates), names, templates, tok)
    check_class_names_survive(_tokens(tok, names, templates[:1]), names, templates[:1], tok)  # every prompt its own


def test_repeated_names_and_words_the_tokenizer_lacks_are_not_cuts():
    """CLIP's ImageNet names repeat ('missile'), and a small vocabulary reads unknown names alike: the same
    prompt without a cut is left alone."""
    from zsprob.zeroshot.prompts import check_class_names_survive
    names, templates = ["missile", "missile", "tench", "ostrich"], ["a photo of a {}."]
    tok = WordTokenizer(known={"a", "photo", "of", "missile"})
    check_class_names_survive(_tokens(tok, names, templates), names, templates, tok)


def test_compare_takes_the_unc_weight_it_is_given(world, tmp_path):
    r = run_cli("zeroshot", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--device", "cpu",
                "--workers", "0", "--compare", "--score", "unc", "--unc-weight", "2", "--out", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["unc_weight"] == 2.0
