"""Small shared helpers: atomic writes and JSON (``io``), devices, URLs (``remote``), resource paths,
host-sync counting, length masks and DataLoader worker signals. May import ``zsprob.errors`` only.
"""
