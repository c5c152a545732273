"""SynthWorld's parts: the offline image-caption world, one module per step (public entry: ``data.synthetic``).

    scene     vocabulary, sampling priors, scene sampling (a scene is a pure function of (seed, split, index))
    render    scene -> PIL image (Pillow draws)
    captions  grammar, match predicate, exact analytic ambiguity
    world     SynthWorld (scene + image + captions per sample), hand-made scenes, format constants
    probes    inclusion pairs and crop scenes for the uncertainty-validity evidence
    files     byte-exact JPEG / JSON / tar / npz writers
    units     one shard or image chunk per work unit (pure functions of their arguments)
    writer    generate(): arguments -> units -> annotations -> manifest
    readers   retrieval splits, pretraining shards, jWAE's paired split
    checks    the files against the manifest's sizes and SHA-256 (re-runs repair, readers refuse damage)
    preview   the preview sheet
"""
