"""Every device path a GPU user reaches, rehearsed on a stand-in device on the CPU: one line per fault, exit 1.

    python scripts/device_rehearsal.py [--only SUBSTRING ...] [--list]

The paths (``--list``): pretrain of every method of the method registry on both demo recipes
(configs/synthetic_tiny.yaml; configs/synthetic_tiny_sigma.yaml with its degraded copies, for the methods with
sigma; jWAE on configs/jwae_synthetic.yaml), PCME's uniform term, fp16 with a GradScaler, gradient accumulation,
SWA, MSDA (both modes), two processes, the logging step, the RedCaps flagship and the COCO fine-tuning recipes
with zsprob-tiny's towers on SynthWorld shards; posthoc (adapter, laplace); eval (the matrix route), ``zeroshot
--compare``, select-prompts for every strategy, the torch index's build and search. Each calls zsprob's library
in-process with tiny sizes on PyTorch's ``meta`` device (forward, backward and the optimisers run there, every
value is absent), 3 training steps (a warm-up and 2 steady ones). The ``fake-cuda`` paths (eval's scores, the
encoding passes in float32 and bf16) run under FakeTensorMode, where ``cuda`` is a device string that matters:
a CPU tensor meeting a fake CUDA one raises there. FakeTensorMode runs forwards only on a CPU build (no
backward, no cuDNN: GPO's GRU asks cuDNN about the device, so that path uses open_clip's native pooling).

A fault is one line ``path: kind at file:line (detail)``:
- ``cpu tensor meets device``: a CPU tensor that is not a 0-dim scalar in a call with a device tensor;
- ``cpu generator on device``: a draw from a CPU ``torch.Generator`` onto the device;
- ``host reads``: more than one host read of a device value (:class:`HostSyncCounter`, device calls only) in a
  steady training step or a logging step (the one allowed: the step's finiteness verdict, the log's stacked read);
- ``data-dependent shape``: nonzero / a boolean mask / unique on a device tensor (the meta device refuses them);
- ``blocking copy``: a host-to-device copy in a steady step that blocks (no ``non_blocking``, or Python data via
  ``torch.tensor(..., device=)``); ``extra host-to-device copy``: a non-blocking one beyond the batch's own (from
  pageable memory CUDA may wait for the stream);
- ``host reads`` in an inference path: more reads at one site than its passes allow (each encoding pass copies
  its results once per 64 batches; any other site once): a read per batch;
- ``crash``: any other error of the path.

Patched, because the meta device cannot do it (nothing else is):
- accelerate refuses the meta device: :class:`StandInAccelerator` does its part (device, prepare = move the step
  module and the optimiser state to the device, backward through the GradScaler, the optimiser wrapper's
  scaler step / update / ``step_was_skipped``, one process); the data loader stays on the CPU, as on a GPU;
- ``torch.autocast(device_type="meta")`` does not exist: it is given the CPU's (a no-op there);
- ``torch.Generator(device="meta")`` does not exist: the CPU's is given (its draws are not checked then);
- a host read of a device value cannot be answered on meta: :class:`StandIn` answers it with a stand-in value
  (True, 1, 1.0, zeros) after it was counted, and a copy of a device tensor to the host gives zeros, so that a
  path runs on to its end and shows every fault;
- two processes: ``torch.distributed`` answers as a world of two whose collectives copy the local tensor;
- ``torch.Generator(device="cuda")`` starts CUDA, which a CPU build cannot: under the fake device a CPU one;
- page-locked memory: zsprob's ``host_sync.pins_memory`` says yes for meta as for CUDA, so ``to_device`` pins, and
  ``Tensor.pin_memory`` (no accelerator here) gives a copy marked pinned; a non-blocking copy from a marked
  tensor is no fault, one from pageable memory is.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zsprob.utils.host_sync import HostSyncCounter, counted_name  # noqa: E402

DEVICE = torch.device("meta")
#: zsprob-tiny cut to two layers of width 32 at 32 px (tests/conftest.py's TINY_TOWERS)
TINY_TOWERS = {"open_clip_cfg": {"vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 8,
                                                "image_size": 32},
                                 "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}
STEPS, FIRST_STEADY = 3, 1
#: calls that read a device value on the host (answered with a stand-in after the counter saw them)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "equal", "allclose"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "__getitem__(bool mask)"}
#: calls that may take tensors of two devices: copies between them
COPIES = {"to", "copy_", "cpu", "cuda", "type_as", "set_", "__get__", "__set__",
          "_has_compatible_shallow_copy_type"}


@dataclass
class Fault:
    path: str
    kind: str
    site: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.path}: {self.kind} at {self.site}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Watch:
    """What the rehearsal watches while a path runs: its faults, the batch's own tensors and the step phase."""

    path: str = ""
    faults: list = field(default_factory=list)
    reads: list = field(default_factory=list)  # host reads of each step, then of each logging step
    steady: bool = False
    batch_ids: set = field(default_factory=set)

    def fault(self, kind: str, site: str, detail: str = "") -> None:
        if not any(f.kind == kind and f.site == site and f.path == self.path for f in self.faults):
            self.faults.append(Fault(self.path, kind, site, detail))


