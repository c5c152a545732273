"""zsprob models inside other projects' evaluation tools: ``clip_benchmark`` (model type "zsprob").

May import ``zsprob.models``, ``zsprob.errors`` and ``zsprob.utils``; only the CLI imports it.
"""
