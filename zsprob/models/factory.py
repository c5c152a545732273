"""create_model: any open_clip model name or zsprob config -> ProbCLIP.

What open_clip does: the model configs (``open_clip.get_model_config``; zsprob's own JSONs in
``configs/models/`` are registered with ``open_clip.add_model_config``), building the CLIP
model from a config, reading and converting checkpoint files
(``open_clip.factory.load_state_dict``, ``convert_state_dict``, position-embedding resizing),
the tokenizer (``open_clip.get_tokenizer``) and the image transforms
(``open_clip.image_transform``). huggingface_hub's ``try_to_load_from_cache`` answers whether a
pretrained tag's weights are already cached.

What zsprob does: never downloads (a pretrained tag must be in the local cache, otherwise a
:class:`zsprob.UserError` names the file to fetch and where to put it), loads the weights into
the mean branch *before* the log-variance heads are copied (so ``sigma_init="copy"`` copies the
pretrained head), re-initialises projections whose shape differs from the checkpoint (a
different ``embed_dim``), and records everything needed to rebuild the model in
``model.config``.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch

from zsprob.errors import UserError
from zsprob.models.sigma_heads import DEFAULT_BIAS_INIT
from zsprob.models.checkpoint import EXTRA_PREFIX, checkpoint_dir, is_checkpoint, load_meta, read_tensors

log = logging.getLogger(__name__)

ZSPROB_CONFIGS = ("zsprob-tiny", "zsprob-tiny-cnn", "zsprob-tiny-bow", "ViT-S-16-d128", "prolip-tiny", "pcmepp-tiny",
                  "pcmepp-coco-tiny")
_registered = False

# Options of create_model that are zsprob's (everything else in **overrides goes to open_clip).
_ZSPROB_OPTIONS = ("normalize_mu", "gpo_dim", "sigma_bias_init", "truncate_text", "size_augment", "sigma_head",
                   "sigma_layout", "sigma_ln_init", "sigma_ln_init_bias", "tokenizer_dir", "sigma_param",
                   "sigma_shape", "unc_layout", "sigma_detach", "mean_head")


def _open_clip():
    import open_clip

    return open_clip


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
        _open_clip().add_model_config(d)
    _registered = True


def list_models() -> list[str]:
    """Every name :func:`create_model` accepts (open_clip's configs plus zsprob's)."""
    register_model_configs()
    return list(_open_clip().list_models())


def _deep_update(base: dict, upd: dict) -> dict:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def get_open_clip_config(name: str) -> dict:
    register_model_configs()
    oc = _open_clip()
    cfg = oc.get_model_config(name.replace("/", "-"))
    if cfg is None:
        import difflib

        close = difflib.get_close_matches(name, oc.list_models(), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"unknown model {name!r}: not an open_clip model name nor a zsprob config in "
                        f"configs/models/ (see zsprob.models.list_models()){hint}")
    return copy.deepcopy(cfg)


def build_open_clip(cfg: dict) -> torch.nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a full model config (random init)."""
    oc = _open_clip()
    cfg = copy.deepcopy(cfg)
    cfg.pop("preprocess_cfg", None)  # transforms, not a constructor argument (read by _preprocess_cfg)
    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in cfg.get("text_cfg", {})
    if "multimodal_cfg" in cfg:
        raise UserError("CoCa models (multimodal_cfg) are not supported by zsprob")
    vision_cfg = cfg.get("vision_cfg", {})
    if "timm_model_name" in vision_cfg:
        vision_cfg["timm_model_pretrained"] = False  # never fetch timm weights at run time
    if "hf_model_name" in cfg.get("text_cfg", {}):
        raise UserError("open_clip models with Hugging Face text towers are not supported by zsprob")
    cls = oc.CustomTextCLIP if custom_text else oc.CLIP
    from zsprob.models.bow_text import BowCLIP, is_bow_config

    if is_bow_config(cfg):
        cls = BowCLIP  # open_clip image tower + zsprob's bag-of-words text tower
    try:
        return cls(**cfg)
    except TypeError as e:
        raise UserError(f"invalid open_clip model config: {e}") from None


