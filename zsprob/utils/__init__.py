"""Small shared helpers: atomic writes and JSON (``io``), devices, URLs (``remote``), resource paths,
host-sync counting, length masks, stop-signal handlers (``signals``), selective-prediction metrics. May import ``zsprob.errors`` only.
"""
