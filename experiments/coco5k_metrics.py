#!/usr/bin/env python
"""Checks that COCO metrics stay identical across a refactor of zsprob.retrieval: prints, as JSON, every metric
zsprob.retrieval.evaluate_embeddings gives fixed synthetic Gaussian embeddings on eccv_caption's official
COCO test ids (5K, 1K folds, CxC, ECCV Caption). Run it with two checkouts on PYTHONPATH and compare:
    PYTHONPATH=OLD python experiments/coco5k_metrics.py > old.json
    PYTHONPATH=NEW python experiments/coco5k_metrics.py > new.json && cmp old.json new.json
"""
import json

import numpy as np
import torch

from zsprob.retrieval.coco import eccv_metrics, official_test_ids, task_for_embeddings
from zsprob.retrieval.embeddings import Embeddings
from zsprob.retrieval.evaluate import evaluate_embeddings

img_ids, cap_ids = official_test_ids()
m = eccv_metrics()
where = {int(x): i for i, x in enumerate(img_ids)}
cap_img = np.array([where[m.coco_gts["t2i"][int(c)][0]] for c in cap_ids])
g = torch.Generator().manual_seed(0)
d = 64
img = torch.nn.functional.normalize(torch.randn(len(img_ids), d, generator=g), dim=-1)
cap = torch.nn.functional.normalize(img[torch.from_numpy(cap_img)] + 3.0 * torch.randn(len(cap_ids), d, generator=g) / d ** 0.5, dim=-1)
lv_i = torch.randn(len(img_ids), d, generator=g) * 0.5 - 4
lv_c = torch.randn(len(cap_ids), d, generator=g) * 0.5 - 4
emb, task = task_for_embeddings(Embeddings(img_ids, cap_ids, img, cap, lv_i, lv_c))
out = evaluate_embeddings(emb, task, score="csd")
def clean(x):
    if isinstance(x, dict): return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [clean(v) for v in x]
    if isinstance(x, (np.floating, float)): return float(x)
    if isinstance(x, (np.integer, int)): return int(x)
    return str(x)
print(json.dumps(clean(out), sort_keys=True))
