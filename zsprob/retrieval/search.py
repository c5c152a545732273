"""Exact (and approximate) CSD search over large galleries.

For a fixed query, ranking by CSD is nearest-neighbour search on augmented vectors (docs/retrieval.md), so an
exact index returns the exact CSD ranking; :class:`MeanRerankIndex` (PCME++ App. C.3: mean-only, re-ranked by
CSD) is the baseline. FAISS (faiss-cpu, imported lazily) does the indexes; zsprob writes the augmentation, the
torch brute-force path, the conversion back to CSD and the on-disk layout (:mod:`zsprob.retrieval.index_format`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.retrieval.index_format import FORMAT_VERSION, KINDS, METRICS, backend_file, default_metric

#: the most neighbours a FAISS GPU index returns per query
GPU_MAX_K = 2048


def _faiss():
    try:
        import faiss  # noqa: F401
    except ImportError:
        raise UserError("FAISS is not installed: pip install faiss-cpu (or zsprob[faiss]); "
                        "kind='torch' gives exact search without it") from None
    return faiss


def _faiss_gpu(faiss, device) -> bool:
    """Whether a faiss index goes to ``device``: a CUDA device and a faiss built with GPUs."""
    return device is not None and torch.device(device).type == "cuda" and \
        getattr(faiss, "get_num_gpus", lambda: 0)() > 0


def _np32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def variance_sum(logvar, n: int) -> np.ndarray:
    """s = ||sigma^2||_1 per row (zeros when ``logvar`` is None: deterministic embeddings)."""
    if logvar is None:
        return np.zeros(n, dtype=np.float64)
    lv = np.asarray(logvar.detach().cpu().numpy() if isinstance(logvar, torch.Tensor) else logvar, dtype=np.float64)
    return np.exp(lv).sum(1)


def augment_queries(mu, metric: str = "ip") -> np.ndarray:
    """[mu, 1] (ip) or [mu, 0] (l2), float32 [N, D+1]."""
    mu = _np32(mu)
    extra = np.ones if metric == "ip" else np.zeros
    return np.ascontiguousarray(np.concatenate([mu, extra((mu.shape[0], 1), dtype=np.float32)], 1))


def augment_gallery(mu, logvar, metric: str = "ip", *, var_sum: np.ndarray | None = None) -> np.ndarray:
    """[2 mu, -(||mu||^2 + s)] (ip) or [mu, sqrt(s)] (l2), float32 [N, D+1]; ``var_sum``: s instead of ``logvar``."""
    mu64 = np.asarray(_np32(mu), dtype=np.float64)
    s = variance_sum(logvar, mu64.shape[0]) if var_sum is None else np.asarray(var_sum, dtype=np.float64)
    if metric == "ip":
        last = -((mu64 ** 2).sum(1) + s)
        out = np.concatenate([2.0 * mu64, last[:, None]], 1)
    elif metric == "l2":
        out = np.concatenate([mu64, np.sqrt(s)[:, None]], 1)
    else:
        raise UserError(f"unknown metric {metric!r} (choose from {', '.join(METRICS)})")
    return np.ascontiguousarray(out, dtype=np.float32)


def to_csd(raw: np.ndarray, q_mu, q_logvar, metric: str) -> np.ndarray:
    """Convert index scores of augmented vectors back to CSD (float64) for the given queries."""
    qmu = np.asarray(_np32(q_mu), dtype=np.float64)
    s_q = variance_sum(q_logvar, qmu.shape[0])[:, None]
    if metric == "ip":
        return (qmu ** 2).sum(1)[:, None] + s_q - raw.astype(np.float64)
    return raw.astype(np.float64) + s_q


@dataclass
class SearchResult:
    """``csd`` [Q, k] (ascending; the query's own s_v included when its logvar was given),
    ``index`` [Q, k] gallery positions, ``ids`` [Q, k] gallery ids (-1 where fewer than k found)."""

    csd: np.ndarray
    index: np.ndarray
    ids: np.ndarray


class CSDIndex:
    """A CSD index over a gallery of Gaussians (mu, logvar). Build with :func:`build_index`."""

    def __init__(self, kind: str, metric: str, dim: int, ids: np.ndarray, params: dict, backend):
        self.kind, self.metric, self.dim = kind, metric, dim
        self.ids = np.asarray(ids, dtype=np.int64)
        self.params = dict(params)
        self.backend = backend  # faiss index, or a float32 torch tensor [N, D+1] (kind "torch")
        self.device = torch.device("cpu")  # where the backend searches
        self._gpu_resources = None  # faiss.StandardGpuResources of a GPU backend (kept alive with it)

    def to(self, device) -> "CSDIndex":
        """Search on ``device`` from now on (kind "torch"; flat and IVF when faiss has GPUs, else they stay on
        the CPU, as HNSW does). Returns self."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if self.kind == "torch":
            self.backend = self.backend.to(device)
            self.device = device
            return self
        faiss = _faiss()
        on_gpu = self._gpu_resources is not None
        if self.kind in ("flat", "ivf") and _faiss_gpu(faiss, device) and not on_gpu:
            self._gpu_resources = faiss.StandardGpuResources()
            self.backend = faiss.index_cpu_to_gpu(self._gpu_resources, device.index or 0, self.backend)
            self.device = device
        elif device.type == "cpu" and on_gpu:
            self.backend, self._gpu_resources = self._cpu_backend(), None
            self.device = device
        return self

    def _cpu_backend(self):
        """The faiss index on the CPU (a copy of a GPU index), for writing."""
        return _faiss().index_gpu_to_cpu(self.backend) if self._gpu_resources is not None else self.backend

    def __len__(self) -> int:
        return len(self.ids)

    def set_search_params(self, *, ef_search: int | None = None, nprobe: int | None = None) -> None:
        if ef_search is not None and self.kind == "hnsw":
            self.backend.hnsw.efSearch = int(ef_search)
            self.params["ef_search"] = int(ef_search)
        if nprobe is not None and self.kind == "ivf":
            if self._gpu_resources is not None:
                _faiss().GpuParameterSpace().set_index_parameter(self.backend, "nprobe", int(nprobe))
            else:
                self.backend.nprobe = int(nprobe)
            self.params["nprobe"] = int(nprobe)

    def search_raw(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Search augmented queries; returns (raw scores, positions) as the backend orders them."""
        if self.kind == "torch":
            return _torch_search(torch.from_numpy(q).to(self.backend.device), self.backend, k, self.metric)
        if self._gpu_resources is not None and k > GPU_MAX_K:
            raise UserError(f"FAISS GPU indexes return at most {GPU_MAX_K} neighbours per query, asked for {k}; "
                            "search on the CPU (--device cpu) for more")
        return self.backend.search(q, k)

    def search(self, q_mu, q_logvar=None, k: int = 10) -> SearchResult:
        """The ``k`` gallery items with the smallest CSD to each query (exact for flat / torch)."""
        qmu = _np32(q_mu)
        if qmu.ndim != 2 or qmu.shape[1] != self.dim:
            raise UserError(f"queries have shape {tuple(qmu.shape)}, the index expects dimension {self.dim}")
        k = int(k)
        k_eff = min(k, len(self))
        raw, pos = self.search_raw(augment_queries(qmu, self.metric), k_eff)
        csd = to_csd(raw, qmu, q_logvar, self.metric)
        csd[pos < 0] = np.inf
        if k_eff < k:
            pad = k - k_eff
            csd = np.concatenate([csd, np.full((len(csd), pad), np.inf)], 1)
            pos = np.concatenate([pos, np.full((len(pos), pad), -1)], 1)
        ids = np.where(pos >= 0, self.ids[np.clip(pos, 0, None)], -1)
        return SearchResult(csd=csd, index=pos.astype(np.int64), ids=ids)

    # ------------------------------------------------------------------ persistence
    def save(self, out_dir) -> Path:
        from zsprob.utils.io import atomic_write, atomic_write_json

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        vectors = out / backend_file(self.kind)
        if self.kind == "torch":
            atomic_write(vectors, lambda tmp: np.save(open(tmp, "wb"), self.backend.cpu().numpy()))
        else:
            faiss = _faiss()
            atomic_write(vectors, lambda tmp: faiss.write_index(self._cpu_backend(), tmp))
        atomic_write(out / "ids.npy", lambda tmp: np.save(open(tmp, "wb"), self.ids))
        atomic_write_json(out / "index.json", {"format": "zsprob-csd-index", "version": FORMAT_VERSION,
                                               "kind": self.kind, "metric": self.metric, "dim": self.dim,
                                               "size": len(self), "params": self.params})
        return out


def _is_count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _read_meta(d: Path) -> dict:
    """index.json, its required keys and their types checked (one line naming the file and key)."""
    from zsprob.utils.io import read_json

    f = d / "index.json"
    meta = read_json(f, "index metadata (index.json)")
    if not isinstance(meta, dict) or meta.get("format") != "zsprob-csd-index":
        raise UserError(f"{f} is not a zsprob CSD index description (no \"format\": \"zsprob-csd-index\")")
    missing = [k for k in ("kind", "metric", "dim", "size") if k not in meta]
    if missing:
        raise UserError(f"{f} lacks {', '.join(missing)}; rebuild the index with `zsprob index build`")
    version = meta.get("version", FORMAT_VERSION)
    if not _is_count(version, 1) or version > FORMAT_VERSION:
        raise UserError(f"{f}: version {version!r} is not one this zsprob reads (up to {FORMAT_VERSION})")
    for key, allowed in (("kind", KINDS), ("metric", METRICS)):
        if meta[key] not in allowed:
            raise UserError(f"{f}: {key} {meta[key]!r} is not one of {', '.join(allowed)}")
    for key, low in (("dim", 1), ("size", 1)):
        if not _is_count(meta[key], low):
            raise UserError(f"{f}: {key} must be an integer >= {low}, got {meta[key]!r}")
    params = meta.setdefault("params", {})
    if not isinstance(params, dict):
        raise UserError(f"{f}: params must be an object, got {params!r}")
    for key in ("ef_search", "nprobe", "nlist", "hnsw_m"):
        if key in params and not _is_count(params[key], 1):
            raise UserError(f"{f}: params.{key} must be an integer >= 1, got {params[key]!r}")
    return meta


def _check_gallery(meta: dict, gallery: np.ndarray, f: Path) -> None:
    """gallery.npy of a "torch" index against index.json: float [size, dim + 1], and the last column's sign
    that the metric's augmentation gives (ip: -(||mu||^2 + s) <= 0; l2: sqrt(s) >= 0)."""
    want = (meta["size"], meta["dim"] + 1)
    if gallery.dtype.kind != "f" or gallery.shape != want:
        raise UserError(f"{f} holds a {gallery.dtype} array of shape {gallery.shape}; index.json (size "
                        f"{meta['size']}, dim {meta['dim']}) needs float vectors of shape {want}")
    last = gallery[:, -1]
    if (meta["metric"] == "ip" and (last > 0).any()) or (meta["metric"] == "l2" and (last < 0).any()):
        other = "l2" if meta["metric"] == "ip" else "ip"
        raise UserError(f"{f} holds {other}-augmented vectors but index.json says metric {meta['metric']!r}")


#: the FAISS index class each kind is written as
_FAISS_CLASS = {"flat": "IndexFlat", "hnsw": "IndexHNSWFlat", "ivf": "IndexIVFFlat"}


def _check_faiss(meta: dict, index, f: Path) -> None:
    """index.faiss against index.json: class (kind), metric, vector dimension (dim + 1), size, IVF lists."""
    faiss = _faiss()
    cls = _FAISS_CLASS[meta["kind"]]
    if not isinstance(index, getattr(faiss, cls)):
        raise UserError(f"{f} holds a FAISS {type(index).__name__}, but index.json says kind {meta['kind']!r} ({cls})")
    metric = {faiss.METRIC_INNER_PRODUCT: "ip", faiss.METRIC_L2: "l2"}.get(index.metric_type, str(index.metric_type))
    if metric != meta["metric"]:
        raise UserError(f"{f} uses metric {metric!r}, but index.json says metric {meta['metric']!r}")
    if index.d != meta["dim"] + 1:
        raise UserError(f"{f} holds vectors of dimension {index.d} (embedding dim {index.d - 1}), but index.json "
                        f"says dim {meta['dim']}")
    if index.ntotal != meta["size"]:
        raise UserError(f"{f} holds {index.ntotal} vectors, but index.json says size {meta['size']}")
    nlist = meta["params"].get("nlist")
    if meta["kind"] == "ivf" and nlist is not None and index.nlist != nlist:
        raise UserError(f"{f} has {index.nlist} inverted lists, but index.json says nlist {nlist}")


def _read_file(f: Path, read, missing: str = ""):
    """``read(f)``, a missing or unreadable index file being one :class:`UserError` line."""
    if not f.is_file():
        raise UserError(f"index file not found: {f}{missing}")
    try:
        return read(f)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot read index file {f}: {e}") from None


def _read_backend(d: Path, meta: dict):
    """The index's vectors (gallery.npy, a torch tensor) or its FAISS index, checked against index.json."""
    f = d / backend_file(meta["kind"])
    read = (lambda p: np.load(p, allow_pickle=False)) if meta["kind"] == "torch" else (
        lambda p: _faiss().read_index(str(p)))
    backend = _read_file(f, read, f" (index.json says kind {meta['kind']!r})")
    if meta["kind"] == "torch":
        _check_gallery(meta, backend, f)
        return torch.from_numpy(np.ascontiguousarray(backend, dtype=np.float32))
    _check_faiss(meta, backend, f)
    return backend


def load_index(path, device=None) -> CSDIndex:
    """Load an index written by :meth:`CSDIndex.save` (moved to ``device`` if given), index.json checked against
    the files beside it: a disagreement is one :class:`UserError` line rather than wrong neighbours."""
    from zsprob.errors import require_dir
    from zsprob.retrieval.embeddings import check_ids

    d = require_dir(path, "index directory", "build one with `zsprob index build`")
    meta = _read_meta(d)
    f = d / "ids.npy"
    ids = check_ids(_read_file(f, lambda p: np.load(p, allow_pickle=False)), str(f), "ids")
    if len(ids) != meta["size"]:
        raise UserError(f"{f} holds {len(ids)} ids, but index.json says size {meta['size']}")
    backend = _read_backend(d, meta)
    idx = CSDIndex(meta["kind"], meta["metric"], meta["dim"], ids, meta["params"], backend)
    idx.set_search_params(ef_search=meta["params"].get("ef_search"), nprobe=meta["params"].get("nprobe"))
    return idx.to(device) if device is not None else idx


def build_index(mu, logvar=None, *, kind: str = "flat", metric: str | None = None, ids=None,
                hnsw_m: int = 32, ef_construction: int = 80, ef_search: int = 64,
                nlist: int | None = None, nprobe: int = 16, train_size: int = 100_000,
                threads: int | None = None, seed: int = 0, var_sum: np.ndarray | None = None,
                device=None) -> CSDIndex:
    """Index a gallery for CSD search (``kind``, ``metric``: :mod:`zsprob.retrieval.index_format`). IVF trains
    its k-means on up to ``train_size`` vectors; ``var_sum`` [N] may replace ``logvar`` (only s = ||sigma^2||_1
    enters CSD ranking); ``device``: where the index is trained, filled and searched (default the CPU)."""
    if kind not in KINDS:
        raise UserError(f"unknown index kind {kind!r} (choose from {', '.join(KINDS)})")
    metric = metric or default_metric(kind)
    mu_np = _np32(mu)
    if mu_np.ndim != 2 or mu_np.shape[0] == 0:
        raise UserError(f"gallery means must be a non-empty [N, D] array, got shape {tuple(mu_np.shape)}")
    n, d = mu_np.shape
    if logvar is not None and tuple(np.shape(logvar)) != (n, d):
        raise UserError(f"gallery logvar has shape {tuple(np.shape(logvar))}, expected {(n, d)}")
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if len(ids) != n:
        raise UserError(f"{len(ids)} ids for {n} gallery items")
    x = augment_gallery(mu_np, logvar, metric, var_sum=var_sum)
    del mu_np
    params: dict = {}
    if kind == "torch":
        return CSDIndex(kind, metric, d, ids, params, torch.from_numpy(x)).to(device)
    faiss = _faiss()
    if threads:
        faiss.omp_set_num_threads(int(threads))
    fm = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    if kind == "flat":
        index = faiss.IndexFlatIP(d + 1) if metric == "ip" else faiss.IndexFlatL2(d + 1)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d + 1, int(hnsw_m), fm)
        index.hnsw.efConstruction = int(ef_construction)
        index.hnsw.efSearch = int(ef_search)
        params.update(hnsw_m=int(hnsw_m), ef_construction=int(ef_construction), ef_search=int(ef_search))
    else:
        nlist = _ivf_lists(nlist, n, train_size)
        quantizer = faiss.IndexFlatIP(d + 1) if metric == "ip" else faiss.IndexFlatL2(d + 1)
        index = faiss.IndexIVFFlat(quantizer, d + 1, nlist, fm)
        index.nprobe = int(min(nprobe, nlist))
        params.update(nlist=nlist, nprobe=int(min(nprobe, nlist)))
    out = CSDIndex(kind, metric, d, ids, params, index).to(device)  # GPU copy (untrained / empty) where it applies
    if kind == "ivf":
        rng = np.random.default_rng(seed)
        out.backend.train(x if n <= train_size else x[np.sort(rng.choice(n, size=train_size, replace=False))])
    out.backend.add(x)
    return out


def default_nlist(n: int) -> int:
    """About 4 sqrt(N) inverted lists, and no more than N / 39 (FAISS wants 39 training vectors per list)."""
    return max(1, min(n // 39, int(4 * np.sqrt(n))))


def _ivf_lists(nlist: int | None, n: int, train_size: int) -> int:
    """``nlist`` as given, or :func:`default_nlist`; one above the number of training vectors (k-means makes no
    more centroids than points) is refused rather than lowered to lists the user did not ask for."""
    if nlist is None:
        return default_nlist(n)
    nlist, most = int(nlist), min(n, int(train_size))
    if nlist < 1:
        raise UserError(f"nlist must be >= 1, got {nlist}")
    if nlist > most:
        size = f"{n} items" + (f", {most} of them train the lists" if most < n else "")
        raise UserError(f"nlist {nlist} is larger than the gallery ({size}): IVF needs a training vector per "
                        f"list, so use nlist <= {most} (the default for this gallery is {default_nlist(n)})")
    return nlist


def _torch_search(q: torch.Tensor, gallery: torch.Tensor, k: int, metric: str, chunk: int = 1024):
    vals, pos = [], []
    g_sq = (gallery ** 2).sum(1) if metric == "l2" else None
    for a in range(0, q.shape[0], chunk):
        s = q[a:a + chunk] @ gallery.T
        if metric == "l2":  # ||q - x||^2 = ||q||^2 + ||x||^2 - 2 q.x; rank by -(||x||^2 - 2 q.x)
            s = 2 * s - g_sq[None, :]
        v, i = s.topk(k, dim=1)
        if metric == "l2":
            v = (q[a:a + chunk] ** 2).sum(1, keepdim=True) - v
        vals.append(v.cpu())
        pos.append(i.cpu())
    return torch.cat(vals).numpy(), torch.cat(pos).numpy()


def brute_force_csd(q_mu, q_logvar, g_mu, g_logvar, k: int = 10, *, query_chunk: int = 256,
                    gallery_chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by CSD with ``zsprob.prob.score`` (the reference ranking): (csd [Q, k] ascending, positions)."""
    from zsprob.retrieval.scoring import chunked_topk

    qmu, gmu = torch.as_tensor(_np32(q_mu)), torch.as_tensor(_np32(g_mu))
    qlv = None if q_logvar is None else torch.as_tensor(_np32(q_logvar))
    glv = None if g_logvar is None else torch.as_tensor(_np32(g_logvar))
    if qlv is None and glv is None:
        v, i = chunked_topk("mean", qmu, None, gmu, None, k, query_chunk=query_chunk, gallery_chunk=gallery_chunk)
    else:
        qlv = torch.full_like(qmu, -30.0) if qlv is None else qlv
        glv = torch.full_like(gmu, -30.0) if glv is None else glv
        v, i = chunked_topk("csd", qmu, qlv, gmu, glv, k, query_chunk=query_chunk, gallery_chunk=gallery_chunk)
    return (-v).double().numpy(), i.numpy()


class MeanRerankIndex:
    """PCME++ App. C.3 baseline: a FAISS index on the means (L2), its ``candidates`` nearest re-ranked by CSD."""

    def __init__(self, mu, logvar, *, kind: str = "hnsw", candidates: int = 100, var_sum: np.ndarray | None = None,
                 **index_options):
        self.mean_index = build_index(mu, None, kind=kind, metric="l2", **index_options)  # hnsw_m, nlist, ...
        self.s = variance_sum(logvar, len(self.mean_index)) if var_sum is None else np.asarray(var_sum, np.float64)
        self.candidates = int(candidates)

    def search(self, q_mu, q_logvar=None, k: int = 10) -> SearchResult:
        qmu = _np32(q_mu)
        kc = max(k, self.candidates)
        raw, pos = self.mean_index.search_raw(augment_queries(qmu, "l2"), kc)  # squared L2 of means
        d = raw.astype(np.float64) + np.where(pos >= 0, self.s[np.clip(pos, 0, None)], np.inf)
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        pos = np.take_along_axis(pos, order, 1)
        csd = np.take_along_axis(d, order, 1) + variance_sum(q_logvar, qmu.shape[0])[:, None]
        return SearchResult(csd=csd, index=pos, ids=np.where(pos >= 0, self.mean_index.ids[np.clip(pos, 0, None)], -1))


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean |found_i ∩ exact_i| / k over queries (k = exact.shape[1])."""
    k = exact.shape[1]
    hit = (found[:, :, None] == exact[:, None, :]).any(2).sum(1)
    return float(hit.mean() / k)
