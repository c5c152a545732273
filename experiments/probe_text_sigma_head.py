#!/usr/bin/env python
"""Diagnostic: what does the text log-variance head learn from the occlusion term, given the towers?

Backs: docs/findings.md, "What the caption head learns within a length" (why sigma^2's order
within a caption length depends on the training seed, and why ``loss.pcmepp.drop_prob`` stays 0.5).

In the demo's PCME++ recipe the text head (``sigma_head: unc``: an MLP over the mean of the word
embeddings and an [UNC] word) reads the tower detached and learns from the occlusion term alone:
a caption must be covered by a copy with some of its words deleted (``inclusion_form: cover``).
Because nothing else reaches the head, the head can be trained again, apart, on a trained model's
frozen tower in seconds. This script does that and reports what the full evaluation reports for
captions: Spearman(||sigma^2||_1, ambiguity), overall and within every caption word-count bin
with at least 100 captions, on

* ``val``: the retrieval val split's 2,500 captions (``ROOT/retrieval``), and
* ``held``: the five captions of every scene in the last ``--held-shards`` pretraining shards
  (20,000 captions with the default world), which the probe does not train on.

On ``held`` it also regresses the standardised log ||sigma^2||_1, and the standardised ambiguity, on
what each caption mentions (counts of shape, colour, size, position and fill words over its objects;
condition, background, object count) plus one indicator per word count: a head that learned each
word's information has coefficients of the ambiguity's signs and proportions, one that learned word
count alone has coefficients near 0.

``--word-deletions N`` (with ``--steps 0``: the head as trained) deletes, one at a time, every
colour, size, fill, shape and filler word of the first N held captions (SynthWorld's own
vocabularies, ``zsprob.data.synthworld.scene``) and prints per kind the mean squared shift of the mean
and the mean log-growth of ||sigma^2||_1: does the mean's shift, the only thing the covering term
can read, show how much a word narrows a caption?

The term, the optimiser and the schedule are the recipe's (AdamW lr 2e-3, weight decay 0.1 on
matrices, betas 0.9 / 0.98, warm-up 50 + cosine, batch 128, half the batch given a copy, the
head's gradient clipped at 2, occlusion weight 0.1); ``--drop-prob`` is the share of words deleted
(one value, or ``LO,HI`` for a uniform draw per step). ``--reinit`` starts the head from its
initialisation instead of the trained head. ``--form tight`` replaces the one-sided covering term by a
two-sided one (not a trainer option): smooth-L1 between log S_copy - log S_caption and ``--kappa`` x
the squared shift of the mean, so the growth must *equal* what the deleted words moved. The test
split is never read. ``--form nll`` trains the head on the caption likelihood term instead
(``zsprob.prob.losses.caption_nll``: the paired image's mean under the caption's Gaussian, the
image means from the frozen image tower over the training shards' scenes), ``--form cover+nll``
on both (weight ``--nll-weight``, scale ``--nll-scale``), as ``loss.pcmepp.caption_nll_alpha`` and
``caption_nll_scale`` do in the trainer.

    python experiments/probe_text_sigma_head.py RUN/model --root sw --steps 0              # the head as trained
    python experiments/probe_text_sigma_head.py RUN/model --root sw --reinit               # the recipe's own term
    python experiments/probe_text_sigma_head.py RUN/model --root sw --reinit --drop-prob 0.2
    python experiments/probe_text_sigma_head.py RUN/model --root sw --reinit --form cover+nll

Components: ``zsprob.models.load_for_inference``, ``zsprob.data.masking.delete_tokens`` (the
trainer's word deletion), ``zsprob.prob.prolip.cover_loss`` and ``zsprob.prob.losses.caption_nll``
(the trainer's terms).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch


MENTIONS = ("shape", "color", "size", "position", "fill", "condition", "background", "count")


def mentions(caption: dict) -> list[float]:
    """What a SynthWorld caption's ground truth says it mentions, in the order of MENTIONS."""
    objects = caption.get("objects") or []
    per_object = [float(sum(1 for o in objects if o.get(k))) for k in MENTIONS[:5]]
    return per_object + [float(caption.get(k) is not None) for k in MENTIONS[5:]]


