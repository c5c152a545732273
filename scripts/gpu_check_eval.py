"""The device-side pieces of scripts/gpu_check.py's evaluation section: seeded random images made on the
device, their embeddings and the captions', CSD top-k in both directions, recall, a ranking comparison
that forgives the order of exact ties, and zsprob's own CPU evaluation of the same embeddings."""
from __future__ import annotations

import time

from gpu_check_record import figure


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def eval_images(n: int, size: int, device: str, chunk: int = 250):
    """Random images, generated chunk by chunk on ``device`` (seeded): the same on every call."""
    import torch
    for i, a in enumerate(range(0, n, chunk)):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        yield torch.randn(min(chunk, n - a), 3, size, size, generator=g, device=device)


def encode_all(model, n_images: int, tokens, device: str, bf16: bool, batch: int = 250):
    """(img_mu, img_lv, cap_mu, cap_lv) on ``device`` and the seconds it took."""
    import torch
    sync(device)
    t = time.perf_counter()
    parts: list[list] = [[], [], [], []]
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
        for images in eval_images(n_images, model.image_size or 224, device):
            mu, lv = model.encode_image(images)
            parts[0].append(mu.float())
            parts[1].append(lv.float())
        for a in range(0, len(tokens), batch * 4):
            mu, lv = model.encode_text(tokens[a:a + batch * 4].to(device))
            parts[2].append(mu.float())
            parts[3].append(lv.float())
    out = [torch.cat(p) for p in parts]
    sync(device)
    return out, time.perf_counter() - t


def rank_both(emb: list, k: int, device: str, dtype):
    """CSD top-k of both directions on ``device`` from ``emb`` (cast to ``dtype``): indices and seconds."""
    from zsprob.retrieval.scoring import chunked_topk
    img_mu, img_lv, cap_mu, cap_lv = (e.to(device=device, dtype=dtype) for e in emb)
    sync(device)
    t = time.perf_counter()
    i2t = chunked_topk("csd", img_mu, img_lv, cap_mu, cap_lv, k)[1]
    t2i = chunked_topk("csd", cap_mu, cap_lv, img_mu, img_lv, k)[1]
    return (i2t, t2i), time.perf_counter() - t


def recalls(ranked, positives, ks=(1, 5, 10)) -> dict:
    from zsprob.retrieval.metrics import metrics_from_ranking
    res = metrics_from_ranking(ranked, positives, ks=ks, r_metrics=False)
    return {key: float(v.mean()) * 100 for key, v in res.values.items()}


def eval_rank(c, emb: list, n_img: int, figs: list) -> dict:
    import numpy as np
    import torch

    from zsprob.retrieval.metrics import positives_from_assignment
    cap_img = np.repeat(np.arange(n_img), 5)
    i2t_pos = positives_from_assignment(cap_img, n_img)
    t2i_pos = i2t_pos.T.tocsr()
    emb_cpu = [e.cpu() for e in emb]
    metrics = {}
    for dtype in (torch.float32, torch.float64):
        tag = str(dtype).split(".")[-1]
        (d_i2t, d_t2i), d_s = rank_both(emb, c.sizes.eval_k, c.device, dtype)
        (c_i2t, c_t2i), c_s = rank_both(emb_cpu, c.sizes.eval_k, "cpu", dtype)
        figs.append(figure(f"CSD top-{c.sizes.eval_k} both directions, {tag}, {c.device}", round(d_s, 3), "s"))
        figs.append(figure(f"CSD top-{c.sizes.eval_k} both directions, {tag}, CPU", round(c_s, 3), "s"))
        same = float(torch.cat([(d_i2t == c_i2t).all(1), (d_t2i == c_t2i).all(1)]).float().mean())
        tied = float(torch.cat([same_up_to_ties(d_i2t, c_i2t, emb_cpu, False),
                                same_up_to_ties(d_t2i, c_t2i, emb_cpu, True)]).float().mean())
        tol = 0.999 if dtype == torch.float64 else 0.99
        figs.append(figure(f"{tag} ranked lists identical, {c.device} vs CPU", same, "fraction of queries",
                           note="exact ties (repeated captions) may be ordered differently by each device"))
        figs.append(figure(f"{tag} ranked lists identical up to exact ties, {c.device} vs CPU", tied,
                           "fraction of queries", f">= {tol}", tied >= tol,
                           note="the float64 CSD of each listed pair, rank by rank, equal to 1e-12 relative"))
        dev_m = {**{f"i2t {k}": v for k, v in recalls(d_i2t, i2t_pos).items()},
                 **{f"t2i {k}": v for k, v in recalls(d_t2i, t2i_pos).items()}}
        cpu_m = {**{f"i2t {k}": v for k, v in recalls(c_i2t, i2t_pos).items()},
                 **{f"t2i {k}": v for k, v in recalls(c_t2i, t2i_pos).items()}}
        diff = max(abs(dev_m[k] - cpu_m[k]) for k in dev_m)
        mtol = 0.0 if dtype == torch.float64 else 0.1
        figs.append(figure(f"{tag} R@1/5/10 both directions, {c.device} vs CPU", diff, "max |diff|, percentage points",
                           f"<= {mtol:g}", diff <= mtol))
        metrics[tag] = dev_m
    return metrics


