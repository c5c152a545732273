"""Small shared helpers: atomic file writes, JSON, resource paths.

Owns small shared helpers (atomic writes, JSON, resource paths). May import ``zsprob.errors`` only.
"""