# ----------------------------------------------------------------------------------------
# Pretrained weights: resolve without downloading, load into the mean branch.
# ----------------------------------------------------------------------------------------
_CKPT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
               "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
               "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


def _cached_hf(repo: str, filename: str, cache_dir: str | None) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    try:
        got = try_to_load_from_cache(repo_id=repo, filename=filename, cache_dir=cache_dir)
    except Exception:  # noqa: BLE001 - malformed cache entries count as missing
        return None
    return got if isinstance(got, str) and os.path.isfile(got) else None


def _hf_cache_root(cache_dir: str | None) -> str:
    if cache_dir:
        return cache_dir
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return HF_HUB_CACHE
    except ImportError:  # pragma: no cover
        return os.path.expanduser("~/.cache/huggingface/hub")


def resolve_pretrained(name: str, pretrained: str | os.PathLike, cache_dir: str | None = None) -> tuple[Path, dict]:
    """(checkpoint file, open_clip pretrained cfg) for a tag or a path; never downloads."""
    oc = _open_clip()
    p = Path(pretrained).expanduser()
    if p.is_file():
        return p, {}
    if p.is_dir():
        for fn in _CKPT_NAMES:
            if (p / fn).is_file():
                return p / fn, {}
        cands = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) + sorted(p.glob("*.pt")) \
            + sorted(p.glob("*.pth"))
        if cands:
            return cands[0], {}
        raise UserError(f"no open_clip checkpoint file (.safetensors/.bin/.pt/.pth) in directory {p}")
    tag = str(pretrained)
    looks_like_path = os.sep in tag or tag.endswith((".pt", ".pth", ".bin", ".safetensors", ".npz"))
    cfg = oc.get_pretrained_cfg(name.replace("/", "-"), tag) if not looks_like_path else {}
    if not cfg:
        if looks_like_path:
            raise UserError(f"pretrained checkpoint file not found: {p}")
        tags = oc.list_pretrained_tags_by_model(name.replace("/", "-"))
        raise UserError(f"{tag!r} is neither a pretrained tag of {name} nor an existing file "
                        f"(known tags: {', '.join(tags) if tags else 'none'})")
    if cfg.get("file") and os.path.isfile(cfg["file"]):
        return Path(cfg["file"]), cfg
    wanted = []
    hf = cfg.get("hf_hub", "")
    if hf:
        repo, filename = os.path.split(hf.rstrip("/") if hf.endswith("/") else hf)
        if hf.endswith("/"):
            repo, filename = hf.rstrip("/"), ""
        names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
        if filename.endswith((".bin", ".pth")):
            names.insert(0, filename[:-4] + ".safetensors")
        for fn in names:
            got = _cached_hf(repo, fn, cache_dir)
            if got:
                return Path(got), cfg
        wanted.append(f"https://huggingface.co/{repo} file {names[-1]} into the Hugging Face cache "
                      f"{_hf_cache_root(cache_dir)} (e.g. `huggingface-cli download {repo} {names[-1]}`)")
    url = cfg.get("url", "")
    if url:
        target = Path(cache_dir or os.path.expanduser("~/.cache/clip")) / os.path.basename(url)
        if target.is_file():
            return target, cfg
        wanted.append(f"{url} to {target}")
    raise UserError(f"pretrained weights {name}/{tag} are not in the local cache and zsprob does not download "
                    f"at run time: download {' or '.join(wanted)}; or pass the checkpoint file path as pretrained")


_PROJ_KEYS = ("visual.proj", "text_projection", "text_projection.weight", "text_projection.bias",
              "text.text_projection", "text.text_projection.weight", "text.text_projection.bias",
              "visual.head.proj.weight", "visual.head.proj.bias",  # timm towers (linear / mlp head)
              "visual.head.mlp.fc1.weight", "visual.head.mlp.fc1.bias", "visual.head.mlp.fc2.weight",
              "visual.head.mlp.fc2.bias")


