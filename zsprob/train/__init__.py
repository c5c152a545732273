"""zsprob.train (being built)."""
