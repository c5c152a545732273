"""Where evaluation runs: --device / --workers / --precision of eval, zeroshot, select-prompts and index.

Device resolution is one function (zsprob.utils.devices.resolve_device); these tests run on the
CPU: a GPU that is absent or a device string that is not one is one line and exit 2 in every
command, decoding workers do not change a single metric, bf16 encoding stays within a stated
tolerance of fp32 while scores stay float32, and an explicit CPU device takes today's path
bit for bit.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli, small_world
from zsprob.errors import UserError
from zsprob.utils.devices import check_precision, encode_autocast, resolve_device

TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
}
#: bf16 encoding against fp32 (stated in docs/retrieval.md): per-embedding cosine of the means
BF16_MIN_COSINE = 0.99
#: ... and R@1 / top-1 in percentage points
BF16_MAX_POINTS = 2.0


# ----------------------------------------------------------------------------- resolve_device
def test_resolve_device_reads_torch_cuda(monkeypatch):
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto") and resolve_device("CPU") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(UserError, match=r"torch sees 2 CUDA GPU\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="no CUDA GPU"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("spec", ["tpu9", "cpu:0", "cuda:", "cuda:x", "gpu", "", "mps", "cuda:-1"])
def test_resolve_device_rejects_unknown_strings(spec):
    with pytest.raises(UserError, match="unknown device .*: choose auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_precision_is_checked_and_bf16_autocasts():
    assert check_precision("fp32") == "fp32" and check_precision("bf16") == "bf16"
    with pytest.raises(UserError, match="unknown precision 'fp16': choose fp32 or bf16"):
        check_precision("fp16")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with encode_autocast("cpu", "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with encode_autocast("cpu", "fp32"):
        assert (a @ b).dtype == torch.float32


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A small SynthWorld (retrieval and classification splits) and a tiny zsprob checkpoint."""
    base = tmp_path_factory.mktemp("evaldev")
    made = small_world(base, seed=1, model={"open_clip_cfg": TINY}, num_pretrain=4, num_classify_select=1,
                       num_classify_eval=3, num_retrieval=40, num_retrieval_val=4, shard_size=4)
    (base / "empty").mkdir()
    return made


def _one_line_error(r, needle: str):
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert r.stderr.startswith("zsprob: error:") and r.stderr.count("\n") == 1, r.stderr
    assert needle in r.stderr, r.stderr


def _bad_devices() -> list[tuple[str, str]]:
    """(device string, words of its error) that fail on this machine."""
    bad = [("tpu9", "unknown device 'tpu9'")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "torch sees no CUDA GPU"))
    if torch.cuda.device_count() < 4:
        bad.append(("cuda:3", "cuda:3"))
    return bad


def test_bad_devices_are_one_line_exit_2_in_every_command(world, tmp_path):
    from test_retrieval_cli import make_npz

    make_npz(tmp_path / "e.npz")
    assert run_cli("index", "build", "--embeddings", tmp_path / "e.npz", "--kind", "torch", "--out",
                   tmp_path / "idx").returncode == 0
    root, ckpt, out = world["root"], world["ckpt"], tmp_path / "out"
    commands = {
        "eval synthetic": ["eval", "synthetic", "--checkpoint", ckpt, "--root", root, "--out", out / "m.json"],
        "eval coco": ["eval", "coco", "--checkpoint", ckpt, "--root", world["base"] / "empty", "--out", out / "c.json"],
        "eval embeddings": ["eval", "embeddings", tmp_path / "e.npz", "--out", out / "e.json"],
        "zeroshot": ["zeroshot", "synthetic", "--checkpoint", ckpt, "--root", root, "--out", out / "z.json"],
        "select-prompts": ["select-prompts", "--checkpoint", ckpt, "--dataset", "synthetic", "--root", root,
                           "--out", out / "s.json"],
        "index build": ["index", "build", "--embeddings", tmp_path / "e.npz", "--out", tmp_path / "idx2"],
        "index search": ["index", "search", "--index", tmp_path / "idx", "--queries", tmp_path / "e.npz"],
    }
    for spec, needle in _bad_devices():
        for name, args in commands.items():
            r = run_cli(*args, "--device", spec)
            _one_line_error(r, needle)
    assert not list(out.glob("*.json")) and not (tmp_path / "idx2" / "index.json").exists()  # nothing ran


# ----------------------------------------------------------------------------- workers
def _metrics(path) -> dict:
    return json.loads(path.read_text())["metrics"]


