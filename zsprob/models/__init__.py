"""zsprob.models: open_clip towers with mean / log-variance heads, checkpoints, batched encoding.

Owns the probabilistic towers (``prob_clip``, tower adapters in ``towers/``), one way to get a model
(``sources`` says what a spec names, ``configs`` builds from a config, ``weights`` loads weights,
``factory`` puts them together in ``create_model``, ``builder`` rebuilds a checkpoint), the
checkpoint file format (``checkpoint``) and the converters of published files (``convert/``).
Inside the package only ``builder`` imports ``factory``. May import ``zsprob.errors``,
``zsprob.utils`` and the root package only: never data, prob, train, zeroshot or retrieval.

open_clip provides the towers, configs, checkpoint conversion, tokenizers and transforms;
zsprob splits every tower into a shared trunk, a mean head and a log-variance head (PCME++
Sec. 2.5), adds GPO pooling, and saves / loads checkpoints as safetensors + JSON. ``jwae`` holds
jWAE's model (MLP autoencoders over a frozen tower's features); ``load`` rebuilds it too.

    model = create_model("zsprob-tiny")                 # or "ViT-B-16", pretrained="openai" (cached)
    mu, logvar = model.encode_image(images)             # [B, D] each, float32
    mu, logvar = model.encode_text(model.tokenizer(["a red square"]))
    save(model, "ckpt/", extra={"method": "pcmepp", "step": 1000}); model = load("ckpt/")
"""
from zsprob.models.builder import load, load_for_inference
from zsprob.models.checkpoint import is_checkpoint, load_extra_tensors, load_meta, save
from zsprob.models.encode import encode_images, encode_texts
from zsprob.models.factory import create_model, list_models, model_from_config, register_model_configs
from zsprob.models.heads import GPO, bound_logvar
from zsprob.models.prob_clip import ProbCLIP

__all__ = ["create_model", "list_models", "model_from_config", "register_model_configs", "ProbCLIP", "GPO",
           "bound_logvar", "save", "load", "load_meta", "load_extra_tensors", "load_for_inference",
           "is_checkpoint", "encode_images", "encode_texts"]
