"""Plots and the demo report.

Owns plots, the resumable command pipeline and the demo report. May import ``zsprob.errors``,
``zsprob.utils`` and the root package; the demo runs the other layers as subprocesses (``zsprob``
commands), not as imports.

- :mod:`zsprob.report.plots`: training curves from metrics.jsonl (matplotlib, Agg backend).
- :mod:`zsprob.report.pipeline`: a resumable chain of zsprob commands run as subprocesses.
- :mod:`zsprob.report.demo`: `zsprob demo`, the whole mission on SynthWorld.
- :mod:`zsprob.report.demo_report`: OUT/report.md and OUT/report.json from the commands' outputs.
- :mod:`zsprob.report.demo_checks`: the report's yes / no checks, each computed from its figures.
"""
