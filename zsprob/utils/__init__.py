"""Small shared helpers: atomic file writes, JSON, resource paths, URLs.

Owns small shared helpers (atomic writes, JSON, resource paths; :mod:`zsprob.utils.remote`: paths
that may be fsspec URLs or ``pipe:`` commands). May import ``zsprob.errors`` only.
"""
