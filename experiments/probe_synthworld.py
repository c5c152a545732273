#!/usr/bin/env python
"""Diagnostic: how fast can an image tower learn SynthWorld's attributes, with labels?

Backs: the plain CNN image tower (``zsprob_plaincnn``) of the demo models (docs/findings.md, "Image tower").

Contrastive pretraining can only teach what the image tower can learn at all in the budget. This
script trains the image tower of a zsprob model (or any timm model) *supervised* on one
attribute of single-object SynthWorld pretraining images (the object named by a "full" caption),
with a linear head on the image embedding, and prints held-out accuracy every ``--eval-every``
steps next to chance. If a supervised probe stays at chance for a given number of samples, a
contrastive model trained on the same samples will not recognise that attribute either
(zero-shot classification over shapes stays at chance).

Libraries: webdataset reads the shards (plain ``webdataset.WebDataset``, as a user would),
zsprob.models builds the tower, timm builds the optional CNN; the training loop is a few lines.

    zsprob data synthetic --out sw
    python experiments/probe_synthworld.py --data sw --attribute shape --steps 400
    python experiments/probe_synthworld.py --data sw --attribute color --steps 200
    python experiments/probe_synthworld.py --data sw --attribute shape --timm regnetx_002 --lr 2e-3
    python experiments/probe_synthworld.py --render 22000 --attribute shape --model zsprob-tiny-cnn --steps 1000 --batch-size 64 --lr 2e-3
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from open_clip.constants import OPENAI_DATASET_MEAN as MEAN, OPENAI_DATASET_STD as STD  # noqa: E402


def fail(msg: str) -> None:
    """One clear line on stderr, exit code 2 (bad input), as zsprob's commands do."""
    print(f"probe_synthworld: error: {msg}", file=sys.stderr)
    sys.exit(2)


def load(data: str, attribute: str, limit: int):
    import webdataset as wds

    urls = sorted(glob.glob(os.path.join(data, "pretrain", "*.tar")))
    if not urls:
        fail(f"no shards under {data}/pretrain (run `zsprob data synthetic --out {data}`)")
    xs, labels = [], []
    for img, meta in wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("jpg", "json"):
        objs = meta.get("objects") or []
        if len(objs) != 1 or meta.get("condition", "normal") != "normal":
            continue  # one visible object, normal rendering: the label is unambiguous
        xs.append(img)
        labels.append(objs[0][attribute])
        if limit and len(xs) >= limit:
            break
    names = sorted(set(labels))
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous()
    y = torch.tensor([names.index(v) for v in labels])
    return x, y, names


def render(n: int, attribute: str, seed: int):
    """n fresh single-object, normal-condition images rendered by SynthWorld (no shards needed)."""
    from zsprob.data.synthetic import SynthWorld

    world = SynthWorld(seed=seed, image_size=64)
    xs, labels = [], []
    for i in range(n):  # "classify*" splits: one object, shape cycling over the classes
        s = world.sample("classify_probe", i, condition="normal")
        xs.append(np.asarray(s.image))
        labels.append(s.meta["objects"][0][attribute])
    names = sorted(set(labels))
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous()
    return x, torch.tensor([names.index(v) for v in labels]), names


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="a `zsprob data synthetic` output folder")
    p.add_argument("--render", type=int, default=0,
                   help="instead of --data: render this many fresh single-object normal images "
                        "(no image is seen twice unless the steps exceed them)")
    p.add_argument("--attribute", default="shape", choices=("shape", "color", "fill", "size", "position"))
    p.add_argument("--model", default="zsprob-tiny", help="zsprob / open_clip model whose image tower is probed")
    p.add_argument("--timm", default=None, help="probe this timm model instead (random init)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--held-out", type=int, default=500)
    p.add_argument("--limit", type=int, default=0, help="read at most this many images (0 = all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    if bool(a.data) == bool(a.render):
        fail("give exactly one of --data DIR or --render N")
    if a.render < 0:
        fail("--render must be positive")
    x, y, names = load(a.data, a.attribute, a.limit) if a.data else render(a.render, a.attribute, a.seed)
    n_tr = len(x) - a.held_out
    if n_tr < a.batch_size:
        fail(f"only {len(x)} usable images; generate more pretraining images")
    if a.timm:
        import timm

        net = timm.create_model(a.timm, num_classes=len(names), pretrained=False)
        forward, modules, what = net, [net], f"timm {a.timm}"
    else:
        from zsprob.models import create_model

        model = create_model(a.model, pooling="native", deterministic=True, seed=a.seed)
        head = torch.nn.Linear(model.embed_dim, len(names))

        def forward(images):
            return head(model.encode_image(images, with_sigma=False)[0]) * 10.0  # mu is unit-norm

        modules, what = [model.clip.visual, head], f"{a.model} image tower + linear head"
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)

    def prep(u8):
        return (u8.float() / 255 - mean) / std

    opt = torch.optim.AdamW([q for mod in modules for q in mod.parameters()], lr=a.lr, weight_decay=0.05)
    counts = torch.bincount(y[n_tr:], minlength=len(names)).float()
    print(f"probe_synthworld: {what}; attribute {a.attribute} ({len(names)} classes); {n_tr} train / "
          f"{len(x) - n_tr} held-out single-object normal images; chance {100 / len(names):.1f}%, "
          f"majority class {100 * counts.max().item() / counts.sum().item():.1f}%")
    print("| step | samples seen | train loss | held-out top-1 (%) | samples/s |\n|---|---|---|---|---|")
    t0 = time.time()
    for step in range(1, a.steps + 1):
        idx = torch.randint(n_tr, (a.batch_size,))
        loss = torch.nn.functional.cross_entropy(forward(prep(x[idx])), y[idx])
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, step / 30)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            for mod in modules:
                mod.eval()
            with torch.no_grad():
                pred = torch.cat([forward(prep(x[i:i + 256])).argmax(1) for i in range(n_tr, len(x), 256)])
            for mod in modules:
                mod.train()
            acc = 100 * (pred == y[n_tr:]).float().mean().item()
            print(f"| {step} | {step * a.batch_size} | {loss.item():.3f} | {acc:.1f} | "
                  f"{step * a.batch_size / (time.time() - t0):.0f} |", flush=True)


if __name__ == "__main__":
    main()
