"""Write the official ProLIP / PCME++ state-dict layouts (key -> shape, dtype) as test fixtures.

Needs the official source trees, which the tests do not: export them first, e.g.

    git -C /work/.mirror/naver-ai+prolip/repo archive HEAD | tar -x -C /tmp/x/prolip
    git -C /work/.mirror/naver-ai+pcmepp/repo archive HEAD | tar -x -C /tmp/x/pcmepp
    python scripts/official_layouts.py --prolip /tmp/x/prolip --pcmepp /tmp/x/pcmepp \
        --out tests/fixtures/official_layouts

The official model classes are instantiated on the ``meta`` device (no weights, nothing is
downloaded) and their ``state_dict()`` names, shapes and dtypes are dumped to JSON, one file per
layout, together with the architecture facts of each official config. The official files are
not modified: PCME++'s ``clip.load`` (which would download OpenAI weights) is replaced by a
function that builds the official ``ProbCLIP`` with OpenAI CLIP ViT-B/32's dimensions, and the
missing ``pkg_resources`` / ``lightning`` imports get tiny stand-ins.
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

# OpenAI CLIP ViT-B/32 (the official PCME++ COCO trainer's default backbone, clip_ViT-B/32)
CLIP_VIT_B32 = dict(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768, vision_patch_size=32,
                    context_length=77, vocab_size=49408, transformer_width=512, transformer_heads=8,
                    transformer_layers=12)

# PCME++ HF ViT-B/16 (hf_models.HfPCMEPPModel): open_clip ViT-B-16 towers, 2 uncertainty layers per tower
# (the dataclass defaults in hf_models/hf_clip.py; the hub config.json passes the same fields)
PCMEPP_HF_B16 = dict(embed_dim=512,
                     vision_cfg=dict(image_size=224, layers=12, width=768, patch_size=16, unc_layers=2),
                     text_cfg=dict(context_length=77, vocab_size=49408, width=512, heads=8, layers=12, unc_layers=2))


def _layout(module: torch.nn.Module) -> dict:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
            for k, v in module.state_dict().items()}


def _write(out: Path, name: str, source: str, config: dict, keys: dict, extra: dict | None = None) -> None:
    doc = {"name": name, "source": source, "config": config, "num_keys": len(keys), "keys": keys}
    doc.update(extra or {})
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{name}: {len(keys)} keys")


def prolip_layouts(root: Path, out: Path) -> None:
    sys.path.insert(0, str(root / "src"))
    from prolip.factory import get_model_config
    from prolip.model import ProLIP

    for cfg_file in sorted((root / "src/prolip/model_configs").glob("*.json")):
        arch = cfg_file.stem  # e.g. ViT-B-16-ProLIP
        cfg = get_model_config(arch)
        with torch.device("meta"):
            model = ProLIP(**cfg)
        name = "prolip-" + arch.replace("-ProLIP-long", "-long").replace("-ProLIP", "")
        _write(out, name, f"naver-ai/prolip src/prolip/model_configs/{cfg_file.name}", cfg, _layout(model))


def _pcmepp_shims(root: Path) -> None:
    sys.path.insert(0, str(root))
    if "pkg_resources" not in sys.modules:  # only clip.py's version check uses it
        shim = types.ModuleType("pkg_resources")
        shim.packaging = types.SimpleNamespace(version=types.SimpleNamespace(parse=lambda s: tuple(
            int(p) for p in s.split("+")[0].split(".")[:2])))
        sys.modules["pkg_resources"] = shim


def pcmepp_layouts(root: Path, out: Path) -> None:
    _pcmepp_shims(root)
    from hf_models.hf_clip import HfPCMEPPModel

    with torch.device("meta"):
        hf = HfPCMEPPModel(**PCMEPP_HF_B16)
    _write(out, "pcmepp-ViT-B-16", "naver-ai/pcmepp hf_models/hf_clip.py HfPCMEPPModel (hub config.json fields)",
           PCMEPP_HF_B16, _layout(hf))

    from pcmepp.criterions import get_criterion
    from pcmepp.models import img_encoder, txt_encoder
    from pcmepp.models.encoders import get_image_encoder, get_text_encoder
    from pcmepp.modules.clip import model as clip_model

    def load_random(name, device="cpu", jit=False, download_root=None, n_unc_layers=2, rand_init=False):
        assert name == "ViT-B/32", name
        return clip_model.ProbCLIP(*CLIP_VIT_B32.values(), n_unc_layers), None

    img_encoder.clip.load = load_random
    txt_encoder.clip.load = load_random
    for n_unc in (1, 2):
        for sigma_ln in (None, 0.01):
            opt_model = dict(is_probabilistic_model=True, n_unc_layers=n_unc, backbone_source="clip_ViT-B/32",
                             precomp_enc_type="backbone", embed_size=1024, img_dim=768, no_imgnorm=False,
                             no_txtnorm=False, sigma_ln_init=sigma_ln)
            trainer = torch.nn.Module()  # attributes named as PCMEPPModel (a LightningModule) names them
            with torch.device("meta"):
                trainer.img_enc = get_image_encoder(size_augment=0.2, **opt_model)
                trainer.txt_enc = get_text_encoder(**opt_model)
                trainer.criterion = get_criterion(name="pcmepp", init_negative_scale=5, init_shift=5,
                                                  vib_beta=0.0001, prob_distance="csd", smoothness_alpha=0.1)
            tag = f"unc{n_unc}-ln{'none' if sigma_ln is None else sigma_ln}"
            _write(out, f"pcmepp-coco-ViT-B-32-{tag}",
                   "naver-ai/pcmepp train.py (lightning ModelCheckpoint of pcmepp.engine.PCMEPPModel), configs/pcmepp.yaml",
                   {"model": opt_model}, _layout(trainer),
                   {"checkpoint": {"state_dict_key": "state_dict",
                                   "note": "lightning checkpoint dict: epoch, global_step, state_dict, "
                                           "hyper_parameters (opt), optimizer_states, lr_schedulers, callbacks; "
                                           "SWA runs add swa_img_enc.module.* / swa_txt_enc.module.* copies"}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prolip", type=Path, required=True, help="exported naver-ai/prolip tree")
    ap.add_argument("--pcmepp", type=Path, required=True, help="exported naver-ai/pcmepp tree")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/official_layouts"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prolip_layouts(args.prolip, args.out)
    pcmepp_layouts(args.pcmepp, args.out)


if __name__ == "__main__":
    main()
