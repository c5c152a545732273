"""jWAE's semi-supervised batches: a paired stream plus unpaired image-only and caption-only streams.

A share ``data.paired_fraction`` of SynthWorld's pretraining split keeps its pairing, the rest feeds the
unpaired streams; step ``s``'s draws are seeded by (seed, epoch, s), so a resumed run reads the same batches.
A batch is a dict: ``img`` / ``txt``, ``u_img`` / ``u_txt`` (None without unpaired rows) and ``features``
(True: the frozen tower's features, :class:`FeatureStore`; False: images and tokens, :class:`RawStore`).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from zsprob.errors import UserError
from zsprob.train.data import BatchSource, mixed_seed
from zsprob.utils.host_sync import to_device

__all__ = ["RawStore", "FeatureStore", "SemiSupervisedSource"]

_PAIRED, _U_IMG, _U_TXT = 0x9A11, 0x9A12, 0x9A13


class RawStore:
    """Images and captions prepared on the fly (transform + tokenizer of the model)."""

    features = False

    def __init__(self, items, preprocess, tokenizer):
        self.items, self.preprocess, self.tokenizer = items, preprocess, tokenizer

    def __len__(self) -> int:
        return len(self.items)

    def n_captions(self, i: int) -> int:
        return len(self.items.captions[i])

    def images(self, idx: np.ndarray) -> torch.Tensor:
        from zsprob.data.images import open_rgb
        return torch.stack([self.preprocess(open_rgb(self.items.jpegs[int(i)])) for i in idx])

    def texts(self, idx: np.ndarray, which: np.ndarray) -> torch.Tensor:
        return self.tokenizer([self.items.captions[int(i)][int(c)] for i, c in zip(idx, which)])


class FeatureStore:
    """The frozen tower's features of every image and every caption, computed once."""

    features = True

    def __init__(self, image_feats: torch.Tensor, text_feats: torch.Tensor, n_caps: np.ndarray):
        self.image_feats, self.text_feats, self.n_caps = image_feats, text_feats, n_caps  # text: [N, C, D]

    @classmethod
    def build(cls, model, raw: RawStore, batch_size: int = 256, device=None) -> "FeatureStore":
        """Encode every image and caption of ``raw`` with ``model.image_features`` / ``text_features``."""
        n = len(raw)
        n_caps = np.array([raw.n_captions(i) for i in range(n)])
        c_max = int(n_caps.max())
        device = device or next(model.parameters()).device
        img = torch.cat([model.image_features(to_device(raw.images(np.arange(s, min(n, s + batch_size))), device))
                         for s in range(0, n, batch_size)])
        pairs = [(i, c) for i in range(n) for c in range(c_max)]
        txt = []
        for s in range(0, len(pairs), 4 * batch_size):
            chunk = np.array(pairs[s:s + 4 * batch_size])
            which = np.minimum(chunk[:, 1], n_caps[chunk[:, 0]] - 1)
            txt.append(model.text_features(to_device(raw.texts(chunk[:, 0], which), device)))
        return cls(img.cpu(), torch.cat(txt).view(n, c_max, -1).cpu(), n_caps)  # read back once

    @classmethod
    def cached(cls, path, fingerprint: dict, model, raw: RawStore) -> "FeatureStore":
        """The store saved at ``path`` when its fingerprint matches, else built and saved there (atomically)."""
        import json
        from pathlib import Path

        from safetensors import safe_open
        from safetensors.torch import save_file

        from zsprob.utils.io import atomic_write
        key = json.dumps(fingerprint, sort_keys=True)
        path = Path(path)
        if path.is_file():
            try:
                with safe_open(str(path), framework="pt") as f:
                    if (f.metadata() or {}).get("fingerprint") == key:
                        return cls(f.get_tensor("image"), f.get_tensor("text"), f.get_tensor("n_caps").numpy())
            except Exception:  # noqa: BLE001 - an unreadable cache is rebuilt
                pass
        store = cls.build(model, raw)
        tensors = {"image": store.image_feats.contiguous(), "text": store.text_feats.contiguous(),
                   "n_caps": torch.as_tensor(store.n_caps, dtype=torch.long)}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"fingerprint": key}))
        return store

    def __len__(self) -> int:
        return self.image_feats.shape[0]

    def n_captions(self, i: int) -> int:
        return int(self.n_caps[i])

    def images(self, idx: np.ndarray) -> torch.Tensor:
        return self.image_feats[torch.as_tensor(idx, dtype=torch.long)]

    def texts(self, idx: np.ndarray, which: np.ndarray) -> torch.Tensor:
        return self.text_feats[torch.as_tensor(idx, dtype=torch.long), torch.as_tensor(which, dtype=torch.long)]


class SemiSupervisedSource(BatchSource):
    """Paired batches of ``batch_size`` rows plus ``unpaired_batch_size`` unpaired images and captions."""

    def __init__(self, store, paired: np.ndarray, unpaired: np.ndarray, *, batch_size: int,
                 unpaired_batch_size: int, use_unpaired: bool, seed: int):
        if len(paired) < batch_size:
            raise UserError(f"the paired set has {len(paired)} samples, fewer than the batch size {batch_size} "
                            "(raise data.paired_fraction or lower --batch-size)")
        self.store, self.paired = store, np.asarray(paired)
        self.unpaired = np.asarray(unpaired) if use_unpaired else np.zeros(0, dtype=np.int64)
        self.local_batch_size = int(batch_size)
        self.unpaired_batch_size = min(int(unpaired_batch_size), len(self.unpaired))
        self.seed = int(seed)
        self.steps_per_epoch = len(self.paired) // self.local_batch_size

    def _captions(self, rng: np.random.Generator, idx: np.ndarray) -> np.ndarray:
        return np.array([rng.integers(self.store.n_captions(int(i))) for i in idx])

    def batch(self, epoch: int, s: int, order: np.ndarray) -> dict:
        B = self.local_batch_size
        idx = order[s * B:(s + 1) * B]
        rng = np.random.default_rng(mixed_seed(self.seed, epoch, s, _PAIRED))
        out = {"img": self.store.images(idx), "txt": self.store.texts(idx, self._captions(rng, idx)),
               "u_img": None, "u_txt": None, "features": self.store.features}
        if self.unpaired_batch_size > 0:
            r_img = np.random.default_rng(mixed_seed(self.seed, epoch, s, _U_IMG))
            r_txt = np.random.default_rng(mixed_seed(self.seed, epoch, s, _U_TXT))
            u_i = r_img.choice(self.unpaired, self.unpaired_batch_size, replace=False)
            u_t = r_txt.choice(self.unpaired, self.unpaired_batch_size, replace=False)
            out["u_img"] = self.store.images(u_i)
            out["u_txt"] = self.store.texts(u_t, self._captions(r_txt, u_t))
        return out

    def epoch_batches(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        order = np.random.default_rng(mixed_seed(self.seed, epoch, _PAIRED)).permutation(self.paired)
        for s in range(skip, self.steps_per_epoch):
            yield self.batch(epoch, s, order)

    def stats(self) -> dict:
        return {"paired": int(len(self.paired)), "unpaired": int(len(self.unpaired))}
