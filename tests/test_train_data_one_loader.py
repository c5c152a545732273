"""One loader per training source for the whole run: the shard source (WdsSource) and COCO keep one
DataLoader whose persistent workers decode, augment, collate and tokenise; every epoch, with or
without skipped batches, yields exactly the batches of a loader built for that epoch (today's
per-epoch construction), augmentations and any draw from the workers' global generators included;
the worker processes are the same ones from epoch to epoch; page-locked batches for CUDA."""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_data_webdataset import make_shards, random_crop_tensor
from test_train_coco_recipe import _tiny_coco
from zsprob.data.webdataset import build_wds_pipeline
from zsprob.train.data import CocoSource, WdsSource, mixed_seed, pins_memory, shard_options


class RngTokenizer:
    """A tokenizer whose output shows the worker's global generators (torch, random, numpy) and the
    process that tokenised: [len(caption), torch draw, random draw, numpy draw, pid] per caption."""

    def __call__(self, captions):
        rows = [[len(c), int(torch.randint(0, 10 ** 6, (1,))), random.randrange(10 ** 6),
                 int(np.random.randint(10 ** 6)), os.getpid()] for c in captions]
        return torch.tensor(rows, dtype=torch.long)


class CaptionTokenizer:
    """A deterministic tokenizer that also shows the process that tokenised: [len, checksum, pid]
    (COCO tokenised in the main process before; the workers' generators differ from its own)."""

    def __call__(self, captions):
        rows = [[len(c), sum(map(ord, c)), os.getpid()] for c in captions]
        return torch.tensor(rows, dtype=torch.long)


def drop_pid(tokens):
    return tokens[:, :-1]


def assert_same_batches(got, expected):
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        assert len(a) == len(b)
        assert torch.equal(a[0], b[0])                          # images, augmentations included
        assert torch.equal(drop_pid(a[1]), drop_pid(b[1]))      # captions and the workers' generator draws
        for x, y in zip(a[2:], b[2:]):
            assert torch.equal(x, y)


def reseed_main(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def pids(batches):
    return {int(p) for b in batches for p in b[1][:, -1]}


# ----------------------------------------------------------------------------- shards

@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("one_loader"), n_shards=4, corrupt=True)[0]


def wds_options(workers, **over):
    data = SimpleNamespace(kind="webdataset", get=lambda key, default=None: {"num_workers": workers}.get(key, default))
    return shard_options(data, 3, 11, 36, **over)


def fresh_epoch(shards, options, epoch, skip):
    """Today's behaviour: a pipeline built for the epoch, starting after ``skip`` batches."""
    loader = build_wds_pipeline(shards, options, preprocess=random_crop_tensor, tokenizer=RngTokenizer(),
                                epoch=epoch, skip_batches=skip)
    return [(images, tokens) for images, tokens in loader if images.shape[0] == options.batch_size]


@pytest.mark.parametrize("workers", [0, 2])
def test_one_shard_loader_yields_the_per_epoch_batches_with_the_same_workers(shard_dir, workers):
    options = wds_options(workers)
    source = WdsSource(shard_dir, options, preprocess=random_crop_tensor, tokenizer=RngTokenizer())
    assert source.steps_per_epoch == 12
    seen_pids = []
    for epoch, skip in ((0, 0), (1, 5), (2, 0)):
        reseed_main(epoch)  # without workers the tokenizer draws from this process's generators
        got = list(source.epoch_batches(epoch, skip))
        reseed_main(epoch)
        assert_same_batches(got, fresh_epoch(shard_dir, options, epoch, skip))
        assert len(got) == 12 - skip
        seen_pids.append(pids(got))
    assert source.loader.loaders_made == 1
    if workers:  # the same two worker processes served every epoch
        assert len(seen_pids[0]) == 2 and seen_pids[0] == seen_pids[1] == seen_pids[2]
        assert os.getpid() not in seen_pids[0]
    else:
        assert seen_pids == [{os.getpid()}] * 3
    stats = source.stats()
    assert stats["skipped_batches"] == 5 and stats["batches"] == 36 - 5 and "epoch" not in stats


def test_an_epoch_left_midway_does_not_leak_into_the_next(shard_dir):
    """The training cursor stops reading an epoch when its step count is reached; the next epoch
    (here also a resume with skip) still equals a loader built for it."""
    options = wds_options(2)
    source = WdsSource(shard_dir, options, preprocess=random_crop_tensor, tokenizer=RngTokenizer())
    it = source.epoch_batches(3)
    first = [next(it) for _ in range(4)]
    assert_same_batches(first, fresh_epoch(shard_dir, options, 3, 0)[:4])
    got = list(source.epoch_batches(4, 2))
    del it
    assert_same_batches(got, fresh_epoch(shard_dir, options, 4, 2))
    assert_same_batches(list(source.epoch_batches(3)), fresh_epoch(shard_dir, options, 3, 0))
    assert source.loader.loaders_made == 1


