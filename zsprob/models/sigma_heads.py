"""The log-variance (log sigma^2) heads of :class:`zsprob.models.ProbCLIP`, and their init laws.

``"block"``: :class:`SigmaHead` (PCME++); ``"unc"``: :class:`UncTokenHead` (ProLIP's [UNC] token) or
:class:`UncPooledHead` (towers without tokens); ``"pcme"``: :class:`PCMEUncertaintyHead`. Layouts and
init laws as in naver-ai/pcmepp, naver-ai/prolip and naver-ai/pcme (docs/models.md).
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.utils.masks import masked_sum

SIGMA_HEADS = ("block", "unc", "pcme")
SIGMA_LAYOUTS = ("official", "legacy")
SIGMA_PARAMS = ("logvar", "logsigma")  # the head predicts log sigma^2, or log sigma (PCME's code)
SIGMA_SHAPES = ("diagonal", "spherical_mean", "spherical_one")  # Pishdad et al.'s covariance shapes
UNC_LAYOUTS = ("zsprob", "prolip")  # "unc" heads as ProLIP's paper says, or as its released code computes
# default sigma_bias_init per head kind: PCME++'s bias_init 0, ProLIP's init_unc_bias -10
DEFAULT_BIAS_INIT = {"block": 0.0, "unc": -10.0, "pcme": 0.0}
# names of the [UNC] embeddings (param_info: depth 0, like the tower's own embeddings)
UNC_EMBEDDING_NAMES = ("unc_embedding", "unc_emb", "unc_pos_embedding")


def make_sigma_ln(embed_dim: int, weight_init: float | None, bias_init: float) -> nn.LayerNorm | None:
    """PCME++'s LayerNorm on log sigma^2 (weight ``weight_init``, bias ``bias_init``), or None when off."""
    if weight_init is None:
        return None
    ln = nn.LayerNorm(embed_dim)
    nn.init.constant_(ln.weight, float(weight_init))
    nn.init.constant_(ln.bias, float(bias_init))
    return ln


def spherical_readout(embed_dim: int) -> nn.Linear:
    """``Linear(D, 1)``: one log-variance from the head's D, starting as their mean (weight 1/D, bias 0)."""
    fc = nn.Linear(embed_dim, 1)
    nn.init.constant_(fc.weight, 1.0 / embed_dim)
    nn.init.zeros_(fc.bias)
    return fc


