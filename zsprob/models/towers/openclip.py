"""Tower adapters for open_clip's ViT image tower and text transformer: where the [UNC] token goes and
which positions native pooling reads."""
from __future__ import annotations

import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.utils.host_sync import host_read_is_free
from zsprob.utils.masks import length_mask


def block_depth(rest: str, embed_names: tuple[str, ...], num_blocks: int) -> int:
    """Depth of an open_clip transformer tower's parameter ``rest`` (relative to the tower)."""
    if rest.startswith("transformer.resblocks."):
        return int(rest.split(".")[2]) + 1
    if rest.split(".")[0] in embed_names:
        return 0
    return num_blocks + 1


class ViTTower:
    kind = "vit"

    def __init__(self, clip_model: nn.Module):
        visual = clip_model.visual
        if visual.attn_pool is not None:
            raise UserError("open_clip image towers with attentional pooling (CoCa) are not supported")
        if visual.pool_type not in ("tok", "avg"):
            raise UserError(f"unsupported image pool_type {visual.pool_type!r}")
        self.visual = visual
        self.blocks = visual.transformer.resblocks
        self.width = visual.transformer.width
        self.num_blocks = len(self.blocks)

    @property
    def ln(self) -> nn.Module:
        return self.visual.ln_post

    @property
    def proj(self):
        return self.visual.proj

    def embed(self, images: torch.Tensor):
        return self.visual._embeds(images), None, None  # tokens, attn_mask, lengths (all)

    @staticmethod
    def run_block(block: nn.Module, x: torch.Tensor, mask) -> torch.Tensor:
        return block(x, attn_mask=mask)

    @staticmethod
    def num_tokens(x: torch.Tensor) -> int:
        return x.shape[1]

    def pooled_rows(self, seq: int, unc: bool) -> list[int] | None:
        """The positions native pooling reads (class token, then [UNC]), or None (average pooling)."""
        if self.visual.pool_type != "tok":
            return None
        return [0, 1] if unc else [0]

    def native_pool(self, x: torch.Tensor, ln: nn.Module, ctx) -> torch.Tensor:
        v = self.visual
        if v.final_ln_after_pool:
            pooled, _ = v._global_pool(x)
            return ln(pooled)
        x = ln(x)
        pooled, _ = v._global_pool(x)
        return pooled

    def local_features(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """PCME's image module inputs: patch tokens after ``ln_post`` [B, T, w], the pooled feature [B, w]."""
        return self.ln(x)[:, 1:], self.native_pool(x, self.ln, ctx)

    def insert_unc(self, x: torch.Tensor, mask, lengths, token: torch.Tensor):
        """[CLS, patches] -> [CLS, UNC, patches] (ProLIP's order); [UNC] gets the per-token ``ln_pre`` on its own."""
        unc = self.visual.ln_pre(token.to(x.dtype))
        unc = unc.view(1, 1, -1).expand(x.shape[0], 1, -1)
        return torch.cat([x[:, :1], unc, x[:, 1:]], dim=1), mask

    @staticmethod
    def split_unc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs -> (tokens without [UNC], [UNC] output)."""
        return torch.cat([x[:, :1], x[:, 2:]], dim=1), x[:, 1]

    def depth_of(self, rest: str) -> int:
        """Depth of a parameter named ``clip.visual.<rest>`` (0 = embeddings, i + 1 = block i)."""
        return block_depth(rest, ("conv1", "class_embedding", "positional_embedding", "ln_pre", "patch_dropout"),
                            self.num_blocks)

    @staticmethod
    def project(x: torch.Tensor, proj) -> torch.Tensor:
        if proj is None:
            return x
        if isinstance(proj, nn.Module):
            return proj(x)
        return x @ proj


class TextHeads:
    """What the text adapters share: ``self.src`` holds ``ln_final`` and ``text_projection``."""

    project = staticmethod(ViTTower.project)
    run_block = staticmethod(ViTTower.run_block)

    @property
    def ln(self) -> nn.Module:
        return self.src.ln_final

    @property
    def proj(self):
        return self.src.text_projection

    def local_features(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, None]:
        """PCME's text module input: every position after the final LayerNorm [B, L, w]."""
        return self.ln(x), None


class TextTower(TextHeads):
    kind = "text"

    def __init__(self, clip_model: nn.Module, truncate: bool):
        import open_clip as oc

        if isinstance(clip_model, oc.CLIP):
            self.src = clip_model
            self.is_clip = True
            self.pool_type = clip_model.text_pool_type
            self.eos_id = getattr(clip_model, "text_eos_id", None)
            self.pad_id = 0
            self.causal = clip_model.attn_mask is not None
            self.cls = False
        else:
            text = clip_model.text  # a TextTransformer: build_open_clip refuses Hugging Face text towers
            self.src = text
            self.is_clip = False
            self.pool_type = text.pool_type
            self.eos_id = text.eos_id
            self.pad_id = text.pad_id
            self.causal = text.attn_mask is not None and not text.use_pad_mask
            self.cls = text.cls_emb is not None
            if self.cls and (text.attn_mask is not None or text.use_pad_mask):
                raise UserError("open_clip text towers with an appended CLS token are supported as ProLIP builds "
                                "them: bidirectional, without padding mask (no_causal_mask true, use_pad_mask false)")
            if self.cls:
                self.pool_type = "last"  # the appended [CLS] token pools the caption, whatever pool_type says
        if self.pool_type not in ("argmax", "eos", "first", "last"):
            raise UserError(f"unsupported text pool_type {self.pool_type!r}")
        self.blocks = self.src.transformer.resblocks
        self.width = self.src.transformer.width
        self.num_blocks = len(self.blocks)
        # Cutting after the longest end-of-text token is exact for causal towers pooled at or before it;
        # it reads that length on the host, so it is taken only where such a read stalls nothing (the CPU).
        self.truncate = bool(truncate) and self.causal and self.pool_type in ("argmax", "eos", "first")

    def lengths(self, text: torch.Tensor) -> torch.Tensor:
        if self.pool_type == "argmax":
            return text.argmax(dim=-1) + 1
        if self.pool_type == "eos":
            return (text == self.eos_id).int().argmax(dim=-1) + 1
        return (text != self.pad_id).sum(dim=-1).clamp(min=1)

    def embed(self, text: torch.Tensor):
        lengths = self.lengths(text)
        if self.truncate and host_read_is_free(text.device) and not torch.compiler.is_compiling():
            n = int(lengths.max())
            if n < text.shape[1]:
                text = text[:, :n]
        if self.is_clip:
            m = self.src
            cast = m.transformer.get_cast_dtype()
            x = m.token_embedding(text).to(cast)
            seq = text.shape[1]
            if seq == m.positional_embedding.shape[0]:
                x = x + m.positional_embedding.to(cast)
                mask = m.attn_mask
            else:
                x = x + m.positional_embedding[:seq].to(cast)
                mask = m.attn_mask[:seq, :seq] if m.attn_mask is not None else None
        elif self.cls:  # ProLIP: [tokens, CLS] with positions 0 .. seq, no attention mask at all
            t = self.src
            x = t.token_embedding(text).to(t.transformer.get_cast_dtype())
            cls = t.cls_emb.to(x.dtype).view(1, 1, -1).expand(x.shape[0], 1, -1)
            x = torch.cat([x, cls], dim=1) + t.positional_embedding[:text.shape[1] + 1].to(x.dtype)
            mask = None
        else:
            x, mask = self.src._embeds(text)
            seq = text.shape[1]
            if mask is not None and mask.ndim == 2 and mask.shape[0] != seq:
                mask = mask[:seq, :seq]
        return x, mask, (text, lengths)

    def insert_unc(self, x: torch.Tensor, mask, lengths: torch.Tensor, token: torch.Tensor):
        """Append the [UNC] token after the last position (ProLIP: before its [CLS]) and extend the mask."""
        b = x.shape[0]
        unc = token.to(x.dtype).view(1, 1, -1).expand(b, 1, -1)
        if self.cls:  # ProLIP's order: [tokens, UNC, CLS]
            return torch.cat([x[:, :-1], unc, x[:, -1:]], dim=1), mask
        x = torch.cat([x, unc], dim=1)
        if mask is None:
            return x, None
        return x, unc_text_mask(mask, lengths, self.blocks[0].attn.num_heads, self.causal, x.dtype)

    def split_unc(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cls:
            return torch.cat([x[:, :-2], x[:, -1:]], dim=1), x[:, -2]
        return x[:, :-1], x[:, -1]

    def pooled_rows(self, seq: int, unc: bool) -> list[int] | None:
        """The positions native pooling reads when every caption has them: ProLIP's [CLS] last, after [UNC];
        else None (end-of-text pooling reads a position per caption)."""
        if not self.cls:
            return None
        return [seq - 2, seq - 1] if unc else [seq - 1]

    def native_pool(self, x: torch.Tensor, ln: nn.Module, ctx) -> torch.Tensor:
        from open_clip.transformer import text_global_pool

        text, _ = ctx
        x = ln(x)
        return text_global_pool(x, text, self.pool_type, eos_token_id=self.eos_id)

    def depth_of(self, rest: str) -> int:
        """Depth of a text-tower parameter ``rest`` (name after the tower's prefix)."""
        return block_depth(rest, ("token_embedding", "positional_embedding", "cls_emb"), self.num_blocks)


def unc_text_mask(mask: torch.Tensor, lengths: torch.Tensor, heads: int, causal: bool,
                   dtype: torch.dtype) -> torch.Tensor:
    """A text mask [L, L] or [B * heads, L, L] -> [B * heads, L + 1, L + 1] with [UNC] last: it reads the first
    ``lengths`` tokens and itself; caption tokens read it unless the tower is causal."""
    b, seq = lengths.shape[0], mask.shape[-1]
    if mask.dtype == torch.bool:  # PyTorch's boolean masks: True = may not attend
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    base = mask.to(dtype)
    if base.ndim == 2:
        base = base.expand(b * heads, seq, seq)
    full = base.new_zeros(b * heads, seq + 1, seq + 1)
    full[:, :seq, :seq] = base
    if causal:
        full[:, :seq, seq] = float("-inf")
    readable = length_mask(lengths, seq + 1)                                  # [B, L + 1]
    readable[:, seq] = True
    unc_row = torch.zeros(b, seq + 1, dtype=dtype, device=lengths.device).masked_fill(~readable, float("-inf"))
    full[:, seq, :] = unc_row.repeat_interleave(heads, dim=0)
    return full
