"""The model catalogue: one entry per model and per official layout with every fact about it (timm's cfgs).

A :class:`Model`'s tower config is ``configs/models/<name>.json``; a :class:`Layout` says how a published
ProLIP / PCME++ file is recognised, mapped and built. No other module names a model or a layout; no torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

from zsprob.errors import UserError
from zsprob.models.convert import pcmepp, prolip


@dataclass(frozen=True)
class Layout:
    """An official layout. ``recognise(keys)``: whether a file's key names are in it; ``options``: its
    create_model options; ``sigma_blocks`` / ``sigma_ln``: key markers counted as ``sigma_depth`` / present as
    ``sigma_ln_init`` 0.01; ``split``: official state -> one key per zsprob key; ``zero_fills`` / ``keep_own``:
    model tensors the file lacks, set to 0 or kept as built; ``swa_copies``: raw module -> its SWA copy."""

    family: str
    description: str
    rules: list
    recognise: Callable[[dict], bool]
    options: dict
    sigma_blocks: str | None = None
    sigma_ln: tuple[str, ...] = ()
    check: Callable[[dict, str], None] | None = None
    split: Callable[[dict], dict] = dict
    zero_fills: tuple[str, ...] = ()
    keep_own: tuple[str, ...] = ()
    swa_copies: dict = field(default_factory=dict)

    def options_for(self, state: dict, source: str | os.PathLike = "checkpoint") -> dict:
        """create_model options under which a zsprob model computes what the official code computes."""
        if self.check is not None:
            self.check(state, source)
        options = dict(self.options)
        if self.sigma_blocks is not None:
            blocks = {k.split(self.sigma_blocks, 1)[1].split(".", 1)[0] for k in state if self.sigma_blocks in k}
            options["sigma_depth"] = max(1, len(blocks))
        if self.sigma_ln:
            options["sigma_ln_init"] = 0.01 if any(k.startswith(self.sigma_ln) for k in state) else None
        return options


_PCMEPP_HF = dict(sigma_head="block", sigma_layout="official", pooling="native", sigma_ln_init=None,
                  deterministic=False)
# pcmepp/models/{img,txt}_encoder.py: fc + GPO on every token of the CLIP trunks (no ln_post, no projections)
_COCO = dict(mean_head="fc", pooling="gpo", gpo_dim=32, normalize_mu=True)
_COCO_SIGMA = dict(sigma_head="block", sigma_layout="official", sigma_init="random", deterministic=False)
_SIGMA_BIASES = ("image_sigma.bias", "text_sigma.bias")

#: the official layouts, in the order the CLI lists them
LAYOUTS: dict[str, Layout] = {
    "prolip": Layout(
        "prolip", "ProLIP (naver-ai/prolip) open_clip-style towers with [UNC] tokens", prolip.RULES,
        lambda keys: "visual.unc_embedding" in keys or "text.unc_emb" in keys,
        dict(sigma_head="unc", unc_layout="prolip", pooling="native", sigma_depth=1, deterministic=False),
        split=prolip.split),
    "pcmepp-hf": Layout(
        "pcmepp", "PCME++ hf_models.HfPCMEPPModel (Hugging Face hub ViT-B/16)", pcmepp.HF_RULES,
        lambda keys: "uncertainty_text_projection" in keys or "visual.uncertainty_proj" in keys,
        _PCMEPP_HF, sigma_blocks="uncertainty_transformer.resblocks.", zero_fills=_SIGMA_BIASES),
    "pcmepp-coco": Layout(
        "pcmepp", "checkpoint of the official PCME++ COCO trainer (train.py)", pcmepp.COCO_RULES,
        lambda keys: pcmepp.is_coco(keys) and pcmepp.has_sigma(keys), dict(_COCO, **_COCO_SIGMA),
        sigma_blocks="prob_resblocks.", sigma_ln=("img_enc.image_std_ln.", "txt_enc.text_std_ln."),
        check=pcmepp.check_sigma_parts, zero_fills=_SIGMA_BIASES, keep_own=("clip.logit_scale",),
        swa_copies={"img_enc": "swa_img_enc", "txt_enc": "swa_txt_enc", "criterion": "swa_criterion"}),
    "pcmepp-coco-mu": Layout(
        "pcmepp", "mu-only checkpoint of the official PCME++ COCO trainer (is_probabilistic_model: false; "
        "InfoNCE / VSE infinity / PCME++ mu-only baselines)", pcmepp.COCO_MU_RULES,
        lambda keys: pcmepp.is_coco(keys) and not pcmepp.has_sigma(keys), dict(_COCO, deterministic=True),
        keep_own=("clip.logit_scale",), swa_copies={"img_enc": "swa_img_enc", "txt_enc": "swa_txt_enc"}),
}


def detect_layout(state) -> str:
    """The official layout a state dict (or its key names) is in."""
    for name, lay in LAYOUTS.items():
        if lay.recognise(state):
            return name
    raise UserError("not a ProLIP or PCME++ checkpoint: none of visual.unc_embedding, uncertainty_text_projection, "
                    "img_enc.* found")


@dataclass(frozen=True)
class Model:
    """A zsprob model: the ``layouts`` its published weights come in and where to ``fetch`` them (None: none
    are published; zsprob never downloads)."""

    name: str
    layouts: tuple[str, ...] = ()
    fetch: str | None = None

    def tower_config(self) -> dict:
        """open_clip's model config of this model (its JSON, read without open_clip)."""
        from zsprob.utils.paths import model_configs_dir

        return json.loads((model_configs_dir() / f"{self.name}.json").read_text())

    @property
    def tokenizer(self) -> str | None:
        """The Hugging Face tokenizer the tower config names (saved beside the weights), or None."""
        return self.tower_config().get("text_cfg", {}).get("hf_tokenizer_name")


