"""ProbCLIP: an open_clip CLIP model turned into a pair of Gaussian encoders (PCME++ Sec. 2.5).

What open_clip does: the towers themselves (patch / token embeddings, residual attention
blocks, final LayerNorms, projections, the causal text mask, pooling by CLS / end-of-text
token), the tokenizers and the image transforms. The wrapped model is kept whole as
``self.clip``, so an open_clip state dict loads into it unchanged and, with native pooling,
the mean branch runs open_clip's operations. One shortcut: when native pooling reads fixed
positions (a ViT's class token, ProLIP's appended text [CLS], the [UNC] tokens) and no head reads
the other tokens, the last block runs its queries, attention output and MLP at those positions
only (every token stays a key and a value), which equals the whole block up to float rounding.

What zsprob adds here: the log-variance heads (``sigma_head``; the modules, layouts and init
laws are in :mod:`zsprob.models.sigma_heads`) and the code that runs them beside the mean branch.
With ``sigma_head="block"`` (PCME++) each tower is split into a shared trunk (all but the last
``n`` residual blocks, ``n = sigma_depth``), a mean head (the last ``n`` blocks, the tower's own
final LayerNorm and projection) and a log-variance head (a deep copy of those ``n`` blocks and
the projection - PCME++'s official layout has no LayerNorm before it, the legacy layout a copy
of the final LayerNorm - re-initialised randomly by default or kept as a copy), each pooled
either natively (CLS / end-of-text token, as open_clip) or by GPO (:mod:`zsprob.models.heads`).
With ``sigma_head="unc"`` (ProLIP) the whole tower is shared: a learned [UNC] token joins the
token sequence (the tower adapters of :mod:`zsprob.models.towers` know where: after the class
token of a ViT, after the last position of a text transformer, with the extra attention-mask row
/ column) and its output gives log sigma^2; bag-of-words and CNN towers read log sigma^2 from a
small MLP on a pooled vector instead.
With ``sigma_head="pcme"`` (PCME) the whole tower is shared too: each adapter's ``local_features``
gives what PCME's attention module reads (a ViT's patch tokens, a CNN's last-stage cells, a text
transformer's tokens, a bag of words' word vectors) and, for images, the pooled feature its
residual fc reads.

Pooling ``"gpo"``: the final LayerNorm and the projection are applied to *every* token and
GPO pools the projected tokens (as PCME++ does: GPO over embedding-space token features).
Image tokens: the class token and all patch tokens. Text tokens: start-of-text up to and
including the end-of-text token (the length comes from the EOT position, later padding is
ignored).

timm image towers (open_clip's ``TimmModel``: ConvNeXt, ResNet, EfficientNet, RegNet trunks and
zsprob's own timm-registered ``zsprob_plaincnn``):
the "blocks" are the trunk's stages, so the log-variance head copies the last ``n`` stages plus
what follows them (EfficientNet's conv_head, ConvNeXt's norm_pre and head norm, the global
pooling) and open_clip's projection head. Native pooling is timm's own global pooling (the mean
branch then equals open_clip's ``encode_image``); GPO pools the projected H x W positions of the
final feature map. timm provides the stages, their init and ``forward_head``'s operations; zsprob
only decides where to cut.

Bag-of-words text towers (:mod:`zsprob.models.bow_text`, the SynthWorld model): no blocks; the
mean head is the word-embedding projection, the log-variance head a second projection of the
same embeddings, each pooled over the caption's tokens (masked mean natively, or GPO).

Mean head ``"fc"`` (``mean_head``; default ``"proj"`` is open_clip's own head): the layout of
PCME++'s official COCO trainer (``pcmepp/models/img_encoder.py``, ``txt_encoder.py``,
``pcmepp/modules/clip/model.py``). The CLIP image tower loses ``ln_post`` and ``proj``, the text
tower ``text_projection`` (set to Identity / None on the wrapped open_clip model, so its state
dict has no such keys); a biased ``nn.Linear(width, D)`` (``image_head.fc`` / ``text_head.fc``)
is applied to every token instead - image: the raw outputs of the last block (class token and
patches, no LayerNorm), text: ``ln_final`` of every token - and GPO pools the result
(``pooling="gpo"``; the official code's ``no_gpo`` option is native pooling here). The block
log-variance head takes the same form: its duplicated blocks, no LayerNorm (official layout),
its own biased ``Linear(width, D)`` and GPO. Only the block head goes with it.

SizeAugment (VSE infinity, used by PCME++ fine-tuning; ``size_augment=p``, off by default):
in training with GPO, image tokens are randomly dropped before pooling (both heads drop the
same tokens).

Outputs: ``mu`` l2-normalised (``normalize_mu=True``), ``logvar`` raw (no normalisation or
sigmoid; PCME's ablation; a LayerNorm only with ``sigma_ln_init``, PCME++'s option) plus a
learnable per-dimension bias initialised to ``sigma_bias_init``, optionally squashed into
variance bounds (Pishdad et al.: [0.1, 10]).
Both are returned as float32 (also under bf16 autocast) so distances stay accurate.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zsprob.errors import UserError
from zsprob.models.heads import GPO, bound_logvar
from zsprob.models.sigma_heads import (SIGMA_HEADS, SIGMA_LAYOUTS, SIGMA_PARAMS, SIGMA_SHAPES,
                                       UNC_EMBEDDING_NAMES, UNC_LAYOUTS, PCMEUncertaintyHead, SigmaHead,
                                       spherical_readout, UncPooledHead, UncTokenHead, make_sigma_ln,
                                       reinit_block_legacy_,
                                       reinit_block_official_, reinit_cnn_head_, reinit_projection_legacy_,
                                       reinit_projection_official_)
from zsprob.models.towers import text_tower, vision_tower
from zsprob.models.towers.bow import BowTextTower as _BowTextTower  # noqa: F401 - tests patch it here


def _open_clip():
    import open_clip

    return open_clip


# --------------------------------------------------------------------------------------
# Building the log-variance heads (the modules themselves live in zsprob.models.sigma_heads).
# --------------------------------------------------------------------------------------
def _check_choices(**options) -> None:
    """Each keyword is (value, allowed values): a UserError naming the first option out of its set."""
    for name, (value, allowed) in options.items():
        if value not in allowed:
            raise UserError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


MEAN_HEADS = ("proj", "fc")


def strip_mean_projection_(clip_model: nn.Module) -> nn.Module:
    """``mean_head="fc"``: drop open_clip's ``visual.ln_post``, ``visual.proj`` and ``text_projection``.

    ``ln_post`` becomes ``nn.Identity`` and the projections ``None`` (open_clip's own towers skip a
    ``None`` projection), so the wrapped model's state dict holds no such keys. Idempotent.
    """
    from open_clip.transformer import VisionTransformer

    if not isinstance(clip_model, _open_clip().CLIP) or not isinstance(clip_model.visual, VisionTransformer):
        raise UserError("mean_head 'fc' (PCME++'s COCO layout) needs an open_clip CLIP with a ViT image tower and "
                        "the built-in text transformer")
    visual = clip_model.visual
    visual.ln_post = nn.Identity()
    visual.proj = None
    clip_model.text_projection = None
    return clip_model


def _fc_head(width: int, embed_dim: int, side: str) -> nn.ModuleDict:
    """The official COCO mean head ``fc``: image Xavier-uniform weight and zero bias (``EncoderImageAggr``),
    text ``nn.Linear``'s defaults (``ProbEncoderTextClip.linear``)."""
    fc = nn.Linear(width, embed_dim)
    if side == "image":
        nn.init.xavier_uniform_(fc.weight)
        nn.init.zeros_(fc.bias)
    return nn.ModuleDict({"fc": fc})


