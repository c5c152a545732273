"""Click options shared by the evaluation commands, and the model loader they use.

The model (``--checkpoint``, ``--model``, ``--pretrained``, ``--tokenizer`` / ``--weights`` of a
published file), the prompt options of ``select-prompts`` and ``zeroshot``, and where evaluation
runs (``--device``, ``--workers``, ``--precision``). Training's options live in
:mod:`zsprob.cli.train_options`. No torch at import.
"""
from __future__ import annotations

import functools
from pathlib import Path

import click

from zsprob.cli.types import CHECKPOINT, COUNT, COUNT0, TOKENIZER, InPath
from zsprob.models.convert.swa import WEIGHTS as OFFICIAL_WEIGHTS
from zsprob.utils.devices import parse_device, resolve_device  # noqa: F401 (resolve_device: the commands')
from zsprob.utils.paths import CHECKPOINT_FILES
from zsprob.zeroshot.strategy_registry import SHOTS_SPLITS, STRATEGY_OPTIONS

# where --tokenizer / --weights are kept (click context meta) for the model loaders, as create_model's keywords
OFFICIAL_FILE_KEYS = {"zsprob.tokenizer": "tokenizer_dir", "zsprob.weights": "weights"}
WEIGHTS_HELP = ("A PCME++ COCO trainer file's SWA copies: swa-text (the official final evaluation: SWA text "
                "encoder, raw image encoder and criterion), swa (every averaged copy) or raw (the trained weights). "
                "Default: swa-text when the file holds averaged copies, else raw.")
DEVICE_HELP = ("Where encoding and scoring run: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or "
               "cuda:N.")
WORKERS_HELP = "Image-decoding DataLoader workers (0: decode in the main process; results are the same)."
PRECISION_HELP = ("Encoding precision: fp32, or bf16 (bfloat16 autocast for the towers only; embeddings, "
                  "scores and metrics stay float32).")


def _keep(key: str):
    def keep(ctx, _param, value):
        if value is not None:
            ctx.meta[key] = value
        return value
    return keep


def official_file_options(f):
    """``--tokenizer DIR`` (a local Hugging Face tokenizer, e.g. ProLIP's) and ``--weights`` (a COCO trainer
    file's SWA or raw copy), options of a published file given as --pretrained, read by the model loaders."""
    f = click.option("--weights", type=click.Choice(OFFICIAL_WEIGHTS), default=None, expose_value=False,
                     callback=_keep("zsprob.weights"), help=WEIGHTS_HELP)(f)
    return click.option("--tokenizer", type=TOKENIZER, default=None, expose_value=False,
                        callback=_keep("zsprob.tokenizer"),
                        help="Local Hugging Face tokenizer directory (ProLIP; default: tokenizer/ next to "
                             "--pretrained).")(f)