@pytest.mark.slow
def test_eval_synthetic_workers_and_auto_device_give_identical_metrics(world, tmp_path):
    base = ["eval", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--no-analysis",
            "--batch-size", "16"]
    runs = {}
    for name, extra in {"w0": ["--device", "cpu", "--workers", "0"], "w2": ["--device", "cpu", "--workers", "2"],
                        "auto": ["--device", "auto"]}.items():
        r = run_cli(*base, *extra, "--out", tmp_path / name / "metrics.json")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = _metrics(tmp_path / name / "metrics.json")
    assert runs["w0"]["caption"]["i2t"]["n_queries"] == 40
    assert runs["w2"] == runs["w0"]
    if not torch.cuda.is_available():  # auto is the CPU here: today's numbers exactly
        assert runs["auto"] == runs["w0"]


@pytest.mark.slow
def test_zeroshot_synthetic_workers_give_identical_results(world, tmp_path):
    base = ["zeroshot", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--topk", "all",
            "--device", "cpu", "--batch-size", "8"]
    got = {}
    for workers in ("0", "2"):
        out = tmp_path / f"w{workers}" / "results.json"  # own cache/ beside each: both encode
        r = run_cli(*base, "--workers", workers, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
        got[workers] = json.loads(out.read_text())
        assert got[workers]["images_from_cache"] is False
    assert got["2"]["metrics"] == got["0"]["metrics"] and got["0"]["metrics"]["n_images"] > 0
    assert got["2"]["selection"] == got["0"]["selection"]


def test_encoders_give_the_same_embeddings_with_workers(world):
    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.models import load_for_inference
    from zsprob.retrieval.synthetic import encode_split

    model = load_for_inference(checkpoint=world["ckpt"], device="cpu")
    rs = load_retrieval_split(world["root"], "test")
    a = encode_split(model, rs, batch_size=16)
    b = encode_split(model, rs, batch_size=16, num_workers=2, device="cpu")
    assert torch.equal(a.image_mu, b.image_mu) and torch.equal(a.image_logvar, b.image_logvar)
    assert torch.equal(a.caption_mu, b.caption_mu)


# ----------------------------------------------------------------------------- precision
def _cosines(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=1)


@pytest.mark.slow
def test_bf16_encoding_is_close_to_fp32_and_scores_stay_float32(world):
    from zsprob.data.synthetic import load_retrieval_split
    from zsprob.models import load_for_inference
    from zsprob.retrieval.evaluate import evaluate_embeddings
    from zsprob.retrieval.scoring import score_matrix
    from zsprob.retrieval.synthetic import encode_split, synthetic_task

    model = load_for_inference(checkpoint=world["ckpt"], device="cpu")
    rs = load_retrieval_split(world["root"], "test")
    full = encode_split(model, rs, batch_size=16)
    half = encode_split(model, rs, batch_size=16, precision="bf16")
    for name in ("image_mu", "caption_mu", "image_logvar", "caption_logvar"):
        x, y = getattr(full, name), getattr(half, name)
        assert y.dtype == torch.float32 and x.shape == y.shape
        assert not torch.equal(x, y)  # autocast really ran the towers in bfloat16
        assert _cosines(x, y).min() > BF16_MIN_COSINE, name
    assert score_matrix("csd", half.image_mu, half.image_logvar, half.caption_mu, half.caption_logvar).dtype \
        == torch.float32
    task = synthetic_task(rs)
    m32 = evaluate_embeddings(full, task, score="csd").metrics
    m16 = evaluate_embeddings(half, task, score="csd").metrics
    for bench, keys in (("caption", ("r@1", "r@5", "r@10")), ("plausible", ("r@1", "map_at_r", "rprecision"))):
        for d in ("i2t", "t2i"):
            for k in keys:
                assert abs(m16[bench][d][k] - m32[bench][d][k]) <= BF16_MAX_POINTS, (bench, d, k)


@pytest.mark.slow
def test_zeroshot_bf16_cli_within_tolerance(world, tmp_path):
    base = ["zeroshot", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--topk", "all",
            "--device", "cpu", "--workers", "0", "--batch-size", "8"]
    got = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision / "results.json"
        r = run_cli(*base, "--precision", precision, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
        got[precision] = json.loads(out.read_text())["metrics"]
    for k in ("top1", "top5", "mean_per_class"):
        assert abs(got["bf16"][k] - got["fp32"][k]) <= BF16_MAX_POINTS, k


# ----------------------------------------------------------------------------- scoring and search on a device
def test_scoring_on_an_explicit_cpu_device_is_todays_path_bit_for_bit():
    from zsprob.retrieval.scoring import PairScores, chunked_topk

    g = torch.Generator().manual_seed(0)
    mu_a, mu_b = torch.randn(37, 8, generator=g), torch.randn(53, 8, generator=g)
    lv_a, lv_b = torch.rand(37, 8, generator=g) - 2, torch.rand(53, 8, generator=g) - 2
    for name in ("csd", "w2", "mc"):
        a = PairScores(name, mu_a, lv_a, mu_b, lv_b, chunk_size=16)
        b = PairScores(name, mu_a, lv_a, mu_b, lv_b, chunk_size=16, device="cpu")
        assert a.i2t.dtype == b.i2t.dtype == torch.float32 and torch.equal(a.i2t, b.i2t)
    v0, i0 = chunked_topk("csd", mu_a, lv_a, mu_b, lv_b, 5, query_chunk=10, gallery_chunk=20)
    v1, i1 = chunked_topk("csd", mu_a, lv_a, mu_b, lv_b, 5, query_chunk=10, gallery_chunk=20,
                          device=torch.device("cpu"))
    assert torch.equal(v0, v1) and torch.equal(i0, i1)


@pytest.mark.parametrize("kind", ["torch", "flat", "ivf"])
def test_index_on_the_cpu_device_searches_as_before(kind):
    if kind != "torch":
        pytest.importorskip("faiss")
    from zsprob.retrieval.search import build_index

    rng = np.random.default_rng(0)
    mu, lv = rng.normal(size=(300, 8)).astype(np.float32), rng.uniform(-3, 0, (300, 8)).astype(np.float32)
    q = rng.normal(size=(20, 8)).astype(np.float32)
    a = build_index(mu, lv, kind=kind, nlist=8, nprobe=8).search(q, None, 5)
    idx = build_index(mu, lv, kind=kind, nlist=8, nprobe=8, device="cpu")
    assert idx.device == torch.device("cpu")
    b = idx.to(torch.device("cpu")).search(q, None, 5)
    np.testing.assert_array_equal(a.index, b.index)
    np.testing.assert_array_equal(a.csd, b.csd)


# ----------------------------------------------------------------------------- on a GPU (skipped on the CPU)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_scores_and_torch_search_on_cuda_match_the_cpu():
    from zsprob.retrieval.scoring import PairScores, chunked_topk
    from zsprob.retrieval.search import build_index

    g = torch.Generator().manual_seed(1)
    mu_a, mu_b = torch.randn(300, 16, generator=g), torch.randn(700, 16, generator=g)
    lv_a, lv_b = torch.rand(300, 16, generator=g) - 2, torch.rand(700, 16, generator=g) - 2
    for name in ("csd", "cosine", "w2"):
        cpu = PairScores(name, mu_a, lv_a, mu_b, lv_b, chunk_size=64)
        gpu = PairScores(name, mu_a, lv_a, mu_b, lv_b, chunk_size=64, device="cuda")
        assert gpu.i2t.device.type == "cpu" and gpu.i2t.dtype == torch.float32
        torch.testing.assert_close(gpu.i2t, cpu.i2t, rtol=1e-4, atol=1e-4)
    v0, i0 = chunked_topk("csd", mu_a, lv_a, mu_b, lv_b, 5, gallery_chunk=256)
    v1, i1 = chunked_topk("csd", mu_a, lv_a, mu_b, lv_b, 5, gallery_chunk=256, device="cuda")
    torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-4)
    assert (i1 == i0).float().mean() > 0.99
    q = mu_a.numpy()
    a = build_index(mu_b.numpy(), lv_b.numpy(), kind="torch").search(q, None, 5)
    b = build_index(mu_b.numpy(), lv_b.numpy(), kind="torch", device="cuda").search(q, None, 5)
    assert (a.index == b.index).mean() > 0.99 and np.allclose(a.csd, b.csd, rtol=1e-4, atol=1e-3)


@needs_cuda
@pytest.mark.slow
def test_eval_synthetic_on_cuda_matches_the_cpu(world, tmp_path):
    base = ["eval", "synthetic", "--checkpoint", world["ckpt"], "--root", world["root"], "--no-analysis"]
    got = {}
    for device in ("cpu", "cuda"):
        r = run_cli(*base, "--device", device, "--out", tmp_path / device / "metrics.json")
        assert r.returncode == 0, r.stderr[-3000:]
        got[device] = _metrics(tmp_path / device / "metrics.json")
    for bench in ("caption", "plausible"):
        for d in ("i2t", "t2i"):
            for k, v in got["cpu"][bench][d].items():
                assert abs(got["cuda"][bench][d][k] - v) <= BF16_MAX_POINTS, (bench, d, k)