WATCH = Watch()


class Abort(Exception):
    """A fault after which the path cannot go on (a data-dependent shape has no stand-in)."""


def site(frame) -> str:
    """"path:line" of the first frame from ``frame`` outwards that is neither torch's, the counter's, the
    warnings module's nor this script's (paths below zsprob/ relative to it)."""
    here = __file__.replace("\\", "/")
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and name != here and not name.endswith(("/host_sync.py", "/warnings.py")):
            return f"{name.rsplit('/zsprob/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _stand_in(name: str, t: torch.Tensor):
    """The value a host read of device tensor ``t`` gets on the stand-in device."""
    if name in ("tolist", "numpy"):
        host = torch.zeros(t.shape, dtype=t.dtype)
        return host.tolist() if name == "tolist" else host.numpy()
    if name in ("__bool__", "equal", "allclose") or t.dtype == torch.bool:
        return True
    if name in ("__int__", "__index__"):
        return 1
    return 0.0 if t.dtype.is_floating_point else 0


class StandIn(TorchFunctionMode):
    """Checks every torch call against the device rules (:data:`WATCH` collects the faults) and answers what the
    meta device cannot: host reads and copies to the host of a device value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = list(_tensors(args, kwargs))
        if not touches_device(name, tensors, args, kwargs):
            return func(*args, **kwargs)
        site = globals()["site"](sys._getframe(1))
        self._check(name, site, tensors, args, kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and _on_device(first):
            if name in HOST_READS:
                return _stand_in(name, first)
            if counted_name(name, args, kwargs) in ("cpu", "to(cpu)") or (name == "to" and _to_cpu(args, kwargs)):
                return torch.zeros(first.shape, dtype=_to_dtype(args, kwargs) or first.dtype)
        if name == "copy_" and not _on_device(args[0]):
            return args[0].zero_()
        kind = counted_name(name, args, kwargs)
        if name in DATA_DEPENDENT or kind in DATA_DEPENDENT:
            WATCH.fault("data-dependent shape", site, kind or name)
            raise Abort(f"{kind or name} at {site}")
        return func(*args, **kwargs)

    def _check(self, name, site, tensors, args, kwargs) -> None:
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu" \
                and not isinstance(generator, MetaGenerator):
            WATCH.fault("cpu generator on device", site, name)
        if name not in COPIES:
            host = [t for t in tensors if not _on_device(t) and t.dim() > 0]
            if host:
                WATCH.fault("cpu tensor meets device", site, f"{name}: cpu {list(host[0].shape)}")
        if WATCH.steady:
            self._check_copy(name, site, args, kwargs)

    def _check_copy(self, name, site, args, kwargs) -> None:
        """A host-to-device copy in a steady step: the batch's own non-blocking one, else a fault."""
        source = None
        if name == "to" and isinstance(args[0], torch.Tensor) and not _on_device(args[0]) and not _to_cpu(args, kwargs):
            source = args[0]
        elif name == "copy_" and _on_device(args[0]) and not _on_device(args[1]):
            source = args[1]
        elif name in ("tensor", "as_tensor") and not any(isinstance(a, torch.Tensor) for a in args[:1]):
            WATCH.fault("blocking copy", site, f"torch.{name}(host data, device=)")
            return
        if source is None:
            return
        blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
        if blocking:
            WATCH.fault("blocking copy", site, f"{name} of a cpu {list(source.shape)} without non_blocking")
        elif id(source) not in WATCH.batch_ids and not getattr(source, "stand_in_pinned", False):
            WATCH.fault("extra host-to-device copy", site,
                        f"non-blocking {name} of a pageable cpu {list(source.shape)}")