def test_pinned_batches_for_cuda_only(shard_dir):
    assert pins_memory("cuda") and pins_memory(torch.device("cuda", 1))
    assert not pins_memory("cpu") and not pins_memory(None) and not pins_memory("meta")
    assert wds_options(0, pin_memory=True).pin_memory and not wds_options(0).pin_memory
    source = WdsSource(shard_dir, wds_options(0), preprocess=random_crop_tensor, tokenizer=RngTokenizer())
    source.configure(device=torch.device("cuda"))
    assert source.loader.pin_memory
    source.configure(device="cpu")
    assert not source.loader.pin_memory
    next(source.epoch_batches(0))
    dataloader = source.loader._dataloader().pipeline[0]
    assert dataloader.pin_memory is False and source.loader.loaders_made == 1


# ----------------------------------------------------------------------------- COCO

def ref_coco_epoch_batches(source, epoch, skip=0):
    """Today's CocoSource.epoch_batches (a DataLoader per epoch, collation and tokenisation in the
    main process), verbatim but for the names, over the same dataset."""
    def collate(items):
        images = [x[0] for x in items if x[2]]
        texts = [x[1] for x in items if x[2]]
        ids = [x[3] for x in items if x[2]]
        return images, texts, ids, sum(1 for x in items if not x[2])

    n = len(source.dataset)
    perm = np.random.default_rng(mixed_seed(source.seed, epoch, 0xC0C0)).permutation(n)
    B, b = source.global_batch_size, source.local_batch_size
    idx_batches = [perm[s * B + source.rank * b: s * B + (source.rank + 1) * b].tolist()
                   for s in range(skip, source.steps_per_epoch)]
    loader = torch.utils.data.DataLoader(source.dataset, batch_sampler=idx_batches, num_workers=source.num_workers,
                                         collate_fn=collate, persistent_workers=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mixed_seed(source.seed, epoch, skip, source.rank))
        it = iter(loader)
    for images, texts, ids, bad in it:
        if not images:
            continue
        while len(images) < b:
            images.append(images[len(images) % max(1, len(images))])
            texts.append(texts[len(texts) % max(1, len(texts))])
            ids.append(ids[len(ids) % max(1, len(ids))])
        yield torch.stack(images), source.tokenizer(texts), torch.tensor(ids, dtype=torch.long)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco_one_loader")
    _tiny_coco(root, n_train=6, n_val=0)  # 30 captions
    from PIL import Image
    rng = np.random.default_rng(0)
    for path in sorted((root / "train2014").glob("*.jpg")):  # texture: every random crop shows
        Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(path)
    (root / "train2014" / "COCO_train2014_000000000004.jpg").write_bytes(b"not a jpeg")  # 5 unreadable
    return root


def coco_source(root, workers, rank=0, world=1):
    return CocoSource(root, preprocess=random_crop_tensor, tokenizer=CaptionTokenizer(), global_batch_size=8,
                      rank=rank, world=world, seed=5, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_one_coco_loader_equals_todays_per_epoch_loader(coco_root, workers):
    source, reference = coco_source(coco_root, workers), coco_source(coco_root, workers)
    assert source.steps_per_epoch == 3
    iterators = set()
    for epoch, skip in ((0, 0), (1, 1), (2, 0), (3, 2)):
        if workers == 0:  # the main process augments: both runs start from the same global state
            reseed_main(epoch)
            expected = list(ref_coco_epoch_batches(reference, epoch, skip))
            reseed_main(epoch)
            got = list(source.epoch_batches(epoch, skip))
        else:
            expected = list(ref_coco_epoch_batches(reference, epoch, skip))
            got = list(source.epoch_batches(epoch, skip))
            iterators.add(id(source._loader._iterator))
            worker_pids = {w.pid for w in source._loader._iterator._workers}
            if epoch == 0:
                first_pids = worker_pids
            assert worker_pids == first_pids and all(w.is_alive() for w in source._loader._iterator._workers)
        assert_same_batches(got, expected)
        assert len(got) == 3 - skip and all(b[0].shape[0] == 8 for b in got)
    assert source.bad > 0  # the unreadable image's captions were replaced (counted)
    if workers:
        assert len(iterators) == 1 and len(first_pids) == 2 and pids(got) <= first_pids  # tokenised there


def test_coco_collates_and_tokenises_in_the_workers(coco_root):
    source = coco_source(coco_root, 2, rank=1, world=2)
    batches = list(source.epoch_batches(0))
    assert len(batches) == 3 and all(b[0].shape[0] == 4 for b in batches)
    assert os.getpid() not in pids(batches)  # the tokenizer ran in the worker processes
    source.configure(device="cuda")
    assert source.pin_memory


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_training_image_is_named_once_and_counted(coco_root, workers):
    """The batch goes on with copies of a readable sample (the official recipe's loader would raise); the user
    is told once, with the file, and the count grows in metrics.jsonl / summary.json (``stats``)."""
    import warnings
    source = coco_source(coco_root, workers)
    with pytest.warns(UserWarning, match=r"unreadable training image .*COCO_train2014_000000000004\.jpg"):
        list(source.epoch_batches(0))
    first = source.bad
    assert first > 0 and source.stats() == {"bad_images": first}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not named again
        list(source.epoch_batches(1))
    assert source.bad > first
