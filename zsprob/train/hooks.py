"""Evaluation hooks for the training loop: ``hook(model, step) -> dict`` on the main process.

Built in: SynthWorld retrieval recall (each image's own captions as positives, as COCO counts them) on a
subset of the retrieval split, scored by CSD (probabilistic models) or cosine; any callable of this
signature works.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def synthworld_root(shards) -> Path | None:
    """The SynthWorld output directory holding ``shards`` (it has retrieval/ and manifest.json)."""
    if not shards:
        return None
    p = Path(str(shards))
    for cand in (p, p.parent, p.parent.parent):
        if (cand / "retrieval").is_dir() and (cand / "manifest.json").is_file():
            return cand
    return None


def retrieval_recall(model, image_tensors, captions, caption_image, *, batch_size=256) -> dict:
    """R@1 / R@5 both directions on a small gallery; positives = each image's own captions."""
    import torch

    from zsprob.models import encode_images, encode_texts
    from zsprob.prob import score
    img_mu, img_lv = encode_images(model, image_tensors, batch_size=batch_size, progress=False)
    txt_mu, txt_lv = encode_texts(model, list(captions), batch_size=batch_size, progress=False)
    if img_lv is not None and txt_lv is not None:
        sim = score("csd", img_mu, img_lv, txt_mu, txt_lv)
    else:
        sim = score("cosine", img_mu, None, txt_mu, None)
    cap_img = torch.as_tensor(caption_image, dtype=torch.long)
    n_img = sim.shape[0]
    pos = cap_img.unsqueeze(0) == torch.arange(n_img).unsqueeze(1)  # [n_img, n_cap]
    out = {}
    for k in (1, 5):
        top_t = sim.topk(min(k, sim.shape[1]), dim=1).indices            # images -> captions
        out[f"i2t_R@{k}"] = 100.0 * pos.gather(1, top_t).any(1).float().mean().item()
        top_i = sim.t().topk(min(k, n_img), dim=1).indices               # captions -> images
        out[f"t2i_R@{k}"] = 100.0 * (top_i == cap_img.unsqueeze(1)).any(1).float().mean().item()
    out["chance_i2t_R@1"] = 100.0 * pos.sum(1).float().mean().item() / sim.shape[1]
    out["chance_t2i_R@1"] = 100.0 / n_img
    return out


def synthworld_retrieval_hook(root, *, max_images: int = 200, split: str = "test") -> Callable:
    """Hook computing SynthWorld retrieval recall on the first ``max_images`` images of a split."""
    from zsprob.data.images import open_rgb
    from zsprob.data.synthetic import load_retrieval_split
    rs = load_retrieval_split(root, split=split)
    n = min(max_images, len(rs.image_paths))
    import numpy as np
    keep_caps = np.nonzero(np.asarray(rs.caption_image) < n)[0]
    captions = [rs.captions[i] for i in keep_caps]
    cap_img = np.asarray(rs.caption_image)[keep_caps]
    pil = [open_rgb(p) for p in rs.image_paths[:n]]

    def hook(model, step):
        images = [model.preprocess_val(im) for im in pil]
        r = retrieval_recall(model, images, captions, cap_img)
        return {f"synthworld/{k}": v for k, v in r.items()}
    return hook


def default_hooks(cfg) -> list:
    """Hooks the CLI adds: SynthWorld retrieval when training on SynthWorld with train.eval_every."""
    if not (cfg.train.eval_every and cfg.data.kind == "synthetic"):
        return []
    root = synthworld_root(cfg.data.shards)
    if root is None:
        return []
    return [synthworld_retrieval_hook(root)]
