"""The demo's resumable pipeline, its report and plots.

:mod:`~zsprob.report.pipeline` runs zsprob commands as resumable subprocesses, :mod:`~zsprob.report.demo`
is `zsprob demo`, :mod:`~zsprob.report.demo_report` writes OUT/report.md and report.json from the
commands' outputs, :mod:`~zsprob.report.demo_checks` decides its yes / no checks and
:mod:`~zsprob.report.plots` draws training curves (matplotlib). May import ``zsprob.errors``,
``zsprob.utils`` and the root package; the other layers run as subprocesses, not imports.
"""