def touches_device(name: str, tensors, args, kwargs) -> bool:
    """Whether a call takes a device tensor or makes one (``device=``, ``.to(device)``)."""
    target = kwargs.get("device", args[1] if name == "to" and len(args) > 1 else None)
    target = target.device if isinstance(target, torch.Tensor) else target
    return any(_on_device(t) for t in tensors) or (isinstance(target, (str, torch.device))
                                                   and torch.device(target).type != "cpu")


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    target = target.device if isinstance(target, torch.Tensor) else target
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _to_dtype(args, kwargs):
    dtype = kwargs.get("dtype")
    return dtype or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)


class DeviceSyncCounter(HostSyncCounter):
    """:class:`HostSyncCounter` restricted to calls that touch a device tensor: a read of host data (the
    loader's, a CPU generator's draw) makes the device wait for nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if touches_device(name, list(_tensors(args, kwargs)), args, kwargs):
            counted = counted_name(name, args, kwargs)
            if counted is not None:
                self.by_name[counted] += 1
                self.where[f"{site(sys._getframe(1))} {counted}"] += 1
        return func(*args, **kwargs)


def judge_reads(counter: HostSyncCounter, what: str) -> None:
    """More than one host read (or any data-dependent shape) in ``counter``: a fault at each site."""
    if counter.total > 1:
        for where, n in counter.where.items():
            site, _, name = where.partition(" ")
            WATCH.fault("host reads", site, f"{n} x {name} in one {what}; {counter.total} in all, at most 1")


# ----------------------------------------------------------------------------- what meta cannot do

class StandInOptimizer:
    """accelerate's optimiser wrapper, the part the step uses: under fp16 the scaler's step and update, and
    ``step_was_skipped``."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler
        self.step_was_skipped = False

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def step(self, closure=None):
        if self.scaler is None:
            return self.optimizer.step(closure)
        stepped, optimizer_step = [], self.optimizer.step

        def step_and_note(*args, **kwargs):  # as accelerate: skipped when the scaler did not call it
            stepped.append(True)
            return optimizer_step(*args, **kwargs)
        self.optimizer.step = step_and_note
        try:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        finally:
            del self.optimizer.step
        self.step_was_skipped = not stepped

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


class StandInAccelerator:
    """The part of accelerate's ``Accelerator`` a training run uses, on the stand-in device, one process
    (``num_processes`` 2 with :func:`two_processes`)."""

    def __init__(self, fp16: bool = False, num_processes: int = 1):
        self.device = DEVICE
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if fp16 else None  # "cuda": off here
        self.process_index, self.num_processes = 0, num_processes
        self.is_main_process = self.is_local_main_process = True

    def prepare(self, module, optimizer):
        """The module on the device; the optimiser's parameters are the moved ones (a CPU parameter cannot
        take meta data in place, so ``Module.to`` makes new ones) and its state is on the device too."""
        before = list(module.parameters())
        module.to(self.device)
        moved = {id(old): new for old, new in zip(before, module.parameters())}
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        optimizer.state = collections.defaultdict(dict, {moved.get(id(p), p): {
            key: value.to(self.device) if isinstance(value, torch.Tensor) and key != "step" else value
            for key, value in state.items()} for p, state in optimizer.state.items()})
        return module, StandInOptimizer(optimizer, self.scaler)

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def autocast(self):
        return contextlib.nullcontext()

    def no_sync(self, module):
        return contextlib.nullcontext()

    def unwrap_model(self, module):
        return module

    def wait_for_everyone(self):
        pass

    def log(self, *args, **kwargs):
        pass


