"""zsprob.report (being built)."""
