"""zsprob.models.convert: published ProLIP / PCME++ checkpoints -> zsprob models, strictly.

One module per family holds its name map as data (:mod:`.prolip`, :mod:`.pcmepp`); the layouts
themselves (recognition, rules, head options) are entries of :mod:`zsprob.models.catalogue`.
:mod:`.mapping` applies a map and checks the result against the shapes a model expects; :mod:`.io`
reads the official files; :mod:`.swa` picks the SWA or raw copy of a COCO trainer file; :mod:`.load`
fills a built model; :mod:`.convert` builds that model (``create_from_official``, which
``create_model(name, pretrained=OFFICIAL)`` calls) and writes a zsprob checkpoint (``zsprob convert``).
No torch at import (the CLI reads the layouts' names).
"""