def _load_torchscript_state(path: Path) -> dict | None:
    """State dict of a TorchScript archive (no Python pickle involved), or None if it is not one."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return None
    try:
        sd = torch.jit.load(str(path), map_location="cpu").state_dict()
    except Exception:  # noqa: BLE001
        return None
    for k in ("input_resolution", "context_length", "vocab_size"):
        sd.pop(k, None)
    return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


def load_open_clip_weights(model: torch.nn.Module, path: str | os.PathLike) -> list[str]:
    """Load an open_clip checkpoint file into an open_clip model (strict, except projections).

    Returns the names of projection parameters whose shape differs from the checkpoint (they
    keep their random init). Any other mismatch, a missing / unexpected key or an unreadable
    file raises :class:`UserError`.
    """
    from open_clip.convert import convert_state_dict
    from open_clip.factory import load_state_dict
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    path = Path(path)
    try:
        sd = load_state_dict(str(path), device="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any read / unpickling failure is the user's file
        sd = _load_torchscript_state(path)  # OpenAI's original .pt files are TorchScript archives
        if sd is None:
            raise UserError(f"cannot read open_clip checkpoint {path}: {type(e).__name__}: {e}") from None
    if not isinstance(sd, dict) or not sd:
        raise UserError(f"open_clip checkpoint {path} holds no state dict")
    try:
        sd = convert_state_dict(model, sd)
    except Exception:  # noqa: BLE001 - conversion only applies to third-party formats
        pass
    if "positional_embedding" in sd and not hasattr(model, "positional_embedding"):
        sd = convert_to_custom_text_state_dict(sd)
    for k in ("logit_scale", "logit_bias"):
        own = getattr(model, k, None)
        if k in sd and own is not None and sd[k].ndim != own.ndim:
            sd[k] = sd[k].reshape(own.shape)
    if "logit_bias" not in sd and getattr(model, "logit_bias", None) is not None and "logit_scale" in sd:
        sd["logit_bias"] = torch.zeros_like(model.logit_bias)
    sd.pop("text.transformer.embeddings.position_ids", None)
    try:
        resize_pos_embed(sd, model)
        resize_text_pos_embed(sd, model)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"open_clip checkpoint {path} does not fit model: {e}") from None
    return _load_state_into(model, sd, str(path))


def _load_state_into(model: torch.nn.Module, sd: dict, source: str) -> list[str]:
    """Strict load except projections of another shape (returned; they keep their init)."""
    path = source
    own = model.state_dict()
    reinit, bad = [], []
    for k, v in list(sd.items()):
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            if k in _PROJ_KEYS:
                reinit.append(k)
                del sd[k]
            else:
                bad.append(f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}")
    if bad:
        raise UserError(f"open_clip checkpoint {path} does not match the model config: " + "; ".join(bad[:5]))
    res = model.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if k not in reinit]
    if missing or res.unexpected_keys:
        raise UserError(f"open_clip checkpoint {path} does not match the model: missing {missing[:5]}, "
                        f"unexpected {list(res.unexpected_keys)[:5]}")
    if reinit:
        log.warning("projections %s re-initialised: embed_dim differs from the checkpoint %s", reinit, path)
    return reinit


# ----------------------------------------------------------------------------------------
def _transforms(preprocess_cfg: dict):
    oc = _open_clip()
    kw = dict(mean=tuple(preprocess_cfg["mean"]), std=tuple(preprocess_cfg["std"]),
              interpolation=preprocess_cfg.get("interpolation"), resize_mode=preprocess_cfg.get("resize_mode"),
              fill_color=preprocess_cfg.get("fill_color", 0))
    size = preprocess_cfg["size"]
    return oc.image_transform(size, is_train=True, **kw), oc.image_transform(size, is_train=False, **kw)


def _preprocess_cfg(open_clip_cfg: dict, pretrained_cfg: dict | None) -> dict:
    from dataclasses import asdict

    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    pc = asdict(PreprocessCfg())
    if pretrained_cfg:
        pc = merge_preprocess_dict(pc, pretrained_cfg)
    pc = merge_preprocess_dict(pc, open_clip_cfg.get("preprocess_cfg", {}))
    pc["size"] = open_clip_cfg["vision_cfg"].get("image_size", 224)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in pc.items()}


def _wrap(clip_model: torch.nn.Module, config: dict, sigma_init: str | None = None):
    """ProbCLIP around an open_clip model, with open_clip's tokenizer and transforms."""
    from zsprob.models.prob_clip import ProbCLIP

    oc = _open_clip()
    name = config["name"]
    ctx = config["open_clip_cfg"].get("text_cfg", {}).get("context_length", 77)
    if config.get("tokenizer_dir"):  # a local Hugging Face tokenizer (ProLIP's SigLIP tokenizer), never the hub
        from zsprob.models.hf_tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(config["tokenizer_dir"], context_length=ctx)
    else:
        try:
            tokenizer = oc.get_tokenizer(name if name in oc.list_models() else "", context_length=ctx)
        except Exception as e:  # noqa: BLE001 - e.g. an HF tokenizer that is not cached
            raise UserError(f"cannot build the tokenizer for {name} (a local Hugging Face tokenizer directory "
                            f"goes in tokenizer_dir / --tokenizer DIR): {str(e).splitlines()[0]}") from None
    pre = config["preprocess_cfg"]
    p_train, p_val = _transforms(pre)
    size = pre["size"]
    return ProbCLIP(
        clip_model, name=name, config=config, embed_dim=config["embed_dim"],
        sigma_depth=config["sigma_depth"], sigma_init=sigma_init or config["sigma_init"],
        pooling=config["pooling"], deterministic=config["deterministic"], var_bounds=config["var_bounds"],
        normalize_mu=config.get("normalize_mu", True), gpo_dim=config.get("gpo_dim", 32),
        sigma_bias_init=config.get("sigma_bias_init", 0.0), truncate_text=config.get("truncate_text", True),
        size_augment=config.get("size_augment", 0.0),
        # log-variance heads: a config saved before these keys existed is the legacy block head
        sigma_head=config.get("sigma_head", "block"), sigma_layout=config.get("sigma_layout", "legacy"),
        sigma_ln_init=config.get("sigma_ln_init"), sigma_ln_init_bias=config.get("sigma_ln_init_bias", 0.0),
        sigma_param=config.get("sigma_param", "logvar"), sigma_shape=config.get("sigma_shape", "diagonal"),
        unc_layout=config.get("unc_layout", "zsprob"), sigma_detach=config.get("sigma_detach", False),
        mean_head=config.get("mean_head", "proj"),
        tokenizer=tokenizer, preprocess_train=p_train, preprocess_val=p_val,
        image_size=int(size if isinstance(size, int) else size[0]),
        reinit_params=tuple(config.get("reinit_params", ())))


