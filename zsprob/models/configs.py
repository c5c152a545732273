"""Model configs: a model name + create_model's options -> ``model.config`` -> a ProbCLIP (no weights here).

open_clip holds the tower configs (zsprob's ``configs/models/*.json`` registered with it) and builds the
CLIP model, tokenizer and transforms.
"""
from __future__ import annotations

import copy
from pathlib import Path

import open_clip
import torch

from zsprob.errors import UserError
from zsprob.models.options import ModelOptions

_registered = False
# create_model options that are zsprob's besides the head options (everything else goes to open_clip)
_OTHER_OPTIONS = ("tokenizer_dir",)
# open_clip options create_model takes by name: the tower config they go into
_TOWER_OPTIONS = {"image_size": "vision_cfg", "context_length": "text_cfg", "patch_dropout": "vision_cfg"}


def register_model_configs() -> None:
    """Register zsprob's model JSONs (configs/models/*.json) with open_clip (once)."""
    global _registered
    if _registered:
        return
    from zsprob.models.plain_cnn import register as register_plaincnn
    from zsprob.utils.paths import model_configs_dir

    register_plaincnn()  # timm models zsprob_plaincnn(_small): zsprob-tiny-bow's image tower

    d = model_configs_dir()
    if d.is_dir():
        open_clip.add_model_config(d)
    _registered = True


def list_models() -> list[str]:
    """Every name :func:`create_model` accepts (open_clip's configs plus zsprob's)."""
    register_model_configs()
    return list(open_clip.list_models())


def _deep_update(base: dict, upd: dict) -> dict:
    """Merge ``upd`` into ``base`` (nested dicts merged key by key); returns ``base``."""
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def get_open_clip_config(name: str) -> dict:
    """A copy of open_clip's config of ``name`` (zsprob's configs registered first); UserError naming close names."""
    register_model_configs()
    cfg = open_clip.get_model_config(name.replace("/", "-"))
    if cfg is None:
        import difflib

        close = difflib.get_close_matches(name, open_clip.list_models(), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"unknown model {name!r}: not an open_clip model name nor a zsprob config in "
                        f"configs/models/ (see zsprob.models.list_models()){hint}")
    return copy.deepcopy(cfg)


def build_open_clip(cfg: dict) -> torch.nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a full model config (random init)."""
    cfg = copy.deepcopy(cfg)
    cfg.pop("preprocess_cfg", None)  # transforms, not a constructor argument (read by _preprocess_cfg)
    custom_text = cfg.pop("custom_text", False)
    if "multimodal_cfg" in cfg:
        raise UserError("CoCa models (multimodal_cfg) are not supported by zsprob")
    vision_cfg = cfg.get("vision_cfg", {})
    if "timm_model_name" in vision_cfg:
        vision_cfg["timm_model_pretrained"] = False  # never fetch timm weights at run time
    if "hf_model_name" in cfg.get("text_cfg", {}):
        raise UserError("open_clip models with Hugging Face text towers are not supported by zsprob")
    cls = open_clip.CustomTextCLIP if custom_text else open_clip.CLIP
    from zsprob.models.bow_text import BowCLIP, is_bow_config

    if is_bow_config(cfg):
        cls = BowCLIP  # open_clip image tower + zsprob's bag-of-words text tower
    try:
        return cls(**cfg)
    except TypeError as e:
        raise UserError(f"invalid open_clip model config: {e}") from None


def _transforms(preprocess_cfg: dict):
    """(train, val) image transforms of a ``preprocess_cfg`` (open_clip's ``image_transform``)."""
    kw = dict(mean=tuple(preprocess_cfg["mean"]), std=tuple(preprocess_cfg["std"]),
              interpolation=preprocess_cfg.get("interpolation"), resize_mode=preprocess_cfg.get("resize_mode"),
              fill_color=preprocess_cfg.get("fill_color", 0))
    size = preprocess_cfg["size"]
    return open_clip.image_transform(size, is_train=True, **kw), open_clip.image_transform(size, is_train=False, **kw)


def preprocess_cfg(open_clip_cfg: dict, pretrained_cfg: dict | None) -> dict:
    """open_clip's preprocessing defaults, merged with the pretrained tag's and the model config's."""
    from dataclasses import asdict

    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    pc = asdict(PreprocessCfg())
    if pretrained_cfg:
        pc = merge_preprocess_dict(pc, pretrained_cfg)
    pc = merge_preprocess_dict(pc, open_clip_cfg.get("preprocess_cfg", {}))
    pc["size"] = open_clip_cfg["vision_cfg"].get("image_size", 224)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in pc.items()}


