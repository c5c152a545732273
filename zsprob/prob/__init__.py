"""zsprob.prob (being built)."""