def model_from_config(config: dict, *, sigma_init: str | None = None):
    """Rebuild a (randomly initialised) ProbCLIP from ``model.config``; weights are loaded separately."""
    register_model_configs()
    for k in ("name", "open_clip_cfg", "embed_dim", "sigma_depth", "sigma_init", "pooling", "deterministic",
              "var_bounds", "preprocess_cfg"):
        if k not in config:
            raise UserError(f"model config lacks {k!r}")
    clip_model = build_open_clip(config["open_clip_cfg"])
    return _wrap(clip_model, copy.deepcopy(config), sigma_init=sigma_init)


def sniff_official(pretrained) -> tuple[dict, str] | None:
    """(state dict, layout) when ``pretrained`` is a published ProLIP / PCME++ checkpoint, else None."""
    from zsprob.models.convert.load import sniff

    return sniff(pretrained)


def _unknown_options(overrides: dict, pretrained) -> str:
    """The error for create_model options that nothing took (``weights`` applies to an official file only)."""
    if "weights" in overrides:
        given = f"{pretrained} is not one" if pretrained not in (None, "") else "no pretrained file is given"
        return (f"weights={overrides['weights']!r} chooses the SWA or raw copy of a PCME++ COCO trainer checkpoint "
                f"given as pretrained; {given}")
    return f"unknown create_model options: {sorted(overrides)}"


