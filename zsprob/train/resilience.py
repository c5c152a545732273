"""Training that survives a cluster: ``--resume auto``, pre-emption signals, test fault hooks.

Reused library behaviour: torchrun's elastic agent (``torch.distributed.run``) restarts the whole
process group after a worker dies (``--max-restarts N``) and tells its workers so through the
``TORCHELASTIC_*`` environment variables; Python's :mod:`signal` delivers SIGTERM / SIGUSR1 (how
SLURM and most schedulers announce pre-emption) to a handler between bytecodes of the main
thread. zsprob writes the policy:

- ``resume="auto"``: the latest valid checkpoint under ``OUT/checkpoints`` if there is one, else a
  fresh start; the default under a torchrun elastic agent, so the same command can be relaunched
  by ``--max-restarts`` or a scheduler's requeue. ``"latest"`` (or True) insists on a checkpoint.
- :class:`StopSignals`: the handler only sets a flag. The loop looks at it after each step (all
  processes agree through one all-reduce), writes a checkpoint unless it has just written one, and
  raises :class:`zsprob.errors.Preempted`, which the command line turns into the requeue exit code.
  A signal that arrives while a checkpoint is being written therefore only sets the flag: the
  write completes and is committed first.
- :func:`fault_point`: test-only fault injection (``ZSPROB_TEST_FAULT``), inert unless set.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from zsprob.errors import UserError

#: environment variables torchrun's elastic agent sets in every worker
ELASTIC_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
#: signals treated as "pre-empted: checkpoint and exit"
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
#: the exit code of a pre-empted run unless ``--requeue-exit-code`` / ``train.requeue_exit_code`` says otherwise
DEFAULT_REQUEUE_EXIT_CODE = 143
FAULT_ENV = "ZSPROB_TEST_FAULT"


def under_elastic_agent() -> bool:
    """True inside a worker started by torchrun's elastic agent."""
    return any(os.environ.get(v) for v in ELASTIC_VARS)


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group (0 outside one)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def init_restart_safe_process_group(cpu: bool, timeout=None) -> bool:
    """Open the default process group in a key space of its own for each torchrun restart.

    Since torch 2.5 torchrun's c10d rendezvous shares one TCPStore (hosted by the agent, which
    outlives its workers) with every generation of workers, and ``init_process_group("env://")``
    writes the same keys into it each time (pytorch/pytorch#135712). After ``--max-restarts``
    relaunches a group, a worker can read the previous generation's gloo addresses before its
    peer overwrites them: "Gloo connectFullMesh failed ... Connection refused", or a hang. Under
    that shared store (``TORCHELASTIC_USE_AGENT_STORE=True``) this opens the group itself on the
    agent's store behind the prefix ``zsprob/restart-<TORCHELASTIC_RESTART_COUNT>``; accelerate then
    finds it initialised and uses it. ``timeout`` (a timedelta, ``train.dist_timeout_s``) bounds every
    collective of the group. Returns whether it did so (False: not under a shared store, or
    a group exists already; accelerate opens its own as usual).

    The restart count is the same on every worker of one node; across nodes it can differ when an
    agent restarts for a membership change, so multi-node elastic jobs should set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on torchrun (a fresh store per round; see docs/).
    """
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available() or dist.is_initialized():
        return False
    timeout = timeout if timeout is not None else timedelta(seconds=1800)  # train.dist_timeout_s's default
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    backend = "gloo" if cpu or not torch.cuda.is_available() else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, store=dist.PrefixStore(f"zsprob/restart-{restart_count()}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return True


def is_complete(step_dir: Path) -> bool:
    """A committed step directory holds its state (json + tensors) and the model."""
    return ((step_dir / "state.json").is_file() and (step_dir / "state.safetensors").is_file()
            and (step_dir / "model").is_dir())


def latest_valid_checkpoint(out: str | os.PathLike) -> Path | None:
    """The step directory ``latest.json`` names when it is complete; else the newest complete
    ``step-*`` directory (a crash between committing a directory and updating ``latest.json``, or a
    damaged pointer); None when there is none. Half-written ``.tmp-*`` directories never count."""
    root = Path(out) / "checkpoints"  # zsprob.train.state.checkpoint_root, without importing torch
    pointer = root / "latest.json"
    try:
        named = root / json.loads(pointer.read_text())["dir"]
        if is_complete(named):
            return named
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and is_complete(p)) if root.is_dir() else []
    return steps[-1] if steps else None


def resume_mode(resume) -> str | Path | None:
    """Normalise ``resume``: None / "" -> "auto" under an elastic agent else None; False / "no" -> None;
    True / "latest" -> "latest"; "auto"; anything else is a step directory (Path)."""
    if resume is None or resume == "":
        return "auto" if under_elastic_agent() else None
    if resume is False or resume == "no":
        return None
    if resume is True or resume == "latest":
        return "latest"
    if resume == "auto":
        return "auto"
    return Path(resume)


def find_resume_dir(resume, out: Path) -> Path | None:
    """The step directory to resume from, per :func:`resume_mode`; None for a fresh start."""
    mode = resume_mode(resume)
    if mode is None:
        return None
    if mode == "auto":
        return latest_valid_checkpoint(out)
    from zsprob.train import state
    ckpt_dir = state.latest_checkpoint(out) if mode == "latest" else mode
    if ckpt_dir is None:
        raise UserError(f"--resume: no checkpoint in {out / 'checkpoints'} (nothing to resume; "
                        "--resume auto starts afresh instead)")
    if not (Path(ckpt_dir) / "state.json").is_file():
        raise UserError(f"--resume: {ckpt_dir} is not a checkpoint directory (no state.json)")
    return Path(ckpt_dir)


class StopSignals:
    """Context manager: SIGTERM / SIGUSR1 set :attr:`received` instead of killing the process.

    Installed only in the main thread (Python's rule); the previous handlers come back on exit.
    """

    def __init__(self, names=STOP_SIGNALS):
        self.names = tuple(names)
        self.received: str | None = None
        self._old: dict = {}

    def _handler(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def fault_point(where: str, step: int, rank: int) -> None:
    """Test-only fault injection. ``ZSPROB_TEST_FAULT="WHERE:STEP:ACTION[:RANK],..."`` with WHERE one
    of ``checkpoint-mid`` (the model written, the state not yet) or ``checkpoint-done`` (committed)
    and ACTION ``kill`` (SIGKILL), ``raise`` (an OSError) or a signal name (sent to this process).
    Fires on the first attempt of an elastic group only, so a restarted group runs clean."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or restart_count() > 0:
        return
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) < 3 or parts[0] != where or int(parts[1]) != step:
            continue
        if len(parts) > 3 and int(parts[3]) != rank:
            continue
        action = parts[2]
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            raise OSError(f"injected fault ({FAULT_ENV}={item})")
        else:
            os.kill(os.getpid(), getattr(signal, action))
