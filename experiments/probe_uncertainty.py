#!/usr/bin/env python
"""Diagnostic: which loss makes caption sigma^2 track SynthWorld's exact ambiguity? A fast probe.

Backs: the uncertainty findings of docs/findings.md ("Does sigma mean ambiguity?") and the
options ``inclusion_form: cover`` / ``text_mask_mode: delete`` / ``inclusion_alpha_occ``.

The image side is frozen: a trained zsprob checkpoint's image trunk turns SynthWorld's pretraining
images (and the retrieval val split) into pooled features once (cached in ``--cache``). On top of
them the probe trains, in seconds per variant, a bag-of-words text tower (mean of N(0, 1) word
embeddings, as ``zsprob-tiny-bow``) with a mean projection and a sigma head ("unc-mean": the
[UNC]-word MLP head of zsprob.models.sigma_heads; "legacy": a second projection of the mean), and
linear / MLP image heads, with zsprob's own losses (PCMEPPLoss, ProLIPLoss) and masking
(zsprob.data.masking). It prints Spearman(||sigma^2||_1, ambiguity) on the val captions, overall,
against word count and per word-count bin, the inclusion accuracy on same-image caption pairs
whose attribute sets nest, and text-to-image R@1 (CSD).

    zsprob data synthetic --out sw
    zsprob pretrain --config configs/synthetic_tiny.yaml --data synthetic --shards sw/pretrain --out runs/tiny
    python experiments/probe_uncertainty.py --root sw --checkpoint runs/tiny/model --loss pcmepp --head legacy
    python experiments/probe_uncertainty.py --root sw --checkpoint runs/tiny/model --loss prolip \\
        --occ delete --alpha-occ 0.1 --drop-ratio 0.5 --drop-prob 0.5 --inclusion-form cover --cover-lambda 4
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import spearmanr

from zsprob.data.masking import TextMaskSpec, delete_tokens, mask_tokens
from zsprob.data.synthetic import load_retrieval_split
from zsprob.models import load
from zsprob.prob import create_loss


def trunk_features(model, images) -> torch.Tensor:
    """Pooled last-stage features of a zsprob CNN image tower (the input of its heads)."""
    tower = model._vision
    with torch.no_grad():
        x = torch.stack([model.preprocess_val(im) for im in images])
        h, _, _ = tower.embed(x)
        for block in tower.blocks:
            h = block(h)
        return tower.ln.pooled(h).float()


def build_cache(root: Path, checkpoint: str, cache: Path) -> dict:
    if cache.is_file():
        return torch.load(cache)
    model = load(checkpoint).eval()
    captions, feats, batch = [], [], []
    for shard in sorted(glob.glob(str(root / "pretrain" / "*.tar"))):
        with tarfile.open(shard) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for key in sorted({n.split(".")[0] for n in members}):
                meta = json.load(tar.extractfile(members[key + ".json"]))
                batch.append(Image.open(io.BytesIO(tar.extractfile(members[key + ".jpg"]).read())).convert("RGB"))
                captions.append([c["text"] for c in meta["captions"]])
                if len(batch) == 500:
                    feats.append(trunk_features(model, batch))
                    batch = []
    if batch:
        feats.append(trunk_features(model, batch))
    split = load_retrieval_split(root, "val")
    val = [trunk_features(model, [Image.open(p).convert("RGB") for p in split.image_paths[i:i + 500]])
           for i in range(0, len(split.image_paths), 500)]
    data = {"train_f": torch.cat(feats), "train_caps": captions, "val_f": torch.cat(val), "tokenizer": model.name}
    torch.save(data, cache)
    return data


class Probe(nn.Module):
    def __init__(self, vocab: int, feat_dim: int, args, dim: int = 64, width: int = 128):
        super().__init__()
        self.args = args
        self.words = nn.Embedding(vocab, width)
        nn.init.normal_(self.words.weight, std=1.0)
        self.text_mu = nn.Linear(width, dim, bias=False)
        self.image_mu = nn.Linear(feat_dim, dim)
        self.image_sigma = self._mlp(feat_dim, dim)
        self.unc_word = nn.Parameter(torch.randn(width))
        self.text_sigma = self._mlp(width, dim) if args.head == "unc-mean" else nn.Linear(width, dim)
        if args.head == "legacy":
            nn.init.constant_(self.text_sigma.bias, args.bias)

    def _mlp(self, width: int, dim: int) -> nn.Module:
        mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, dim))
        nn.init.zeros_(mlp[2].weight)
        nn.init.constant_(mlp[2].bias, self.args.bias)
        return mlp

    def _unit(self, x):
        return F.normalize(x, dim=-1) if self.args.norm else x

    def image(self, feats):
        return self._unit(self.image_mu(feats)), self.image_sigma(feats)

    def text(self, tokens):
        n = (tokens != 0).sum(1).clamp(min=1)
        keep = (torch.arange(tokens.shape[1])[None] < n[:, None]).float()
        x = self.words(tokens) * keep[..., None]
        mean = x.sum(1) / n[:, None]
        if self.args.head == "legacy":
            return self._unit(self.text_mu(mean)), self.text_sigma(mean)
        return self._unit(self.text_mu(mean)), self.text_sigma((x.sum(1) + self.unc_word) / (n[:, None] + 1))


def nested_pairs(split) -> tuple[np.ndarray, np.ndarray]:
    """(general, specific) caption indices of the same image, single object, nested attribute sets."""
    by_image: dict[int, list[int]] = {}
    for k, meta in enumerate(split.caption_meta):
        if meta.get("noisy") or meta.get("condition") or meta.get("background") or meta.get("count") \
                or len(meta.get("objects", [])) != 1:
            continue
        by_image.setdefault(int(split.caption_image[k]), []).append(k)
    general, specific = [], []
    for ks in by_image.values():
        for a in ks:
            for b in ks:
                if a != b and set(split.caption_meta[a]["objects"][0].items()) < set(split.caption_meta[b]["objects"][0].items()):
                    general.append(a)
                    specific.append(b)
    return np.array(general), np.array(specific)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--loss", default="pcmepp", choices=("pcmepp", "prolip"))
    ap.add_argument("--head", default="unc-mean", choices=("unc-mean", "legacy"))
    ap.add_argument("--norm", type=int, default=1, help="1: unit-norm means (PCME++, ProLIP), 0: free means")
    ap.add_argument("--occ", default="none", choices=("none", "replace", "delete"))
    ap.add_argument("--alpha-occ", type=float, default=1e-3)
    ap.add_argument("--drop-ratio", type=float, default=0.125)
    ap.add_argument("--drop-prob", type=float, default=0.75)
    ap.add_argument("--inclusion-form", default="prolip", choices=("prolip", "cover"))
    ap.add_argument("--cover-lambda", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bias", type=float, default=-6.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    data = build_cache(args.root, args.checkpoint, args.cache or args.root / "probe_uncertainty_features.pt")
    tokenizer = load(args.checkpoint).tokenizer
    split = load_retrieval_split(args.root, "val")
    train_tokens = tokenizer([c for caps in data["train_caps"] for c in caps]).view(len(data["train_caps"]), 5, -1)
    val_tokens = tokenizer(split.captions)
    sot, eot, mask = int(tokenizer.sot_token_id), int(tokenizer.eot_token_id), int(tokenizer.encoder["?</w>"])
    vocab = torch.unique(torch.cat([train_tokens.flatten(), val_tokens.flatten(), torch.tensor([0, sot, eot, mask])]))
    remap = torch.zeros(int(vocab.max()) + 1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))  # a compact vocabulary: the probe's word table stays small
    train_tokens, val_tokens = remap[train_tokens], remap[val_tokens]
    spec = TextMaskSpec(int(remap[mask]), (0, int(remap[sot]), int(remap[eot])))
    occ = {"inclusion_alpha_occ": args.alpha_occ if args.occ != "none" else 0.0, "drop_ratio": args.drop_ratio,
           "drop_prob": args.drop_prob, "inclusion_form": args.inclusion_form, "cover_lambda": args.cover_lambda,
           "text_mask_mode": "delete" if args.occ == "delete" else "replace"}
    if args.loss == "pcmepp":
        criterion = create_loss("pcmepp", pp_alpha=0.0, vib_beta=1e-6, **occ)
    else:
        criterion = create_loss("prolip", vib_beta=1e-6, inclusion_alpha=0.0, **occ)
    probe = Probe(len(vocab), data["train_f"].shape[1], args)
    params = list(probe.parameters()) + list(criterion.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in probe.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in probe.parameters() if p.ndim < 2], "weight_decay": 0.0},
                                   {"params": list(criterion.parameters()), "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    generator = torch.Generator().manual_seed(args.seed)
    masker = delete_tokens if args.occ == "delete" else mask_tokens
    for _ in range(args.steps):
        idx = torch.randint(0, len(data["train_f"]), (args.batch_size,), generator=generator)
        tokens = train_tokens[idx, torch.randint(0, 5, (args.batch_size,), generator=generator)]
        img_mu, img_lv = probe.image(data["train_f"][idx])
        txt_mu, txt_lv = probe.text(tokens)
        extra = {}
        if criterion.wants_masked:
            extra["masked_txt"] = probe.text(masker(tokens[:criterion.n_masked(len(tokens))], args.drop_prob, spec,
                                                    generator))
        loss, _ = criterion(img_mu, img_lv, txt_mu, txt_lv, **extra)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 2.0)
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        img_mu, img_lv = probe.image(data["val_f"])
        txt_mu, txt_lv = probe.text(val_tokens)
    u = txt_lv.exp().sum(1).numpy()
    amb, words = split.caption_ambiguity, np.array([len(c.split()) for c in split.captions])
    dist = torch.cdist(img_mu.double(), txt_mu.double()).square() + img_lv.exp().sum(1).double()[:, None] \
        + txt_lv.exp().sum(1).double()[None]
    general, specific = nested_pairs(split)
    out = {"spearman": round(spearmanr(u, amb).correlation, 3), "spearman_vs_words": round(spearmanr(u, words).correlation, 3),
           "bins": {int(w): round(spearmanr(u[words == w], amb[words == w]).correlation, 2)
                    for w in sorted(set(words)) if (words == w).sum() >= 100},
           "inclusion_accuracy": round(float((u[general] > u[specific]).mean()), 3),
           "t2i_r1": round(float((dist.argmin(0).numpy() == split.caption_image).mean() * 100), 1)}
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **out}))
    return out


if __name__ == "__main__":
    main()
