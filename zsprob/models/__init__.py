"""zsprob.models (being built)."""
