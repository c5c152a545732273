#!/usr/bin/env python
"""Benchmark: exact CSD search at scale, in one run (PCME++ App. C.3 vs augmented-vector search).

For each gallery size (default 100K and 1M) it compares, on the same random Gaussian gallery:

1. exact brute force in torch (augmented matmul + top-k; ground truth, checked against
   ``zsprob.prob.score("csd")`` on a subset of queries),
2. FAISS exact (IndexFlatIP on the augmented MIPS vectors),
3. FAISS approximate on the augmented vectors (IVF-Flat and, where built, HNSW, on the L2 form
   q = [mu_v, 0], x = [mu_t, sqrt(s_t)]) -- this approximates CSD itself,
4. the paper's scheme: the same ANN index on the means only, then the K' retrieved candidates
   re-ranked by CSD with the stored s_t (and mean-only without re-ranking, for reference),

reporting recall@10 against exact CSD and queries/s (all single-process, FAISS/torch threads
as given by --threads).

Gallery: ``--clusters`` Gaussian clusters in D dims (mu = centre + within-cluster noise, like
real embeddings, which are clustered); per item log sigma^2 = b_t + 0.1 N(0, 1) per dim with
b_t ~ U(lo, hi), so s_t = ||sigma_t^2||_1 varies by a factor e^(hi-lo) across items and is
comparable to the spread of ||mu_v - mu_t||^2 among a query's neighbours: the mean-only
ranking and the CSD ranking really differ (the script prints how much). Queries come from
the same clusters.

Run: ``nice .venv/bin/python scripts/bench_search.py`` (``--sizes 100000`` for a quick run).
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zsprob.retrieval import search as S  # noqa: E402


def make_data(n, nq, d, clusters, lo, hi, seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d)).astype(np.float32)
    mu = np.empty((n, d), dtype=np.float32)
    s = np.empty(n, dtype=np.float64)
    step = 100_000
    for a in range(0, n, step):
        b = min(n, a + step)
        c = rng.integers(0, clusters, size=b - a)
        mu[a:b] = centres[c] + 0.35 * rng.standard_normal(size=(b - a, d), dtype=np.float32)
        base = rng.uniform(lo, hi, size=(b - a, 1))
        lv = base + 0.1 * rng.standard_normal(size=(b - a, d))
        s[a:b] = np.exp(lv).sum(1)
    cq = rng.integers(0, clusters, size=nq)
    q = (centres[cq] + 0.35 * rng.standard_normal(size=(nq, d), dtype=np.float32)).astype(np.float32)
    return mu, s, q


def timed(fn, n_queries):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    return out, n_queries / dt, dt


def rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def run_size(n, args, rows):
    print(f"\n=== gallery N = {n:,}  (D = {args.dim}, {args.queries} queries, k = {args.k}) ===", flush=True)
    t0 = time.perf_counter()
    mu, s, q = make_data(n, args.queries, args.dim, args.clusters, args.lo, args.hi, args.seed)
    print(f"data: {time.perf_counter() - t0:.1f}s; s_t = ||sigma_t^2||_1 range {s.min():.3g}..{s.max():.3g} "
          f"(median {np.median(s):.3g})", flush=True)
    k = args.k
    nq = len(q)

    def add(method, index, build_s, qps, rec, note=""):
        rows.append(dict(N=n, method=method, index=index, build_s=build_s, qps=qps, recall=rec, note=note))
        print(f"{method:<34} {index:<26} build {build_s:7.1f}s  {qps:10.1f} q/s  recall@{k} {rec:.4f}  {note}",
              flush=True)

    # 1. exact brute force (torch, augmented) = ground truth
    t = time.perf_counter()
    bf = S.build_index(mu, None, kind="torch", var_sum=s)
    b_bf = time.perf_counter() - t
    res, qps_bf, _ = timed(lambda: bf.search(q, None, k), nq)
    exact = res.index
    # check the ground truth against zsprob.prob.score("csd") on a subset (logvar reproducing s_t)
    m = min(50, nq)
    lv = np.repeat(np.log(s / args.dim)[:, None], args.dim, 1).astype(np.float32)
    _, ref = S.brute_force_csd(q[:m], None, mu, lv, k, query_chunk=m, gallery_chunk=1 << 18)
    del lv
    add("exact brute force (torch)", "augmented matmul", b_bf, qps_bf, 1.0,
        f"vs prob.score('csd'): recall {S.recall_at_k(exact[:m], ref):.4f}")
    del bf
    gc.collect()

    # 2. FAISS exact
    t = time.perf_counter()
    flat = S.build_index(mu, None, kind="flat", metric="ip", var_sum=s, threads=args.threads)
    b = time.perf_counter() - t
    r, qps, _ = timed(lambda: flat.search(q, None, k), nq)
    add("FAISS exact", "IndexFlatIP (aug. MIPS)", b, qps, S.recall_at_k(r.index, exact))
    del flat
    gc.collect()

    # mean-only ranking (no sigma) for reference: how much does sigma change the top-10?
    mflat = S.build_index(mu, None, kind="flat", metric="l2", threads=args.threads)
    r, qps, _ = timed(lambda: mflat.search(q, None, k), nq)
    add("mean-only exact (no re-rank)", "IndexFlatL2 (means)", 0.0, qps, S.recall_at_k(r.index, exact))
    del mflat
    gc.collect()

    # 3./4. IVF: augmented CSD vs mean-only + re-rank, same nlist / nprobe
    nlist = args.nlist or int(4 * np.sqrt(n))  # default 1024 lists at every size
    t = time.perf_counter()
    ivf = S.build_index(mu, None, kind="ivf", metric="l2", var_sum=s, nlist=nlist, train_size=args.train_size,
                        threads=args.threads, seed=args.seed)
    b_ivf = time.perf_counter() - t
    t = time.perf_counter()
    mivf = S.MeanRerankIndex(mu, None, kind="ivf", nlist=nlist, threads=args.threads, seed=args.seed, var_sum=s)
    mivf.mean_index.params  # noqa: B018
    b_mivf = time.perf_counter() - t
    for nprobe in args.nprobe:
        ivf.set_search_params(nprobe=nprobe)
        r, qps, _ = timed(lambda: ivf.search(q, None, k), nq)
        add("CSD ANN (augmented)", f"IVF{nlist} nprobe={nprobe}", b_ivf, qps, S.recall_at_k(r.index, exact),
            f"{qps / qps_bf:.1f}x brute force")
        mivf.mean_index.set_search_params(nprobe=nprobe)
        for cand in args.candidates:
            mivf.candidates = cand
            r, qps, _ = timed(lambda: mivf.search(q, None, k), nq)
            add("mean-only ANN + sigma re-rank", f"IVF{nlist} nprobe={nprobe} K'={cand}", b_mivf, qps,
                S.recall_at_k(r.index, exact), f"{qps / qps_bf:.1f}x brute force")
    del ivf, mivf
    gc.collect()

    # HNSW (graph build is the slow part on 2 cores; skipped above --hnsw-max)
    if n <= args.hnsw_max:
        t = time.perf_counter()
        h = S.build_index(mu, None, kind="hnsw", metric="l2", var_sum=s, hnsw_m=args.hnsw_m,
                          ef_construction=args.ef_construction, threads=args.threads)
        b_h = time.perf_counter() - t
        t = time.perf_counter()
        mh = S.MeanRerankIndex(mu, None, kind="hnsw", hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
                               threads=args.threads, var_sum=s)
        b_mh = time.perf_counter() - t
        for ef in args.ef_search:
            h.set_search_params(ef_search=ef)
            r, qps, _ = timed(lambda: h.search(q, None, k), nq)
            add("CSD ANN (augmented)", f"HNSW{args.hnsw_m} ef={ef}", b_h, qps, S.recall_at_k(r.index, exact),
                f"{qps / qps_bf:.1f}x brute force")
            # equal cost: the same graph search (efSearch = ef) returns ef mean-only candidates to re-rank
            mh.mean_index.set_search_params(ef_search=ef)
            mh.candidates = ef
            r, qps, _ = timed(lambda: mh.search(q, None, k), nq)
            add("mean-only ANN + sigma re-rank", f"HNSW{args.hnsw_m} ef={ef} K'={ef}", b_mh, qps,
                S.recall_at_k(r.index, exact), f"{qps / qps_bf:.1f}x brute force")
        del h, mh
    else:
        print(f"(HNSW skipped at N = {n:,}: graph build too slow for this machine; raise --hnsw-max to include it)")
    print(f"peak RSS so far: {rss_gb():.2f} GB", flush=True)
    del mu, s, q
    gc.collect()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--clusters", type=int, default=2000)
    p.add_argument("--lo", type=float, default=-6.0, help="min per-item log sigma^2 level")
    p.add_argument("--hi", type=float, default=-1.5, help="max per-item log sigma^2 level")
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--candidates", type=int, nargs="+", default=[10, 50, 200])
    p.add_argument("--train-size", type=int, default=50_000)
    p.add_argument("--hnsw-max", type=int, default=200_000)
    p.add_argument("--hnsw-m", type=int, default=16)
    p.add_argument("--ef-construction", type=int, default=40)
    p.add_argument("--ef-search", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import faiss

    faiss.omp_set_num_threads(args.threads)
    print(f"bench_search: torch {torch.__version__}, faiss {faiss.__version__}, threads {args.threads}, "
          f"cpu count {os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}")
    rows = []
    t = time.perf_counter()
    for n in args.sizes:
        run_size(n, args, rows)
    print(f"\ntotal {time.perf_counter() - t:.0f}s, peak RSS {rss_gb():.2f} GB")
    print("\n| N | method | index | build s | queries/s | recall@10 | note |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']:,} | {r['method']} | {r['index']} | {r['build_s']:.1f} | {r['qps']:.0f} | "
              f"{r['recall']:.4f} | {r['note']} |")


if __name__ == "__main__":
    main()