class _Autocast(torch.autocast):
    """``torch.autocast`` that takes the meta device (as the CPU's)."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


class MetaGenerator(torch.Generator):
    """``torch.Generator`` that takes the meta device (a CPU generator then, whose draws are not checked)."""

    def __new__(cls, device=None):
        meta = device is not None and torch.device(device).type == "meta"
        return super().__new__(cls, "cpu" if meta or device is None else device)

    def __init__(self, device=None):
        super().__init__()


def _pins_memory(device) -> bool:
    """zsprob's "does this device pin?" answering yes for the stand-in device, as for CUDA."""
    return device is not None and torch.device(device).type in ("cuda", "meta")


def _pin_memory(self, *args, **kwargs):
    """``Tensor.pin_memory`` without an accelerator: a copy marked as page-locked."""
    pinned = self.clone()
    pinned.stand_in_pinned = True
    return pinned


@contextlib.contextmanager
def stand_in_device():
    """The meta device's patches (module docstring) and the :class:`StandIn` checks, for the block."""
    from unittest import mock

    from zsprob.utils import host_sync
    autocast, generator = torch.autocast, torch.Generator
    torch.autocast, torch.Generator = _Autocast, MetaGenerator
    try:
        with mock.patch.object(host_sync, "pins_memory", _pins_memory), \
                mock.patch.object(torch.Tensor, "pin_memory", _pin_memory), StandIn():
            yield
    finally:
        torch.autocast, torch.Generator = autocast, generator


@contextlib.contextmanager
def two_processes():
    """``torch.distributed`` answering as rank 0 of a world of two whose collectives copy the local tensor."""
    import torch.distributed as dist

    def all_gather(parts, x, *args, **kwargs):
        for part in parts:
            part.copy_(x)

    saved = {name: getattr(dist, name) for name in ("is_initialized", "get_world_size", "get_rank", "all_reduce",
                                                    "all_gather", "barrier", "broadcast")}
    patched = {"is_initialized": lambda: True, "get_world_size": lambda *a: 2, "get_rank": lambda *a: 0,
               "all_reduce": lambda *a, **k: None, "all_gather": all_gather, "barrier": lambda *a, **k: None,
               "broadcast": lambda *a, **k: None}
    for name, value in patched.items():
        setattr(dist, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)


# ----------------------------------------------------------------------------- training

def tiny_overrides(world: Path, model: str = "recipe") -> list[str]:
    """Three steps of batch 8 on the tiny world, logging at the last, nothing written."""
    over = [f"data.shards={world / 'pretrain'}", "data.kind=synthetic", f"schedule.steps={STEPS}",
            "data.batch_size=8", "data.num_workers=0", "data.shuffle_buffer=8", f"train.log_every={STEPS}",
            "train.checkpoint_every=0", "train.tensorboard=false", "train.threads=1", "schedule.warmup_steps=1",
            "data.samples_per_epoch=null", "data.pipeline.caption_key=json:captions"]
    if model == "tiny":  # zsprob-tiny with TINY_TOWERS instead of the recipe's towers
        flow = json.dumps(TINY_TOWERS).replace('"', "")
        over += ["model.name=zsprob-tiny", "model.pretrained=null", "model.embed_dim=16",
                 f"model.overrides={flow}", "data.preprocess=null", "data.kind=synthetic", "data.root=null"]
    return over


def train_path(recipe: str, world: Path, out: Path, extra=(), *, model="recipe", fp16=False, processes=1,
               judge_log=False) -> None:
    """Build the run of ``recipe`` + ``extra`` on the stand-in device and take :data:`STEPS` steps with the
    loop's after-step work; each steady step (and with ``judge_log`` the logging step) is judged."""
    from zsprob.train import state
    from zsprob.train.build import build_run
    from zsprob.train.defaults import load_train_config, resolve_config

    cfg = resolve_config(load_train_config(ROOT / "configs" / recipe, tiny_overrides(world, model) + list(extra)), out)
    state.seed_everything(int(cfg.seed))
    acc = StandInAccelerator(fp16=fp16, num_processes=processes)
    with two_processes() if processes > 1 else contextlib.nullcontext():
        _train_steps(build_run(cfg, out, acc, None), judge_log)


