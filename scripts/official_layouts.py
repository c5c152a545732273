"""Write the official ProLIP / PCME++ state-dict layouts (key -> shape, dtype) as test fixtures.

Needs the official source trees, which the tests do not: export them first, e.g.

    git -C /work/.mirror/naver-ai+prolip/repo archive HEAD | tar -x -C /tmp/x/prolip
    git -C /work/.mirror/naver-ai+pcmepp/repo archive HEAD | tar -x -C /tmp/x/pcmepp
    python scripts/official_layouts.py --prolip /tmp/x/prolip --pcmepp /tmp/x/pcmepp \
        --out tests/fixtures/official_layouts

(either family alone is fine). The official model classes are instantiated on the ``meta``
device (no weights, nothing is downloaded) and their ``state_dict()`` names, shapes and dtypes are
dumped to JSON, one file per layout, together with the architecture facts of each official config.
The official files are not modified. The PCME++ COCO trainer's modules are built as
``pcmepp.engine.PCMEPPModel`` builds them, from the official YAML configs with the README's
command-line overrides; its ``clip.load`` (which would download the OpenAI weights) is replaced by a
function that hands the official ``build_model`` a stand-in OpenAI state dict (open_clip's CLIP of
the same architecture on ``meta``: OpenAI's key names and shapes), so the official code derives the
tower sizes and chooses ``CLIP`` or ``ProbCLIP`` itself. The missing ``pkg_resources`` import
gets a tiny stand-in. An SWA run (``configs/pcmepp.yaml`` as shipped: ``swa_start_epoch: 16``) also
gets the engine's ``torch.optim.swa_utils.AveragedModel`` wrappers (``swa_img_enc``, ``swa_txt_enc``,
``swa_criterion``); its fixture lists only the keys they add, one per line (the raw keys are those of
the run's plain fixture, checked here key for key).
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

# OpenAI CLIP backbones of the COCO trainer (``backbone_source: clip_<name>``) -> open_clip's config of that
# architecture, whose state dict has OpenAI's key names and shapes (what the official build_model reads)
OPENAI_CLIP = {"ViT-B/32": "ViT-B-32", "ViT-B/16": "ViT-B-16", "ViT-L/14": "ViT-L-14"}

# COCO trainer layouts: (fixture name, official config, README command-line overrides ``--group__option``)
COCO_RUNS = [(f"pcmepp-coco-ViT-B-32-unc{u}-ln{'none' if ln is None else ln}", "configs/pcmepp.yaml",
              {"model__n_unc_layers": u, "model__sigma_ln_init": ln}) for u in (1, 2) for ln in (None, 0.01)] + [
    ("pcmepp-coco-ViT-B-16-unc1-lnnone", "configs/pcmepp.yaml", {"model__backbone_source": "clip_ViT-B/16"}),
    ("pcmepp-coco-ViT-L-14-unc1-lnnone", "configs/pcmepp.yaml",
     {"model__backbone_source": "clip_ViT-L/14", "model__img_dim": 1024}),
]
# the SWA run: (fixture name, official config as shipped, the plain fixture holding the same raw keys)
SWA_RUN = ("pcmepp-coco-ViT-B-32-unc1-lnnone-swa", "configs/pcmepp.yaml", "pcmepp-coco-ViT-B-32-unc1-lnnone")
# the non-probabilistic baselines (is_probabilistic_model: false); one fixture, the criteria's keys beside it.
# pcmepp_mu_only.yaml as shipped stops in MCSoftContrastiveLoss.__init__ (its prob_distance
# energy_distance_closed_form is not one of non_squared_l2 / squared_l2): built with a valid one
MU_ONLY_CONFIGS = {"configs/others/info_nce.yaml": {},
                   "configs/others/pcmepp_mu_only.yaml": {"criterion__prob_distance": "squared_l2"},
                   "configs/others/vse_infty.yaml": {}}

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

    for name, config, overrides in COCO_RUNS:
        opt = _official_opt(root, config, overrides)
        note = ("lightning checkpoint dict: epoch, global_step, state_dict, hyper_parameters (opt), optimizer_states, "
                "lr_schedulers, callbacks; SWA runs add swa_img_enc.module.* / swa_txt_enc.module.* copies")
        extra = {"checkpoint": {"state_dict_key": "state_dict", "note": note}}
        if not name.startswith("pcmepp-coco-ViT-B-32-unc"):
            extra["readme_overrides"] = overrides
        _write(out, name, f"naver-ai/pcmepp train.py (lightning ModelCheckpoint of pcmepp.engine.PCMEPPModel), {config}",
               {"model": opt["model"]}, _layout(_coco_trainer(opt)), extra)
    _swa_layout(root, out)
    _mu_only_layout(root, out)


def _official_opt(root: Path, config: str, overrides: dict) -> dict:
    """An official YAML config with train.py's ``--group__option value`` overrides applied."""
    import yaml

    opt = yaml.safe_load((root / config).read_text())
    for key, value in overrides.items():
        group, option = key.split("__")
        opt[group][option] = value
    return opt


