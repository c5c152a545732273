"""Shared pytest fixtures. Fixtures generate their data on the fly; nothing is downloaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (README's command: one worker per core) each worker, and the CLI processes it
# starts, computes on one torch thread (two workers of two OpenMP threads each oversubscribe two cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` first, the longest (``slow(seconds=...)``) first of all, so that under
    pytest-xdist a free worker takes the short ones while another runs them; tests marked ``gpu``
    run only where torch sees a CUDA device."""
    def cost(item) -> float:
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else slow.kwargs.get("seconds", 1.0)

    items.sort(key=lambda item: -cost(item))  # stable: file order among equals
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


class _ForkServer:
    """Client of tests/cli_forkserver.py: one interpreter with the heavy imports done, which forks a
    child process per CLI call (see that module). Started on first use, restarted if it dies."""

    def __init__(self):
        import threading
        self.proc = None
        self.tmp = None
        self.lock = threading.Lock()  # one request at a time on the pipe

    def start(self) -> None:
        import tempfile
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="zsprob-cli-")
        code = f"import sys; sys.path.insert(1, {str(ROOT / 'tests')!r}); import cli_forkserver; cli_forkserver.serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self.proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"the CLI fork server did not start: {ready!r}")

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with self.lock:
            return self._run(args, cwd, env, timeout)

    def _run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        import select
        import signal
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        out, err = Path(self.tmp) / "call.out", Path(self.tmp) / "call.err"  # one call at a time (the lock)
        req = {"args": args, "cwd": str(cwd or os.getcwd()), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        timed_out = not ready
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        status = json.loads(self.proc.stdout.readline())["status"]
        stdout = out.read_text(errors="replace")
        stderr = err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        cmd = [sys.executable, "-m", "zsprob", *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), stdout, stderr)

    def close(self) -> None:
        import shutil
        if self.proc is not None:
            self.proc.stdin.close()  # the server's loop ends with its input
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


_FORK_SERVER = _ForkServer()


def pytest_sessionfinish(session, exitstatus):
    _FORK_SERVER.close()


def run_cli(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: float = 600, cold: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m zsprob ARGS`` in a child process and capture its output.

    The child is forked from tests/cli_forkserver.py's interpreter, which has done the heavy imports
    once (5-7 s per call otherwise); ``cold=True``, extra ``env`` (it could change how a module
    imports) or ``ZSPROB_TEST_FORKSERVER=0`` start a fresh interpreter instead."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    args = [str(a) for a in args]
    if env or cold or os.environ.get("ZSPROB_TEST_FORKSERVER", "1") == "0" or not hasattr(os, "fork"):
        full_env.update(env or {})
        return subprocess.run([sys.executable, "-m", "zsprob", *args], cwd=cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    return _FORK_SERVER.run(args, cwd, full_env, timeout)


@pytest.fixture
def cli_run():
    return run_cli


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (tiny ops are faster so when the cores are shared); restored after.
    Test modules of small tensor maths opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ tiny training runs, shared
# The towers every training test uses: zsprob-tiny's open_clip ViT and text transformer cut to two
# layers of width 32 at 32 px (model.overrides); with embed_dim 16 a step takes milliseconds.
TINY_TOWERS = {"open_clip_cfg": {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                                "image_size": 32},
                                 "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> Path:
    """A SynthWorld at 32 px with 64 pretraining samples in two shards (read-only for the tests)."""
    from zsprob.data.synthetic import generate
    out = tmp_path_factory.mktemp("sw")
    generate(out, image_size=32, num_pretrain=64, num_classify_select=0, num_classify_eval=0,
             num_retrieval=4, num_retrieval_val=0, shard_size=32, progress=False)
    return out


def small_world(base: Path, *, seed: int, model: dict, **sizes) -> dict:
    """A 32 px SynthWorld under ``base/sw`` with the split ``sizes`` of ``generate`` and an untrained zsprob-tiny
    checkpoint (``create_model`` keywords ``model``) at ``base/ckpt``; torch seeded 0 before the model."""
    import torch

    from zsprob.data.synthetic import generate
    from zsprob.models import create_model, save

    generate(base / "sw", image_size=32, progress=False, seed=seed, **sizes)
    torch.manual_seed(0)
    ckpt = save(create_model("zsprob-tiny", seed=0, **model), base / "ckpt")
    return {"root": base / "sw", "ckpt": ckpt, "base": base}


def tiny_model_args() -> list[str]:
    """`--model` and `--set` arguments selecting zsprob-tiny with TINY_TOWERS on the command line."""
    flow = json.dumps(TINY_TOWERS).replace('"', "")  # a YAML flow mapping
    return ["--model", "zsprob-tiny", "--set", "model.pretrained=null", "--set", "model.embed_dim=16",
            "--set", f"model.overrides={flow}"]


def read_losses(run: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("loss") is not None:
            out[r["step"]] = r["loss"]
    return out
