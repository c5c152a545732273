"""zsprob.zeroshot (being built)."""
