"""zsprob.models.convert on state dicts in the exact official ProLIP / PCME++ layouts.

The layouts (key -> shape, dtype) are fixtures written by scripts/official_layouts.py from the
official model classes; the weights here are random.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_convert import branch_of, zsprob_to_official
from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS, detect_layout
from zsprob.models.convert import prolip
from zsprob.models.convert.io import read_state_dict
from zsprob.models.convert.load import official_to_zsprob
from zsprob.models.convert.mapping import check_strict, to_zsprob

FIXTURES = Path(__file__).parent / "fixtures" / "official_layouts"
LAYOUT_FILES = sorted(FIXTURES.glob("*.json"))


def official_layout(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def official_state(name: str, device="meta", generator=None) -> dict:
    """A state dict with the official names, shapes and dtypes (random values off the meta device; integer
    tensors, e.g. an SWA copy's n_averaged, are 0). A fixture that lists only the keys added to another
    (``raw_keys``: the SWA copies) gets that fixture's keys first."""
    layout = official_layout(name)
    out = official_state(layout["raw_keys"], device, generator) if "raw_keys" in layout else {}
    for key, spec in layout["keys"].items():
        dtype = getattr(torch, spec["dtype"])
        if device == "meta":
            out[key] = torch.empty(spec["shape"], dtype=dtype, device="meta")
        elif not dtype.is_floating_point:
            out[key] = torch.zeros(spec["shape"], dtype=dtype)
        else:
            out[key] = torch.randn(spec["shape"], generator=generator).to(dtype) * 0.02
    return out


def test_every_listed_model_has_a_layout_fixture():
    names = {p.stem for p in LAYOUT_FILES}
    for model in ("prolip-ViT-B-16", "prolip-ViT-B-16-long", "prolip-ViT-L-16", "prolip-ViT-H-14",
                  "prolip-ViT-SO400M-14", "pcmepp-ViT-B-16"):
        assert model in names
    for unc in (1, 2):
        for ln in ("none", "0.01"):
            assert f"pcmepp-coco-ViT-B-32-unc{unc}-ln{ln}" in names
    assert {"pcmepp-coco-ViT-B-16-unc1-lnnone", "pcmepp-coco-ViT-L-14-unc1-lnnone", "pcmepp-coco-ViT-B-32-mu"} <= names
    b16 = official_layout("prolip-ViT-B-16")
    assert b16["config"]["text_cfg"]["context_length"] == 64 and b16["config"]["text_cfg"]["pool_type"] == "last"
    assert b16["keys"]["text.positional_embedding"]["shape"] == [66, 768]  # 64 tokens + [CLS] + [UNC]


# the SWA fixture (raw keys + AveragedModel copies) is checked in tests/test_models_pcmepp_coco.py
@pytest.mark.parametrize("path", [p for p in LAYOUT_FILES if not p.stem.endswith("-swa")], ids=lambda p: p.stem)
def test_round_trip_official_zsprob_official_is_the_identity(path):
    state = official_state(path.stem)
    kind = detect_layout(state)
    rules = LAYOUTS[kind].rules
    split = LAYOUTS[kind].split(state)
    converted = official_to_zsprob(state, kind)
    assert len(converted) == len(split)
    back = zsprob_to_official(converted, kind)
    assert list(back) == list(state) and all(back[k] is state[k] for k in state if k not in prolip.TABLES)
    assert all(back[k].shape == state[k].shape for k in state)  # the ProLIP tables: values in the test below
    branches = {branch_of(k, rules) for k in converted}
    assert branches <= {"mean", "sigma", "loss"} and ("sigma" in branches) == (kind != "pcmepp-coco-mu")
    # every uncertainty parameter of the official model lands in a sigma head, nothing else does
    for official, zs in zip(split, converted):
        is_unc = any(w in official for w in ("unc", "uncertainty", "prob_resblocks", "std_"))
        assert (branch_of(zs, rules) == "sigma") == is_unc, (official, zs)


def test_renamed_unknown_or_misshaped_keys_fail_naming_the_key():
    state = official_state("pcmepp-ViT-B-16")
    rules = LAYOUTS["pcmepp-hf"].rules
    expected = {k: v.shape for k, v in to_zsprob(state, rules).items()}
    bad = dict(state)
    bad["visual.transformer.resblocks.3.attn.in_proj_weights"] = bad.pop("visual.transformer.resblocks.3.attn.in_proj_weight")
    with pytest.raises(UserError, match=r"missing key for 'clip.visual.transformer.resblocks.3.attn.in_proj_weight'"):
        check_strict(to_zsprob(bad, rules), expected, rules, "ckpt")
    bad = dict(state, **{"text_projection": torch.empty(512, 256, device="meta")})
    with pytest.raises(UserError, match=r"key 'text_projection' has shape \(512, 256\)"):
        check_strict(to_zsprob(bad, rules), expected, rules, "ckpt")
    with pytest.raises(UserError, match="unexpected key 'head.weight'"):
        to_zsprob(dict(state, **{"head.weight": torch.empty(1)}), rules)
    smaller = dict(expected)
    smaller.pop("loss.shift")
    with pytest.raises(UserError, match=r"key 'shift' \('loss.shift'\) has no place in the model"):
        check_strict(to_zsprob(state, rules), smaller, rules, "ckpt")
    with pytest.raises(UserError, match="not a ProLIP or PCME"):
        detect_layout({"conv.weight": torch.empty(1)})


def test_pcmepp_hf_mean_branch_fills_open_clip_vit_b16_exactly():
    """Every mean-branch key of the HF ViT-B/16 is a parameter of open_clip's ViT-B-16 CLIP, shape for shape."""
    import open_clip

    with torch.device("meta"):
        reference = open_clip.CLIP(**open_clip.get_model_config("ViT-B-16"))
    expected = {"clip." + k: v.shape for k, v in reference.state_dict().items()}
    rules = LAYOUTS["pcmepp-hf"].rules
    converted = to_zsprob(official_state("pcmepp-ViT-B-16"), rules)
    mean = {k: v for k, v in converted.items() if branch_of(k, rules) == "mean"}
    check_strict(mean, expected, rules, "pcmepp-ViT-B-16")


@pytest.mark.slow
def test_pcmepp_hf_mean_branch_equals_open_clip_on_the_same_weights():
    """The converted mean branch inside a zsprob ProbCLIP encodes as open_clip's CLIP given the official names."""
    import open_clip

    from zsprob.models import create_model

    generator = torch.Generator().manual_seed(0)
    state = official_state("pcmepp-ViT-B-16", device="cpu", generator=generator)
    rules = LAYOUTS["pcmepp-hf"].rules
    converted = to_zsprob(state, rules)
    reference = open_clip.create_model("ViT-B-16").eval()
    mean_official = {k: v for k, v in state.items() if branch_of(to_zsprob({k: v}, rules).popitem()[0], rules) == "mean"}
    reference.load_state_dict(mean_official, strict=True)
    model = create_model("ViT-B-16", pooling="native", sigma_depth=2).eval()
    clip_part = {k[len("clip."):]: v for k, v in converted.items() if k.startswith("clip.")}
    check_strict(clip_part, {k: v.shape for k, v in model.clip.state_dict().items()}, [], "pcmepp-ViT-B-16")
    model.clip.load_state_dict(clip_part, strict=True)
    images = torch.randn(2, 3, 224, 224, generator=generator)
    tokens = torch.randint(1, 49000, (2, 77), generator=generator)
    tokens[:, 9] = 49407  # the EOT token (the highest id) pools the text
    tokens[:, 10:] = 0
    with torch.no_grad():
        want_image = torch.nn.functional.normalize(reference.encode_image(images), dim=-1)
        want_text = torch.nn.functional.normalize(reference.encode_text(tokens), dim=-1)
        got_image, _ = model.encode_image(images)
        got_text, _ = model.encode_text(tokens)
    torch.testing.assert_close(got_image, want_image, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_text, want_text, atol=1e-5, rtol=1e-4)


def test_reads_safetensors_torch_hf_dir_and_the_coco_trainer_dict(tmp_path):
    from safetensors.torch import save_file

    state = {"visual.proj": torch.randn(4, 3), "text_projection": torch.randn(3, 2)}
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(state, tmp_path / "w.pth")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(state, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"embed_dim": 2}))
    trainer = {"epoch": 3, "global_step": 10, "state_dict": {"module." + k: v for k, v in state.items()},
               "hyper_parameters": {"opt": {"model": {"n_unc_layers": 1}}}}
    torch.save(trainer, tmp_path / "last.ckpt")
    for source in (tmp_path / "w.safetensors", tmp_path / "w.pth", hf, tmp_path / "last.ckpt"):
        got = read_state_dict(source)
        assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state), source
    # the official trainer's hyper-parameters are a munch.Munch: read as a dict, munch's code never runs
    import sys
    import types

    fake = types.ModuleType("munch")

    class Munch(dict):  # pickles as munch's Munch does: dict items plus __getstate__ / __setstate__
        def __getstate__(self):
            return dict(self)

        def __setstate__(self, state):
            self.clear()
            self.update(state)

    Munch.__module__, Munch.__qualname__ = "munch", "Munch"
    fake.Munch = Munch
    sys.modules["munch"], saved = fake, sys.modules.get("munch")
    try:
        torch.save(dict(trainer, hyper_parameters={"opt": Munch(model=Munch(n_unc_layers=1))}), tmp_path / "munch.ckpt")
    finally:
        if saved is None:
            del sys.modules["munch"]
        else:
            sys.modules["munch"] = saved
    got = read_state_dict(tmp_path / "munch.ckpt")
    assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)
    # any other pickled Python object is never unpickled
    torch.save({"state_dict": state, "opt": Path("x")}, tmp_path / "obj.ckpt")
    with pytest.raises(UserError, match="without unpickling code"):
        read_state_dict(tmp_path / "obj.ckpt")
    with pytest.raises(UserError, match="no weights in directory"):
        read_state_dict(tmp_path)
    with pytest.raises(UserError, match="holds no state dict"):
        torch.save({"epoch": 1}, tmp_path / "empty.pt")
        read_state_dict(tmp_path / "empty.pt")


