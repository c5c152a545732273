"""Small shared helpers: atomic writes and JSON (``io``), devices, URLs (``remote``), resource paths,
host-sync counting, length masks and stop-signal handlers (``signals``). May import ``zsprob.errors`` only.
"""
