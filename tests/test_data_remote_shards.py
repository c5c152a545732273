"""Shards from anywhere: ``pipe:`` commands, fsspec ``file://`` and ``memory://`` URLs in the same
brace-pattern syntax as local shards read exactly the samples, in exactly the order, of the local
pattern; unknown schemes are one-line errors; epoch lengths from a SynthWorld manifest still work."""
from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from conftest import run_cli
from test_data_webdataset import _keys, make_shards, to_tensor
from zsprob.data.webdataset import build_wds_pipeline, expand_shards
from zsprob.errors import UserError


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    pattern, good = make_shards(root, n_shards=5, corrupt=False)
    return root, pattern, good


def _sequence(spec, **kw):
    kw = {"preprocess": to_tensor, "tokenizer": None, "batch_size": 3, "seed": 7, "with_keys": True,
          "shuffle_buffer": 8, **kw}
    return _keys(build_wds_pipeline(spec, **kw))


@pytest.mark.parametrize("workers", [0, 2])
def test_pipe_and_file_urls_read_what_the_local_pattern_reads_in_the_same_order(local, workers):
    root, pattern, good = local
    reference = _sequence(pattern, num_workers=workers)
    assert sorted(reference) == sorted(good)
    brace = "{000000..000004}.tar"
    assert _sequence(f"pipe:cat {root}/{brace}", num_workers=workers) == reference
    assert _sequence(f"file://{root}/{brace}", num_workers=workers) == reference
    # a fixed epoch length (open_clip's roll-over rule) counts the same over URLs
    fixed = build_wds_pipeline(f"file://{root}/{brace}", preprocess=None, tokenizer=None, batch_size=2,
                               num_samples=20, num_workers=workers)
    assert len(fixed) == len(build_wds_pipeline(pattern, preprocess=None, tokenizer=None, batch_size=2,
                                                num_samples=20, num_workers=workers))


def test_memory_urls_patterns_and_directory_listing(local):
    root, pattern, good = local
    base = f"memory://zsprob-{uuid.uuid4().hex[:8]}/shards"
    fs = fsspec.filesystem("memory")
    for tar in sorted(root.glob("*.tar")):
        fs.pipe(f"{base}/{tar.name}", tar.read_bytes())
    reference = _sequence(pattern)
    assert _sequence(f"{base}/{{000000..000004}}.tar") == reference
    # a directory URL is listed through fsspec (sorted *.tar), like a local directory
    listed = expand_shards(base)[0]
    assert [u.rsplit("/", 1)[1] for u in listed] == [f"{i:06d}.tar" for i in range(5)]
    assert _sequence(base) == reference
    # two sources joined by '::' with weights, resampled: the URL sources mix like local ones
    mixed = build_wds_pipeline(f"{base}/000000.tar::{root}/000001.tar", weights="1::1", resampled=True,
                               num_samples=24, preprocess=None, tokenizer=None, batch_size=4, with_keys=True)
    keys = _keys(mixed)
    assert len(keys) == 24 and {k[:2] for k in keys} == {"s0", "s1"}


def test_missing_and_broken_remote_shards(local, tmp_path):
    root, _, good = local
    base = f"memory://zsprob-{uuid.uuid4().hex[:8]}"
    with pytest.raises(UserError, match="none of .* shards probed exists"):
        build_wds_pipeline(f"{base}/x-{{000..003}}.tar", preprocess=None, tokenizer=None, batch_size=2)
    fsspec.filesystem("memory").pipe(f"{base}/000003.tar", (root / "000003.tar").read_bytes())
    # one present, one absent: the absent one is counted, the run goes on
    loader = build_wds_pipeline(f"{base}/{{000003..000004}}.tar", preprocess=None, tokenizer=None,
                                batch_size=2, with_keys=True)
    assert sorted(_keys(loader)) == sorted(k for k in good if k.startswith("s3_"))
    assert loader.stats()["missing_shard"] == 1
    with pytest.raises(UserError, match="no \\*.tar shards"):
        fsspec.filesystem("memory").pipe(f"{base}/empty/readme.txt", b"x")
        build_wds_pipeline(f"{base}/empty", preprocess=None, tokenizer=None, batch_size=2)


@pytest.mark.parametrize("spec, message", [
    ("foo://bucket/{000..009}.tar", "unknown URL scheme 'foo'"),
    ("a.tar::nope://x.tar", "unknown URL scheme 'nope'"),
])
def test_unknown_schemes_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        build_wds_pipeline(spec, preprocess=None, tokenizer=None, batch_size=2)
    assert "\n" not in str(e.value)


def test_missing_fsspec_backend_names_the_package():
    from zsprob.utils.remote import fsspec_problem
    if fsspec_problem("s3") is None:
        pytest.skip("s3fs is installed here")
    with pytest.raises(UserError, match="s3fs"):
        build_wds_pipeline("s3://bucket/{000..009}.tar", preprocess=None, tokenizer=None, batch_size=2)


def test_synthworld_epoch_length_from_a_manifest_behind_a_url(tmp_path):
    from zsprob.data.synthetic import generate
    from zsprob.train.data import count_samples_synthetic
    generate(tmp_path / "sw", image_size=32, num_pretrain=12, num_classify_select=0, num_classify_eval=0,
             num_retrieval=2, num_retrieval_val=0, shard_size=6, progress=False)
    pretrain = tmp_path / "sw" / "pretrain"
    assert count_samples_synthetic(str(pretrain)) == 12
    assert count_samples_synthetic(f"file://{pretrain}/shard-{{000000..000001}}.tar") == 12
    base = f"memory://zsprob-{uuid.uuid4().hex[:8]}/sw"
    fs = fsspec.filesystem("memory")
    for f in [tmp_path / "sw" / "manifest.json", *sorted(pretrain.glob("*.tar"))]:
        fs.pipe(f"{base}/{f.relative_to(tmp_path / 'sw').as_posix()}", f.read_bytes())
    assert count_samples_synthetic(f"{base}/pretrain/shard-{{000000..000001}}.tar") == 12
    assert count_samples_synthetic(f"{base}/pretrain") == 12
    assert count_samples_synthetic("pipe:cat x.tar") is None


def test_cli_unknown_scheme_is_exit_2_and_pipe_shards_train(tmp_path):
    r = run_cli("pretrain", "--data", "webdataset", "--shards", "foo://x/{000..001}.tar", "--steps", "1",
                "--out", str(tmp_path / "bad"), "--no-progress")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "unknown URL scheme 'foo'" in r.stderr
    from zsprob.data.synthetic import generate
    generate(tmp_path / "sw", image_size=32, num_pretrain=16, num_classify_select=0, num_classify_eval=0,
             num_retrieval=2, num_retrieval_val=0, shard_size=8, progress=False)
    spec = f"pipe:cat {tmp_path / 'sw' / 'pretrain'}/shard-{{000000..000001}}.tar"
    r = run_cli("pretrain", "--config", "synthetic_tiny.yaml", "--data", "synthetic", "--shards", spec,
                "--steps", "2", "--batch-size", "8", "--workers", "0", "--log-every", "1",
                "--set", "model.embed_dim=16", "--set", "train.tensorboard=false",
                "--out", str(tmp_path / "run"), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (Path(tmp_path / "run") / "model").is_dir()
