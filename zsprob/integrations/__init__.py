"""zsprob.integrations: zsprob models inside other projects' evaluation tools.

``clip_benchmark``: model type "zsprob" for CLIP_benchmark (its loaders, datasets and metrics run
unchanged on zsprob's means). May import ``zsprob.models``, ``zsprob.errors`` and ``zsprob.utils``;
nothing in the package imports it except the CLI.
"""
