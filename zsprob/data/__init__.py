"""zsprob.data (being built)."""
