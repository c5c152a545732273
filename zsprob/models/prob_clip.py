"""ProbCLIP: an open_clip CLIP model turned into a pair of Gaussian encoders (PCME++ Sec. 2.5).

open_clip provides the towers, tokenizers and transforms (the model is kept whole as ``self.clip``, so
its state dicts load unchanged); zsprob adds the log-variance heads (:mod:`.sigma_heads`) beside the
mean branch, through the tower adapters (:mod:`.towers`). docs/models.md says what each option builds.
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
from zsprob.models.options import ModelOptions
from zsprob.models.sigma_heads import (UNC_EMBEDDING_NAMES, PCMEUncertaintyHead, SigmaHead, UncPooledHead,
                                       UncTokenHead, make_sigma_ln, reinit_block_legacy_, reinit_block_official_,
                                       reinit_cnn_head_, reinit_projection_legacy_, reinit_projection_official_,
                                       spherical_readout)
from zsprob.models.towers import text_tower, vision_tower
from zsprob.models.towers.bow import BowTextTower as _BowTextTower  # noqa: F401 - tests patch it here


def strip_mean_projection_(clip_model: nn.Module) -> nn.Module:
    """``mean_head="fc"``: no ``visual.ln_post`` (Identity), ``visual.proj`` or ``text_projection`` (None,
    which open_clip skips), so the state dict holds no such keys. Idempotent."""
    import open_clip
    from open_clip.transformer import VisionTransformer

    if not isinstance(clip_model, open_clip.CLIP) or not isinstance(clip_model.visual, VisionTransformer):
        raise UserError("mean_head 'fc' (PCME++'s COCO layout) needs an open_clip CLIP with a ViT image tower and "
                        "the built-in text transformer")
    visual = clip_model.visual
    visual.ln_post = nn.Identity()
    visual.proj = None
    clip_model.text_projection = None
    return clip_model


def _fc_head(width: int, embed_dim: int, side: str) -> nn.ModuleDict:
    """The official COCO mean head ``fc``: image Xavier-uniform weight, zero bias; text nn.Linear's defaults."""
    fc = nn.Linear(width, embed_dim)
    if side == "image":
        nn.init.xavier_uniform_(fc.weight)
        nn.init.zeros_(fc.bias)
    return nn.ModuleDict({"fc": fc})


def _make_unc_head(tower, side: str, embed_dim: int, bias_init: float, sigma_ln) -> nn.Module:
    """[UNC] token head for open_clip transformer towers, pooled-MLP head for bag-of-words / CNN towers."""
    if tower.kind in ("vit", "text"):
        return UncTokenHead(side, tower.width, embed_dim, bias_init, sigma_ln)
    if tower.kind == "bow":
        return UncPooledHead(tower.width, embed_dim, bias_init, word_init_std=tower.src.embed_init_std,
                             sigma_ln=sigma_ln)
    return UncPooledHead(tower.width, embed_dim, bias_init, sigma_ln=sigma_ln)


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


