"""WebDataset shard pipeline on tiny RedCaps-style shards generated here, with broken data."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from zsprob.errors import UserError
from zsprob.data.webdataset import (build_wds_pipeline, clean_caption, clean_redcaps_caption,
                                    expand_shards)

N_SHARDS = 5
PER_SHARD = 6


def _jpg(color, size=24) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (size, size), color).save(b, "JPEG")
    return b.getvalue()


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def make_shards(root: Path, n_shards=N_SHARDS, per=PER_SHARD, prefix="", corrupt=True):
    """img2dataset layout: KEY.jpg, KEY.txt, KEY.json. Returns (pattern, good keys).

    With ``corrupt``: shard 0 sample 1 has undecodable JPEG bytes, shard 1 sample 2 an empty
    caption, shard 1 sample 4 no caption member, shard 2 is truncated inside sample 4's
    image, and the pattern names one shard more than exists (a missing shard).
    """
    root.mkdir(parents=True, exist_ok=True)
    good = []
    for s in range(n_shards):
        path = root / f"{prefix}{s:06d}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(per):
                key = f"{prefix}s{s}_{i:03d}"
                img = _jpg(((s * 50) % 255, (i * 40) % 255, 90))
                cap = f"[OC] itap of a thing number {s} {i} \U0001F600"
                bad = False
                if corrupt and s == 0 and i == 1:
                    img, bad = b"\xff\xd8\xff\xe0 this is not a jpeg" * 4, True
                if corrupt and s == 1 and i == 2:
                    cap, bad = "  \t ", True
                _add(tf, key + ".jpg", img)
                if not (corrupt and s == 1 and i == 4):
                    _add(tf, key + ".txt", cap.encode())
                else:
                    bad = True
                _add(tf, key + ".json", json.dumps({"subreddit": f"sub{s}", "key": key}).encode())
                if not bad and not (corrupt and s == 2 and i >= 4):
                    good.append(key)
        if corrupt and s == 2:
            with tarfile.open(path) as tf:
                m = tf.getmember(f"{prefix}s2_004.jpg")
                cut = m.offset_data + 10
            data = path.read_bytes()[:cut]
            path.write_bytes(data)
    last = n_shards if corrupt else n_shards - 1
    return str(root / f"{prefix}{{000000..{last:06d}}}.tar"), good


def to_tensor(img):
    return torch.from_numpy(__import__("numpy").asarray(img, dtype="float32")).permute(2, 0, 1) / 255.0


def random_crop_tensor(img):
    return T.Compose([T.RandomResizedCrop(16, scale=(0.3, 1.0)), T.ToTensor()])(img)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("redcaps"))


def _keys(loader):
    out = []
    for _, _, keys in loader:
        out.extend(keys)
    return out


def test_two_workers_read_every_good_sample_exactly_once_and_count_bad_ones(shards):
    pattern, good = shards
    loader = build_wds_pipeline(pattern, preprocess=to_tensor, tokenizer=None, batch_size=4,
                                num_workers=2, dataset_type="redcaps", with_keys=True, seed=3)
    batches = list(loader)
    keys = [k for _, _, ks in batches for k in ks]
    assert sorted(keys) == sorted(good)          # each good sample exactly once
    assert len(keys) == len(set(keys))
    assert all(b[0].shape[1:] == (3, 24, 24) for b in batches)
    st = loader.stats()
    assert st["samples"] == len(good)
    assert st["bad_image"] == 1
    assert st["empty_caption"] == 1
    assert st["missing_caption"] == 1
    assert st["truncated_shard"] == 1
    assert st["missing_shard"] == 1
    assert st["shards_opened"] == N_SHARDS
    assert st["batches"] == len(batches)
    assert st["skipped_total"] == 5
    assert loader.epoch == 1                     # advanced after a full pass
    # second epoch: same set, different order (seeded, epoch-aware)
    keys2 = _keys(loader)
    assert sorted(keys2) == sorted(good) and keys2 != keys
    assert loader.stats()["samples"] == 2 * len(good)


def test_order_is_a_function_of_seed_and_epoch(shards):
    pattern, _ = shards
    kw = dict(preprocess=to_tensor, tokenizer=None, batch_size=3, num_workers=0, with_keys=True)
    a = _keys(build_wds_pipeline(pattern, seed=1, epoch=2, **kw))
    b = _keys(build_wds_pipeline(pattern, seed=1, epoch=2, **kw))
    c = _keys(build_wds_pipeline(pattern, seed=1, epoch=3, **kw))
    d = _keys(build_wds_pipeline(pattern, seed=2, epoch=2, **kw))
    assert a == b
    assert a != c and a != d
    e = _keys(build_wds_pipeline(pattern, shuffle=False, **kw))
    assert e == sorted(e)                        # shuffle=False: shard order, file order


def test_split_by_node_covers_all_shards_disjointly(shards):
    pattern, good = shards
    per_rank = []
    for rank in range(2):
        loader = build_wds_pipeline(pattern, preprocess=to_tensor, tokenizer=None, batch_size=2,
                                    rank=rank, world_size=2, num_workers=2, with_keys=True, epoch=5)
        per_rank.append(set(_keys(loader)))
        assert loader.world_size == 2 and loader.rank == rank
    assert per_rank[0].isdisjoint(per_rank[1])
    assert per_rank[0] | per_rank[1] == set(good)
    # shard level: the schedule partitions the shard list
    loaders = [build_wds_pipeline(pattern, preprocess=to_tensor, tokenizer=None, batch_size=2,
                                  rank=r, world_size=2) for r in range(2)]
    assigned = [set(l._stream.assigned_shards(w, 2, 7)) for l in loaders for w in range(2)]
    assert sum(len(a) for a in assigned) == N_SHARDS + 1
    assert set().union(*assigned) == set(loaders[0].shards)


def test_rank_from_environment(shards, monkeypatch):
    pattern, _ = shards
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = build_wds_pipeline(pattern, preprocess=to_tensor, tokenizer=None, batch_size=2)
    assert (loader.rank, loader.world_size) == (1, 3)


def test_resampled_fixed_length_and_weights(tmp_path):
    pa, good_a = make_shards(tmp_path / "a", n_shards=3, prefix="a", corrupt=False)
    pb, good_b = make_shards(tmp_path / "b", n_shards=3, prefix="b", corrupt=False)
    loader = build_wds_pipeline(f"{pa}::{pb}", preprocess=to_tensor, tokenizer=None, batch_size=4,
                                resampled=True, num_samples=40, num_workers=2, with_keys=True, seed=0)
    assert loader.num_batches == 10 and len(loader) == 10
    batches = list(loader)
    assert len(batches) == 10 and all(len(k) == 4 for _, _, k in batches)
    keys = [k for _, _, ks in batches for k in ks]
    assert set(keys) <= set(good_a) | set(good_b)
    # sampling weights per source: weight 0 for b -> never read
    only_a = build_wds_pipeline([pa, pb], weights="1::0", preprocess=to_tensor, tokenizer=None,
                                batch_size=4, resampled=True, num_samples=24, with_keys=True)
    ka = _keys(only_a)
    assert len(ka) == 24 and set(ka) <= set(good_a)
    # 1::3 -> about three times more from b (shards have equal sizes)
    mix = build_wds_pipeline([pa, pb], weights=[1, 3], preprocess=None, tokenizer=None,
                             batch_size=6, resampled=True, num_samples=600, with_keys=True,
                             shuffle_buffer=1)
    km = _keys(mix)
    frac_b = sum(k.startswith("b") for k in km) / len(km)
    assert 0.6 < frac_b < 0.9
    with pytest.raises(UserError, match="resampled"):
        build_wds_pipeline([pa, pb], weights=[1, 3], preprocess=None, tokenizer=None, batch_size=2)


def test_fixed_epoch_length_without_resampling_rolls_over(tmp_path):
    p, good = make_shards(tmp_path, n_shards=4, corrupt=False)   # 24 samples
    loader = build_wds_pipeline(p, preprocess=None, tokenizer=None, batch_size=5, num_samples=40,
                                num_workers=2, with_keys=True, shuffle=False)
    batches = list(loader)
    assert len(batches) == loader.num_batches == 8
    keys = [k for _, _, ks in batches for k in ks]
    assert set(keys) == set(good)                 # every sample read, some twice
    assert len(keys) == 40


def test_resume_is_exact_including_augmentation(tmp_path):
    p, _ = make_shards(tmp_path, n_shards=4, corrupt=True)
    kw = dict(preprocess=random_crop_tensor, tokenizer=None, batch_size=3, num_samples=36,
              num_workers=2, with_keys=True, seed=11, epoch=4)
    full = list(build_wds_pipeline(p, **kw))
    loader = build_wds_pipeline(p, **kw)
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    sd = loader.state_dict()
    del it
    assert sd["epoch"] == 4 and sd["batch"] == 5
    resumed = build_wds_pipeline(p, **{**kw, "epoch": 0})
    resumed.load_state_dict(sd)
    rest = list(resumed)
    got = first + rest
    assert len(got) == len(full)
    for (ia, _, ka), (ib, _, kb) in zip(full, got):
        assert ka == kb
        assert torch.equal(ia, ib)                # identical augmentations
    assert resumed.stats()["skipped_batches"] == 5
    assert resumed.epoch == 5


def test_loader_leaves_the_callers_rng_alone(shards):
    pattern, _ = shards
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    list(build_wds_pipeline(pattern, preprocess=random_crop_tensor, tokenizer=None, batch_size=4))
    assert torch.equal(torch.rand(3), expected)


def test_tokenised_batches_with_open_clip_tokenizer_and_subreddit(shards):
    import open_clip

    tok = open_clip.get_tokenizer("ViT-B-32")
    pattern, good = shards
    loader = build_wds_pipeline(pattern, preprocess=to_tensor, tokenizer=tok, batch_size=4,
                                dataset_type="redcaps", prepend_subreddit=True, shuffle=False)
    images, tokens = next(iter(loader))
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32
    assert tokens.shape == (4, 77) and tokens.dtype == torch.long
    expected = tok(["sub0: a thing number 0 0"])[0]
    assert torch.equal(tokens[0], expected)
    caps = next(iter(build_wds_pipeline(pattern, preprocess=None, tokenizer=None, batch_size=2,
                                        dataset_type="webdataset", shuffle=False)))[1]
    assert caps[0] == "[OC] itap of a thing number 0 0 \U0001F600"   # generic: whitespace only


def test_json_caption_key_draws_from_a_list(tmp_path):
    path = tmp_path / "syn-000000.tar"
    with tarfile.open(path, "w") as tf:
        for i in range(4):
            _add(tf, f"k{i}.jpg", _jpg((10, 20, 30)))
            _add(tf, f"k{i}.txt", b"first caption")
            caps = ["red cube", "a red cube", "cube"]
            if i % 2:  # SynthWorld style: caption records with a "text" field
                caps = [{"text": c, "noisy": False} for c in caps]
            _add(tf, f"k{i}.json", json.dumps({"captions": caps}).encode())
    caps = []
    for e in range(6):
        caps += next(iter(build_wds_pipeline(str(path), preprocess=None, tokenizer=None, batch_size=4,
                                             dataset_type="synthetic", caption_key="json:captions",
                                             epoch=e)))[1]
    assert set(caps) == {"red cube", "a red cube", "cube"}
    # a directory with *.tar works as a shard spec (SynthWorld's pretrain/ folder)
    assert expand_shards(str(tmp_path)) == [[str(path)]]


def test_user_errors(tmp_path):
    with pytest.raises(UserError, match="none of the"):
        build_wds_pipeline(str(tmp_path / "x-{000..003}.tar"), preprocess=None, tokenizer=None, batch_size=2)
    with pytest.raises(UserError, match="dataset type"):
        build_wds_pipeline("a.tar", preprocess=None, tokenizer=None, batch_size=2, dataset_type="laion")
    with pytest.raises(UserError, match="weights"):
        build_wds_pipeline("a.tar::b.tar", weights="1", preprocess=None, tokenizer=None, batch_size=2,
                           resampled=True)


@pytest.mark.parametrize("raw,clean", [
    ("[OC] My cat sleeping in the sun", "My cat sleeping in the sun"),
    ("ITAP of a rainy street in Paris", "a rainy street in Paris"),
    ("itap of a bird [4032x3024]", "a bird"),
    ("Sunset over the lake (OC) \U0001F305\u2764\ufe0f", "Sunset over the lake"),
    ("  my   garden\n after rain   ", "my garden after rain"),
    ("Found this guy at the park (x-post from r/aww) - u/someone", "Found this guy at the park"),
    ("Old bridge, 1920x1080 OC", "Old bridge"),
    ("[OC]", ""),
])
def test_redcaps_caption_cleaning(raw, clean):
    assert clean_redcaps_caption(raw) == clean
    assert clean_redcaps_caption(clean) == clean   # idempotent


def test_caption_cleaning_emoji_option_and_generic():
    assert clean_redcaps_caption("dog \U0001F436 park", keep_emoji=True) == "dog \U0001F436 park"
    assert clean_caption(" a\tb\u200b  c ") == "a b c"


def test_pipe_urls_and_unreadable_streams(shards, tmp_path):
    pattern, good = shards
    root = Path(pattern).parent
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    spec = f"pipe:cat {root / '000003.tar'}::pipe:cat {tmp_path / 'gone.tar'}::{empty}"
    loader = build_wds_pipeline(spec, preprocess=None, tokenizer=None, batch_size=4, with_keys=True)
    keys = _keys(loader)
    assert sorted(keys) == sorted(k for k in good if k.startswith("s3_"))
    st = loader.stats()
    assert st["missing_shard"] == 2 and st["truncated_shard"] == 0


def test_endless_streams_over_broken_shards_stop(tmp_path):
    (tmp_path / "000000.tar").write_bytes(b"not a tar at all" * 10)
    pattern = str(tmp_path / "{000000..000001}.tar")          # one garbage, one missing
    for kw in (dict(resampled=True, num_samples=100), dict(num_samples=100)):
        loader = build_wds_pipeline(pattern, preprocess=None, tokenizer=None, batch_size=4, **kw)
        assert list(loader) == []
        assert loader.stats()["missing_shard"] >= 2


def test_preprocess_with_inconsistent_output_shape_is_skipped_and_counted(tmp_path):
    p, good = make_shards(tmp_path, n_shards=2, corrupt=False)

    def odd(img):
        t = to_tensor(img)
        return t[:, :10] if abs(img.getpixel((0, 0))[1] - 40) <= 8 else t   # sample 1 of each shard

    loader = build_wds_pipeline(p, preprocess=odd, tokenizer=None, batch_size=4, shuffle=False,
                                num_workers=2, with_keys=True)
    batches = list(loader)
    keys = [k for _, _, ks in batches for k in ks]
    assert sorted(keys) == sorted(k for k in good if not k.endswith("_001"))
    assert all(b[0].shape[1:] == (3, 24, 24) and b[0].shape[0] == len(b[2]) for b in batches)
    assert loader.stats()["transform_error"] == 2


def test_one_options_object_equals_the_keyword_form_and_rejects_unknown_names(shards):
    from zsprob.config import to_config
    from zsprob.data.webdataset import ShardPipelineOptions
    from zsprob.train.data import shard_options
    pattern, _ = shards
    opts = ShardPipelineOptions(batch_size=3, seed=5, num_workers=2, shuffle_buffer=8, with_keys=True)
    by_keywords = _keys(build_wds_pipeline(pattern, preprocess=None, tokenizer=None, batch_size=3, seed=5,
                                           num_workers=2, shuffle_buffer=8, with_keys=True))
    assert _keys(build_wds_pipeline(pattern, opts, preprocess=None, tokenizer=None)) == by_keywords
    # keyword changes replace fields of the object (and leave it alone: it is frozen)
    other = _keys(build_wds_pipeline(pattern, opts, preprocess=None, tokenizer=None, seed=6))
    assert sorted(other) == sorted(by_keywords) and other != by_keywords and opts.seed == 5
    with pytest.raises(UserError, match="unknown shard pipeline option.*shufle_buffer"):
        build_wds_pipeline(pattern, opts, preprocess=None, tokenizer=None, shufle_buffer=4)
    # training builds it once from the config: data.* first, then data.pipeline.* by field name
    data = to_config({"kind": "redcaps", "num_workers": 2, "resampled": True, "shuffle_buffer": 64,
                      "pipeline": {"prepend_subreddit": True, "shuffle_buffer": 16}})
    built = shard_options(data, local_batch_size=4, seed=3, samples_per_epoch=40)
    assert (built.batch_size, built.seed, built.num_workers, built.dataset_type, built.resampled) == (4, 3, 2, "redcaps", True)
    assert (built.shuffle_buffer, built.prepend_subreddit, built.num_samples, built.drop_last) == (16, True, 40, True)
    with pytest.raises(UserError, match="unknown shard pipeline option"):
        shard_options(to_config({"kind": "webdataset", "pipeline": {"num_worker": 2}}), 4, 0, None)
