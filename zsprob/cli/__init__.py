"""The ``zsprob`` command line: a click group whose sub-commands live one per module here, imported on use.

Each command is a thin function that parses options and calls the library (shared options: ``options``,
``train_options``); ``zsprob --help`` imports no torch. Errors: a :class:`zsprob.UserError`, a usage error or
what the machine refuses prints one ``zsprob: error: ...`` line and exits 2 (``--debug`` / ``ZSPROB_DEBUG=1``:
the traceback); :class:`zsprob.errors.Preempted` prints one line and exits with its requeue code; warnings and
log records print as ``zsprob: warning: ...``, one line each."""
from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

import click

from zsprob import __version__
from zsprob.errors import Preempted, UserError, one_line

# command name -> (module, attribute, one-line help shown by `zsprob --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "data": ("zsprob.cli.data", "data", "Generate SynthWorld and inspect datasets."),
    "pretrain": ("zsprob.cli.pretrain", "pretrain", "Pretrain a probabilistic image-text model on shards."),
    "finetune": ("zsprob.cli.finetune", "finetune", "Fine-tune on COCO with the PCME++ recipe."),
    "select-prompts": ("zsprob.cli.select_prompts", "select_prompts",
                       "Rank prompt templates by text uncertainty and select them per class."),
    "zeroshot": ("zsprob.cli.zeroshot", "zeroshot", "Zero-shot classification with selected prompts."),
    "probe": ("zsprob.cli.probe", "probe", "Linear-probe baseline on frozen image embeddings (full, k-shot)."),
    "eval": ("zsprob.cli.eval", "eval_", "Retrieval evaluation (COCO 1K/5K, CxC, ECCV, PMRP, SynthWorld)."),
    "index": ("zsprob.cli.index", "index", "Build and search exact / approximate CSD indexes (FAISS)."),
    "convert": ("zsprob.cli.convert", "convert", "Convert a published ProLIP / PCME++ checkpoint to zsprob's format."),
    "posthoc": ("zsprob.cli.posthoc", "posthoc",
                "Give a frozen model trained log-variance heads, its means untouched."),
    "reproduce": ("zsprob.cli.reproduce", "reproduce",
                  "Reproduce a published table (PCME++, ProLIP): paper figures beside measured ones."),
    "demo": ("zsprob.cli.demo", "demo", "Run the whole mission on SynthWorld and write a report."),
    "export": ("zsprob.cli.export", "export", "Export a zsprob model to an open_clip / Hugging Face directory."),
    "clip-benchmark": ("zsprob.cli.clip_benchmark", "clip_benchmark", "Run CLIP_benchmark with zsprob models."),
}


class LazyGroup(click.Group):
    """A group that imports each sub-command's module on first use."""

    def list_commands(self, ctx):
        return list(COMMANDS) + [c for c in super().list_commands(ctx) if c not in COMMANDS]

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return super().get_command(ctx, name)
        mod, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(mod), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, helptext) for name, (_, _, helptext) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="zsprob")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def cli(debug: bool) -> None:
    """zsprob: probabilistic image-text models (PCME++, ProLIP, PCME, probabilistic VSE, jWAE).

    Start with `zsprob demo`, which runs the whole pipeline offline on SynthWorld.
    """
    # --debug is read by main() from the arguments, before click parses them (_debug_asked)


def _own_words(e: UserError) -> str:
    """The message of a UserError, also when a torch DataLoader worker raised it (torch re-raises it in the main
    process with the worker's traceback in front: the last line holds the message)."""
    msg = str(e)
    if "Original Traceback" not in msg:
        return msg
    last = msg.rstrip().splitlines()[-1]
    return last.split("UserError: ", 1)[1] if "UserError: " in last else last


def _debug_asked(args: list[str]) -> bool:
    """``zsprob --debug CMD ...`` (the group's option, before the command) or ``ZSPROB_DEBUG`` set to a true value."""
    leading = []
    for a in args:
        if not a.startswith("-") or a == "--":
            break
        leading.append(a)
    env = os.environ.get("ZSPROB_DEBUG", "").strip().lower()
    return "--debug" in leading or env not in ("", "0", "false", "no", "off")


def _environment_error(e: BaseException) -> str | None:
    """The one line for what the machine refused rather than a fault of zsprob: a file the system will not read
    or write (permissions, a full or read-only disk, a name too long) and memory that cannot be had. None
    for anything else (a bug: the traceback stays)."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or \
            (isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))):
        return ("out of memory: " + one_line(e)[:200] +
                " (a smaller --batch-size, or train.accum_steps / model.grad_checkpointing, needs less)")
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        where += f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
        return f"{e.strerror}{where}"
    return None


def _error_line(e: BaseException, args: list[str]) -> str | None:
    """The one line of a user's error (click's usage errors, a :class:`UserError`) or of what the machine refused
    (:func:`_environment_error`); None for a bug, whose traceback stays."""
    if isinstance(e, click.ClickException):
        hint = " (--debug goes before the command: zsprob --debug COMMAND ...)" if "--debug" in args else ""
        return e.format_message() + hint
    return _own_words(e) if isinstance(e, UserError) else _environment_error(e)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warning_line(message, category, filename, lineno, file=None, line=None, _python=warnings.showwarning):
    """``warnings.showwarning`` for the command line: zsprob's own warnings as one line each."""
    if not os.path.abspath(str(filename)).startswith(_PACKAGE_DIR + os.sep):
        return _python(message, category, filename, lineno, file, line)
    try:
        print(f"zsprob: warning: {one_line(message)}", file=file or sys.stderr)
    except OSError:  # stderr gone (closed pipe): nothing to tell
        pass


class _LogLine(logging.Formatter):
    """zsprob's log records on the command line: ``zsprob: warning: ...``, one line each."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        for prefix in ("zsprob: warning: ", "zsprob.data: "):
            msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        return f"zsprob: {record.levelname.lower()}: {one_line(msg)}"


def _log_lines() -> None:
    """Route the ``zsprob`` loggers to one-line records on stderr (not through a root handler that another
    library may have set up, which would print them again in its own form)."""
    log = logging.getLogger("zsprob")
    if not any(getattr(h, "zsprob_cli", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_LogLine())
        seen: set = set()
        handler.addFilter(lambda r: not (r.getMessage() in seen or seen.add(r.getMessage())))  # each once
        handler.zsprob_cli = True
        log.addHandler(handler)
    log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group, mapping user errors to one line and exit code 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not sys.stderr.isatty():  # a log file or pipe: no self-erasing bars (zsprob.models.encode.transient_bars)
        os.environ.setdefault("ZSPROB_TRANSIENT_BARS", "0")
    debug = _debug_asked(args)
    if not debug:
        warnings.showwarning = _warning_line
        _log_lines()
    try:
        rv = cli.main(args=args, prog_name="zsprob", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("zsprob: aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("zsprob: interrupted", err=True)
        sys.exit(130)
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            click.echo(f"zsprob: {'interrupted' if e.interrupted else 'pre-empted'}: {one_line(e)}", err=True)
        sys.exit(e.exit_code)
    except (click.ClickException, UserError, OSError, MemoryError, RuntimeError) as e:
        line = None if debug else _error_line(e, args)
        if line is None:
            raise
        click.echo(f"zsprob: error: {one_line(line)}", err=True)
        sys.exit(2)
    if isinstance(rv, int) and rv not in (0, None):
        sys.exit(rv)
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
