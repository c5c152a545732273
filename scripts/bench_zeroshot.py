#!/usr/bin/env python
"""Prompt-bank text-encoding throughput: zsprob vs open_clip's build_zero_shot_classifier.

Both run in one process on the SAME weights: open_clip's ``build_zero_shot_classifier`` on the
open_clip CLIP inside a zsprob ``ProbCLIP`` (means only), and ``zsprob.zeroshot.build_prompt_bank``
on the ProbCLIP itself, which also runs the log-variance head and returns sigma^2 for every
prompt. The model uses native pooling so the two ``all`` classifiers must agree (checked).
Prints prompts/s for each (median of ``--repeats`` timed runs after one warm-up), the ratio,
and the cached-bank load time.

    python scripts/bench_zeroshot.py                       # zsprob-tiny, 100 ImageNet classes x 80
    python scripts/bench_zeroshot.py --model ViT-B-32 --classes 20 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zsprob-tiny", help="open_clip name or zsprob config (random init)")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=512, help="zsprob encode_texts batch size")
    ap.add_argument("--classes-per-batch", type=int, default=10, help="open_clip num_classes_per_batch")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import torch
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    from zsprob.models import create_model
    from zsprob.zeroshot.prompts import build_prompt_bank, load_classnames, load_templates
    from zsprob.zeroshot.selection import select_all

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_model(args.model, pooling="native").to(args.device).eval()
    classes = load_classnames("imagenet_classnames.txt")[: args.classes]
    templates = load_templates()
    n = len(classes) * len(templates)

    def run_open_clip():
        return build_zero_shot_classifier(model.clip, model.tokenizer, classes, templates,
                                          num_classes_per_batch=args.classes_per_batch, device=args.device)

    def run_zsprob():
        return build_prompt_bank(model, classes, templates, model_id="bench", cache_dir=None,
                                 batch_size=args.batch_size, device=args.device, progress=False)

    def timed(fn):
        fn()  # warm-up
        ts, cs = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            ts.append(time.perf_counter() - t0)
            cs.append(time.process_time() - c0)
        return statistics.median(ts), statistics.median(cs), out

    # interleave so background load affects both alike; CPU time (process_time, all threads) is
    # reported too because wall time on a shared machine mostly measures the other jobs
    t_oc, c_oc, ref = timed(run_open_clip)
    t_zs, c_zs, bank = timed(run_zsprob)
    t_oc2, c_oc2, _ = timed(run_open_clip)
    t_zs2, c_zs2, _ = timed(run_zsprob)
    t_oc, t_zs = min(t_oc, t_oc2), min(t_zs, t_zs2)
    c_oc, c_zs = min(c_oc, c_oc2), min(c_zs, c_zs2)
    diff = (select_all(bank).class_mu - ref.T).abs().max().item()

    with tempfile.TemporaryDirectory() as d:
        build_prompt_bank(model, classes, templates, model_id="bench", cache_dir=d, progress=False)
        t0 = time.perf_counter()
        cached = build_prompt_bank(model, classes, templates, model_id="bench", cache_dir=d, progress=False)
        t_cache = time.perf_counter() - t0
        assert cached.from_cache

    print(f"model {args.model} (text context {model.tokenizer.context_length if hasattr(model.tokenizer, 'context_length') else '?'}), "
          f"{len(classes)} classes x {len(templates)} templates = {n} prompts, device {args.device}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats} (best of 2 interleaved rounds)")
    print(f"open_clip build_zero_shot_classifier (mu only):  wall {t_oc:7.3f} s  {n / t_oc:9.1f} prompts/s   "
          f"cpu {c_oc:7.3f} s  {n / c_oc:9.1f} prompts/cpu-s")
    print(f"zsprob build_prompt_bank (mu + sigma^2):         wall {t_zs:7.3f} s  {n / t_zs:9.1f} prompts/s   "
          f"cpu {c_zs:7.3f} s  {n / c_zs:9.1f} prompts/cpu-s")
    print(f"ratio zsprob / open_clip throughput:              wall {t_oc / t_zs:5.2f}x   cpu {c_oc / c_zs:5.2f}x")
    print(f"zsprob cached bank load:                          {t_cache:7.3f} s  {n / t_cache:9.1f} prompts/s")
    print(f"max |all - open_clip classifier| = {diff:.2e}; sigma^2 shape {tuple(bank.var.shape)}")


if __name__ == "__main__":
    main()
