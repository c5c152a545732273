"""The jWAE model: per-modality MLP autoencoders over the mean features of a frozen deterministic tower
(jWAE, Sec. 3); retrieval uses the l2-normalised codes, training the raw codes and reconstructions.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zsprob.errors import UserError
from zsprob.models.configs import model_from_config

JWAE_KIND = "jwae"
_KEYS = {"latent_dim", "image_hidden", "text_hidden", "decoder"}
_DECODER_KEYS = {"image_hidden", "text_hidden"}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{what} must be a positive integer, got {value!r}")
    return value


def resolve_jwae_config(jwae: Any) -> dict:
    """The checked ``model.jwae`` section (a dict with latent_dim, hidden widths and a decoder)."""
    if not isinstance(jwae, dict) or not jwae.get("decoder"):
        raise UserError("--method jwae needs a model with a decoder config: set model.jwae with a decoder "
                        "(e.g. --config jwae_synthetic.yaml, or --set model.jwae.decoder.image_hidden=512 ...)")
    unknown = set(jwae) - _KEYS
    if unknown:
        raise UserError(f"unknown model.jwae keys {sorted(unknown)} (known: {', '.join(sorted(_KEYS))})")
    dec = jwae["decoder"]
    if not isinstance(dec, dict) or set(dec) - _DECODER_KEYS:
        raise UserError(f"model.jwae.decoder must be a mapping with {', '.join(sorted(_DECODER_KEYS))}, got {dec!r}")
    out = {"latent_dim": _positive_int(jwae.get("latent_dim", 64), "model.jwae.latent_dim"),
           "image_hidden": _positive_int(jwae.get("image_hidden", 512), "model.jwae.image_hidden"),
           "text_hidden": _positive_int(jwae.get("text_hidden", 256), "model.jwae.text_hidden")}
    out["decoder"] = {k: _positive_int(dec.get(k, out[k]), f"model.jwae.decoder.{k}") for k in sorted(_DECODER_KEYS)}
    return out


def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, d_out))


class JWAEModel(nn.Module):
    """A frozen tower plus an image and a text autoencoder meeting in one latent space."""

    deterministic = True
    sigma_depth = 0
    sigma_init = "none"
    var_bounds = None

    def __init__(self, tower: nn.Module, jwae: dict):
        super().__init__()
        cfg = resolve_jwae_config(jwae)
        if not getattr(tower, "deterministic", False):
            raise UserError("the jWAE tower must be deterministic (its mean output is the feature)")
        self.tower = tower.requires_grad_(False).eval()
        d_in, latent = int(tower.embed_dim), cfg["latent_dim"]
        self.image_encoder = _mlp(d_in, cfg["image_hidden"], latent)
        self.image_decoder = _mlp(latent, cfg["decoder"]["image_hidden"], d_in)
        self.text_encoder = _mlp(d_in, cfg["text_hidden"], latent)
        self.text_decoder = _mlp(latent, cfg["decoder"]["text_hidden"], d_in)
        self.feature_dim = d_in
        self.embed_dim = latent
        self.name = f"jwae-{tower.name}"
        self.pooling = tower.pooling
        self.tokenizer = tower.tokenizer
        self.preprocess_train, self.preprocess_val = tower.preprocess_train, tower.preprocess_val
        self.image_size = getattr(tower, "image_size", None)
        self.config = {"kind": JWAE_KIND, "name": self.name, "tower": copy.deepcopy(tower.config), "jwae": cfg}

    def train(self, mode: bool = True):
        super().train(mode)
        self.tower.eval()  # frozen: no dropout, fixed normalisation statistics
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("tower.")]

    @torch.no_grad()
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """The frozen tower's image features [B, feature_dim] (float32, no gradient)."""
        return self.tower.encode_image(images, with_sigma=False)[0].float()

    @torch.no_grad()
    def text_features(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tower.encode_text(tokens, with_sigma=False)[0].float()

    def autoencode_image(self, feats: torch.Tensor):
        """(features, reconstruction, code) of image features."""
        z = self.image_encoder(feats)
        return feats, self.image_decoder(z), z

    def autoencode_text(self, feats: torch.Tensor):
        z = self.text_encoder(feats)
        return feats, self.text_decoder(z), z

    def encode_image(self, images: torch.Tensor, *, with_sigma: bool = True):
        """(l2-normalised latent code [B, latent_dim], None): the retrieval embedding."""
        return F.normalize(self.image_encoder(self.image_features(images)), dim=-1), None

    def encode_text(self, tokens: torch.Tensor, *, with_sigma: bool = True):
        return F.normalize(self.text_encoder(self.text_features(tokens)), dim=-1), None

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor | None]:
        img, _ = self.encode_image(images)
        txt, _ = self.encode_text(tokens)
        return {"img_mu": img, "img_logvar": None, "txt_mu": txt, "txt_logvar": None}

    def extra_repr(self) -> str:
        return f"tower={self.tower.name}, features={self.feature_dim}, latent={self.embed_dim}"


def jwae_from_config(config: dict) -> JWAEModel:
    """Rebuild a (randomly initialised) JWAEModel from ``model.config``; weights are loaded separately."""
    if config.get("kind") != JWAE_KIND or "tower" not in config or "jwae" not in config:
        raise UserError("not a jWAE model config (kind, tower and jwae keys expected)")
    return JWAEModel(model_from_config(config["tower"]), config["jwae"])
