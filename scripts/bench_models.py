#!/usr/bin/env python
"""Forward+backward time of a zsprob ProbCLIP vs the plain open_clip model of the same config.

Both models are built in the same run from the same open_clip config; timings are interleaved
(plain, prob, plain, prob, ...) so background load hits both alike, and the median is reported.
Variants: the probabilistic model as configured (GPO + sigma heads; token sequences cut after
the longest end-of-text token, which is exact for causal text towers), the same on full-length
token sequences (like open_clip: the fair measure of the sigma-head + GPO overhead), with native
pooling (isolates GPO), and the deterministic native wrapper (mean branch only).
The sigma head adds ``sigma_depth`` blocks to each L-block tower, so the expected overhead of
the blocks alone is about sigma_depth / L.

    python scripts/bench_models.py                                   # zsprob-tiny, CPU, batch 64 and 128
    python scripts/bench_models.py --device cuda --model ViT-B-16 --image-size 224 --batch-sizes 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

WORDS = ("a small red square above a big blue circle left of green triangle the two three yellow "
         "purple star near under right large tiny picture photo of with and").split()


def make_captions(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    caps = []
    for _ in range(n):
        k = int(torch.randint(4, 16, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        caps.append(" ".join(WORDS[i] for i in idx))
    return caps


def step_plain(m, images, tokens):
    f_i = m.encode_image(images, normalize=True)
    f_t = m.encode_text(tokens, normalize=True)
    loss = (f_i @ f_t.T).float().logsumexp(-1).mean()
    loss.backward()


def step_prob(m, images, tokens):
    out = m(images, tokens)
    loss = (out["img_mu"] @ out["txt_mu"].T).logsumexp(-1).mean()
    if out["img_logvar"] is not None:
        loss = loss + out["img_logvar"].exp().mean() + out["txt_logvar"].exp().mean()
    loss.backward()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zsprob-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sigma-depth", type=int, default=1)
    ap.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                    help="autocast dtype (GPU runs usually use bf16)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from zsprob.models import create_model
    from zsprob.models.factory import build_open_clip

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kw = {"image_size": args.image_size} if args.image_size else {}
    torch.manual_seed(0)
    prob = create_model(args.model, sigma_depth=args.sigma_depth, **kw)
    variants = {
        "prob (gpo)": prob,
        "prob (gpo, full text)": create_model(args.model, sigma_depth=args.sigma_depth, truncate_text=False, **kw),
        "prob (native)": create_model(args.model, sigma_depth=args.sigma_depth, pooling="native", **kw),
        "det. wrapper (native)": create_model(args.model, pooling="native", deterministic=True, **kw),
    }
    plain = build_open_clip(prob.config["open_clip_cfg"])
    for m in [plain, *variants.values()]:
        m.to(device).train()
    L_img = prob._vision.num_blocks
    L_txt = prob._text.num_blocks
    n = args.sigma_depth
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    print(f"model {args.model}  device {device}  torch threads {torch.get_num_threads()}  "
          f"image {prob.image_size}px  blocks image/text {L_img}/{L_txt}  sigma_depth {n}  amp {args.amp}")
    print(f"params: plain open_clip {sum(p.numel() for p in plain.parameters()) / 1e6:.2f}M, "
          f"prob {sum(p.numel() for p in prob.parameters()) / 1e6:.2f}M")
    print(f"expected block overhead of the sigma heads: image {n}/{L_img} = {n / L_img:.1%}, "
          f"text {n}/{L_txt} = {n / L_txt:.1%}")
    if getattr(prob._vision, "kind", "vit") == "timm":
        print("  (timm image tower: the blocks are CNN stages of unequal cost; the last stages run at the "
              "lowest resolution, so the image overhead is usually below n/L)")
    results = []
    for bs in args.batch_sizes:
        images = torch.randn(bs, 3, prob.image_size, prob.image_size, device=device)
        tokens = prob.tokenizer(make_captions(bs)).to(device)
        models = {"open_clip": (plain, step_plain), **{k: (v, step_prob) for k, v in variants.items()}}
        times: dict[str, list[float]] = {k: [] for k in models}
        cpu: dict[str, list[float]] = {k: [] for k in models}
        for it in range(args.warmup + args.iters):
            for name, (m, fn) in models.items():
                m.zero_grad(set_to_none=True)
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    fn(m, images, tokens)
                sync(device)
                if it >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        # medians, and minima (the least disturbed run: robust when other jobs share the CPU)
        base, cbase = statistics.median(times["open_clip"]), statistics.median(cpu["open_clip"])
        bmin, cmin = min(times["open_clip"]), min(cpu["open_clip"])
        print(f"\nbatch {bs}: forward+backward over {args.iters} runs, seconds (median / min); "
              f"process CPU time / threads estimates the wall time on an idle machine")
        row = {"batch": bs}
        for name in times:
            w_med, w_min = statistics.median(times[name]), min(times[name])
            c_med, c_min = statistics.median(cpu[name]), min(cpu[name])
            row[name] = {"wall_median_s": w_med, "wall_min_s": w_min, "cpu_median_s": c_med, "cpu_min_s": c_min}
            print(f"  {name:22s} wall {w_med:6.3f} / {w_min:6.3f}  ratio {w_med / base:5.3f} / {w_min / bmin:5.3f}   "
                  f"cpu {c_med:6.3f} / {c_min:6.3f}  ratio {c_med / cbase:5.3f} / {c_min / cmin:5.3f}   "
                  f"{bs / w_min:6.1f} samples/s (best wall)")
        results.append(row)
        p = row["prob (gpo, full text)"]
        print(f"  probabilistic model (full-length text) overhead vs open_clip: wall {p['wall_median_s'] / base - 1:+.1%} (median) "
              f"{p['wall_min_s'] / bmin - 1:+.1%} (min), cpu {p['cpu_median_s'] / cbase - 1:+.1%} (median) "
              f"{p['cpu_min_s'] / cmin - 1:+.1%} (min); expected from the extra blocks alone: about "
              f"{n / L_img:.0%} image / {n / L_txt:.0%} text tower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": str(device), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