class PCMEUncertaintyHead(nn.Module):
    """PCME's local-attention uncertainty module (PCME Sec. 3) over local features [B, T, w] -> D values.

    Attention pooling ``softmax_T(w2 tanh(w1 x))`` then ``fc``, plus a residual: image ``fc2`` of the
    pooled feature [B, w]; text a bidirectional GRU (D / 2 per direction) read at the last valid position.
    """

    def __init__(self, side: str, width: int, embed_dim: int, bias_init: float = 0.0):
        super().__init__()
        if side == "text" and embed_dim % 2:
            raise UserError(f"sigma_head 'pcme' needs an even embedding size for its text GRU, got {embed_dim}")
        self.side = side
        self.w1 = nn.Linear(width, max(1, width // 2), bias=False)
        self.w2 = nn.Linear(max(1, width // 2), 1, bias=False)
        self.fc = nn.Linear(width, embed_dim)
        for lin in (self.w1, self.w2, self.fc):
            nn.init.xavier_uniform_(lin.weight)
        nn.init.constant_(self.fc.bias, float(bias_init))
        if side == "image":
            self.fc2 = nn.Linear(width, embed_dim)
        else:
            self.rnn = nn.GRU(width, embed_dim // 2, bidirectional=True, batch_first=True)

    def attend(self, x: torch.Tensor, pad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention-pooled local features [B, w] and the weights [B, T]."""
        logits = self.w2(torch.tanh(self.w1(x))).squeeze(-1)
        if pad is not None:
            logits = logits.masked_fill(pad, float("-inf"))
        attn = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).to(x.dtype)
        return torch.einsum("bt,btw->bw", attn, x), attn

    def forward(self, local: torch.Tensor, pooled: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        pad = None
        if lengths is not None:
            lengths = lengths.clamp(1, local.shape[1])
            pad = torch.arange(local.shape[1], device=local.device)[None, :] >= lengths[:, None]
        att, _ = self.attend(local, pad)
        if self.side == "image":
            return self.fc(att) + self.fc2(pooled)
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(local, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        last = out.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, 1, out.shape[-1]).to(out.device)).squeeze(1)
        return self.fc(att) + last


class SigmaHead(nn.Module):
    """Copy of a tower's last ``n`` blocks + final LayerNorm (or none) + projection + bias (+ GPO)."""

    def __init__(self, blocks: list[nn.Module], ln: nn.Module, proj, embed_dim: int, gpo: nn.Module | None,
                 bias_init: float, sigma_ln: nn.LayerNorm | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks)
        self.ln = copy.deepcopy(ln)
        if isinstance(proj, nn.Module):
            self.proj = copy.deepcopy(proj)
        elif proj is not None:
            self.proj = nn.Parameter(proj.detach().clone())
        else:
            self.proj = None
        self.bias = nn.Parameter(torch.full((embed_dim,), float(bias_init)))
        self.gpo = gpo
        self.sigma_ln = sigma_ln

    def finish(self, raw: torch.Tensor) -> torch.Tensor:
        """Pooled, projected output -> log sigma^2 (+ bias, + the optional LayerNorm)."""
        dtype = torch.promote_types(raw.dtype, torch.float32)  # float32, or float64 for a float64 model
        raw = raw.to(dtype) + self.bias.to(dtype)
        return self.sigma_ln(raw) if self.sigma_ln is not None else raw


class UncTokenHead(nn.Module):
    """ProLIP's [UNC] token of one open_clip transformer tower: embedding, position, projection.

    Parameter names and init are ProLIP's per side, so its keys map one to one: embedding and position
    N(0, w^-1/2) for the image, N(0, 0.01) for the text; projection weight N(0, w^-1/2), bias ``bias_init``.
    """

    def __init__(self, side: str, width: int, embed_dim: int, bias_init: float,
                 sigma_ln: nn.LayerNorm | None = None):
        super().__init__()
        self.side = side
        emb_std = width ** -0.5 if side == "image" else 0.01
        embedding = nn.Parameter(torch.randn(width) * emb_std)
        position = nn.Parameter(torch.randn(width) * emb_std)
        projection = nn.Linear(width, embed_dim, bias=True)
        nn.init.normal_(projection.weight, std=width ** -0.5)
        nn.init.constant_(projection.bias, float(bias_init))
        if side == "image":
            self.unc_embedding = embedding
            self.unc_pos_embedding = position
            self.uncertainty_proj = projection
        else:
            self.unc_emb = embedding
            self.unc_pos_embedding = position
            self.text_uncertainty_projection = projection
        self.sigma_ln = sigma_ln

    @property
    def embedding(self) -> nn.Parameter:
        return self.unc_embedding if self.side == "image" else self.unc_emb

    @property
    def projection(self) -> nn.Linear:
        return self.uncertainty_proj if self.side == "image" else self.text_uncertainty_projection

    def token(self) -> torch.Tensor:
        """The [UNC] input token: embedding + its position, [width]."""
        return self.embedding + self.unc_pos_embedding

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """[UNC] output after the tower's final LayerNorm [B, w] -> log sigma^2 [B, D]."""
        raw = self.projection(normed)
        return self.sigma_ln(raw) if self.sigma_ln is not None else raw


class UncPooledHead(nn.Module):
    """log sigma^2 = MLP(pooled vector) for towers without tokens (bag of words, CNN). With ``word_init_std``
    (bag of words), a learned [UNC] word ``unc_emb`` ~ N(0, word_init_std) joins every caption's bag."""

    def __init__(self, in_dim: int, embed_dim: int, bias_init: float, word_init_std: float | None = None,
                 sigma_ln: nn.LayerNorm | None = None):
        super().__init__()
        self.unc_emb = nn.Parameter(torch.randn(in_dim) * float(word_init_std)) if word_init_std is not None \
            else None
        self.mlp = nn.Sequential(OrderedDict([("fc1", nn.Linear(in_dim, in_dim)), ("act", nn.GELU()),
                                              ("fc2", nn.Linear(in_dim, embed_dim))]))
        nn.init.constant_(self.mlp.fc2.bias, float(bias_init))
        self.sigma_ln = sigma_ln

    def pool_words(self, words: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Mean of the first ``lengths`` word embeddings [B, L, w] and the [UNC] word: [B, w]."""
        total = masked_sum(words, lengths) + self.unc_emb.to(words.dtype)
        return total / (lengths[:, None].to(words.dtype) + 1)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        raw = self.mlp(pooled)
        return self.sigma_ln(raw) if self.sigma_ln is not None else raw


def _is_norm_param(root: nn.Module, name: str) -> bool:
    mod_name = name.rsplit(".", 1)[0] if "." in name else ""
    mod = root.get_submodule(mod_name) if mod_name else root
    return isinstance(mod, nn.LayerNorm)


def _clip_weight_laws_(block: nn.Module, width: int, num_layers: int, *, others: bool = False) -> None:
    """CLIP's normal laws on a block's four weight matrices, in parameter order; with ``others`` (legacy) also
    zero biases and N(0, 0.02) on every other matrix, LayerNorms left alone."""
    attn_std = width ** -0.5
    proj_std = width ** -0.5 * (2 * max(num_layers, 1)) ** -0.5
    fc_std = (2 * width) ** -0.5
    for name, p in block.named_parameters():
        if name.endswith("in_proj_weight"):
            nn.init.normal_(p, std=attn_std)
        elif name.endswith("out_proj.weight") or name.endswith("c_proj.weight"):
            nn.init.normal_(p, std=proj_std)
        elif name.endswith("c_fc.weight"):
            nn.init.normal_(p, std=fc_std)
        elif not others or _is_norm_param(block, name):
            continue
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.ndim >= 2:
            nn.init.normal_(p, std=0.02)


def reinit_block_legacy_(block: nn.Module, width: int, num_layers: int) -> None:
    """zsprob's legacy init: CLIP's laws on the weights, zero biases, LayerNorms reset."""
    for mod in block.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.reset_parameters()
    _clip_weight_laws_(block, width, num_layers, others=True)


def reinit_block_official_(block: nn.Module, side: str, width: int, num_layers: int) -> None:
    """PCME++'s official init: every layer's PyTorch default (attention last, as its reset zeroes the
    out-projection bias a Linear reset would overwrite); text blocks get CLIP's weight laws on top."""
    attention = []
    for mod in block.modules():
        if isinstance(mod, nn.MultiheadAttention):
            attention.append(mod)
        elif mod is not block and hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    for mod in attention:
        mod._reset_parameters()
    if side == "text":
        _clip_weight_laws_(block, width, num_layers)


def reinit_projection_official_(head: SigmaHead, side: str, width: int, bias_init: float,
                                with_sigma_ln: bool) -> None:
    """The official sigma Linear's laws on ``proj`` (image Xavier-uniform, text U(+-w^-1/2)) and ``bias``
    (``bias_init``; with the LayerNorm on log sigma^2: image 0, text U(+-w^-1/2))."""
    weight = head.proj.weight if isinstance(head.proj, nn.Linear) else head.proj
    bound = width ** -0.5
    with torch.no_grad():
        if weight is None:  # a tower without projection (width = D): only the bias is initialised
            pass
        elif side == "image":
            nn.init.xavier_uniform_(weight)  # symmetric in fan-in / fan-out: layout of proj does not matter
        else:
            weight.uniform_(-bound, bound)
        if isinstance(head.proj, nn.Linear) and head.proj.bias is not None:
            head.proj.bias.zero_()  # the head's own ``bias`` is the official projection bias
        if not with_sigma_ln:
            head.bias.fill_(float(bias_init))
        elif side == "image":
            head.bias.zero_()
        else:
            head.bias.uniform_(-bound, bound)


def reinit_projection_legacy_(head: SigmaHead, width: int) -> None:
    if isinstance(head.ln, nn.LayerNorm):
        head.ln.reset_parameters()
    if isinstance(head.proj, nn.Linear):
        nn.init.normal_(head.proj.weight, std=width ** -0.5)
        if head.proj.bias is not None:
            nn.init.zeros_(head.proj.bias)
    elif isinstance(head.proj, nn.Parameter):
        with torch.no_grad():
            head.proj.normal_(std=width ** -0.5)


def reinit_cnn_head_(head: SigmaHead) -> None:
    """A CNN head: every layer's own PyTorch default init (both layouts)."""
    for mod in head.modules():
        if mod is not head and mod is not head.sigma_ln and hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