def _train_steps(run, judge_log: bool) -> None:
    """:data:`STEPS` steps of ``run`` and the loop's after-step work, the steady ones judged."""
    from zsprob.train.loop import after_step

    _watch_batches(run)
    run.step_module.train()
    run.counters.loss_sum = torch.zeros((), device=run.acc.device)
    for step in range(STEPS):
        WATCH.steady = step >= FIRST_STEADY
        with DeviceSyncCounter() as counter:
            stats = run.step_fn(run, step)
        WATCH.steady = False
        WATCH.reads.append(counter.total)
        if step >= FIRST_STEADY:
            judge_reads(counter, "steady step")
        with DeviceSyncCounter() as counter:
            after_step(run, step + 1, stats, _NoBar())
        if judge_log and step + 1 == STEPS:
            judge_reads(counter, "logging step")


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kwargs):
        pass


def _watch_batches(run) -> None:
    """Remember the tensors of each batch the cursor hands out: their copies to the device are the batch's own."""
    cursor_next = run.cursor.next

    def next_batch():
        batch = cursor_next()
        WATCH.batch_ids = {id(t) for t in (batch.values() if isinstance(batch, dict) else batch)
                           if isinstance(t, torch.Tensor)}
        return batch
    run.cursor.next = next_batch


# ----------------------------------------------------------------------------- the paths

A, B = "synthetic_tiny.yaml", "synthetic_tiny_sigma.yaml"
#: the fine-tuning recipe's epochs in steps: backbone frozen for the first, embedding warm-up in the second
FINETUNE_STEPS = ["schedule.epochs=null", "schedule.milestones_epochs=null", "schedule.milestones_steps=[2]",
                  "freeze.image_epochs=null", "freeze.image_steps=1", "freeze.warmup_epochs=null",
                  "freeze.warmup_steps=1"]


def training_paths() -> dict:
    """name -> (recipe, overrides, keywords of :func:`train_path`)."""
    from zsprob.prob.method_registry import METHOD_ENTRIES, method_names

    paths = {}
    for recipe, tag in ((A, "recipe"), (B, "sigma recipe")):  # the sigma recipe's heads need sigma
        for method in method_names():
            entry = METHOD_ENTRIES[method]
            if entry.step_kind == "pairwise" and (tag == "recipe" or entry.needs_sigma):
                paths[f"pretrain {tag} {method}"] = (recipe, [f"method={method}"], {})
    paths["pretrain jwae"] = ("jwae_synthetic.yaml", [], {})
    tiny_swa = ["swa.enabled=true", "swa.last_steps=2", "swa.every_steps=1", "swa.last_epochs=null"]
    paths.update({
        "pretrain pcme uniform_weight": (A, ["method=pcme", "loss.pcme.uniform_weight=0.1"], {}),
        "pretrain fp16 GradScaler": (A, ["train.precision=fp16"], {"fp16": True}),
        "pretrain sigma recipe fp16 GradScaler": (B, ["train.precision=fp16"], {"fp16": True}),
        "pretrain accumulation": (A, ["train.accum_steps=2"], {}),
        "pretrain sigma recipe accumulation": (B, ["train.accum_steps=2"], {}),
        "pretrain swa": (A, tiny_swa, {}),
        "pretrain msda random": (A, ["msda.enabled=true"], {}),
        "pretrain msda official": (A, ["msda.enabled=true", "msda.mode=official"], {}),
        "pretrain logging step": (A, [], {"judge_log": True}),
        "pretrain 2 processes": (A, [], {"processes": 2}),
        "pretrain flagship redcaps": ("pretrain_redcaps_vits16.yaml", [], {"model": "tiny"}),
        "finetune coco recipe": ("finetune_coco_vitb32.yaml", tiny_swa + FINETUNE_STEPS, {"model": "tiny"}),
    })
    return paths


