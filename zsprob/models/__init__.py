"""zsprob.models: open_clip towers with mean / log-variance heads, the model catalogue, checkpoints, encoding.

May import ``zsprob.errors``, ``zsprob.utils`` and the root package only. The names below load on first
use, so the command line reads the catalogue without torch.

    model = create_model("zsprob-tiny")                 # or "ViT-B-16", pretrained="openai" (cached)
    mu, logvar = model.encode_image(images)             # [B, D] each, float32
    mu, logvar = model.encode_text(model.tokenizer(["a red square"]))
    save(model, "ckpt/", extra={"method": "pcmepp", "step": 1000}); model = load("ckpt/")
"""
import importlib

_HOMES = {"load": "builder", "load_for_inference": "builder", "is_checkpoint": "checkpoint",
          "load_extra_tensors": "checkpoint", "load_meta": "checkpoint", "save": "checkpoint",
          "encode_images": "encode", "encode_texts": "encode", "create_model": "factory", "list_models": "factory",
          "model_from_config": "factory", "register_model_configs": "factory", "GPO": "heads",
          "bound_logvar": "heads", "ProbCLIP": "prob_clip"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = list(_HOMES)