def _coco_trainer(opt: dict) -> torch.nn.Module:
    """The modules of pcmepp.engine.PCMEPPModel (a LightningModule) under its attribute names, on ``meta``."""
    from pcmepp.criterions import get_criterion
    from pcmepp.models import img_encoder, txt_encoder
    from pcmepp.models.encoders import get_image_encoder, get_text_encoder
    from pcmepp.modules.clip import model as clip_model

    def load_stand_in(name, device="cpu", jit=False, download_root=None, n_unc_layers=2, rand_init=False):
        openai = clip_model_state(name)  # OpenAI's names and shapes; build_model derives every size from them
        return clip_model.build_model(openai, name, n_unc_layers, rand_init=True), None  # rand_init: nothing to load

    img_encoder.clip.load = load_stand_in
    txt_encoder.clip.load = load_stand_in
    trainer = torch.nn.Module()
    with torch.device("meta"):
        trainer.img_enc = get_image_encoder(size_augment=opt["augment"]["img_size_augment"], **opt["model"])
        trainer.txt_enc = get_text_encoder(**opt["model"])
        trainer.criterion = get_criterion(**opt["criterion"])
    return trainer


def _with_swa(trainer: torch.nn.Module, opt: dict) -> torch.nn.Module:
    """pcmepp/engine.py PCMEPPModel.__init__ with train.swa_start_epoch: AveragedModel copies of the encoders and,
    for a probabilistic model (is_swa_criterion), of the criterion (device='cuda' there; meta here)."""
    from torch.optim.swa_utils import AveragedModel

    assert opt["train"].get("swa_start_epoch"), "not an SWA run"
    with torch.device("meta"):
        trainer.swa_img_enc = AveragedModel(trainer.img_enc)
        trainer.swa_txt_enc = AveragedModel(trainer.txt_enc)
        if opt["model"].get("is_probabilistic_model"):
            trainer.swa_criterion = AveragedModel(trainer.criterion)
    return trainer


def _swa_layout(root: Path, out: Path) -> None:
    """The keys the SWA wrappers add (``swa_*``), one per line; the raw keys must equal the plain fixture's."""
    name, config, plain = SWA_RUN
    opt = _official_opt(root, config, {})
    keys = _layout(_with_swa(_coco_trainer(opt), opt))
    raw = {k: v for k, v in keys.items() if not k.startswith("swa_")}
    assert raw == json.loads((out / f"{plain}.json").read_text())["keys"], f"raw keys differ from {plain}"
    added = {k: v for k, v in keys.items() if k.startswith("swa_")}
    head = {"name": name, "source": f"naver-ai/pcmepp train.py (lightning ModelCheckpoint of "
            f"pcmepp.engine.PCMEPPModel with swa_start_epoch), {config}", "config": {"model": opt["model"],
            "train": {k: v for k, v in opt["train"].items() if k.startswith("swa_")}},
            "raw_keys": plain, "note": "keys: only those the AveragedModel wrappers add; the file holds the raw "
            "keys of raw_keys beside them", "num_keys": len(added)}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in added.items()]
    text = json.dumps(head, indent=1)[:-2] + ',\n "keys": {\n' + ",\n".join(lines) + "\n }\n}\n"
    (out / f"{name}.json").write_text(text)
    print(f"{name}: {len(added)} keys added to {plain}'s {len(raw)}")


def clip_model_state(name: str) -> dict:
    import open_clip

    with torch.device("meta"):
        return dict(open_clip.CLIP(**open_clip.get_model_config(OPENAI_CLIP[name])).state_dict())


def _mu_only_layout(root: Path, out: Path) -> None:
    """configs/others/*: the same encoders without uncertainty modules; only the criterion's keys differ."""
    layouts, criteria, models = {}, {}, {}
    for config, overrides in MU_ONLY_CONFIGS.items():
        opt = _official_opt(root, config, overrides)
        assert opt["model"]["is_probabilistic_model"] is False, config
        layouts[config] = _layout(_coco_trainer(opt))
        criteria[config] = {k: v for k, v in layouts[config].items() if k.startswith("criterion.")}
        models[config] = {k: v for k, v in layouts[config].items() if not k.startswith("criterion.")}
    first = next(iter(MU_ONLY_CONFIGS))
    assert all(m == models[first] for m in models.values()), "the mu-only encoders differ between configs"
    note = ("keys: those of the listed config; the other configs/others/*.yaml with is_probabilistic_model false "
            "hold the same encoder keys and criterion_keys[config] (no swa_start_epoch in them: no SWA copies)")
    _write(out, "pcmepp-coco-ViT-B-32-mu",
           f"naver-ai/pcmepp train.py (lightning ModelCheckpoint of pcmepp.engine.PCMEPPModel), {first}",
           {"model": _official_opt(root, first, {})["model"]}, layouts[first],
           {"criterion_keys": criteria, "criterion_overrides": {c: o for c, o in MU_ONLY_CONFIGS.items() if o},
            "checkpoint": {"state_dict_key": "state_dict", "note": note}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prolip", type=Path, help="exported naver-ai/prolip tree")
    ap.add_argument("--pcmepp", type=Path, help="exported naver-ai/pcmepp tree")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/official_layouts"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.prolip is None and args.pcmepp is None:
        ap.error("give --prolip and / or --pcmepp")
    if args.prolip is not None:
        prolip_layouts(args.prolip, args.out)
    if args.pcmepp is not None:
        pcmepp_layouts(args.pcmepp, args.out)


if __name__ == "__main__":
    main()
