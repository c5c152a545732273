#!/usr/bin/env python
"""Prompt-bank text-encoding throughput: zsprob vs open_clip's build_zero_shot_classifier.

Two modes, both in one process, timed interleaved (A B A B ...), the same torch threads, float32:

* Same weights (default; any model without ``--baseline``): open_clip's
  ``build_zero_shot_classifier`` on the open_clip CLIP inside a zsprob ``ProbCLIP`` (means only)
  and ``zsprob.zeroshot.build_prompt_bank`` on the ProbCLIP itself, which also runs the
  log-variance head and returns sigma^2 for every prompt. The model uses native pooling so the
  two ``all`` classifiers must agree (checked).
* Against an open_clip model (``--baseline NAME``; ``prolip-ViT-B-16`` defaults to ``ViT-B-16``):
  zsprob's ProLIP model with random weights (ProLIP's released layout: [UNC] token, native
  pooling) through ``build_prompt_bank``, against ``open_clip.create_model(NAME)`` (random init,
  ``pretrained=None``) through ``build_zero_shot_classifier`` with open_clip's own tokenizer
  (``open_clip.get_tokenizer``: the OpenAI BPE file shipped inside open_clip, no download).
  ProLIP needs its SigLIP tokenizer from a local directory (``--tokenizer DIR``); without one a
  throwaway SentencePiece-style Unigram tokenizer with the model's vocabulary size (T5 / SigLIP
  layout: <pad> 0, </s> 1, <unk> 2) is built in a temporary directory with the ``tokenizers``
  package, as the tests do. Nothing is downloaded.

Batch sizes are each library's default: zsprob ``batch_size=512`` prompts, open_clip
``num_classes_per_batch=10`` classes (800 prompts with the 80 templates). Each side runs once
untimed on the first class (warm-up), then ``--repeats`` timed runs, alternating. Prints every
run, min and median seconds and prompts/s per side, the throughput ratio (zsprob / open_clip),
and the tokenisation share (tokeniser alone, also interleaved); the ratio is per prompt at the
number of classes given. ``--profile`` then times zsprob's stages on its own model (tokeniser;
open_clip's ``encode_text`` of the same tower, means only; zsprob's ``encode_texts``, mu + sigma^2).

    python scripts/bench_zeroshot.py                       # zsprob-tiny, 100 ImageNet classes x 80
    python scripts/bench_zeroshot.py --model ViT-B-32 --classes 20 --threads 2
    python scripts/bench_zeroshot.py --model prolip-ViT-B-16 --classes 10 --threads 2   # docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def make_unigram_tokenizer(directory, vocab_size: int, words) -> Path:
    """A throwaway T5 / SigLIP-style Hugging Face tokenizer (Unigram over Metaspace pieces) with
    exactly ``vocab_size`` entries, saved in ``directory``: ids 0-2 are <pad>, </s>, <unk>; then
    every character (word-initial and inner), every word of ``words`` as a whole piece (preferred),
    and filler pieces up to ``vocab_size``. ``</s>`` ends every sequence (as SigLIP's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    words = sorted({w for w in words if w})
    chars = sorted({c for w in words for c in w})
    pieces = [(s, 0.0) for s in specials]
    seen = set(specials)
    for p, score in [("\u2581" + c, -12.0) for c in chars] + [(c, -12.0) for c in chars] + [("\u2581", -12.0)] \
            + [("\u2581" + w, -6.0) for w in words]:
        if p not in seen:
            pieces.append((p, score))
            seen.add(p)
    if len(pieces) > vocab_size:
        raise ValueError(f"{len(pieces)} pieces do not fit a vocabulary of {vocab_size}")
    pieces += [(f"<extra_id_{i}>", -30.0) for i in range(vocab_size - len(pieces))]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(directory))
    return Path(directory)