class ProbCLIP(nn.Module):
    """Gaussian image and text encoders on top of an open_clip CLIP model (or a bag-of-words BowCLIP).

    Build with :func:`zsprob.models.create_model` or :func:`zsprob.models.load`. ``config`` rebuilds the
    model; each of ``options`` is also an attribute (``var_bounds`` as floats).
    """

    #: the log-variance heads' modules (the trainer can clip their gradients apart: optim.grad_clip_split)
    SIGMA_MODULES = ("image_sigma", "text_sigma", "sigma_readout")

    def __init__(self, clip_model: nn.Module, *, name: str, config: dict, embed_dim: int, options: ModelOptions,
                 tokenizer=None, preprocess_train=None, preprocess_val=None, image_size: int | None = None,
                 reinit_params: tuple[str, ...] = ()):
        super().__init__()
        self.clip = clip_model
        self.name = name
        self.config = config
        self.embed_dim = int(embed_dim)
        self.options = options
        for key, value in options.config().items():
            setattr(self, key, value)
        self.var_bounds = options.bounds
        self.sigma_ln_init = None if options.sigma_ln_init is None else float(options.sigma_ln_init)
        self.sigma_ln_init_bias = float(options.sigma_ln_init_bias)
        self.tokenizer = tokenizer
        self.preprocess_train = preprocess_train
        self.preprocess_val = preprocess_val
        self.image_size = image_size
        self.grad_checkpointing = False
        self._reinit_params = set(reinit_params)
        mean_head, sigma_head = options.mean_head, options.sigma_head

        if mean_head == "fc":
            strip_mean_projection_(clip_model)
        self._vision = vision_tower(clip_model)
        self._text = text_tower(clip_model, options.truncate_text)
        if mean_head == "fc":
            self.image_head = _fc_head(self._vision.width, self.embed_dim, "image")
            self.text_head = _fc_head(self._text.width, self.embed_dim, "text")
        else:
            self.image_head = self.text_head = None
        self._check_sigma_depth()
        # open_clip's logit_scale / logit_bias, unused by zsprob's losses: kept (strict loads) but frozen (DDP)
        for pname in ("logit_scale", "logit_bias"):
            p = getattr(clip_model, pname, None)
            if isinstance(p, nn.Parameter):
                p.requires_grad_(False)

        gpo = (lambda: GPO(options.gpo_dim, options.gpo_dim)) if self.pooling == "gpo" else (lambda: None)
        self.image_gpo = gpo()
        self.text_gpo = gpo()
        if self.unc_layout == "prolip" and sigma_head == "unc" and self._text.kind == "text" \
                and self._text.width != self.embed_dim:
            raise UserError(f"unc_layout 'prolip' reads log sigma^2 from the projected text output, so it needs "
                            f"text width = embed_dim (got {self._text.width} and {self.embed_dim})")
        if self.deterministic:
            self.image_sigma = None
            self.text_sigma = None
        else:
            self.image_sigma = self._make_sigma(self._vision, self.image_gpo, gpo, float(options.sigma_bias_init))
            self.text_sigma = self._make_sigma(self._text, self.text_gpo, gpo, float(options.sigma_bias_init))
        if self.sigma_detach and any(isinstance(h, UncTokenHead) for h in (self.image_sigma, self.text_sigma)):
            raise UserError("sigma_detach needs log sigma^2 heads beside the tower (block, pcme, or unc on a bag of "
                            "words / CNN); an [UNC] token runs inside the tower and cannot be cut off from it")
        self.sigma_readout = (nn.ModuleDict({"image": spherical_readout(self.embed_dim),
                                             "text": spherical_readout(self.embed_dim)})
                              if self.sigma_shape == "spherical_one" and not self.deterministic else None)

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
        """VSE infinity's SizeAugment of image tokens (training + GPO only): with r ~ U(0, 1) per sample, a
        sample with r > p drops each token with probability p * r. (token order, kept first; number kept) or None."""
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
        mu = projected.to(torch.promote_types(projected.dtype, torch.float32))  # float32 (float64 for such a model)
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
        raw = raw.to(torch.promote_types(raw.dtype, torch.float32))
        return mu, bound_logvar(self._shape_sigma(raw, side), self.var_bounds)

    def _pooled_rows(self, tower, seq: int, token_head: bool, gpo_mu, sigma, with_sigma: bool) -> list[int] | None:
        """The consecutive token positions whose last-block outputs are all the forward reads (native pooling at
        fixed positions, no head reading every token), or None."""
        pooled_rows = getattr(tower, "pooled_rows", None)
        if pooled_rows is None or gpo_mu is not None or self.mean_head != "proj" or not tower.num_blocks:
            return None
        if sigma is not None and with_sigma and not isinstance(sigma, (SigmaHead, UncTokenHead)):
            return None
        if not all(_plain_block(b) for b in tower.blocks):
            return None
        return pooled_rows(seq, token_head)

    def _shape_sigma(self, raw: torch.Tensor, side: str) -> torch.Tensor:
        """The head's D outputs -> log sigma^2 [B, D], by ``sigma_param`` (log sigma: x 2) and ``sigma_shape``
        ("spherical_mean": log mean exp over D; "spherical_one": the learned readout, one value per input)."""
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

    def param_info(self) -> dict[str, dict[str, Any]]:
        """Per parameter: ``tower`` (image | text | other), ``depth`` (0 embeddings, i + 1 block i and its copy,
        ``num_layers`` = blocks + 1 after the blocks: layer-wise decay ``decay ** (num_layers - depth)``) and
        ``backbone`` (what a pretrained open_clip checkpoint provides)."""
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
            elif name.startswith(text_prefix) and parts[-1] not in ("logit_scale", "logit_bias"):
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
                f"var_bounds={self.var_bounds}"
                + (f", mean_head={self.mean_head!r}" if self.mean_head != "proj" else ""))


def _plain_block(block: nn.Module) -> bool:
    """An open_clip ``ResidualAttentionBlock`` doing self-attention (no cross-attention LayerNorm)."""
    from open_clip.transformer import ResidualAttentionBlock

    return type(block) is ResidualAttentionBlock and not hasattr(block, "ln_1_kv")


def _run_block_rows(block: nn.Module, x: torch.Tensor, rows: list[int], mask) -> torch.Tensor:
    """``block(x, attn_mask=mask)[:, rows]`` for consecutive ``rows``: every position is still a key and a
    value, only the queries, attention output and MLP run at ``rows`` ([B, T, w] -> [B, len(rows), w])."""
    kv = block.ln_1(x)
    first, n = rows[0], len(rows)
    q = x.narrow(1, first, n).contiguous()  # a slice: no index tensor to send, no host sync
    m = mask.narrow(-2, first, n).contiguous() if mask is not None else None
    y = q + block.ls_1(block.attention(q_x=kv.narrow(1, first, n).contiguous(), k_x=kv, v_x=kv, attn_mask=m))
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