def wrap(clip_model: torch.nn.Module, config: dict, options: ModelOptions | None = None):
    """ProbCLIP around an open_clip model, with its tokenizer and transforms (``options``: ``config``'s)."""
    from zsprob.models.prob_clip import ProbCLIP

    name = config["name"]
    ctx = config["open_clip_cfg"].get("text_cfg", {}).get("context_length", 77)
    if config.get("tokenizer_dir"):  # a local Hugging Face tokenizer (ProLIP's SigLIP tokenizer), never the hub
        from zsprob.models.hf_tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(config["tokenizer_dir"], context_length=ctx)
        vocab = config["open_clip_cfg"].get("text_cfg", {}).get("vocab_size", 49408)
        if len(tokenizer.tokenizer) > vocab:
            raise UserError(f"the tokenizer in {tokenizer.directory} has {len(tokenizer.tokenizer)} tokens, more than "
                            f"the model's vocabulary of {vocab}: its ids would index past the token embedding")
    else:
        try:
            tokenizer = open_clip.get_tokenizer(name if name in open_clip.list_models() else "", context_length=ctx)
        except Exception as e:  # noqa: BLE001 - e.g. an HF tokenizer that is not cached
            raise UserError(f"cannot build the tokenizer for {name} (a local Hugging Face tokenizer directory "
                            f"goes in tokenizer_dir / --tokenizer DIR): {str(e).splitlines()[0]}") from None
    pre = config["preprocess_cfg"]
    p_train, p_val = _transforms(pre)
    size = pre["size"]
    return ProbCLIP(clip_model, name=name, config=config, embed_dim=config["embed_dim"],
                    options=options or ModelOptions.from_config(config), tokenizer=tokenizer,
                    preprocess_train=p_train, preprocess_val=p_val,
                    image_size=int(size if isinstance(size, int) else size[0]),
                    reinit_params=tuple(config.get("reinit_params", ())))


def model_from_config(config: dict, *, sigma_init: str | None = None):
    """Rebuild a (randomly initialised) ProbCLIP from ``model.config``; weights are loaded separately."""
    register_model_configs()
    for k in ("name", "open_clip_cfg", "embed_dim", "preprocess_cfg"):
        if k not in config:
            raise UserError(f"model config lacks {k!r}")
    config = copy.deepcopy(config)
    options = ModelOptions.from_config(dict(config, sigma_init=sigma_init) if sigma_init else config)
    return wrap(build_open_clip(config["open_clip_cfg"]), config, options)


def _unknown_options(overrides: dict, pretrained) -> str:
    """The error for create_model options that nothing took (``weights`` applies to an official file only)."""
    if "weights" in overrides:
        given = f"{pretrained} is not one" if pretrained not in (None, "") else "no pretrained file is given"
        return (f"weights={overrides['weights']!r} chooses the SWA or raw copy of a PCME++ COCO trainer checkpoint "
                f"given as pretrained; {given}")
    return f"unknown create_model options: {sorted(overrides)}"


def resolve_options(base: dict, overrides: dict, embed_dim: int | None, pretrained=None,
                    checkpoint_config: dict | None = None, **head) -> tuple[dict, ModelOptions, str | None]:
    """(open_clip config, head options, tokenizer directory) of a create_model call: ``base`` (a copy) with the
    open_clip options of ``overrides`` applied, which are used up (a name nothing takes is a UserError).
    ``checkpoint_config``: a zsprob checkpoint being fine-tuned, whose head kind is kept unless overridden."""
    ocfg = base
    zopts = {k: overrides.pop(k) for k in list(overrides) if k in ModelOptions.names() + _OTHER_OPTIONS}
    tokenizer_dir = zopts.pop("tokenizer_dir", None)
    if checkpoint_config is not None:
        zopts = {**ModelOptions.inherited(checkpoint_config), **zopts}
    if "open_clip_cfg" in overrides:
        _deep_update(ocfg, copy.deepcopy(overrides.pop("open_clip_cfg")))
    for key, tower in _TOWER_OPTIONS.items():
        if key in overrides:
            ocfg[tower][key] = overrides.pop(key)
    if "quick_gelu" in overrides:
        ocfg["quick_gelu"] = bool(overrides.pop("quick_gelu"))
    if overrides:
        raise UserError(_unknown_options(overrides, pretrained))
    if embed_dim is not None:
        ocfg["embed_dim"] = int(embed_dim)
    return ocfg, ModelOptions(**head, **zopts), tokenizer_dir


def model_config(name: str, ocfg: dict, options: ModelOptions, *, tokenizer_dir=None,
                 pretrained_cfg: dict | None = None, pretrained=None, reinit: list[str] = ()) -> dict:
    """``model.config``: what :func:`model_from_config` rebuilds the model from (``reinit``: tower parameters
    that kept their random init)."""
    return {
        "name": name,
        "open_clip_cfg": ocfg,
        "embed_dim": int(ocfg["embed_dim"]),
        **options.config(),
        "tokenizer_dir": str(Path(tokenizer_dir).resolve()) if tokenizer_dir else None,
        "preprocess_cfg": preprocess_cfg(ocfg, pretrained_cfg),
        "pretrained": str(pretrained) if pretrained is not None else None,
        "reinit_params": ["clip." + k for k in reinit],
    }

