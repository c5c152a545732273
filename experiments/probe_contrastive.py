#!/usr/bin/env python
"""Diagnostic: does *contrastive* image-text training learn SynthWorld's shapes, and if not, where does it stall?

Backs: the bag-of-words text tower of ``zsprob-tiny-bow`` (docs/findings.md, "Text tower").

Companion of ``probe_synthworld.py`` (supervised). Trains a small image tower and a text tower
with CLIP's InfoNCE on SynthWorld pretraining scenes (one of their five captions per sample,
as ``zsprob pretrain`` draws them), in memory, and prints every ``steps / 6`` steps:

* the InfoNCE loss and learnt logit scale;
* zero-shot top-1 on ``classify_eval`` scenes with the prompt "a photo of a {shape}." (chance 5%);
* the mean pairwise cosine between the 20 class prompts (1.00 = the text tower ignores the
  shape word: the same check ``zsprob zeroshot`` reports as ``class_separation``);

and at the end a linear probe of the image tower's features for shape (80% / 20% of the
``classify_eval`` scenes, 800 / 200 by default), next to the same probe at initialisation: does the image side hold
shape information even when the text side does not?

The towers are real components: the text tower (and ``--image-tower model``) come from
``zsprob.models.create_model`` (open_clip towers); ``--image-tower plain-cnn`` is
``zsprob.models.plain_cnn.zsprob_plaincnn`` (conv-BN-ReLU stages with max-pool downsampling, the
architecture that escapes the *supervised* plateau fastest in our measurements); ``--text bow`` is a bag-of-words baseline
(``torch.nn.EmbeddingBag`` over the same tokens). The loss is ``zsprob.prob.InfoNCELoss``.

    python experiments/probe_contrastive.py --steps 300                    # plain CNN + zsprob-tiny text tower
    python experiments/probe_contrastive.py --steps 900 --text bow        # learns shape: 41% zero-shot at 115k samples
    python experiments/probe_contrastive.py --steps 300 --captions shape   # no colour shortcut: still stalls
    python experiments/probe_contrastive.py --steps 300 --text-lr-mult 0   # frozen random text tower
    python experiments/probe_contrastive.py --image-tower model --model zsprob-tiny-cnn
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD  # noqa: E402

MEAN = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)


def fail(msg: str) -> None:
    print(f"probe_contrastive: error: {msg}", file=sys.stderr)
    sys.exit(2)


def render(split: str, n: int, seed: int, captions: str = "world"):
    """n SynthWorld scenes of ``split``: uint8 images [n, 3, 64, 64], their captions, shape labels.

    ``captions="shape"`` replaces the five captions by "a {shape}" for each object of the scene.
    """
    from zsprob.data.synthetic import SHAPES, SynthWorld

    world = SynthWorld(seed=seed, image_size=64)
    xs, caps, ys = [], [], []
    for i in range(n):
        s = world.sample(split, i)
        xs.append(np.asarray(s.image))
        caps.append(s.captions if captions == "world" else
                    [f"a {o['shape']}" for o in s.meta["objects"]])
        ys.append(SHAPES.index(s.meta["objects"][0]["shape"]))
    return torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous(), caps, torch.tensor(ys)


def linear_probe(feats: torch.Tensor, labels: torch.Tensor) -> float:
    """Held-out accuracy (%) of a logistic regression on the first 80% of the scenes."""
    from sklearn.linear_model import LogisticRegression

    n_train = int(0.8 * len(labels))
    x = F.normalize(feats.float(), dim=-1).numpy()
    clf = LogisticRegression(max_iter=3000).fit(x[:n_train], labels[:n_train].numpy())
    return 100.0 * clf.score(x[n_train:], labels[n_train:].numpy())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--image-tower", default="plain-cnn", choices=("plain-cnn", "model"))
    p.add_argument("--model", default="zsprob-tiny", help="zsprob model config giving the text tower "
                                                          "(and the image tower with --image-tower model)")
    p.add_argument("--text", default="model", choices=("model", "bow"))
    p.add_argument("--text-layers", type=int, default=None, help="override the text tower's depth")
    p.add_argument("--text-pooling", default="native", choices=("native", "gpo"),
                   help="the zsprob model's pooling (of both towers with --image-tower model)")
    p.add_argument("--text-zero-init", action="store_true",
                   help="zero the text blocks' residual output projections: at init the tower passes token "
                        "embeddings through (with GPO pooling: a bag of words behind a LayerNorm)")
    p.add_argument("--text-embed-std", type=float, default=None,
                   help="re-initialise the text token embeddings with this std (open_clip: 0.02)")
    p.add_argument("--text-lr-mult", type=float, default=1.0, help="0 freezes the text tower at its random init")
    p.add_argument("--temperature", type=float, default=0.07, help="InfoNCE's initial temperature")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--num-pretrain", type=int, default=20000, help="distinct pretraining scenes (the demo's world)")
    p.add_argument("--captions", default="world", choices=("world", "shape"),
                   help="world: SynthWorld's five captions; shape: only 'a {shape}' per object (no colour shortcut)")
    p.add_argument("--center", default="none", choices=("none", "batchnorm"),
                   help="batchnorm: BatchNorm1d (no affine) on both embeddings before L2 normalisation")
    p.add_argument("--num-eval", type=int, default=1000, help="classify_eval scenes (zero-shot and the probe)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps < 0 or a.batch_size < 2 or a.num_pretrain < a.batch_size or a.num_eval < 40:
        fail("need --steps >= 0, --batch-size >= 2, --num-pretrain >= --batch-size and --num-eval >= 40")
    if a.text_lr_mult < 0:
        fail("--text-lr-mult must be >= 0")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    from zsprob.data.synthetic import SHAPES
    from zsprob.errors import UserError
    from zsprob.models import create_model
    from zsprob.prob import InfoNCELoss
    from zsprob.zeroshot.metrics import class_separation

    t0 = time.time()
    x, caps, _ = render("pretrain", a.num_pretrain, a.seed, a.captions)
    ex, _, ey = render("classify_eval", a.num_eval, a.seed)
    print(f"probe_contrastive: rendered {len(x)} pretraining and {len(ex)} evaluation scenes in "
          f"{time.time() - t0:.0f}s")

    cfg = {"text_cfg": {"layers": a.text_layers}} if a.text_layers else None
    try:
        model = create_model(a.model, pooling=a.text_pooling, deterministic=True, seed=a.seed, normalize_mu=False,
                             **({"open_clip_cfg": cfg} if cfg else {}))
    except UserError as e:
        fail(str(e))
    tok = model.tokenizer
    D = model.embed_dim
    if a.text_zero_init:
        with torch.no_grad():
            for name, q in model.named_parameters():
                if not name.startswith("clip.visual.") and (name.endswith("attn.out_proj.weight")
                                                            or name.endswith("mlp.c_proj.weight")):
                    q.zero_()
    if a.text_embed_std is not None:
        with torch.no_grad():
            model.clip.token_embedding.weight.normal_(std=a.text_embed_std)
    norms = {k: (nn.BatchNorm1d(D, affine=False) if a.center == "batchnorm" else nn.Identity())
             for k in ("image", "text")}

    def out(z, k):
        return F.normalize(norms[k](z), dim=-1)
    # image embedding = image_head(image_features(u)); the shape probe reads the plain CNN's
    # features before its projection, and the model tower's embeddings
    if a.image_tower == "plain-cnn":
        from zsprob.models.plain_cnn import zsprob_plaincnn

        cnn = zsprob_plaincnn(num_classes=D)
        image_modules = [cnn]

        def image_features(u):
            return cnn.forward_head(cnn.forward_features(u), pre_logits=True)

        def image_head(f):
            return out(cnn.fc(f), "image")
    else:
        image_modules = [model.clip.visual]

        def image_features(u):
            return model.encode_image(u, with_sigma=False)[0]

        def image_head(f):
            return out(f, "image")

    def enc_img(u):
        return image_head(image_features(u))
    if a.text == "bow":
        bow = nn.EmbeddingBag(tok.vocab_size if hasattr(tok, "vocab_size") else 49408, D, mode="mean")
        text_params = list(bow.parameters())

        def enc_txt(tokens):
            rows = [[t for t in r if t != 0] for r in tokens.tolist()]
            offsets = torch.tensor([0] + [len(r) for r in rows[:-1]]).cumsum(0)
            return out(bow(torch.tensor([t for r in rows for t in r]), offsets), "text")
    else:
        text_params = [q for n, q in model.named_parameters() if not n.startswith("clip.visual.")]

        def enc_txt(tokens):
            return out(model.encode_text(tokens, with_sigma=False)[0], "text")

    loss_fn = InfoNCELoss(init_temperature=a.temperature)
    image_params = [q for m in image_modules for q in m.parameters()] + list(loss_fn.parameters())
    groups = [{"params": image_params, "mult": 1.0}]
    if a.text_lr_mult > 0:
        groups.append({"params": text_params, "mult": a.text_lr_mult})
    else:
        for q in text_params:
            q.requires_grad_(False)
    opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    trained = [q for g in groups for q in g["params"]]
    everything = image_modules + ([bow] if a.text == "bow" else [model]) + list(norms.values())
    prompts = tok([f"a photo of a {s}." for s in SHAPES])

    def prep(u8):
        return (u8.float() / 255 - MEAN) / STD

    @torch.no_grad()
    def evaluate():
        for m in everything:
            m.eval()
        t = enc_txt(prompts)
        f = torch.cat([image_features(prep(ex[i:i + 250])) for i in range(0, len(ex), 250)])
        e = image_head(f)
        for m in everything:
            m.train()
        sep = class_separation(t, SHAPES)["mean_pairwise_cosine"]
        return 100.0 * float(((e @ t.t()).argmax(1) == ey).float().mean()), sep, \
            (f if a.image_tower == "plain-cnn" else e)

    zs0, sep0, f0 = evaluate()
    probe0 = linear_probe(f0, ey)
    print(f"init: zero-shot {zs0:.1f}% (chance {100 / len(SHAPES):.1f}%), class-prompt cosine {sep0:.2f}, "
          f"image-feature shape probe {probe0:.1f}%")
    print("| step | samples | loss | logit scale | zero-shot top-1 (%) | class-prompt cosine | samples/s |\n"
          "|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(a.seed)
    t0 = time.time()
    every = max(1, a.steps // 6)
    for step in range(1, a.steps + 1):
        idx = torch.randint(len(x), (a.batch_size,), generator=g)
        which = torch.rand(a.batch_size, generator=g)
        tokens = tok([caps[i][int(u * len(caps[i]))] for i, u in zip(idx.tolist(), which.tolist())])
        loss, stats = loss_fn(enc_img(prep(x[idx])), None, enc_txt(tokens), None)
        if step <= a.warmup:
            lr = a.lr * step / a.warmup
        else:
            lr = a.lr * 0.5 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup)))
        for grp in opt.param_groups:
            grp["lr"] = lr * grp["mult"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 2.0)
        opt.step()
        if step % every == 0 or step == a.steps:
            zs, sep, _ = evaluate()
            print(f"| {step} | {step * a.batch_size} | {loss.item():.3f} | {stats['logit_scale'].item():.1f} | "
                  f"{zs:.1f} | {sep:.2f} | {step * a.batch_size / (time.time() - t0):.0f} |", flush=True)
    zs, sep, f = evaluate()
    print(f"end: zero-shot {zs:.1f}%, class-prompt cosine {sep:.2f}, image-feature shape probe "
          f"{linear_probe(f, ey):.1f}% (at init {probe0:.1f}%; chance {100 / len(SHAPES):.1f}%)")


if __name__ == "__main__":
    main()
