"""Click parameter types for counts and output locations, shared by every command.

Both delegate to :mod:`zsprob.utils.checks` (the one place the rules live), so a negative
``--batch-size`` or an unwritable ``--out`` is one line and exit 2 in every command, before any work.
"""
from __future__ import annotations

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


class OutPath(click.ParamType):
    """An output directory (``kind="dir"``) or file (``kind="file"``) that can be created and written."""

    name = "path"

    def __init__(self, kind: str = "dir"):
        self.kind = kind

    def convert(self, value, param, ctx):
        from zsprob.utils.checks import check_output
        try:
            return check_output(value, None, self.kind)
        except UserError as e:
            self.fail(str(e), param, ctx)


COUNT = Count(">=1")
COUNT0 = Count(">=0")
OUT_DIR = OutPath("dir")
OUT_FILE = OutPath("file")
