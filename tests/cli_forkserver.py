"""A fork server for the CLI tests: ``python -m zsprob ARGS`` without paying the imports each time.

Every ``zsprob`` command that builds a model imports torch, torchvision, open_clip (and through it
transformers) and timm: 5-7 s of a fresh interpreter's time on a 2-core CI machine, repeated for
each of the suite's CLI calls. The server is one interpreter that has imported those once and
then, per request, forks a child that runs ``zsprob.cli.main`` with the request's argv, working
directory and environment, with stdin from /dev/null and stdout / stderr on files of its own. The
child is a real process: its exit status, its output and its crash behaviour (an uncaught
exception prints the traceback and exits 1; ``sys.exit(x)`` gives the interpreter's status for x;
non-daemon threads are joined and atexit handlers run) are what ``python -m zsprob`` gives; only the
final teardown of every module is skipped (``_exit``). The server itself never runs a torch operation, so no thread pool
exists when it forks.

Protocol (JSON lines): the client writes {"args", "cwd", "env", "stdout", "stderr"}; the server
answers {"pid"} when the child starts and {"status"} (a waitpid status) when it ends.
``tests/conftest.py:run_cli`` is the client; it falls back to a fresh interpreter when asked
(``cold=True``) or when ``ZSPROB_TEST_FORKSERVER=0``.
"""
from __future__ import annotations

import json
import os
import sys

PRELOAD = ("torch", "torchvision", "open_clip", "timm", "accelerate", "webdataset", "safetensors",
           "scipy.stats", "zsprob.cli", "zsprob.models", "zsprob.prob", "zsprob.retrieval", "zsprob.train.loop")


def _child(req: dict) -> None:
    """Become ``python -m zsprob ARGS``; never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    import importlib.util
    sys.argv = [importlib.util.find_spec("zsprob.__main__").origin] + list(req["args"])  # as -m sets it
    from zsprob.cli import main
    code = 0
    try:
        main()
    except SystemExit as e:  # what the interpreter makes of sys.exit(x)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """The observable part of interpreter shutdown (join non-daemon threads, atexit handlers - which
    include multiprocessing's and weakref.finalize's - and flushing stdio), without tearing down every
    module: in a forked child that teardown copies the whole inherited heap (1.5 s per call here)."""
    import atexit
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def serve() -> None:
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)  # never returns
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"status": status}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