def read_shard_captions(paths) -> list[list[tuple[str, float, list[float]]]]:
    """Per scene, its five (caption, ambiguity, mentions) triples, from SynthWorld pretraining shards."""
    scenes = []
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.load(tar.extractfile(member))
                    scenes.append([(c["text"], float(c["ambiguity"]), mentions(c)) for c in meta["captions"]])
    return scenes


@torch.no_grad()
def shard_image_means(model, paths, batch: int = 512) -> torch.Tensor:
    """The image tower's means of every scene in the shards, in ``read_shard_captions``' order [N, D]."""
    import io

    from PIL import Image

    out, pending = [], []
    for path in paths:
        with tarfile.open(path) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for name in members:
                if name.endswith(".json"):
                    stem = name[:-5]
                    image = next(members[stem + ext] for ext in (".jpg", ".png", ".jpeg") if stem + ext in members)
                    pending.append(model.preprocess_val(Image.open(io.BytesIO(tar.extractfile(image).read())).convert("RGB")))
                    if len(pending) == batch:
                        out.append(model.encode_image(torch.stack(pending), with_sigma=False)[0])
                        pending = []
    if pending:
        out.append(model.encode_image(torch.stack(pending), with_sigma=False)[0])
    return torch.cat(out)


FILLER = ("a", "an", "the", "of", "photo", "image", "picture", "there", "is")


def word_kind(word: str) -> str | None:
    """colour / size / fill / shape / filler for one caption word, None for anything else."""
    from zsprob.data.synthworld.captions import FILL_WORD
    from zsprob.data.synthworld.scene import COLOR_NAMES, PLURALS, SHAPES, SIZES

    if word in COLOR_NAMES:
        return "colour"
    if word in SIZES:
        return "size"
    if word in FILL_WORD.values():
        return "fill"
    if word in SHAPES or word in PLURALS.values():
        return "shape"
    return "filler" if word in FILLER else None


@torch.no_grad()
def word_deletions(model, texts: list[str]) -> dict[str, tuple[int, float, float]]:
    """kind -> (count, mean ||mu_copy - mu||^2, mean log S_copy / S) over single-word deletions."""
    found: dict[str, list[tuple[float, float]]] = {}
    for text in texts:
        words = text.split()
        copies = [(word_kind(w), " ".join(words[:i] + words[i + 1:])) for i, w in enumerate(words)]
        copies = [(k, c) for k, c in copies if k is not None and len(words) > 1]
        if not copies:
            continue
        mu, lv = model.encode_text(model.tokenizer([text] + [c for _, c in copies]))
        shift = (mu[1:] - mu[0]).square().sum(-1)
        growth = torch.log(lv[1:].exp().sum(-1) / lv[0].exp().sum())
        for (kind, _), d, g in zip(copies, shift.tolist(), growth.tolist()):
            found.setdefault(kind, []).append((d, g))
    return {k: (len(v), float(np.mean([d for d, _ in v])), float(np.mean([g for _, g in v]))) for k, v in found.items()}