def official_file_kwargs() -> dict:
    """The create_model keywords of :func:`official_file_options` that were given."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    return {kw: meta[key] for key, kw in OFFICIAL_FILE_KEYS.items() if meta.get(key)}


def _device_form(_ctx, _param, value):
    """``--device`` checked for form at parse time (no torch); :func:`resolve_device` does the rest."""
    parse_device(value)
    return value


def device_options(f, *, encoding: bool = True):
    """``--device``; with ``encoding`` also ``--workers`` and ``--precision`` (commands that encode images)."""
    from zsprob.utils.devices import ENCODE_PRECISIONS as PRECISIONS, default_workers

    if encoding:
        f = click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
                         help=PRECISION_HELP)(f)
        f = click.option("--workers", type=COUNT0, default=default_workers(), show_default=True,
                         help=WORKERS_HELP)(f)
    return click.option("--device", default="auto", show_default=True, callback=_device_form, help=DEVICE_HELP)(f)


#: ``--device`` alone, for commands that only score or search (no encoding)
scoring_device_option = functools.partial(device_options, encoding=False)


def model_options(f):
    f = official_file_options(f)
    f = click.option("--pretrained", default=None, help="open_clip pretrained tag or weights file, a published "
                     "ProLIP / PCME++ checkpoint (file or directory) or a zsprob checkpoint (with --model).")(f)
    f = click.option("--model", "model_name", default=None,
                     help="A plain open_clip model name (e.g. ViT-B-32) instead of a checkpoint.")(f)
    return click.option("--checkpoint", type=CHECKPOINT, default=None, help="zsprob checkpoint directory.")(f)


def eval_model_options(f):
    """The model options of ``zsprob eval``, with --device/--workers/--precision and --batch-size."""
    f = model_options(f)
    f = device_options(f)
    return click.option("--batch-size", type=COUNT, default=128, show_default=True)(f)


def common_options(f):
    """The prompt, few-shot, pool and run options of ``select-prompts`` and ``zeroshot``."""
    f = click.option("--k-grid", default=None, help="K values searched by auto/global/oracle, e.g. '1-80' "
                     "or '1,2,4,8,16,32,80' (default: every K).")(f)
    f = click.option("--batch-size", type=COUNT, default=256, show_default=True)(f)
    f = device_options(f)
    f = click.option("--cache-dir", type=click.Path(), default=None,
                     help="Prompt-bank and image-embedding cache (default: cache/ next to --out).")(f)
    f = click.option("--templates", default=None, help="Template file, one per line with {} "
                     "(default: the 80 CLIP ImageNet templates).")(f)
    f = click.option("--classes", type=click.Path(), default=None,
                     help="Class-name file (default: the dataset's class names).")(f)
    f = click.option("--class-prompts", type=InPath("class-prompts file", "file"), default=None,
                     help='Per-class prompt pools, CuPL format {"class name": ["prompt", ...]}, matched to the '
                          "classes by name (instead of --templates).")(f)
    f = click.option("--allow-eval-shots", is_flag=True,
                     help="Allow --shots-split eval; the result is marked as reading evaluation labels.")(f)
    f = click.option("--shots", type=COUNT, default=None, help="bprw-fewshot: images per class (default all).")(f)
    return click.option("--shots-split", type=click.Choice(SHOTS_SPLITS), default="select", show_default=True,
                        help="bprw-fewshot: the split its labelled shots come from (eval = ProLIP's --use_gt "
                             "protocol; refused without --allow-eval-shots).")(f)


def refuse_given(why: str, *names: str) -> None:
    """One line naming the options of ``names`` given on the command line, which ``why`` says have no effect
    (so that they are not silently ignored)."""
    from click.core import ParameterSource

    from zsprob.errors import UserError

    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in names
             if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
    if given:
        raise UserError(f"{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect {why}")


def refuse_unread_options(strategy: str, compare: bool, names=STRATEGY_OPTIONS) -> None:
    """The options of :data:`~zsprob.zeroshot.strategy_registry.STRATEGY_OPTIONS` act on the strategies whose
    registry entry reads them (under --compare, on any strategy compared): one given to another strategy is one
    line naming its readers."""
    from zsprob.zeroshot.strategy_registry import compare_order, get_strategy, readers_of

    read = {option for name in (compare_order() if compare else (strategy,)) for option in get_strategy(name).options}
    for option in names:
        if option not in read:
            readers = ", ".join(readers_of(option))
            refuse_given(f"{'under --compare' if compare else f'with --strategy {strategy}'} "
                         f"(strategies that read it: {readers})", option)


def refuse_overwriting_inputs(outputs: dict, inputs: dict, *, checkpoint=None, pretrained=None, dirs=None,
                              data=None) -> None:
    """One line, before anything is written, when an output (``{name: path}``: --out and every file written
    beside it) would destroy an input: one of the files ``inputs`` (``{option: path}``, None skipped), a file in
    an input model directory (--checkpoint, --pretrained when a path, --tokenizer, and ``dirs``; a zsprob
    checkpoint's own file or a published file beside its tokenizer names its folder) or one a dataset root of
    ``data`` ships (:func:`zsprob.utils.checks.check_outputs_apart`)."""
    import os

    from zsprob.utils.checks import check_outputs_apart, is_tokenizer_dir

    model_files: dict = {}
    model_dirs: dict = {}
    for option, given in (("--checkpoint", checkpoint), ("--pretrained", pretrained),
                          ("--tokenizer", official_file_kwargs().get("tokenizer_dir"))):
        path = None if given is None else os.path.expanduser(os.fspath(given))
        if path is None or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            model_dirs[option] = given
            continue
        model_files[option] = given
        if os.path.basename(path) in CHECKPOINT_FILES or is_tokenizer_dir(os.path.dirname(os.path.abspath(path))):
            model_dirs[option] = os.path.dirname(os.fspath(given)) or "."  # as typed (resolved when compared)
    check_outputs_apart(outputs, {**model_files, **inputs}, {**model_dirs, **(dirs or {})}, data)


def check_prompt_outputs(opts: dict, beside=(), roots: dict | None = None) -> Path:
    """The cache folder of ``select-prompts`` / ``zeroshot`` / ``probe`` (--cache-dir, default cache/ next to
    --out), checked; then one line when it, --out or a file ``beside`` --out would destroy an input or a data
    root (``roots``, default --root and --select-root). Returns it."""
    from zsprob.utils.checks import check_output

    out, given = opts["out"], opts["cache_dir"]
    folder = Path(out).resolve().parent
    cache = Path(check_output(given or folder / "cache",
                              "--cache-dir" if given else "cache folder (cache/ next to --out; or pass --cache-dir)"))
    outputs = {"--out": out, **{f"--out (beside it, {name})": folder / name for name in beside},
               "--cache-dir" if given else "the cache folder (cache/ next to --out)": cache}
    inputs = {f"--{name.replace('_', '-')}": opts.get(name) for name in ("prompts", "templates", "classes",
                                                                         "class_prompts")}
    refuse_overwriting_inputs(outputs, inputs, checkpoint=opts["checkpoint"], pretrained=opts["pretrained"],
                              data=roots or {"--root": opts["root"], "--select-root": opts["select_root"]})
    return cache


def request_and_model(opts: dict, **fields):
    """``(model, request)`` of ``select-prompts`` / ``zeroshot``: the request made of the options and
    ``fields`` (its inputs read and checked first), then the model on its device, described in ``model_meta``."""
    from dataclasses import replace

    from zsprob.models import load_for_inference
    from zsprob.zeroshot.options import request_from_options

    request = request_from_options(opts, **fields, device=resolve_device(opts["device"]))
    checkpoint, name, pretrained = opts["checkpoint"], opts["model_name"], opts["pretrained"]
    m = load_for_inference(checkpoint=checkpoint, model=name, pretrained=pretrained, device=request.device,
                           **official_file_kwargs())
    meta = {"checkpoint": None if checkpoint is None else str(checkpoint), "name": getattr(m, "name", name),
            "pretrained": pretrained, "deterministic": bool(m.deterministic), "embed_dim": m.embed_dim}
    return m, replace(request, model_meta=meta)
