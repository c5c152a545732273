"""One command from a paper's table: :data:`~zsprob.reproduce.recipes.RECIPES` (the published figures and the
zsprob commands that measure them), :func:`~zsprob.reproduce.run.reproduce` (check, run, compare) and the
real-format miniatures of its smoke mode (:mod:`zsprob.reproduce.miniature`). Manual: docs/reproduce.md."""