def _check_sigma_options(sigma_head, sigma_layout, sigma_init, deterministic, sigma_ln_init, sigma_ln_init_bias,
                         sigma_bias_init) -> None:
    if sigma_head not in SIGMA_HEADS:
        raise UserError(f"sigma_head must be one of {', '.join(SIGMA_HEADS)}, got {sigma_head!r}")
    if sigma_layout not in SIGMA_LAYOUTS:
        raise UserError(f"sigma_layout must be one of {', '.join(SIGMA_LAYOUTS)}, got {sigma_layout!r}")
    if sigma_head in ("unc", "pcme") and deterministic:
        raise UserError(f"sigma_head {sigma_head!r} needs a probabilistic model; a deterministic model (InfoNCE / "
                        "triplet methods) has no log-variance head")
    if sigma_head in ("unc", "pcme") and sigma_init == "copy":
        raise UserError(f"sigma_init 'copy' has nothing to copy with sigma_head {sigma_head!r} (no duplicated "
                        "blocks); use sigma_init 'random'")
    for key, value in (("sigma_ln_init", sigma_ln_init), ("sigma_ln_init_bias", sigma_ln_init_bias),
                       ("sigma_bias_init", sigma_bias_init)):
        if value is None and key == "sigma_ln_init":
            continue
        try:
            finite = not isinstance(value, bool) and math.isfinite(float(value))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise UserError(f"{key} must be a finite number{' or null' if key == 'sigma_ln_init' else ''}, "
                            f"got {value!r}")


