"""The demo's resumable pipeline (zsprob commands as resumable subprocesses), its report, checks and plots.

May import ``zsprob.errors``, ``zsprob.utils`` and the root package; the other layers run as subprocesses,
not imports.
"""