def all_paths(world: Path, out: Path) -> dict:
    """name -> a callable that drives the path."""
    paths = {name: (lambda recipe=recipe, extra=extra, kw=kw, name=name:
                    train_path(recipe, world, out / name.replace(" ", "_"), extra, **kw))
             for name, (recipe, extra, kw) in training_paths().items()}
    for method in ("adapter", "laplace"):
        paths[f"posthoc {method}"] = lambda method=method: posthoc_path(method, world, out / f"posthoc-{method}")
    paths.update(inference_paths(world, out))
    paths.update(fake_cuda_paths())
    return paths


def posthoc_path(method: str, world: Path, out: Path) -> None:
    """``zsprob posthoc --method METHOD --device cuda`` on a frozen zsprob-tiny-bow: features, fit, the saved copy."""
    from zsprob.models import create_model
    from zsprob.posthoc.adapter import AdapterSettings
    from zsprob.posthoc.features import DataSpec
    from zsprob.posthoc.run import posthoc

    frozen = create_model("zsprob-tiny-bow", deterministic=True)  # the demo recipe's towers (laplace reads them)
    settings = AdapterSettings(steps=STEPS, batch_size=8, warmup_steps=1)
    posthoc(frozen, DataSpec("synthetic", str(world / "pretrain"), max_samples=8), out, method=method, views=1,
            encode_batch_size=8, settings=settings, device=DEVICE, progress=False)


# ----------------------------------------------------------------------------- inference

#: the most often an encoding pass may copy its results to the host: once per 64 batches (each copy waits)
COPY_EVERY = 64
INFERENCE_BATCH = 4  # several batches per encoding pass, so that a read per batch shows as more reads than passes


@dataclass
class Inference:
    """One zsprob-tiny with sigma heads on the device in eval mode (as ``load_for_inference`` hands it to the
    CLI), shared by every inference path with one feature cache, and the encoding passes of the current path."""
    model: object = None
    passes: int = 0
    copies: int = 0  # the host copies the passes may make: means and log-variances, once per HOST_COPY_EVERY batches


INFERENCE = Inference()


def tiny_model():
    if INFERENCE.model is None:
        from zsprob.models import create_model

        INFERENCE.model = create_model("zsprob-tiny", pretrained=None, embed_dim=16, seed=0, **TINY_TOWERS)
    return INFERENCE.model.to(DEVICE).eval()


def judge_inference(counter: HostSyncCounter) -> None:
    """An inference path reads its device results at the end of each pass: each encoding pass copies its means and
    log-variances once per :data:`COPY_EVERY` batches (:func:`zsprob.models.encode._to_host`), any other site
    once. More: a read per batch."""
    from zsprob.models import encode

    lines, first = inspect.getsourcelines(encode._to_host)
    copies = {f"{Path(encode.__file__).parent.name}/encode.py:{n}" for n in range(first, first + len(lines))}
    for where, n in counter.where.items():
        at, _, name = where.partition(" ")
        allowed = INFERENCE.copies if at in copies else 1
        if n > allowed:
            WATCH.fault("host reads", at, f"{n} x {name} at one site; at most {allowed} ({INFERENCE.passes} "
                                          "encoding passes): a read per batch")