def create_from_official(name: str, source, state: dict, kind: str, **options: Any):
    """A ProbCLIP built as ``name`` with the options that reproduce the official forward, then filled strictly.

    A model whose config names a Hugging Face tokenizer (ProLIP's SigLIP one) needs it locally:
    ``tokenizer_dir``, or a tokenizer directory beside the weights.
    The loss's official tensors (PCME++'s shift / negative_scale) are kept as ``model.official_loss``.
    ``weights`` ("swa-text" | "swa" | "raw"; None: the official final evaluation's) picks the copy of a COCO
    trainer file with SWA copies (:mod:`zsprob.models.convert.swa`); the choice is ``config["official_weights"]``.
    """
    from zsprob.models.convert.load import load_official, official_options
    from zsprob.models.convert.swa import select_weights

    if options.get("deterministic", False) is None:  # None: the file's own
        options.pop("deterministic")
    state, chosen = select_weights(state, kind, options.pop("weights", None), source)
    fixed = official_options(kind, state, source)
    clash = sorted(k for k in fixed if k in options and options[k] != fixed[k])
    if clash:
        raise UserError(f"{source} is an official {kind} checkpoint: {', '.join(clash)} must be as it was trained "
                        f"({', '.join(f'{k}={fixed[k]!r}' for k in clash)})")
    options.update(fixed)
    hf_tokenizer = get_open_clip_config(name).get("text_cfg", {}).get("hf_tokenizer_name")
    if hf_tokenizer or options.get("tokenizer_dir"):
        from zsprob.models.hf_tokenizer import find_tokenizer_dir

        options["tokenizer_dir"] = str(find_tokenizer_dir(source, options.get("tokenizer_dir")))
    model = create_model(name, None, **options)
    model.official_loss = load_official(model, state, kind, source)
    model.config.update(pretrained=str(source), official_layout=kind)
    if chosen is not None:
        model.config["official_weights"] = chosen
    return model