def _check_model_options(*, pooling, sigma_init, sigma_head, sigma_layout, deterministic, sigma_ln_init,
                         sigma_ln_init_bias, sigma_bias_init, var_bounds, unc_layout, sigma_param, sigma_shape,
                         mean_head, size_augment):
    """Every ProbCLIP option that can be checked before anything is built; returns var_bounds as floats."""
    if pooling not in ("gpo", "native"):
        raise UserError(f"pooling must be 'gpo' or 'native', got {pooling!r}")
    if sigma_init not in ("random", "copy"):
        raise UserError(f"sigma_init must be 'random' or 'copy', got {sigma_init!r}")
    _check_sigma_options(sigma_head, sigma_layout, sigma_init, deterministic, sigma_ln_init,
                         sigma_ln_init_bias, sigma_bias_init)
    _check_choices(unc_layout=(unc_layout, UNC_LAYOUTS), sigma_param=(sigma_param, SIGMA_PARAMS),
                   sigma_shape=(sigma_shape, SIGMA_SHAPES), mean_head=(mean_head, MEAN_HEADS))
    if mean_head == "fc" and sigma_head != "block":
        raise UserError(f"mean_head 'fc' (PCME++'s COCO layout) goes with sigma_head 'block', got {sigma_head!r}")
    if not 0.0 <= float(size_augment) < 1.0:
        raise UserError(f"size_augment must be in [0, 1), got {size_augment}")
    if var_bounds is None:
        return None
    bounds = (float(var_bounds[0]), float(var_bounds[1]))
    if not (0 < bounds[0] < bounds[1]):
        raise UserError(f"var_bounds must satisfy 0 < lo < hi, got {bounds}")
    return bounds


def _make_unc_head(tower, side: str, embed_dim: int, bias_init: float, sigma_ln) -> nn.Module:
    """[UNC] token head for open_clip transformer towers, pooled-MLP head for bag-of-words / CNN towers."""
    if tower.kind in ("vit", "text"):
        return UncTokenHead(side, tower.width, embed_dim, bias_init, sigma_ln)
    if tower.kind == "bow":
        return UncPooledHead(tower.width, embed_dim, bias_init, word_init_std=tower.src.embed_init_std,
                             sigma_ln=sigma_ln)
    if tower.kind == "timm":
        return UncPooledHead(tower.width, embed_dim, bias_init, sigma_ln=sigma_ln)
    raise UserError(f"sigma_head 'unc' cannot serve a {tower.kind} tower")


def _reinit_block_head_(head: SigmaHead, tower, side: str, official: bool, bias_init: float,
                        with_sigma_ln: bool) -> None:
    """Random init of a block head: official (PCME++'s code) or legacy laws; CNN heads: layer defaults."""
    if tower.kind == "timm":
        reinit_cnn_head_(head)
        return
    width, num_layers = tower.width, tower.num_blocks
    if official:
        for block in head.blocks:
            reinit_block_official_(block, side, width, num_layers)
        reinit_projection_official_(head, side, width, bias_init, with_sigma_ln)
        return
    for block in head.blocks:
        reinit_block_legacy_(block, width, num_layers)
    reinit_projection_legacy_(head, width)