def inference_path(drive) -> None:
    """``drive()`` with every host read of a device value counted, each site judged against the passes made."""
    from zsprob.models import encode

    real = encode._encode_all

    def counted_pass(model, encode_fn, batches, *args, **kwargs):
        seen = [0]

        def counted(batches=batches):
            for batch in batches:
                seen[0] += 1
                yield batch
        try:
            return real(model, encode_fn, counted(), *args, **kwargs)
        finally:
            INFERENCE.passes += 1
            INFERENCE.copies += 2 * max(1, -(-seen[0] // COPY_EVERY))
    INFERENCE.passes = INFERENCE.copies = 0
    encode._encode_all = counted_pass
    try:
        with DeviceSyncCounter() as counter:
            drive()
    finally:
        encode._encode_all = real
    WATCH.reads.append(counter.total)
    judge_inference(counter)


def eval_path(world: Path, out: Path) -> None:
    """``zsprob eval synthetic --device cuda`` (the matrix route): encoding (one item per batch: 4 images, 4
    captions), scoring and metrics."""
    from zsprob.retrieval.synthetic import evaluate_synthetic

    evaluate_synthetic(tiny_model(), world, "test", "csd", out, batch_size=1, device=DEVICE,
                       corruption=False, validity=False, progress=False)


def zeroshot_path(world: Path, out: Path, strategy: str | None) -> None:
    """``zsprob select-prompts --strategy STRATEGY --device cuda`` (``zsprob zeroshot --compare`` when None),
    on 6 of CLIP's templates; the image features come from the cache shared by the paths after the first."""
    from zsprob.zeroshot.classify import compare_strategies, run_selection

    request = dict(dataset="synthetic", root=str(world), batch_size=INFERENCE_BATCH, device=DEVICE, progress=False,
                   cache_dir=out.parent / "zs-cache", k_values="1-4", templates=str(world.parent / "templates.txt"))
    if strategy is None:
        compare_strategies(tiny_model(), out_dir=out, **request)
    else:
        from zsprob.zeroshot.strategy_registry import get_strategy

        run_selection(tiny_model(), strategy=strategy, k=2 if get_strategy(strategy).needs_k else None, **request)


def index_path(out: Path) -> None:
    """``zsprob index build --kind torch --device cuda`` then ``index search``: the device kind (flat, HNSW
    and IVF are faiss's, on the host unless faiss has GPUs)."""
    from zsprob.retrieval.search import build_index, load_index

    gallery, queries = torch.randn(40, 16), torch.randn(6, 16)
    idx = build_index(gallery, torch.randn(40, 16), kind="torch", device=DEVICE)
    idx.save(out)
    load_index(out).to(DEVICE).search(queries, torch.randn(6, 16), 5)


def inference_paths(world: Path, out: Path) -> dict:
    """name -> a callable that drives the path: eval, zero-shot (compare, and select-prompts per strategy), index."""
    from zsprob.zeroshot.strategy_registry import strategy_names

    paths = {"eval synthetic": lambda: inference_path(lambda: eval_path(world, out / "eval")),
             "zeroshot compare": lambda: inference_path(lambda: zeroshot_path(world, out / "zs-compare", None)),
             "index torch build search": lambda: inference_path(lambda: index_path(out / "index"))}
    for strategy in strategy_names():
        paths[f"select-prompts {strategy}"] = lambda strategy=strategy: inference_path(
            lambda: zeroshot_path(world, out / f"zs-{strategy}", strategy))
    return paths


# ----------------------------------------------------------------------------- a fake cuda device

class FakeCudaGenerator(torch.Generator):
    """``torch.Generator(device="cuda")`` would start CUDA, which a CPU build cannot: a CPU generator stands in."""

    def __new__(cls, device=None):
        return super().__new__(cls, "cpu")

    def __init__(self, device=None):
        super().__init__()


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode, in which tensors made on ``cuda`` are fakes on a device that does not exist here: a CPU
    tensor (not a 0-dim scalar) meeting one raises, and is reported as the fault ``cpu tensor meets device`` at
    zsprob's line. Host data enters as real tensors (``allow_non_fake_inputs``), as a loader's batches do."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

    generator = torch.Generator
    torch.Generator = FakeCudaGenerator
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    except FakeTensorDeviceMismatchError as e:
        tb, frames = e.__traceback__, []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        WATCH.fault("cpu tensor meets device", site(frames[-1]), str(e).splitlines()[0][:160])
    finally:
        torch.Generator = generator


def fake_cuda_scores() -> None:
    """``zsprob eval --device cuda``'s scoring: every score of the matrix route and the chunked top-k of the
    index, CPU embeddings in, the blocks scored on the device, CPU results out."""
    from zsprob.prob.method_registry import SCORE_NAMES
    from zsprob.retrieval.scoring import chunked_topk, score_matrix

    g = torch.Generator().manual_seed(0)
    a, b = [torch.randn(6, 16, generator=g) for _ in range(2)], [torch.randn(9, 16, generator=g) for _ in range(2)]
    with fake_cuda():
        for name in SCORE_NAMES:
            score_matrix(name, *a, *b, chunk_size=4, device="cuda", **({"n_samples": 2} if name == "mc" else {}))
        chunked_topk("csd", *a, *b, 3, query_chunk=4, gallery_chunk=4, device="cuda")


def fake_cuda_encode() -> None:
    """``encode_images`` / ``encode_texts`` with the model on ``cuda`` (the batches made on the host, as a loader
    makes them), in float32 and under bf16 autocast. open_clip's native pooling: GPO's GRU asks cuDNN about
    the device, which a CPU build cannot answer (GPO runs on meta in the other paths)."""
    from zsprob.models import create_model
    from zsprob.models.encode import encode_images, encode_texts

    model = create_model("zsprob-tiny", pretrained=None, embed_dim=16, seed=0, pooling="native", **TINY_TOWERS)
    images = torch.randn(10, 3, 32, 32)
    with fake_cuda():
        model._apply(lambda t: torch.empty_like(t, device="cuda"))
        for precision in ("fp32", "bf16"):
            encode_images(model.eval(), iter(images.split(4)), device="cuda", progress=False, precision=precision)
            encode_texts(model, ["a photo of a cat", "a dog"] * 3, batch_size=4, device="cuda", progress=False,
                         precision=precision)


def fake_cuda_paths() -> dict:
    return {"fake-cuda eval scores": fake_cuda_scores, "fake-cuda encode": fake_cuda_encode}


def make_world(base: Path) -> Path:
    from zsprob.data.synthetic import generate

    generate(base / "sw", image_size=32, num_pretrain=32, num_classify_select=8, num_classify_eval=8,
             num_retrieval=4, num_retrieval_val=0, shard_size=8, progress=False)
    from zsprob.zeroshot.prompts import load_templates

    (base / "templates.txt").write_text("\n".join(load_templates()[:6]) + "\n")
    return base / "sw"


def run_path(name: str, drive) -> list[Fault]:
    """Drive one path under the stand-in device; its faults (a crash is one)."""
    WATCH.path, WATCH.faults, WATCH.steady, WATCH.reads = name, [], False, []
    try:
        with contextlib.nullcontext() if name.startswith("fake-cuda") else stand_in_device():
            drive()
    except Abort:
        pass
    except Exception as e:  # noqa: BLE001 - every error of a path is reported as its fault
        tb = e.__traceback__
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        WATCH.fault("crash", site(frames[-1]) if frames else "?", f"{type(e).__name__}: {first_line}")
    return list(WATCH.faults)


def rehearse(only=(), out=None, verbose: bool = False) -> dict[str, list[Fault]]:
    """Every path (or those whose name holds one of ``only``): name -> faults."""
    import warnings

    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="zsprob-rehearsal-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = Path(out or tmp)
        paths = all_paths(make_world(base), base / "runs")
        for name, drive in paths.items():
            if not only or any(o in name for o in only):
                started = time.perf_counter()
                results[name] = run_path(name, drive)
                if verbose:
                    print(f"{time.perf_counter() - started:5.2f} s  {len(results[name])} faults  {name}  "
                          f"(host reads per step: {WATCH.reads})", file=sys.stderr)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="paths whose name holds one of these")
    parser.add_argument("--list", action="store_true", help="print the paths and exit")
    parser.add_argument("--verbose", action="store_true", help="print each path's time and verdict")
    args = parser.parse_args(argv)
    if args.list:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(all_paths(Path(tmp), Path(tmp))))
        return 0
    start = time.perf_counter()
    results = rehearse(args.only, verbose=args.verbose)
    faults = [f for found in results.values() for f in found]
    for f in faults:
        print(f.line())
    failed = sum(1 for found in results.values() if found)
    print(f"{len(results)} paths, {failed} with faults ({len(faults)} faults), {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