def create_model(name: str, pretrained: str | os.PathLike | None = None, *, embed_dim: int | None = None,
                 sigma_depth: int = 1, sigma_init: str = "random", pooling: str = "gpo",
                 deterministic: bool | None = None, var_bounds=None, cache_dir: str | None = None,
                 seed: int | None = None, **overrides: Any):
    """Build a :class:`~zsprob.models.prob_clip.ProbCLIP`.

    name: an open_clip model name (``open_clip.list_models()``, e.g. ``ViT-B-16``) or a zsprob
        config from configs/models/ (``zsprob-tiny``, ``ViT-S-16-d128``).
    pretrained: None (random init), an open_clip pretrained tag whose weights are in the local
        cache (``openai``, ``laion2b_s34b_b88k``, ...), or a path to an open_clip checkpoint
        (state dict in .pt/.pth/.bin/.safetensors, or a directory holding one). The weights go into
        the mean branch; the log-variance branch follows ``sigma_init``. A published ProLIP or
        PCME++ checkpoint (file or Hugging Face directory, :mod:`zsprob.models.convert`) is
        recognised by its key names and loaded whole and strictly, the head options from its layout
        (a COCO trainer file's SWA or raw copy: option ``weights``, :func:`create_from_official`).
    embed_dim: embedding size D (default: the config's). A pretrained projection of another size
        is re-initialised (and marked ``backbone=False`` in :meth:`param_info`).
    sigma_depth, sigma_init, pooling, deterministic, var_bounds: see :class:`ProbCLIP`; deterministic=None
        is False, or a published file's own (a PCME++ COCO mu-only file: True; a contradicting value: error).
    seed: seeds torch's RNG before building, so random inits are reproducible.
    overrides: zsprob options ``sigma_head`` ("block" | "unc"), ``sigma_layout`` ("official" |
        "legacy"), ``sigma_ln_init`` (None), ``sigma_ln_init_bias`` (0.0) (see
        :mod:`zsprob.models.sigma_heads`), ``sigma_param`` ("logvar" | "logsigma": the head predicts
        log sigma, as PCME's code), ``sigma_shape`` ("diagonal" | "spherical_mean" | "spherical_one",
        Pishdad et al.), ``normalize_mu`` (True), ``gpo_dim`` (32),
        ``sigma_bias_init`` (0.0; -10 with ``sigma_head="unc"``, ProLIP's init_unc_bias),
        ``truncate_text`` (True), ``size_augment`` (0.0; VSE infinity / PCME++ use 0.2 for fine-tuning),
        ``tokenizer_dir`` (a local Hugging Face tokenizer directory, e.g. ProLIP's SigLIP tokenizer),
        ``unc_layout`` ("zsprob" | "prolip"), ``mean_head`` ("proj" | "fc": PCME++'s COCO trainer layout);
        open_clip options ``image_size``, ``context_length``,
        ``quick_gelu``, ``patch_dropout``; or ``open_clip_cfg={...}`` merged into the open_clip
        config (e.g. ``{"vision_cfg": {"layers": 2}}``).
    """
    register_model_configs()
    zs_ckpt = pretrained is not None and str(pretrained) != "" and is_checkpoint(pretrained)
    official = None if zs_ckpt or pretrained is None or str(pretrained) == "" else sniff_official(pretrained)
    if official is not None:  # a published ProLIP / PCME++ file: converted in memory, strictly
        if embed_dim is not None and int(embed_dim) == int(get_open_clip_config(name).get("embed_dim", -1)):
            embed_dim = None  # the model's own size (e.g. a recipe's D = 1024) is no change
        if embed_dim is not None:
            raise UserError(f"{pretrained} is an official {official[1]} checkpoint: its architecture is fixed "
                            "(no embed_dim option)")
        return create_from_official(name, pretrained, *official, var_bounds=var_bounds, seed=seed,
                                    deterministic=deterministic, **overrides)
    if zs_ckpt:  # a zsprob checkpoint: its open_clip config is the base
        zs_meta = load_meta(pretrained)
        ocfg = copy.deepcopy(zs_meta["config"]["open_clip_cfg"])
    else:
        ocfg = get_open_clip_config(name)
    zopts = {k: overrides.pop(k) for k in list(overrides) if k in _ZSPROB_OPTIONS}
    if zs_ckpt:  # fine-tuning a zsprob checkpoint keeps its log-variance head kind unless told otherwise
        for key, missing in (("sigma_head", "block"), ("sigma_layout", "legacy"), ("sigma_ln_init", None),
                             ("sigma_ln_init_bias", 0.0), ("sigma_param", "logvar"), ("sigma_shape", "diagonal"),
                             ("unc_layout", "zsprob"), ("sigma_detach", False), ("mean_head", "proj")):
            zopts.setdefault(key, zs_meta["config"].get(key, missing))
    if "open_clip_cfg" in overrides:
        _deep_update(ocfg, copy.deepcopy(overrides.pop("open_clip_cfg")))
    if "image_size" in overrides:
        ocfg["vision_cfg"]["image_size"] = overrides.pop("image_size")
    if "context_length" in overrides:
        ocfg["text_cfg"]["context_length"] = overrides.pop("context_length")
    if "patch_dropout" in overrides:
        ocfg["vision_cfg"]["patch_dropout"] = overrides.pop("patch_dropout")
    if "quick_gelu" in overrides:
        ocfg["quick_gelu"] = bool(overrides.pop("quick_gelu"))
    if overrides:
        raise UserError(_unknown_options(overrides, pretrained))
    if embed_dim is not None:
        ocfg["embed_dim"] = int(embed_dim)

    ckpt, pcfg = (None, {})
    if zs_ckpt:
        pass
    elif pretrained is not None and str(pretrained) != "":
        ckpt, pcfg = resolve_pretrained(name, pretrained, cache_dir=cache_dir)
        if pcfg.get("quick_gelu", False) and not ocfg.get("quick_gelu", False):
            ocfg["quick_gelu"] = True  # e.g. OpenAI weights were trained with QuickGELU
    if seed is not None:
        torch.manual_seed(int(seed))

    clip_model = build_open_clip(ocfg)
    reinit: list[str] = []
    zs_rest: dict = {}
    if ckpt is not None:
        reinit = load_open_clip_weights(clip_model, ckpt)
    elif zs_ckpt:
        tensors = read_tensors(checkpoint_dir(pretrained), zs_meta, verify=True)
        clip_sd = {k[len("clip."):]: v for k, v in tensors.items() if k.startswith("clip.")}
        if zs_meta["config"].get("mean_head", "proj") == "fc":  # the saved tower has no ln_post / projections
            from zsprob.models.prob_clip import strip_mean_projection_

            strip_mean_projection_(clip_model)
        reinit = _load_state_into(clip_model, clip_sd, str(pretrained))
        zs_rest = {k: v for k, v in tensors.items() if not k.startswith(("clip.", EXTRA_PREFIX))}

    config = {
        "name": name,
        "open_clip_cfg": ocfg,
        "embed_dim": int(ocfg["embed_dim"]),
        "sigma_depth": int(sigma_depth),
        "sigma_init": sigma_init,
        "pooling": pooling,
        "deterministic": bool(deterministic),
        "var_bounds": list(var_bounds) if var_bounds is not None else None,
        "normalize_mu": bool(zopts.get("normalize_mu", True)),
        "gpo_dim": int(zopts.get("gpo_dim", 32)),
        "sigma_head": zopts.get("sigma_head", "block"),
        "sigma_layout": zopts.get("sigma_layout", "official"),  # new models: PCME++'s official layout
        "sigma_ln_init": zopts.get("sigma_ln_init"),
        "sigma_ln_init_bias": zopts.get("sigma_ln_init_bias", 0.0),
        "sigma_param": zopts.get("sigma_param", "logvar"),
        "sigma_shape": zopts.get("sigma_shape", "diagonal"),
        "unc_layout": zopts.get("unc_layout", "zsprob"),
        "sigma_detach": bool(zopts.get("sigma_detach", False)),
        "mean_head": zopts.get("mean_head", "proj"),
        "sigma_bias_init": zopts.get("sigma_bias_init", DEFAULT_BIAS_INIT.get(zopts.get("sigma_head", "block"), 0.0)),
        "truncate_text": bool(zopts.get("truncate_text", True)),
        "size_augment": float(zopts.get("size_augment", 0.0)),
        "tokenizer_dir": str(Path(zopts["tokenizer_dir"]).resolve()) if zopts.get("tokenizer_dir") else None,
        "preprocess_cfg": _preprocess_cfg(ocfg, pcfg),
        "pretrained": str(pretrained) if pretrained is not None else None,
        "reinit_params": ["clip." + k for k in reinit],
    }
    if zs_ckpt:
        config["preprocess_cfg"] = copy.deepcopy(zs_meta["config"].get("preprocess_cfg", config["preprocess_cfg"]))
        config["preprocess_cfg"]["size"] = ocfg["vision_cfg"].get("image_size", 224)
    model = _wrap(clip_model, config)
    if zs_rest:
        # the checkpoint's heads (GPO, log-variance heads) are reused, group by group, where they fit
        own = model.state_dict()
        loaded, skipped = [], []
        for group in ("image_head", "text_head", "image_gpo", "text_gpo", "image_sigma", "text_sigma", "sigma_readout"):
            mine = {k: v for k, v in own.items() if k.split(".")[0] == group}
            theirs = {k: v for k, v in zs_rest.items() if k.split(".")[0] == group}
            if not mine:
                continue
            if set(mine) == set(theirs) and all(mine[k].shape == theirs[k].shape for k in mine):
                model.load_state_dict(theirs, strict=False)
                loaded.append(group)
            else:
                skipped.append(group)
        model.config["heads_from_checkpoint"] = loaded
        if skipped:
            log.warning("zsprob checkpoint %s: %s do not fit this model (sigma_depth / pooling / embed_dim "
                        "differ) and keep their fresh init (sigma_init=%r)", pretrained, skipped, sigma_init)
    return model


__all__ = ["create_model", "create_from_official", "sniff_official", "list_models", "register_model_configs", "resolve_pretrained",
           "load_open_clip_weights", "model_from_config", "build_open_clip", "get_open_clip_config",
           "ZSPROB_CONFIGS"]