def interleaved(fns: dict, repeats: int) -> dict:
    """Run each callable ``repeats`` times, alternating (a b a b ...); wall and CPU seconds per run
    and the last result."""
    out = {k: {"wall": [], "cpu": [], "last": None} for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            out[k]["last"] = fn()
            out[k]["wall"].append(time.perf_counter() - t0)
            out[k]["cpu"].append(time.process_time() - c0)
    return out


def _line(label: str, times: dict, n: int) -> str:
    w, c = times["wall"], times["cpu"]
    return (f"{label:<44s} wall min {min(w):8.3f} s median {statistics.median(w):8.3f} s "
            f"(best {n / min(w):8.1f}, median {n / statistics.median(w):8.1f} prompts/s)   "
            f"cpu min {min(c):8.3f} s median {statistics.median(c):8.3f} s\n"
            f"{'':44s} runs (wall s): {', '.join(f'{t:.3f}' for t in w)}")


def _ratios(zs: dict, oc: dict) -> str:
    med = statistics.median
    return (f"wall: {min(oc['wall']) / min(zs['wall']):5.2f}x (min)  {med(oc['wall']) / med(zs['wall']):5.2f}x (median)   "
            f"cpu: {min(oc['cpu']) / min(zs['cpu']):5.2f}x (min)  {med(oc['cpu']) / med(zs['cpu']):5.2f}x (median)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zsprob-tiny", help="open_clip name or zsprob config (random init)")
    ap.add_argument("--baseline", default=None,
                    help="comma-separated baselines for open_clip's build_zero_shot_classifier: 'same' (the open_clip "
                         "model inside zsprob's, same weights, means only) and/or open_clip model names (random "
                         "init, their own tokenizer); default: 'same', for prolip-ViT-B-16 'same,ViT-B-16'")
    ap.add_argument("--tokenizer", default=None,
                    help="local Hugging Face tokenizer directory for ProLIP models (default: a throwaway one)")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=512, help="zsprob encode_texts batch size")
    ap.add_argument("--classes-per-batch", type=int, default=10, help="open_clip num_classes_per_batch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true",
                    help="then time zsprob's stages on its own model: tokeniser, open_clip's text forward of the "
                         "same tower (means only), zsprob's encode_texts (mu + sigma^2), interleaved")
    args = ap.parse_args(argv)
    if args.baseline is None:
        args.baseline = "same,ViT-B-16" if args.model == "prolip-ViT-B-16" else "same"
    baselines = [b.strip() for b in args.baseline.split(",") if b.strip()]

    import torch
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    from zsprob.models import create_model
    from zsprob.zeroshot.prompts import build_prompt_bank, load_classnames, load_templates, prompt_texts
    from zsprob.zeroshot.selection import select_all

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    classes = load_classnames("imagenet_classnames.txt")[: args.classes]
    templates = load_templates()
    n = len(classes) * len(templates)
    tmp = tempfile.TemporaryDirectory()

    import open_clip

    from zsprob.models.factory import get_open_clip_config

    text_cfg = get_open_clip_config(args.model).get("text_cfg", {})
    tok_dir = args.tokenizer
    if tok_dir is None and text_cfg.get("hf_tokenizer_name"):
        all_names = load_classnames("imagenet_classnames.txt")
        from open_clip.tokenizer import canonicalize_text

        words = {w for t in prompt_texts(all_names, templates) for w in canonicalize_text(t).split()}
        tok_dir = make_unigram_tokenizer(Path(tmp.name) / "tokenizer", int(text_cfg["vocab_size"]), words)
    options = dict(pooling="native")
    if args.model.startswith("prolip-"):  # the released ProLIP forward (zsprob.models.convert.load)
        options.update(sigma_head="unc", unc_layout="prolip", sigma_depth=1)
    if tok_dir is not None:
        options["tokenizer_dir"] = str(tok_dir)
    model = create_model(args.model, **options).to(args.device).eval()
    token_head = model.sigma_head == "unc"
    sides = {}  # label -> (open_clip model, tokenizer, description)
    for b in baselines:
        if b == "same":
            what = ("with the [UNC] token removed from the sequence" if token_head else "the same open_clip model")
            sides[f"open_clip same tower"] = (model.clip, model.tokenizer,
                                              f"{args.model}'s own open_clip model ({what}, means only)")
        else:
            sides[f"open_clip {b}"] = (open_clip.create_model(b, pretrained=None).to(args.device).eval(),
                                       open_clip.get_tokenizer(b), f"open_clip {b} (random init, pretrained=None)")

    def run_open_clip(side, names=classes):
        oc_model, oc_tok, _ = sides[side]
        return build_zero_shot_classifier(oc_model, oc_tok, names, templates,
                                          num_classes_per_batch=args.classes_per_batch, device=args.device)

    def run_zsprob(names=classes):
        return build_prompt_bank(model, names, templates, model_id="bench", cache_dir=None,
                                 batch_size=args.batch_size, device=args.device, progress=False)

    texts = prompt_texts(classes, templates)
    ctx_zs = getattr(model.tokenizer, "context_length", None)
    print(f"zsprob {args.model} (text context {ctx_zs}, tokenizer {type(model.tokenizer).__name__}"
          f"{' from ' + str(getattr(model.tokenizer, 'directory', '')) if getattr(model.tokenizer, 'directory', None) else ''})",
          flush=True)
    for side, (_, oc_tok, what) in sides.items():
        print(f"  vs {side}: {what} (text context {getattr(oc_tok, 'context_length', None)}, "
              f"tokenizer {type(oc_tok).__name__})", flush=True)
    print(f"{len(classes)} classes x {len(templates)} templates = {n} prompts, device {args.device}, float32, "
          f"torch threads {torch.get_num_threads()}; batches: zsprob {args.batch_size} prompts, open_clip "
          f"{args.classes_per_batch} classes ({args.classes_per_batch * len(templates)} prompts)", flush=True)

    for side in sides:  # warm-up
        run_open_clip(side, classes[:1])
    run_zsprob(classes[:1])
    toks = interleaved({"zsprob": lambda: model.tokenizer(texts),
                        **{side: (lambda t=t: t(texts)) for side, (_, t, _) in sides.items()}}, max(args.repeats, 3))
    runs = interleaved({"zsprob": run_zsprob, **{side: (lambda s=side: run_open_clip(s)) for side in sides}},
                       args.repeats)
    bank = runs["zsprob"]["last"]

    print(f"timed: {args.repeats} runs per side, interleaved (zsprob, {', '.join(sides)}, zsprob, ...); "
          f"wall on a shared machine includes the other jobs, CPU time (process_time, all threads) too")
    print(_line("zsprob build_prompt_bank (mu + sigma^2):", runs["zsprob"], n))
    for side in sides:
        print(_line(f"{side} build_zero_shot_classifier (mu):", runs[side], n))
    for side in sides:
        print(f"ratio zsprob / {side}, prompts/s per prompt at {len(classes)} classes: "
              f"{_ratios(runs['zsprob'], runs[side])}")
    print(f"tokenisation alone ({n} prompts, min of {len(toks['zsprob']['wall'])}): "
          + ", ".join(f"{k} {min(v['wall']):.3f} s ({100 * min(v['wall']) / min(runs[k]['wall']):.1f}% of its min run)"
                      for k, v in toks.items()))
    if bank.logvar is None or not bool(torch.isfinite(bank.var).all()):
        raise SystemExit("zsprob bank has no finite sigma^2")
    print(f"zsprob sigma^2 per prompt: shape {tuple(bank.var.shape)} [C, T, D], finite; "
          f"open_clip classifiers [D, C], means only")
    if "open_clip same tower" in sides:
        diff = (select_all(bank).class_mu - runs["open_clip same tower"]["last"].T).abs().max().item()
        print(f"max |all - open_clip same-tower classifier| = {diff:.2e}"
              + (" (differs by design: zsprob's means attend to [UNC])" if token_head else " (same weights)"))
        with tempfile.TemporaryDirectory() as d:
            build_prompt_bank(model, classes, templates, model_id="bench", cache_dir=d, progress=False)
            t0 = time.perf_counter()
            cached = build_prompt_bank(model, classes, templates, model_id="bench", cache_dir=d, progress=False)
            t_cache = time.perf_counter() - t0
            assert cached.from_cache
        print(f"zsprob cached bank load: {t_cache:7.3f} s  {n / t_cache:9.1f} prompts/s")
    if args.profile:
        profile_stages(model, texts, args, n)
    tmp.cleanup()


