"""Training that survives a cluster (no torch import): the run directory's claim (:class:`RunLock`,
:func:`claim_run_dir`: two runs never share one OUT), the checkpoint to resume from (``resume="auto"``: the
latest valid one, else a fresh start; the default under torchrun's elastic agent) and pre-emption signals
(:class:`StopSignals` only sets a flag; the loop checkpoints after the step and raises ``Preempted``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

from zsprob.errors import Preempted, UserError, stop_exit_code
from zsprob.utils.paths import RUN_MARKERS
from zsprob.utils.signals import install_stop_handlers, restore_handlers

#: environment variables torchrun's elastic agent sets in every worker
ELASTIC_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
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


def init_restart_safe_process_group(cpu: bool, timeout) -> bool:
    """Open the default process group under a key prefix of its own for each torchrun restart when torchrun
    shares its agent's TCPStore with every generation of workers: otherwise a restarted worker can read its
    dead peer's address (pytorch/pytorch#135712). Returns whether it opened the group (accelerate uses it)."""
    import torch
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available() or dist.is_initialized():
        return False
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    backend = "gloo" if cpu or not torch.cuda.is_available() else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, store=dist.PrefixStore(f"zsprob/restart-{restart_count()}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return True


def checkpoint_root(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoints"


def _whole_tensors(path: Path) -> bool:
    """Whether a safetensors file is whole: its header parses and the file is as long as the header says (a
    truncated or overwritten file is not; no tensor is read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(length, size)))  # a length past the file: no huge read, and not whole
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + length + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def is_complete(step_dir: Path) -> bool:
    """A committed step directory holds its state (a JSON object and whole tensors) and the model."""
    try:
        meta = json.loads((step_dir / "state.json").read_text())
    except (OSError, ValueError):
        return False
    model = step_dir / "model"
    return (isinstance(meta, dict) and isinstance(meta.get("step"), int) and (model / "zsprob.json").is_file()
            and _whole_tensors(step_dir / "state.safetensors") and _whole_tensors(model / "model.safetensors"))


def named_checkpoint(out: str | os.PathLike) -> Path | None:
    """The existing directory ``latest.json`` names, or None (no pointer, an unreadable one, no such directory)."""
    root = checkpoint_root(out)
    try:
        named = root / json.loads((root / "latest.json").read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return named if named.is_dir() else None


def latest_valid_checkpoint(out: str | os.PathLike, say: bool = False) -> Path | None:
    """The complete step directory ``latest.json`` names, else the newest complete ``step-*`` directory (a
    crash before the pointer moved, a pointer gone or damaged, a damaged latest checkpoint), else None;
    ``say``: a warning on the main process when it is not the one ``latest.json`` names."""
    root = checkpoint_root(out)
    named = named_checkpoint(out)
    if named is not None and is_complete(named):
        return named
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and is_complete(p)) if root.is_dir() else []
    if steps and say and os.environ.get("RANK", "0") == "0":
        why = f"{named} is incomplete or damaged" if named else f"{root / 'latest.json'} is missing or unreadable"
        warnings.warn(f"--resume: {why}; resuming from {steps[-1]}, the newest complete checkpoint")
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


def find_resume_dir(resume, out: Path, say: bool = True) -> Path | None:
    """The step directory to resume from, per :func:`resume_mode`; None for a fresh start. "auto" and "latest"
    take the newest complete checkpoint when ``latest.json`` is gone or names a damaged one (saying so)."""
    mode = resume_mode(resume)
    if mode is None:
        return None
    if mode in ("auto", "latest"):  # none complete: the damaged one named, refused in one line by its loader
        found = latest_valid_checkpoint(out, say=say) or named_checkpoint(out)
        if found is None and mode == "latest":
            raise UserError(f"--resume: no complete checkpoint in {out / 'checkpoints'} (nothing to resume; "
                            "--resume auto starts afresh instead)")
        return found
    if not (mode / "state.json").is_file():
        raise UserError(f"--resume: {mode} is not a checkpoint directory (no state.json)")
    return mode


#: seconds a stop signal during a wait for a batch gives the batch to come before the run stops without a
#: checkpoint (a stream that makes no progress never ends its step otherwise)
DATA_WAIT_GRACE_S = 10.0


class StopSignals:
    """Context manager: SIGTERM / SIGUSR1 / the first SIGINT set :attr:`received` instead of killing the
    process (main thread only; the previous handlers come back on exit). During a wait for a batch
    (:class:`data_wait`) a signal also arms a timer that raises Preempted, without a checkpoint, when no
    batch has come :data:`DATA_WAIT_GRACE_S` seconds after the wait began."""

    active: "StopSignals | None" = None  # the one installed now (data_wait finds it)

    def __init__(self, exit_code: int, step: int = 0):
        self.received: str | None = None
        self.exit_code, self.step = int(exit_code), int(step)
        self.waiting_since: float | None = None
        self._armed = False
        self._old: dict = {}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:  # the first Ctrl-C stops gracefully; the next one raises KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if os.environ.get("RANK", "0") == "0":
                print(f"\nzsprob: Ctrl-C: stopping after step {self.step + 1} with a checkpoint (press Ctrl-C "
                      "again to stop at once, without one)", file=sys.stderr, flush=True)
        self.received = self.received or signal.Signals(signum).name
        if self.waiting_since is not None and not self._armed:
            self._armed = True
            left = max(0.01, DATA_WAIT_GRACE_S - (time.monotonic() - self.waiting_since))
            signal.setitimer(signal.ITIMER_REAL, left, 1.0)  # again every second until the wait ends

    def _alarm(self, signum, frame):
        if self.waiting_since is not None and self.received:
            raise _StopWaiting()  # a BaseException: no "except Exception" in a data pipeline swallows it

    def preempted(self):
        return Preempted(f"stopped by {self.received} while waiting for training data (no batch within "
                         f"{DATA_WAIT_GRACE_S:.0f} s, at step {self.step}); no checkpoint written: "
                         "--resume auto continues from the last one", exit_code=self.code(), step=self.step,
                         interrupted=self.received == "SIGINT")

    def code(self) -> int:
        """The exit code of this stop: 130 after Ctrl-C, else the requeue exit code."""
        return stop_exit_code(self.received, self.exit_code)

    def __enter__(self) -> "StopSignals":
        self._old = install_stop_handlers(self._handler)
        if self._old:  # the main thread, the only one that may install handlers
            if hasattr(signal, "SIGALRM"):
                self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._alarm)
            StopSignals.active = self
        return self

    def disarm(self) -> None:
        """Stop the data-wait timer, if armed."""
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._armed = False

    def __exit__(self, *exc) -> None:
        self.disarm()
        restore_handlers(self._old)
        if StopSignals.active is self:
            StopSignals.active = None


class data_wait:
    """Context manager around fetching one batch, so that a stop signal during a wait that never ends
    stops the run (:class:`StopSignals`)."""

    def __init__(self):
        self.stop = StopSignals.active

    def __enter__(self):
        if self.stop is not None:
            self.stop.waiting_since = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.stop is not None:
            self.stop.waiting_since = None
            self.stop.disarm()
            workers_stopped = (self.stop.received and exc_type is not None and issubclass(exc_type, RuntimeError)
                               and "DataLoader worker" in str(exc))
            if exc_type is _StopWaiting or workers_stopped:
                raise self.stop.preempted() from None  # the data workers were stopped with the run
        return False


class _StopWaiting(BaseException):
    """Raised by :class:`StopSignals`' timer inside a data wait; :class:`data_wait` turns it into Preempted."""


def fault_point(where: str, step: int, rank: int) -> None:
    """The tests' fault injection: ``ZSPROB_TEST_FAULT="WHERE:STEP:ACTION[:RANK],..."``, WHERE
    ``checkpoint-mid`` or ``checkpoint-done``, ACTION ``kill``, ``raise`` (an OSError) or a signal name; on
    the first attempt of an elastic group only."""
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


# --------------------------------------------------------------------------- the run directory
#: everything a run writes under OUT, removed by --overwrite before the fresh run starts
RUN_ENTRIES = RUN_MARKERS + ("summary.json", "model-swa", "model-best", "tensorboard")
LOCK_NAME = ".lock"


def run_markers(out: str | os.PathLike) -> list[str]:
    """The :data:`zsprob.utils.paths.RUN_MARKERS` present under ``out``; empty when only the config.yaml of a
    run that stopped before its first record is there (the same command may simply run again)."""
    found = [m for m in RUN_MARKERS if (Path(out) / m).exists()]
    return found if set(found) - {"config.yaml"} else []


def check_reuse(out: str | os.PathLike, resume, overwrite: bool) -> bool:
    """Whether this launch overwrites ``out``; one line when ``out`` holds a run and neither ``resume`` nor
    ``overwrite`` says what to do with it (a restarted elastic group resumes instead of overwriting)."""
    mode = resume_mode(resume)
    if overwrite and resume not in (None, "", False, "no"):
        raise UserError("--overwrite and --resume contradict each other: drop one (--overwrite starts afresh, "
                        "--resume continues)")
    if overwrite and restart_count() > 0:
        return False  # the first attempt replaced the old run; this restart continues it ("auto")
    found = run_markers(out)
    if found and mode is None and not overwrite:
        raise UserError(f"--out {out} already holds a run ({', '.join(found)}): pass --resume to continue it or "
                        "--overwrite to replace it (or choose another --out)")
    finished = [name for name in ("model", "summary.json") if (Path(out) / name).exists()]
    if finished and mode == "auto" and not overwrite and latest_valid_checkpoint(out) is None:
        raise UserError(f"--out {out} holds a finished run ({', '.join(finished)}) and no checkpoint to continue "
                        "from (extending needs its checkpoints/): --resume auto never trains over it; pass "
                        "--overwrite to replace it, or choose another --out")
    return bool(overwrite)


def remove_run(out: str | os.PathLike) -> None:
    """--overwrite: the old run's files (:data:`RUN_ENTRIES`) removed before the fresh run starts."""
    for name in RUN_ENTRIES:
        p = Path(out) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``OUT/.lock`` (pid and host, created with O_EXCL) held by the main process while a run writes
    ``OUT``; a lock left by a dead process on this host is taken over with a warning."""

    def __init__(self, out: str | os.PathLike):
        self.path = Path(out) / LOCK_NAME
        self.held = False

    def _stale(self) -> tuple[bool, str]:
        """(whether the existing lock can be taken over, who holds it)."""
        try:
            info = json.loads(self.path.read_text())
            pid, host = int(info["pid"]), str(info["host"])
        except FileNotFoundError:
            return True, "nobody"
        except (OSError, ValueError, KeyError, TypeError):
            try:  # half-written by a process that died at once; a fresh one may be mid-write
                return time.time() - self.path.stat().st_mtime > 5, "an unreadable lock"
            except FileNotFoundError:
                return True, "nobody"
        here = host == socket.gethostname()
        return here and (pid == os.getpid() or not _pid_alive(pid)), f"pid {pid} on {host}"

    def acquire(self) -> "RunLock":
        folder = self.path.parent
        self.created = not folder.exists()
        self.was_empty = self.created or (folder.is_dir() and not any(folder.iterdir()))
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                stale, owner = self._stale()
                if not stale:
                    raise UserError(f"--out {self.path.parent} is in use by another run ({owner}, {self.path}); "
                                    "wait for it to end or choose another --out") from None
                warnings.warn(f"taking over the stale lock {self.path} ({owner} is gone)")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
            self.held = True
            return self
        raise UserError(f"--out {self.path.parent}: could not take the lock {self.path} (contended)")

    def release(self, refused: bool = False) -> None:
        """Unlock; ``refused`` (the run stopped on a UserError before it logged or saved anything): remove what it
        wrote in a folder that was new or empty, and the folder it created, so that a refused run leaves nothing."""
        if not self.held:
            return
        self.path.unlink(missing_ok=True)
        self.held = False
        out = self.path.parent
        kept = [name for name in ("metrics.jsonl", "model", "checkpoints") if (out / name).exists()]
        if refused and self.was_empty and not kept:
            remove_run(out)
            if self.created and not any(out.iterdir()):
                out.rmdir()


def claim_run_dir(out: Path, resume, overwrite: bool, main: bool, mirrored: bool = False) -> RunLock | None:
    """Before a run writes anything: the lock and, with ``overwrite``, the old run removed (main process), the
    reuse rule (every process); returns the held lock. A ``resume`` that names no checkpoint is one line here,
    unless a remote mirror (``mirrored``) may bring one."""
    if not mirrored and resume_mode(resume) not in (None, "auto"):  # "auto" may find nothing: a fresh start
        find_resume_dir(resume, out, say=False)
    if not main:
        check_reuse(out, resume, overwrite)
        return None
    lock = RunLock(out).acquire()
    try:
        if check_reuse(out, resume, overwrite):
            remove_run(out)
    except BaseException:
        lock.release()
        raise
    return lock


def checkpoint_step(ckpt_dir: Path) -> int:
    """The step a checkpoint directory was written at (its state.json)."""
    from zsprob.utils.io import read_json
    meta = read_json(Path(ckpt_dir) / "state.json", "training state")
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int):
        from zsprob.train import state
        step = int(state.load_state(ckpt_dir, require=state.MAIN_STATE_KEYS)["step"])
    return step


def check_resume_target(ckpt_step: int, total_steps: int, ckpt_dir: Path, out: Path) -> bool:
    """``--resume`` never moves backwards (one line when the checkpoint is past ``total_steps``); True when the
    run is finished (checkpoint at the end and summary.json written)."""
    if ckpt_step > total_steps:
        raise UserError(f"--resume: the checkpoint {ckpt_dir} is at step {ckpt_step}, past the {total_steps} steps "
                        f"asked for; resuming never goes back (ask for more steps than {ckpt_step}, or --overwrite)")
    return ckpt_step == total_steps and (Path(out) / "summary.json").is_file()
