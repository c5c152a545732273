"""Click parameter types for counts, numbers, inputs and output locations, shared by every command.

The rules live in :mod:`zsprob.utils.checks`; these types apply them at parse time, so a negative
``--batch-size``, a missing ``--root`` or an unwritable ``--out`` is one line and exit 2 in every
command, before torch is imported or any other option is acted on.
"""
from __future__ import annotations

import math

import click

from zsprob.errors import UserError


class _Checked(click.ParamType):
    """A type whose :meth:`check` raises :class:`UserError`; click words it as the option's one line."""

    name = "path"

    def convert(self, value, param, ctx):
        try:
            return self.check(value)
        except UserError as e:
            self.fail(str(e), param, ctx)


class Count(_Checked):
    """An integer count obeying ``rule`` (">=1" or ">=0"), e.g. ``type=Count()`` for ``--steps``."""

    name = "integer"

    def __init__(self, rule: str = ">=1"):
        self.rule = rule

    def check(self, value):
        from zsprob.utils.checks import check_count

        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise UserError(f"{value!r} is not an integer") from None
        return check_count(value, None, self.rule)


class Real(click.ParamType):
    """A finite number in [``low``, ``high``] (``low`` excluded with ``low_open``): ``nan``, ``inf`` and text
    are one line at parse time, for every float option outside the training config (which checks its own)."""

    name = "number"

    def __init__(self, low: float = -math.inf, high: float = math.inf, low_open: bool = False):
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value, param, ctx):
        from zsprob.errors import check_range

        try:
            return check_range(value, "the value", self.low, self.high, self.low_open)
        except UserError as e:
            self.fail(str(e).replace("the value must be", "must be"), param, ctx)


class OutPath(_Checked):
    """An output directory (``kind="dir"``) or file (``kind="file"``) that can be created and written; an
    existing file must be a regular one (or a symlink to one), since zsprob renames a new file over it; ``own``:
    the kind of folder ("run" / "world") the command may write into as its owner (zsprob.utils.checks)."""

    def __init__(self, kind: str = "dir", own: str | None = None):
        self.kind, self.own = kind, own

    def check(self, value):
        from zsprob.utils.checks import check_output

        return check_output(value, None, self.kind, self.own)


class InPath(_Checked):
    """An existing input: a directory (``kind="dir"``), a file (``"file"``) or either (``"any"``);
    ``what`` and ``hint`` go into the message."""

    def __init__(self, what: str, kind: str = "dir", hint: str = ""):
        self.what, self.kind, self.hint = what, kind, hint

    def check(self, value):
        from zsprob.utils.checks import check_input

        return check_input(value, self.what, self.kind, self.hint)


class TokenizerDir(InPath):
    """A saved Hugging Face tokenizer directory: it exists and holds one of the files that mark one."""

    def __init__(self):
        super().__init__("tokenizer directory")

    def check(self, value):
        from zsprob.utils.checks import TOKENIZER_FILES, is_tokenizer_dir

        path = super().check(value)
        if not is_tokenizer_dir(path):
            raise UserError(f"tokenizer directory {path} holds none of {', '.join(TOKENIZER_FILES)}")
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