_HUB = "`huggingface-cli download SanghyukChun/{} --local-dir DIR`"
_PROLIP_HUB = ("the ProLIP collection on the Hugging Face hub (huggingface.co/SanghyukChun, e.g. "
               f"{_HUB.format('ProLIP-ViT-B-16-DC-1B-12_8B')})")
_COCO_RUN = "your naver-ai/pcmepp train.py checkpoint (last.ckpt) or the announced COCO weights"
_COCO_LAYOUTS = ("pcmepp-coco", "pcmepp-coco-mu")

MODELS: dict[str, Model] = {m.name: m for m in (
    Model("zsprob-tiny"),  # SynthWorld's ViT + text transformer
    Model("zsprob-tiny-cnn"),
    Model("zsprob-tiny-bow"),  # SynthWorld's plain CNN + bag of words (the demo's towers)
    Model("ViT-S-16-d128"),
    Model("prolip-tiny", ("prolip",)),  # small test towers of each official layout
    Model("pcmepp-tiny", ("pcmepp-hf",)),
    Model("pcmepp-coco-tiny", _COCO_LAYOUTS),
    Model("prolip-ViT-B-16", ("prolip",), _HUB.format("ProLIP-ViT-B-16-DC-1B-12_8B")),
    Model("prolip-ViT-B-16-long", ("prolip",), _PROLIP_HUB),
    Model("prolip-ViT-L-16", ("prolip",), _PROLIP_HUB),
    Model("prolip-ViT-H-14", ("prolip",), _PROLIP_HUB),
    Model("prolip-ViT-SO400M-14", ("prolip",), _PROLIP_HUB),
    Model("pcmepp-ViT-B-16", ("pcmepp-hf",), _HUB.format("PCMEPP-ViT-B-16-CC3M-12M-RedCaps")),
    Model("pcmepp-coco-ViT-B-32", _COCO_LAYOUTS, _COCO_RUN),  # the COCO trainer's OpenAI CLIP backbones
    Model("pcmepp-coco-ViT-B-16", _COCO_LAYOUTS, _COCO_RUN),
    Model("pcmepp-coco-ViT-L-14", _COCO_LAYOUTS, _COCO_RUN),
)}
#: the smallest model with sigma heads, which smoke runs use untrained (zsprob reproduce --smoke)
SMOKE_MODEL = MODELS["zsprob-tiny-bow"].name
#: the ProLIP model whose ImageNet zero-shot figure its paper's abstract gives
PROLIP_PAPER_MODEL = MODELS["prolip-ViT-B-16"].name


def default_model(kind: str, state: dict) -> str:
    """The published model a file of layout ``kind`` belongs to when --model is not given: of a COCO
    trainer file, the one whose patch size is that of ``img_enc.backbone.conv1``."""
    candidates = [m for m in MODELS.values() if m.fetch is not None and kind in m.layouts]
    conv = state.get("img_enc.backbone.conv1.weight")
    if conv is not None and conv.ndim == 4:
        for m in candidates:
            if m.tower_config()["vision_cfg"].get("patch_size") == int(conv.shape[-1]):
                return m.name
    return candidates[0].name


def require_published_weights(name: str | None, pretrained) -> None:
    """A published model without ``pretrained`` would be random weights under a published name: one UserError
    line instead, naming what to fetch."""
    model = MODELS.get(name)
    if model is None or model.fetch is None or (pretrained is not None and str(pretrained) != ""):
        return
    tok = (f" with its tokenizer (`huggingface-cli download {model.tokenizer} --local-dir DIR/tokenizer`, or pass "
           "--tokenizer TOKDIR)" if model.tokenizer else "")
    raise UserError(f"--model {name} needs its published weights, and zsprob never downloads: fetch {model.fetch}, "
                    f"then pass --pretrained DIR{tok}")