def profile_stages(model, texts, args, n: int) -> None:
    """zsprob's time per stage against open_clip's own forward of the same text tower, same batches."""
    import torch

    from zsprob.models.encode import encode_texts

    tokens = model.tokenizer(texts)
    bs = args.batch_size

    @torch.no_grad()
    def open_clip_forward():  # the wrapped open_clip model's encode_text: means only, no [UNC] token
        return [model.clip.encode_text(tokens[i:i + bs].to(args.device), normalize=True)
                for i in range(0, len(tokens), bs)]

    stages = interleaved({
        "tokeniser": lambda: model.tokenizer(texts),
        "open_clip forward (mu)": open_clip_forward,
        "zsprob encode_texts (mu + sigma^2)": lambda: encode_texts(model, tokens, batch_size=bs, device=args.device,
                                                                   progress=False),
    }, args.repeats)
    print(f"stages of zsprob {args.model} on its own weights, {n} prompts, batches of {bs}, "
          f"{args.repeats} interleaved runs:")
    for k, v in stages.items():
        print(_line(k + ":", v, n))
    print(f"ratio zsprob encode_texts / open_clip forward of the same tower, prompts/s: "
          f"{_ratios(stages['zsprob encode_texts (mu + sigma^2)'], stages['open_clip forward (mu)'])}")


if __name__ == "__main__":
    main()
