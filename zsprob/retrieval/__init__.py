"""zsprob.retrieval (being built)."""
