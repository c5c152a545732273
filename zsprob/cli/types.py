"""Click parameter types for counts, inputs and output locations, shared by every command.

All delegate to :mod:`zsprob.utils.checks` (the one place the rules live), so a negative
``--batch-size``, a missing ``--root`` or ``--checkpoint`` or an unwritable ``--out`` is one line and
exit 2 in every command, at parse time: before torch is imported (5-15 s on a small CPU) and
before any other option is acted on.
"""
from __future__ import annotations

import math

import click

from zsprob.errors import UserError


class Count(click.ParamType):
    """An integer count obeying ``rule`` (">=1" or ">=0"), e.g. ``type=Count()`` for ``--steps``."""

    name = "integer"

    def __init__(self, rule: str = ">=1"):
        self.rule = rule

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                self.fail(f"{value!r} is not an integer", param, ctx)
        from zsprob.utils.checks import check_count
        try:
            return check_count(value, None, self.rule)
        except UserError as e:
            self.fail(str(e), param, ctx)


class Real(click.ParamType):
    """A finite number in [``low``, ``high``] (``low`` excluded with ``low_open``): ``nan``, ``inf`` and text
    are one line at parse time, for every float option outside the training config (which checks its own)."""

    name = "number"

    def __init__(self, low: float = -math.inf, high: float = math.inf, low_open: bool = False):
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value, param, ctx):
        from zsprob.errors import check_range
        if math.isinf(self.low):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number) or number > self.high:
                bound = "" if math.isinf(self.high) else f" <= {self.high:g}"
                self.fail(f"must be a finite number{bound}, got {value!r}", param, ctx)
            return number
        try:
            return check_range(value, "the value", self.low, self.high, self.low_open)
        except UserError as e:
            self.fail(str(e).replace("the value must be", "must be"), param, ctx)


class OutPath(click.ParamType):
    """An output directory (``kind="dir"``) or file (``kind="file"``) that can be created and written. A file
    that exists must be a regular file (or a symlink to one: written through); a named pipe, a device or a
    socket is refused at parse time, since zsprob renames a new file over its outputs."""

    name = "path"

    def __init__(self, kind: str = "dir"):
        self.kind = kind

    def convert(self, value, param, ctx):
        from zsprob.utils.checks import check_output
        try:
            return check_output(value, None, self.kind)
        except UserError as e:
            self.fail(str(e), param, ctx)


class InPath(click.ParamType):
    """An existing input: a directory (``kind="dir"``), a file (``"file"``) or either (``"any"``);
    ``what`` and ``hint`` go into the message."""

    name = "path"

    def __init__(self, what: str, kind: str = "dir", hint: str = ""):
        self.what, self.kind, self.hint = what, kind, hint

    def convert(self, value, param, ctx):
        from zsprob.utils.checks import check_input
        try:
            return check_input(value, self.what, self.kind, self.hint)
        except UserError as e:
            self.fail(str(e), param, ctx)


class TokenizerDir(InPath):
    """A saved Hugging Face tokenizer directory: it exists and holds one of the files that mark one."""

    def __init__(self):
        super().__init__("tokenizer directory")

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        from zsprob.utils.checks import TOKENIZER_FILES, is_tokenizer_dir
        if not is_tokenizer_dir(path):
            self.fail(f"tokenizer directory {path} holds none of {', '.join(TOKENIZER_FILES)}", param, ctx)
        return path


REAL = Real()
SHARE = Real(0.0, 1.0)
POSITIVE = Real(0.0, math.inf, low_open=True)
COUNT = Count(">=1")
COUNT0 = Count(">=0")
OUT_DIR = OutPath("dir")
OUT_FILE = OutPath("file")
CHECKPOINT = InPath("checkpoint", "any")
TOKENIZER = TokenizerDir()
EMBEDDINGS = InPath("embeddings file", "file", "an .npz with image_ids, caption_ids, image_mu, caption_mu")
