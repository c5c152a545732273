"""SynthWorld's parts, one module per step (public entry: :mod:`zsprob.data.synthetic`): ``scene``
(vocabulary, priors, sampling), ``render`` (Pillow draws), ``captions`` (grammar, match predicate,
exact ambiguity), ``world`` (one sample), ``probes`` (evidence sets), ``files`` (byte-exact writers),
``writer`` (:func:`generate`, its work units and the preview sheet), ``readers`` and ``checks`` (files
against the manifest).
"""
