"""Small shared helpers: atomic file writes, JSON, resource paths."""