# --------------------------------------------------------------------------------------
class ProbCLIP(nn.Module):
    """Gaussian image and text encoders on top of an open_clip CLIP model.

    Build with :func:`zsprob.models.create_model` (or :func:`zsprob.models.load`). Arguments:

    clip_model: an open_clip ``CLIP`` / ``CustomTextCLIP`` with a VisionTransformer or timm
        (ResNet / EfficientNet / RegNet / ConvNeXt / zsprob_plaincnn) image tower and a
        TextTransformer text tower, or a :class:`zsprob.models.bow_text.BowCLIP` (bag-of-words
        text); it becomes ``self.clip`` (the trunk and mean heads).
    config: the dict that rebuilds this model (see :func:`zsprob.models.configs.model_from_config`).
    sigma_depth: number of final blocks in each head (n); the trunk is the other L - n blocks
        (a bag-of-words text tower has no blocks: its heads are a projection + pooling each).
    sigma_init: "random" (re-initialised copy, PCME++) or "copy" (the mean head's weights).
    pooling: "gpo" or "native" (CLS / EOT token as open_clip).
    deterministic: no log-variance heads (logvar is None), for InfoNCE / triplet baselines.
    var_bounds: None or (lo, hi) variance bounds, e.g. (0.1, 10).
    sigma_head: "block" (PCME++: duplicated last blocks), "unc" (ProLIP's [UNC] token; a
        pooled MLP on bag-of-words and CNN towers) or "pcme" (PCME's local-attention modules over
        patch tokens, CNN cells or word vectors); see :mod:`zsprob.models.sigma_heads`.
    sigma_param: "logvar" or "logsigma" (the head's output is log sigma; logvar = 2 x output).
    sigma_shape: "diagonal", "spherical_mean" or "spherical_one" (Pishdad et al.).
    sigma_layout: "official" (PCME++'s code: no LayerNorm before the sigma projection, the
        official init laws) or "legacy" (zsprob's earlier layout) for ``sigma_head="block"``.
        :func:`create_model` builds "official"; a saved config without the key means "legacy".
    sigma_bias_init: initial bias of log sigma^2 (the block head's bias, the [UNC] projection's
        bias, the MLP's output bias).
    sigma_ln_init, sigma_ln_init_bias: None (default) or the weight init of a LayerNorm on
        log sigma^2 (PCME++'s ``sigma_ln_init``, e.g. 0.01) and its bias init.
    unc_layout: "zsprob" (default; log sigma^2 from the [UNC] output, as the ProLIP paper describes)
        or "prolip" (what ProLIP's released code computes, for its published weights: ``ln_post``
        twice on the image class token, text log sigma^2 from the projected [CLS] output).
    sigma_detach: False (default) or True: the log sigma^2 heads read the trunk's features
        detached, so no loss term reaches the trunk (or the means) through sigma; the trunk is
        shaped by the means alone. Not for [UNC] tokens, which run inside the tower.
    mean_head: "proj" (default: the tower's final LayerNorm and projection, as open_clip) or "fc"
        (PCME++'s COCO trainer: no ``ln_post`` / projections, a biased Linear on every token before
        pooling; ViT + CLIP text towers and ``sigma_head="block"`` only; module docstring).
    """

    #: the log-variance heads' modules (the trainer can clip their gradients apart: optim.grad_clip_split)
    SIGMA_MODULES = ("image_sigma", "text_sigma", "sigma_readout")

    def __init__(self, clip_model: nn.Module, *, name: str, config: dict, embed_dim: int,
                 sigma_depth: int = 1, sigma_init: str = "random", pooling: str = "gpo",
                 deterministic: bool = False, var_bounds=None, normalize_mu: bool = True,
                 gpo_dim: int = 32, sigma_bias_init: float = 0.0, truncate_text: bool = True,
                 size_augment: float = 0.0, sigma_head: str = "block", sigma_layout: str = "official",
                 sigma_ln_init: float | None = None, sigma_ln_init_bias: float = 0.0,
                 sigma_param: str = "logvar", sigma_shape: str = "diagonal", unc_layout: str = "zsprob",
                 sigma_detach: bool = False, mean_head: str = "proj", tokenizer=None, preprocess_train=None,
                 preprocess_val=None, image_size: int | None = None, reinit_params: tuple[str, ...] = ()):
        super().__init__()
        var_bounds = _check_model_options(
            pooling=pooling, sigma_init=sigma_init, sigma_head=sigma_head, sigma_layout=sigma_layout,
            deterministic=deterministic, sigma_ln_init=sigma_ln_init, sigma_ln_init_bias=sigma_ln_init_bias,
            sigma_bias_init=sigma_bias_init, var_bounds=var_bounds, unc_layout=unc_layout, sigma_param=sigma_param,
            sigma_shape=sigma_shape, mean_head=mean_head, size_augment=size_augment)
        self.clip = clip_model
        self.name = name
        self.config = config
        self.embed_dim = int(embed_dim)
        self.sigma_depth = int(sigma_depth)
        self.sigma_init = sigma_init
        self.sigma_head = sigma_head
        self.sigma_layout = sigma_layout
        self.unc_layout = unc_layout
        self.mean_head = mean_head
        self.sigma_detach = bool(sigma_detach)
        self.sigma_ln_init = None if sigma_ln_init is None else float(sigma_ln_init)
        self.sigma_ln_init_bias = float(sigma_ln_init_bias)
        self.sigma_param, self.sigma_shape = sigma_param, sigma_shape
        self.pooling = pooling
        self.deterministic = bool(deterministic)
        self.var_bounds = var_bounds
        self.normalize_mu = bool(normalize_mu)
        self.tokenizer = tokenizer
        self.preprocess_train = preprocess_train
        self.preprocess_val = preprocess_val
        self.image_size = image_size
        self.grad_checkpointing = False
        self.size_augment = float(size_augment)
        self._reinit_params = set(reinit_params)

        if mean_head == "fc":
            strip_mean_projection_(clip_model)
        self._vision = vision_tower(clip_model)
        self._text = text_tower(clip_model, truncate_text)
        if mean_head == "fc":
            self.image_head = _fc_head(self._vision.width, self.embed_dim, "image")
            self.text_head = _fc_head(self._text.width, self.embed_dim, "text")
        else:
            self.image_head = self.text_head = None
        self._check_sigma_depth()
        # logit_scale / logit_bias of open_clip are not used by zsprob's losses: keep them (so
        # open_clip state dicts load strictly) but frozen, so DDP sees no unused trainable params.
        for pname in ("logit_scale", "logit_bias"):
            p = getattr(clip_model, pname, None)
            if isinstance(p, nn.Parameter):
                p.requires_grad_(False)

        gpo = (lambda: GPO(gpo_dim, gpo_dim)) if pooling == "gpo" else (lambda: None)
        self.image_gpo = gpo()
        self.text_gpo = gpo()
        if unc_layout == "prolip" and sigma_head == "unc" and self._text.kind == "text" \
                and self._text.width != self.embed_dim:
            raise UserError(f"unc_layout 'prolip' reads log sigma^2 from the projected text output, so it needs "
                            f"text width = embed_dim (got {self._text.width} and {self.embed_dim})")
        if self.deterministic:
            self.image_sigma = None
            self.text_sigma = None
        else:
            self.image_sigma = self._make_sigma(self._vision, self.image_gpo, gpo, float(sigma_bias_init))
            self.text_sigma = self._make_sigma(self._text, self.text_gpo, gpo, float(sigma_bias_init))
        if self.sigma_detach and any(isinstance(h, UncTokenHead) for h in (self.image_sigma, self.text_sigma)):
            raise UserError("sigma_detach needs log sigma^2 heads beside the tower (block, pcme, or unc on a bag of "
                            "words / CNN); an [UNC] token runs inside the tower and cannot be cut off from it")
        self.sigma_readout = (nn.ModuleDict({"image": spherical_readout(self.embed_dim),
                                             "text": spherical_readout(self.embed_dim)})
                              if sigma_shape == "spherical_one" and not self.deterministic else None)

    def _check_sigma_depth(self) -> None:
        for tower, what in ((self._vision, "image"), (self._text, "text")):
            if tower.num_blocks == 0 or self.sigma_head in ("unc", "pcme"):  # no duplicated blocks to cut
                continue
            if not 1 <= self.sigma_depth <= tower.num_blocks:
                raise UserError(f"sigma_depth={self.sigma_depth} but the {what} tower has "
                                f"{tower.num_blocks} blocks (need 1 <= sigma_depth <= blocks)")

    def _head_depth(self, tower) -> int:
        """Blocks in each head of ``tower``: ``sigma_depth``, or 0 (a tower without blocks, or [UNC] heads)."""
        return self.sigma_depth if tower.num_blocks and self.sigma_head == "block" else 0

    def _make_sigma(self, tower, gpo_mu, new_gpo, bias_init) -> nn.Module:
        side = "image" if tower is self._vision else "text"
        sigma_ln = make_sigma_ln(self.embed_dim, self.sigma_ln_init, self.sigma_ln_init_bias)
        if self.sigma_head == "unc":
            return _make_unc_head(tower, side, self.embed_dim, bias_init, sigma_ln)
        if self.sigma_head == "pcme":
            if getattr(tower, "local_features", None) is None:
                raise UserError(f"sigma_head 'pcme' attends over local features (patch tokens, CNN cells, word "
                                f"vectors); the {side} tower ({tower.kind}) has none: use sigma_head block or unc")
            return PCMEUncertaintyHead(side, tower.width, self.embed_dim, bias_init)
        n = self._head_depth(tower)
        # "copy": the whole mean head, GPO included; "random": a fresh GPO and re-initialised blocks
        gpo = copy.deepcopy(gpo_mu) if (self.sigma_init == "copy" and gpo_mu is not None) else new_gpo()
        official = self.sigma_layout == "official" and tower.kind in ("vit", "text")
        ln = nn.Identity() if official and self.sigma_init == "random" else tower.ln
        head = SigmaHead(list(tower.blocks[tower.num_blocks - n:]), ln, self._mean_proj(tower), self.embed_dim,
                         gpo, bias_init, sigma_ln)
        if self.sigma_init == "random":
            _reinit_block_head_(head, tower, side, official, bias_init, sigma_ln is not None)
        return head

    def _mean_proj(self, tower):
        """What projects the mean head's tokens: the tower's projection, or the ``fc`` of ``mean_head="fc"``."""
        if self.mean_head == "fc":
            return (self.image_head if tower is self._vision else self.text_head)["fc"]
        return tower.proj

    # ----------------------------------------------------------------------------------
    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in backward (saves memory on large towers)."""
        self.grad_checkpointing = bool(enable)

    def _run(self, tower, blocks, x, mask):
        for blk in blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(tower.run_block, blk, x, mask, use_reentrant=False)
            else:
                x = tower.run_block(blk, x, mask)
        return x

    def _head_out(self, tower, x, ln, proj, gpo, ctx, lengths, keep):
        if gpo is None:
            pooled = tower.native_pool(x, ln, ctx)
            return tower.project(pooled, proj)
        tokens = tower.project(ln(x), proj)  # [B, T, D]
        if keep is not None:  # SizeAugment: move the kept tokens to the front, GPO ignores the rest
            order, lengths = keep
            tokens = tokens.gather(1, order[..., None].expand(-1, -1, tokens.shape[-1]))
        return gpo(tokens, lengths)

    def _size_augment(self, b: int, t: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """VSE infinity's SizeAugment for image tokens (training + GPO only).

        A sample is augmented with probability 1 - r, r ~ U(0, 1) per sample (when r > p); each of
        its tokens is then dropped with probability p * r. Returns (token order putting kept
        tokens first, number kept) or None when off.
        """
        p = self.size_augment
        if p <= 0 or not self.training or self.pooling != "gpo":
            return None
        r = torch.rand(b, 1, device=device)
        keep = (torch.rand(b, t, device=device) > p * r) | (r <= p)
        keep[:, 0] |= ~keep.any(dim=1)  # never drop everything
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        return order, keep.sum(dim=1)

    def _encode(self, tower, gpo_mu, sigma: nn.Module | None, inp, with_sigma: bool):
        x, mask, ctx = tower.embed(inp)
        lengths = ctx[1] if ctx is not None else None
        token_head = isinstance(sigma, UncTokenHead)
        if token_head:  # [UNC] joins the sequence whether or not sigma is asked for: mu may attend to it
            x, mask = tower.insert_unc(x, mask, lengths, sigma.token())
        split = tower.num_blocks - self._head_depth(tower)
        rows = self._pooled_rows(tower, x.shape[1], token_head, gpo_mu, sigma, with_sigma)
        last = tower.num_blocks - 1 if rows is not None else tower.num_blocks
        if split <= last:
            h = self._run(tower, tower.blocks[:split], x, mask)
            hm = self._run(tower, tower.blocks[split:last], h, mask)
        else:  # a whole shared tower ([UNC] head): no block head reads the trunk's output
            h = hm = self._run(tower, tower.blocks[:last], x, mask)
        if rows is not None:
            hm = _run_block_rows(tower.blocks[last], hm, rows, mask)
        unc_out = None
        if token_head:
            hm, unc_out = tower.split_unc(hm)
        keep = self._size_augment(hm.shape[0], tower.num_tokens(hm), hm.device) if tower is self._vision else None
        released = token_head and self.unc_layout == "prolip"
        ln = _twice(tower.ln) if released and tower is self._vision else tower.ln
        projected = self._head_out(tower, hm, ln, self._mean_proj(tower), gpo_mu, ctx, lengths, keep)
        mu = projected.to(torch.promote_types(projected.dtype, torch.float32))  # float32, or float64 for a float64 model
        if self.normalize_mu:
            mu = F.normalize(mu, dim=-1)
        if sigma is None or not with_sigma:
            return mu, None
        # sigma_detach: the head reads the trunk's features without sending gradients back into them
        cut = (lambda t: t.detach()) if self.sigma_detach else (lambda t: t)
        if released and tower is self._text:  # ProLIP's released text code: the projected [CLS] output
            raw = sigma(projected)
        elif token_head:  # ProLIP: the tower's own final LayerNorm, then the [UNC] projection
            raw = sigma(tower.ln(unc_out))
        elif isinstance(sigma, PCMEUncertaintyHead):
            raw = sigma(*tower.local_features(cut(hm), ctx), lengths=lengths)
        elif isinstance(sigma, UncPooledHead):
            pooled = sigma.pool_words(cut(hm), lengths) if sigma.unc_emb is not None else tower.ln.pooled(cut(hm))
            raw = sigma(pooled)
        else:
            hs = self._run(tower, sigma.blocks, cut(h), mask)
            raw = sigma.finish(self._head_out(tower, hs, sigma.ln, sigma.proj, sigma.gpo, ctx, lengths, keep))
        side = "image" if tower is self._vision else "text"
        return mu, bound_logvar(self._shape_sigma(raw.to(torch.promote_types(raw.dtype, torch.float32)), side), self.var_bounds)

    def _pooled_rows(self, tower, seq: int, token_head: bool, gpo_mu, sigma, with_sigma: bool) -> list[int] | None:
        """The token positions whose last-block outputs are all that the forward reads, or None.

        With native pooling at fixed positions (a ViT's class token, ProLIP's appended text [CLS],
        plus [UNC]) and no head that reads every token (GPO, PCME's attention, a pooled [UNC] MLP),
        the other positions of the last block feed nothing: their keys and values are still needed,
        their queries, attention outputs and MLPs are not (64 of ProLIP's 66 text positions).
        """
        pooled_rows = getattr(tower, "pooled_rows", None)
        if pooled_rows is None or gpo_mu is not None or self.mean_head != "proj" or not tower.num_blocks:
            return None
        if sigma is not None and with_sigma and not isinstance(sigma, (SigmaHead, UncTokenHead)):
            return None
        if not all(_plain_block(b) for b in tower.blocks):
            return None
        return pooled_rows(seq, token_head)

    def _shape_sigma(self, raw: torch.Tensor, side: str) -> torch.Tensor:
        """The head's D outputs -> log sigma^2 [B, D]: ``sigma_param`` ("logsigma": the head predicts
        log sigma, as PCME's code, so log sigma^2 = 2 x output), then ``sigma_shape`` (Pishdad et
        al.'s spherical variants, one variance per embedding: "spherical_mean" the average of the
        D variances, log mean exp(log sigma^2); "spherical_one" one predicted value, a learned
        linear readout of the D log-variances)."""
        logvar = 2.0 * raw if self.sigma_param == "logsigma" else raw
        if self.sigma_shape == "spherical_mean":
            one = torch.logsumexp(logvar, dim=-1, keepdim=True) - math.log(logvar.shape[-1])
            return one.expand_as(logvar)
        if self.sigma_shape == "spherical_one":
            return self.sigma_readout[side](logvar).expand_as(logvar)
        return logvar

    def towers(self) -> dict:
        """side ("image", "text") -> the tower adapter (:mod:`zsprob.models.towers`) the encoders run."""
        return {"image": self._vision, "text": self._text}

    def encode_image(self, images: torch.Tensor, *, with_sigma: bool = True):
        """images [B, 3, H, W] -> (mu [B, D], logvar [B, D] or None), float32."""
        return self._encode(self._vision, self.image_gpo, self.image_sigma, images, with_sigma)

    def encode_text(self, tokens: torch.Tensor, *, with_sigma: bool = True):
        """tokens [B, L] (from ``self.tokenizer``) -> (mu [B, D], logvar [B, D] or None), float32."""
        return self._encode(self._text, self.text_gpo, self.text_sigma, tokens, with_sigma)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor | None]:
        img_mu, img_logvar = self.encode_image(images)
        txt_mu, txt_logvar = self.encode_text(tokens)
        return {"img_mu": img_mu, "img_logvar": img_logvar, "txt_mu": txt_mu, "txt_logvar": txt_logvar}

    # ----------------------------------------------------------------------------------
    def param_info(self) -> dict[str, dict[str, Any]]:
        """Per-parameter metadata for the trainer.

        ``tower``: "image" | "text" | "other"; ``depth``: 0 = embeddings, i + 1 = residual block i
        (the log-variance copies of the last blocks share their depth; the [UNC] token's embedding
        and position are embeddings: depth 0), depth ``num_layers`` for the final LayerNorm,
        projection, GPO, log-variance bias, [UNC] projection, pooled MLP and sigma LayerNorm;
        ``num_layers`` = blocks + 1, so a
        layer-wise decay reads ``lr_scale = decay ** (num_layers - depth)``. ``backbone``: True
        for parameters of the wrapped open_clip model (those a pretrained checkpoint provides),
        False for modules zsprob adds (log-variance heads, GPO) and for projections that were
        re-initialised because the embedding size differs from the checkpoint.
        """
        nv, nt = self._vision.num_blocks, self._text.num_blocks
        split_v, split_t = nv - self._head_depth(self._vision), nt - self._head_depth(self._text)
        vis_prefix = "clip.visual."
        text_prefix = "clip.text." if not self._text.is_clip else "clip."
        info: dict[str, dict[str, Any]] = {}
        for name, _ in self.named_parameters():
            tower, depth, backbone = "other", 0, True
            num_layers = 0
            parts = name.split(".")
            if name.startswith(vis_prefix):
                tower, num_layers = "image", nv + 1
                depth = self._vision.depth_of(name[len(vis_prefix):])
            elif name.startswith("clip.") and name.split(".")[-1] not in ("logit_scale", "logit_bias") \
                    and (name.startswith(text_prefix)):
                tower, num_layers = "text", nt + 1
                depth = self._text.depth_of(name[len(text_prefix):])
            elif parts[0] in ("image_sigma", "image_gpo", "image_head"):
                tower, num_layers, backbone = "image", nv + 1, False
                depth = _sigma_depth_of(parts, split_v, nv + 1)
            elif parts[0] in ("text_sigma", "text_gpo", "text_head"):
                tower, num_layers, backbone = "text", nt + 1, False
                depth = _sigma_depth_of(parts, split_t, nt + 1)
            elif parts[0] == "sigma_readout":  # the spherical readout sits on top of the head
                tower, backbone = parts[1], False
                num_layers = depth = (nv if tower == "image" else nt) + 1
            if name in self._reinit_params:
                backbone = False
            info[name] = {"tower": tower, "depth": depth, "num_layers": num_layers, "backbone": backbone}
        return info

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, embed_dim={self.embed_dim}, sigma_head={self.sigma_head!r}, "
                f"sigma_layout={self.sigma_layout!r}, unc_layout={self.unc_layout!r}, sigma_depth={self.sigma_depth}, "
                f"sigma_init={self.sigma_init!r}, pooling={self.pooling!r}, deterministic={self.deterministic}, "
                f"var_bounds={self.var_bounds}" + (f", mean_head={self.mean_head!r}" if self.mean_head != "proj" else ""))


def _plain_block(block: nn.Module) -> bool:
    """An open_clip ``ResidualAttentionBlock`` doing self-attention (no cross-attention LayerNorm)."""
    from open_clip.transformer import ResidualAttentionBlock

    return type(block) is ResidualAttentionBlock and not hasattr(block, "ln_1_kv")


def _run_block_rows(block: nn.Module, x: torch.Tensor, rows: list[int], mask) -> torch.Tensor:
    """Outputs of an open_clip ``ResidualAttentionBlock`` at positions ``rows`` only: [B, T, w] -> [B, len(rows), w].

    Every position is still a key and a value; only the queries, the attention output and the MLP
    are restricted to ``rows``. Equal to ``block(x, attn_mask=mask)[:, rows]`` (tested), the
    operations are open_clip's own modules (``ln_1``, ``attention``, ``ls_1``, ``ln_2``, ``mlp``, ``ls_2``).
    """
    kv = block.ln_1(x)
    first, n = rows[0], len(rows)
    if list(rows) == list(range(first, first + n)):  # every tower's rows: a slice, no index tensor to send
        take = lambda t, dim: t.narrow(dim, first, n).contiguous()  # noqa: E731  (the device, no host sync)
    else:
        index = torch.tensor(rows, device=x.device)
        take = lambda t, dim: t.index_select(dim, index)  # noqa: E731
    q = take(x, 1)
    m = take(mask, -2) if mask is not None else None
    y = q + block.ls_1(block.attention(q_x=take(kv, 1), k_x=kv, v_x=kv, attn_mask=m))
    return y + block.ls_2(block.mlp(block.ln_2(y)))


def _twice(ln: nn.Module):
    """``ln(ln(x))``: ProLIP's released image tower applies ``ln_post`` to the class token twice."""
    return lambda x: ln(ln(x))


def _sigma_depth_of(parts: list[str], split: int, num_layers: int) -> int:
    """Depth of a log-variance head / GPO parameter (name split at dots) in a tower cut at ``split``."""
    if parts[0].endswith("_sigma") and parts[1] == "blocks":
        return split + int(parts[2]) + 1
    if parts[0].endswith("_sigma") and parts[1] in UNC_EMBEDDING_NAMES:
        return 0
    return num_layers


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["ProbCLIP", "SigmaHead", "MEAN_HEADS", "strip_mean_projection_", "count_parameters"]