@pytest.mark.parametrize("name", ["prolip-ViT-B-16", "prolip-ViT-B-16-long", "prolip-ViT-L-16", "prolip-ViT-H-14",
                                  "prolip-ViT-SO400M-14"])
def test_prolip_model_json_builds_the_official_state_dict(name, tmp_path):
    """configs/models/<name>.json + sigma_head 'unc' give exactly ProLIP's state dict, names and shapes
    (the [UNC] rows of the positional tables split off into the [UNC] heads)."""
    from test_models_hf_tokenizer import make_tokenizer_dir
    from zsprob.models import create_model

    tokenizer = make_tokenizer_dir(tmp_path / "tokenizer")
    with torch.device("meta"):
        model = create_model(name, sigma_head="unc", unc_layout="prolip", pooling="native", tokenizer_dir=tokenizer)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    converted = official_to_zsprob(official_state(name), "prolip")
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected


def test_prolip_unc_rows_split_off_and_back():
    """The [UNC] rows: image row 1 (after CLS), text the row before the last ([tokens, UNC, CLS])."""
    image, text = torch.randn(6, 4), torch.randn(5, 4)
    state = {"visual.positional_embedding": image, "visual.unc_embedding": torch.randn(4),
             "text.positional_embedding": text}
    zs = official_to_zsprob(state, "prolip")
    assert torch.equal(zs["image_sigma.unc_pos_embedding"], image[1])
    assert torch.equal(zs["clip.visual.positional_embedding"], torch.cat([image[:1], image[2:]]))
    assert torch.equal(zs["text_sigma.unc_pos_embedding"], text[3])
    assert torch.equal(zs["clip.text.positional_embedding"], torch.cat([text[:3], text[4:]]))
    back = zsprob_to_official(zs, "prolip")
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_local_tokenizer_dir_goes_into_the_model_and_its_checkpoint(tmp_path):
    """create_model(..., tokenizer_dir=DIR) tokenizes with that directory; save / load keeps it (no hub)."""
    from test_models_hf_tokenizer import make_tokenizer_dir
    from zsprob.models import create_model, load, save

    directory = make_tokenizer_dir(tmp_path / "tokenizer")
    model = create_model("zsprob-tiny", tokenizer_dir=directory)
    context = model.config["open_clip_cfg"]["text_cfg"]["context_length"]
    tokens = model.tokenizer(["A RED car!"])
    assert tokens.shape == (1, context)
    assert model.tokenizer.tokenizer.decode(tokens[0], skip_special_tokens=True) == "a red car"
    again = load(save(model, tmp_path / "ckpt"))
    assert torch.equal(again.tokenizer(["A RED car!"]), tokens)
    assert again.config["tokenizer_dir"] == str(directory.resolve())  # its identity, as saved
    assert again.tokenizer.directory == str(tmp_path / "ckpt" / "tokenizer")  # the copy saved with the weights


def test_pcmepp_hf_b16_fills_pcmepp_vit_b16_exactly():
    """The official HF ViT-B/16 layout fills create_model('pcmepp-ViT-B-16') with the loader's options, key for
    key (zsprob's sigma biases, absent officially, are the only constant fills)."""
    from zsprob.models import create_model

    state = official_state("pcmepp-ViT-B-16")
    options = LAYOUTS["pcmepp-hf"].options_for(state)
    assert options["sigma_depth"] == 2
    with torch.device("meta"):
        model = create_model("pcmepp-ViT-B-16", **options)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    converted = {k: tuple(v.shape) for k, v in official_to_zsprob(state, "pcmepp-hf").items()
                 if not k.startswith("loss.")}
    assert set(expected) - set(converted) == set(LAYOUTS["pcmepp-hf"].zero_fills)
    assert all(converted[k] == expected[k] for k in converted)
