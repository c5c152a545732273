"""The post-hoc model: a frozen model's towers and means, with log-variance heads that can be trained apart.

:func:`probabilistic_copy` builds the copy (the head is the model's own kind when it has one, else zsprob's
pooled heads or PCME++'s block heads). A :class:`HeadAdapter` is one tower's head seen from the cache:
``encode(inputs)`` gives the frozen mean and the tensor the head reads (stored once in the feature file),
``logvar(features)`` runs the trainable part on it; :func:`adapter_for` picks the kind for a head.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.models.heads import bound_logvar
from zsprob.models.sigma_heads import SigmaHead, UncPooledHead, UncTokenHead
from zsprob.utils.masks import masked_sum

#: the log sigma^2 bias of fresh heads (the demo's recipe value: summed variance small next to CSD's distances)
FRESH_BIAS_INIT = -6.0


def head_kind_for(model) -> str:
    """The ``sigma_head`` a post-hoc copy of ``model`` gets: its own, or ``unc`` (pooled MLP heads)."""
    if not model.deterministic:
        return model.sigma_head
    kinds = {tower.kind for tower in model.towers().values()}
    if kinds <= {"bow", "timm"}:
        return "unc"
    if kinds <= {"vit", "text"} and model.pooling == "native":
        return "block"
    raise UserError(f"post-hoc heads for {model.name} need features to read: this version trains them on "
                    f"bag-of-words and CNN (timm) towers, on ViT + text transformer pairs with native pooling, and on "
                    f"models with their own [UNC] or pooled heads; its towers are {', '.join(sorted(kinds))}")


def probabilistic_copy(frozen, *, seed: int = 0):
    """(model, names of its trainable parameters): ``frozen``'s config with log-variance heads on and its
    state dict loaded, so the means are bit-identical; the heads (also a model's own) start afresh from ``seed``."""
    from zsprob.models.configs import model_from_config

    if not callable(getattr(frozen, "towers", None)) or not hasattr(frozen, "config"):
        raise UserError(f"{type(frozen).__name__} has no image and text towers to read (a jWAE model or another "
                        "kind); post-hoc heads need a zsprob ProbCLIP, an open_clip model or a published one")
    kind = head_kind_for(frozen)
    config = copy.deepcopy(frozen.config)
    if frozen.deterministic:
        config.update(deterministic=False, sigma_head=kind, sigma_bias_init=FRESH_BIAS_INIT, sigma_detach=True,
                      sigma_param="logvar", sigma_shape="diagonal", sigma_ln_init=None)
    torch.manual_seed(int(seed))
    model = model_from_config(config)
    trainable = trainable_names(model)
    kept = {k: v for k, v in frozen.state_dict().items() if k not in trainable}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    if unexpected or set(missing) - trainable:
        raise UserError(f"the post-hoc copy of {frozen.name} does not match its weights (missing "
                        f"{sorted(set(missing) - trainable)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.checkpoint_meta = getattr(frozen, "checkpoint_meta", None)
    return model, trainable


def trainable_names(model) -> set[str]:
    """Names of the parameters post-hoc training may change: the log-variance heads (an [UNC] token's
    projection only)."""
    names = {f"{side}_sigma.{name}" for side in ("image", "text")
             for name, _ in adapter_for(model, side).parameters_named()}
    if model.sigma_readout is not None:
        raise UserError("post-hoc heads support diagonal covariances; this model uses sigma_shape spherical_one")
    return names


class HeadAdapter:
    """One tower's log-variance head, run on cached features (module docstring)."""

    kind = ""

    def __init__(self, model, side: str):
        self.model, self.side = model, side
        self.tower = model.towers()[side]
        self.head = getattr(model, f"{side}_sigma")

    def parameters_named(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.head.named_parameters())

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.parameters_named()]

    def _encode(self, inputs: torch.Tensor, with_sigma: bool):
        encode = self.model.encode_image if self.side == "image" else self.model.encode_text
        return encode(inputs, with_sigma=with_sigma)

    def encode(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(frozen mean [B, D], the head's frozen features [B, F]) of a batch of inputs: by default the input
        the head receives in the model's own forward."""
        return self._hooked_encode(self.head, inputs)

    def _hooked_encode(self, module: nn.Module, inputs: torch.Tensor, **hook) -> tuple[torch.Tensor, torch.Tensor]:
        """(frozen mean, the first input ``module`` receives in the model's forward, as float32)."""
        got = {}

        def grab(_module, args, *_kwargs):
            got["x"] = args[0].detach()

        handle = module.register_forward_pre_hook(grab, **hook)
        try:
            mu, _ = self._encode(inputs, True)
        finally:
            handle.remove()
        return mu, got["x"].float()

    def raw(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    def lengths(self, features: torch.Tensor) -> torch.Tensor | None:
        """Words per row when the features carry them (a bag of words), else None."""
        return None

    def logvar(self, features: torch.Tensor) -> torch.Tensor:
        """log sigma^2 [B, D] from cached features [B, F], as the model's forward computes it."""
        raw = self.raw(features).float()
        if self.model.sigma_param == "logsigma":
            raw = 2.0 * raw
        if self.model.sigma_shape != "diagonal":
            raw = torch.logsumexp(raw, dim=-1, keepdim=True).expand_as(raw) - torch.log(
                torch.tensor(float(raw.shape[-1])))
        return bound_logvar(raw, self.model.var_bounds)

    def projection_input(self, features: torch.Tensor) -> torch.Tensor:
        """The vector the tower's projection maps linearly to the unnormalised mean (for Laplace)."""
        raise UserError(f"the Laplace method needs the projection's input, which the {self.kind} head's features "
                        "do not carry (supported: bag-of-words and CNN towers)")

    def projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [D, w], bias [D] or None) of the tower's projection."""
        proj = self.tower.proj
        linear = [m for m in proj.modules() if isinstance(m, nn.Linear)] if isinstance(proj, nn.Module) else []
        if len(linear) != 1:
            raise UserError("the Laplace method needs a single linear projection on the tower")
        return linear[0].weight, linear[0].bias


class WordsAdapter(HeadAdapter):
    """Bag of words: features = [sum of the caption's word embeddings, number of words]."""

    kind = "words"

    def encode(self, inputs):
        words, _mask, ctx = self.tower.embed(inputs)
        lengths = ctx[1]
        total = masked_sum(words, lengths)
        return self._encode(inputs, False)[0], torch.cat([total.float(), lengths[:, None].float()], dim=1)

    def raw(self, features):
        total, count = features[:, :-1], features[:, -1:]
        return self.head((total + self.head.unc_emb) / (count + 1))

    def projection_input(self, features):
        return features[:, :-1] / features[:, -1:].clamp(min=1)

    def lengths(self, features):
        return features[:, -1]


class PooledAdapter(HeadAdapter):
    """CNN: features = timm's pooled last-stage vector (the projection's input too)."""

    kind = "pooled"

    def projection_input(self, features):
        return features


class TokenAdapter(HeadAdapter):
    """ProLIP's [UNC] token: features = its output after the final LayerNorm; the projection trains."""

    kind = "token"

    def parameters_named(self):
        name = "uncertainty_proj" if self.side == "image" else "text_uncertainty_projection"
        named = [(f"{name}.{n}", p) for n, p in self.head.projection.named_parameters()]
        if self.head.sigma_ln is not None:
            named += [(f"sigma_ln.{n}", p) for n, p in self.head.sigma_ln.named_parameters()]
        return named


class BlockAdapter(HeadAdapter):
    """PCME++'s block head on an open_clip ViT or text transformer: features = the trunk's token outputs (the
    input of the head's copied blocks), flattened, a caption's tokens first (zero padding past the batch's
    longest caption: the text tower is causal, so the positions read are unchanged)."""

    kind = "block"

    def encode(self, inputs):
        mu, x = self._hooked_encode(self.head.blocks[0], inputs, with_kwargs=True)
        if self.tower.kind != "text":
            return mu, x.flatten(1)
        padded = x.new_zeros(x.shape[0], inputs.shape[1], x.shape[2])
        padded[:, :x.shape[1]] = x
        return mu, torch.cat([inputs.float(), padded.flatten(1)], dim=1)

    def raw(self, features):
        tower, head, ctx, mask = self.tower, self.head, None, None
        if tower.kind == "text":
            length = features.shape[1] // (tower.width + 1)
            tokens = features[:, :length].round().long()
            _, mask, ctx = tower.embed(tokens)  # the tower's own mask and truncation for these captions
            x = features[:, length:].view(features.shape[0], length, tower.width)[:, :ctx[0].shape[1]]
        else:
            x = features.view(features.shape[0], -1, tower.width)
        for block in head.blocks:
            x = tower.run_block(block, x, mask)
        return head.finish(tower.project(tower.native_pool(x, head.ln, ctx), head.proj))


def adapter_for(model, side: str) -> HeadAdapter:
    """The :class:`HeadAdapter` of ``model``'s ``side`` head; a head kind without one is a UserError."""
    head = getattr(model, f"{side}_sigma")
    if isinstance(head, UncPooledHead):
        return (WordsAdapter if head.unc_emb is not None else PooledAdapter)(model, side)
    if isinstance(head, UncTokenHead):
        return TokenAdapter(model, side)
    if isinstance(head, SigmaHead) and head.gpo is None and len(head.blocks) and model.mean_head == "proj" \
            and model.towers()[side].kind in ("vit", "text"):
        return BlockAdapter(model, side)
    raise UserError(f"post-hoc training does not know the {side} head {type(head).__name__} of {model.name} "
                    "(supported: pooled MLP heads, ProLIP's [UNC] tokens, natively pooled block heads on ViT / text "
                    "transformers)")


__all__ = ["probabilistic_copy", "head_kind_for", "trainable_names", "adapter_for", "HeadAdapter", "FRESH_BIAS_INIT"]