def mention_coefficients(y: np.ndarray, features: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of standardised y on the mention counts, with one intercept per word count."""
    design = np.column_stack([features] + [(words == w).astype(float) for w in np.unique(words)])
    coef, *_ = np.linalg.lstsq(design, (y - y.mean()) / y.std(), rcond=None)
    return coef[:features.shape[1]]


def within_bins(u: np.ndarray, amb: np.ndarray, words: np.ndarray, min_count: int) -> dict[int, float]:
    from scipy.stats import spearmanr

    out = {}
    for w in np.unique(words):
        sel = words == w
        if sel.sum() >= min_count and np.std(amb[sel]) > 0:
            out[int(w)] = float(spearmanr(u[sel], amb[sel])[0])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a zsprob checkpoint of the demo's PCME++ recipe (RUN/model)")
    p.add_argument("--root", required=True, help="the SynthWorld folder (pretrain/ and retrieval/)")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--drop-prob", default="0.5", help="share of words deleted: P or LO,HI")
    p.add_argument("--drop-ratio", type=float, default=0.5, help="share of the batch given a copy")
    p.add_argument("--cover-lambda", type=float, default=0.002)
    p.add_argument("--cover-scale", type=float, default=1000.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--form", choices=["cover", "tight", "nll", "cover+nll"], default="cover")
    p.add_argument("--nll-weight", type=float, default=1.0, help="--form cover+nll: weight of the NLL term")
    p.add_argument("--nll-scale", type=float, default=3.0,
                   help="--form nll / cover+nll: sigma^2 fitted to the residual / this (loss.pcmepp.caption_nll_scale)")
    p.add_argument("--kappa", type=float, default=1.0, help="--form tight: log-growth per unit squared shift")
    p.add_argument("--reinit", action="store_true", help="start the head from its initialisation")
    p.add_argument("--held-shards", type=int, default=4)
    p.add_argument("--min-count", type=int, default=100, help="smallest word-count bin reported")
    p.add_argument("--word-deletions", type=int, default=0, metavar="N",
                   help="also delete single words of the first N held captions (see above)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    from scipy.stats import spearmanr

    from zsprob.data.masking import delete_tokens, text_mask_spec
    from zsprob.models import load_for_inference
    from zsprob.models.sigma_heads import UncPooledHead
    from zsprob.prob.losses import caption_nll
    from zsprob.prob.prolip import cover_loss

    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    def refuse(message: str) -> int:
        print(f"probe_text_sigma_head: error: {message}", file=sys.stderr)
        return 2

    root = Path(a.root)
    shards = sorted((root / "pretrain").glob("*.tar"))
    if len(shards) <= a.held_shards:
        return refuse(f"need more than {a.held_shards} shards under {root / 'pretrain'}")
    if not (root / "retrieval" / "val_meta.json").is_file():
        return refuse(f"no retrieval val split under {root} (zsprob data synthetic writes one)")
    try:
        drops = [float(x) for x in a.drop_prob.split(",")]
    except ValueError:
        drops = []
    if a.steps < 0 or len(drops) not in (1, 2) or not all(0.0 <= x <= 1.0 for x in drops):
        return refuse("--steps must be >= 0 and --drop-prob one or two values in [0, 1]")
    if not (math.isfinite(a.nll_scale) and a.nll_scale > 0):
        return refuse(f"--nll-scale must be a number > 0, got {a.nll_scale}")
    train = read_shard_captions(shards[:-a.held_shards])
    held = [c for scene in read_shard_captions(shards[-a.held_shards:]) for c in scene]
    val_meta = json.loads((root / "retrieval" / "val_meta.json").read_text())
    val = [(c["text"], float(x), mentions(c)) for c, x in zip(val_meta["caption_meta"], val_meta["caption_ambiguity"])]

    model = load_for_inference(checkpoint=a.checkpoint)
    image_mu = shard_image_means(model, shards[:-a.held_shards]) if "nll" in a.form else None
    head = model.text_sigma
    if not isinstance(head, UncPooledHead) or head.unc_emb is None:
        return refuse("the checkpoint's text head is not the bag-of-words [UNC] head (model.sigma_head: unc)")
    for q in model.parameters():
        q.requires_grad_(False)
    if a.reinit:  # as UncPooledHead builds it: [UNC] word N(0, 1) like the tower's words, default Linear, bias -6
        bias = float(model.config["sigma_bias_init"])
        torch.nn.init.normal_(head.unc_emb, std=1.0)
        head.mlp.fc1.reset_parameters()
        head.mlp.fc2.reset_parameters()
        torch.nn.init.constant_(head.mlp.fc2.bias, bias)
    params = list(head.parameters())
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW([{"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
                             {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.98), eps=1e-6)
    warm = 50

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, a.steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    spec = text_mask_spec(model.tokenizer)
    gen = torch.Generator().manual_seed(a.seed)
    lo_hi = drops
    n_copy = int(round(a.drop_ratio * 128))
    for _ in range(a.steps):
        picks, texts = [], []
        for _ in range(128):  # a scene, then one of its captions (the same draws as random.choice twice)
            picks.append(random.randrange(len(train)))
            texts.append(random.choice(train[picks[-1]])[0])
        tokens = model.tokenizer(texts)
        drop = lo_hi[0] if len(lo_hi) == 1 else float(torch.empty(()).uniform_(lo_hi[0], lo_hi[1], generator=gen))
        copies = delete_tokens(tokens[:n_copy], drop, spec, gen)
        mu, lv = model.encode_text(tokens[:n_copy])
        c_mu, c_lv = model.encode_text(copies)
        if a.form in ("cover", "cover+nll"):
            term = cover_loss(mu.detach(), lv, c_mu.detach(), c_lv, a.cover_scale, a.cover_lambda)
        if "nll" in a.form:  # the paired image's mean under the caption's Gaussian (all 128 captions)
            all_mu, all_lv = model.encode_text(tokens)
            nll = caption_nll(torch.eye(len(picks)), image_mu[picks], all_mu.detach(), all_lv, a.nll_scale)
            term = nll if a.form == "nll" else term + a.nll_weight * nll
        elif a.form == "tight":
            growth = torch.log(c_lv.exp().sum(-1)) - torch.log(lv.exp().sum(-1))
            term = torch.nn.functional.smooth_l1_loss(growth, a.kappa * (mu - c_mu).detach().square().sum(-1),
                                                      beta=0.01)
        loss = 0.1 * term
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 2.0)
        opt.step()
        sched.step()

    print(f"steps {a.steps}, form {a.form}, drop_prob {a.drop_prob}, reinit {a.reinit}, seed {a.seed}")
    for name, pairs in (("val", val), ("held", held)):
        texts = [t for t, _, _ in pairs]
        amb = np.array([x for _, x, _ in pairs])
        with torch.no_grad():
            u = np.concatenate([model.encode_text(model.tokenizer(texts[i:i + 1024]))[1].exp().sum(-1).double().numpy()
                                for i in range(0, len(texts), 1024)])
        words = np.array([len(t.split()) for t in texts])
        bins = within_bins(u, amb, words, a.min_count)
        summary = (f"bins > 0: {sum(v > 0 for v in bins.values())}/{len(bins)}  min {min(bins.values()):+.2f}  "
                   f"mean {np.mean(list(bins.values())):+.3f}") if bins else f"no bin of {a.min_count}+ captions"
        print(f"{name:4s} Spearman {spearmanr(u, amb)[0]:+.3f}  mean ||sigma^2||_1 {u.mean():.3f}  {summary}")
        print("     " + " ".join(f"{w}:{v:+.2f}" for w, v in bins.items()))
        if name == "held":
            features = np.array([m for _, _, m in pairs])
            for label, y in (("log sigma^2", np.log(u)), ("ambiguity", amb)):
                coef = mention_coefficients(y, features, words)
                print(f"     {label:11s} on mentions: " + " ".join(f"{k} {c:+.2f}" for k, c in zip(MENTIONS, coef)))
    if a.word_deletions:
        print(f"single-word deletions in the first {a.word_deletions} held captions:")
        found = word_deletions(model, [t for t, _, _ in held[:a.word_deletions]])
        for kind, (n, shift, growth) in sorted(found.items()):
            print(f"     {kind:7s} n {n:5d}  ||Delta mu||^2 {shift:.3f}  log S_copy / S {growth:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
