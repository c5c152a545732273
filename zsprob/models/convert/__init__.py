"""zsprob.models.convert: published ProLIP / PCME++ checkpoints -> zsprob models, strictly.

A family's name map is data (:mod:`.prolip`, :mod:`.pcmepp`), applied and checked by :mod:`.mapping`;
the layouts are entries of :mod:`zsprob.models.catalogue`. No torch at import (the CLI reads the names).
"""