def same_up_to_ties(dev, cpu, emb: list, captions_first: bool):
    """Per query: the two top-k lists rank the same gallery scores, i.e. they are equal up to the order
    of exactly tied items. The float64 CSD of each listed (query, item) pair is compared rank by rank
    (relative 1e-12), so lists that differ only among repeated, identical captions count as equal."""
    import torch

    from zsprob.prob.distances import csd
    img_mu, img_lv, cap_mu, cap_lv = (e.cpu().double() for e in emb)
    q_mu, q_lv, g_mu, g_lv = (cap_mu, cap_lv, img_mu, img_lv) if captions_first else (img_mu, img_lv, cap_mu, cap_lv)
    ok = []
    for a in range(0, len(dev), 1024):
        rows = slice(a, a + 1024)
        score = csd(q_mu[rows], q_lv[rows], g_mu, g_lv)  # [chunk, gallery] in float64
        d = score.gather(1, dev[rows].cpu().long())
        c = score.gather(1, cpu[rows].cpu().long())
        ok.append(((d - c).abs() <= 1e-12 * c.abs().clamp_min(1.0)).all(1))
    return torch.cat(ok)


def eval_cpu(emb: list, n_img: int, ref: dict, figs: list) -> None:
    import numpy as np

    from zsprob.retrieval import Embeddings, evaluate_embeddings
    from zsprob.retrieval.benchmarks import BenchmarkSet, RetrievalTask
    from zsprob.retrieval.metrics import positives_from_assignment
    import scipy.sparse as sp
    cap_img = np.repeat(np.arange(n_img), 5)
    pos = positives_from_assignment(cap_img, n_img)
    task = RetrievalTask("coco5k-sized", np.arange(n_img), np.arange(5 * n_img), cap_img,
                         sets=[BenchmarkSet("caption", pos, sp.csr_matrix(pos.T))])
    e = [t.cpu() for t in emb]
    data = Embeddings(image_ids=task.image_ids, caption_ids=task.caption_ids, image_mu=e[0], caption_mu=e[2],
                      image_logvar=e[1], caption_logvar=e[3], caption_image=cap_img)
    t = time.perf_counter()
    res = evaluate_embeddings(data, task, score="csd")
    figs.append(figure("zsprob evaluation (CSD, every metric), CPU", round(time.perf_counter() - t, 3), "s",
                       note=res.metrics.get("setup", {}).get("method", "")))
    got = flat_recalls(res.metrics)
    common = [k for k in ref if k in got]
    diffs = {k: round(got[k] - ref[k], 6) for k in common}
    # float32 scores on both sides, computed differently: near-ties may order a few queries otherwise
    ok = bool(common) and all(abs(diffs[k]) <= 0.1 for k in common)
    figs.append(figure(f"CPU evaluation R@K vs float32 top-k on the device ({len(common)} values)",
                       max((abs(v) for v in diffs.values()), default=float("nan")), "max |diff|, percentage points",
                       "<= 0.1", ok, note=f"differences: {diffs}"))


def flat_recalls(metrics: dict) -> dict:
    """{"i2t r@1": value, ...} from an EvalResult's nested metrics (first recall set)."""
    out = {}

    def walk(d, path):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, path + [str(k)])
            elif isinstance(v, (int, float)) and str(k).lower() in ("r@1", "r@5", "r@10"):
                direction = next((p for p in path if p in ("i2t", "t2i")), None)
                if direction and f"{direction} {k.lower()}" not in out:
                    out[f"{direction} {k.lower()}"] = float(v)
    walk(metrics, [])
    return out
