"""The log-variance (log sigma^2) heads of :class:`zsprob.models.ProbCLIP`, and their init laws.

torch provides every layer; open_clip provides the blocks the ``"block"`` head copies and the
LayerNorm the ``"unc"`` token head reads through. Nothing here is copied from the official code
bases; the layouts and init laws below were read from them (naver-ai/pcmepp, naver-ai/prolip).

``sigma_head`` (model config key; one list: :data:`SIGMA_HEADS`):

``"block"`` - :class:`SigmaHead` (PCME++): a copy of the tower's last ``sigma_depth`` blocks +
    (LayerNorm) + projection + a learned per-dimension bias (+ its own GPO), applied to the
    output of the shared trunk. Two layouts (``sigma_layout``, :data:`SIGMA_LAYOUTS`):

    * ``"official"`` (default for new models): as PCME++'s COCO code builds its probabilistic
      CLIP (``pcmepp/modules/clip/model.py``, ``pcmepp/models/{img,txt}_encoder.py``). No
      LayerNorm between the duplicated blocks and the sigma projection on either tower (the
      official code applies ``ln_final`` to the mean branch only and has no ``ln_post`` at all;
      ``hf_models/hf_clip.py`` does the same). Random init of the duplicated blocks: image
      tower - PyTorch's module defaults (the official ``uncertainty_transformer`` is never
      re-initialised: ``nn.MultiheadAttention`` in-projection Xavier-uniform, its biases 0,
      ``nn.Linear`` Kaiming-uniform weights and uniform biases, LayerNorm 1 / 0); text tower -
      the same defaults, then CLIP's laws on the four weight matrices (in-projection
      N(0, w^-1/2), out-projection and c_proj N(0, w^-1/2 (2L)^-1/2) with L the tower's number
      of blocks, c_fc N(0, (2w)^-1/2)). Sigma projection ``x @ proj + bias`` (the official
      ``nn.Linear(width, D)``): image Xavier-uniform, text U(-w^-1/2, w^-1/2) (nn.Linear's
      default); its bias is ``sigma_bias_init`` (the official ``bias_init``) without
      ``sigma_ln_init``, and the official default with it (image 0, text U(-w^-1/2, w^-1/2)).
    * ``"legacy"`` (zsprob's own layout before the official one; what a config without ``sigma_layout``
      rebuilds): a copy of the final LayerNorm before the projection, CLIP's laws with zero
      biases on the blocks, projection N(0, w^-1/2), bias ``sigma_bias_init``.

    Both layouts apply only to open_clip transformer towers. timm (CNN) towers keep what follows
    their last stage (tail + timm's pooling; each layer's PyTorch default init when random) and
    bag-of-words towers have no blocks and no norm, so both layouts build the same head there.
    ``sigma_init="copy"`` copies the whole mean head, its final LayerNorm included, in both
    layouts (the projection expects normalised input).

``"unc"`` - ProLIP's [UNC] token (``src/prolip/transformer.py``) and its analogue for towers
    without tokens. No block is duplicated: the tower is shared in full.

    * :class:`UncTokenHead` (open_clip ViT and text transformers): a learned token joins the
      sequence before the first block and runs through the same blocks as every other token;
      its output, through the tower's own final LayerNorm (shared, as ProLIP) and its own
      ``Linear(width, D)`` (weight N(0, w^-1/2), bias ``sigma_bias_init``, -10 by default as
      ProLIP's ``init_unc_bias``), is log sigma^2. mu comes from the usual CLS / EOT token or
      GPO over the other tokens. Image: the token sits right after the class token (index 1,
      as ProLIP) and attends / is attended like a patch, so mu depends on it (as in ProLIP).
      Text: the token is appended after the last position (ProLIP appends [UNC] after the
      padded caption). A tower without any attention mask (bidirectional, as ProLIP's) leaves
      it unmasked, exactly as ProLIP. A masked tower (zsprob's causal open_clip towers, or a
      padding mask) gets one extra mask row and column: the [UNC] token attends to the
      caption's own tokens (start .. end-of-text, padding excluded) and to itself; in a causal
      tower no caption token attends to it, so mu is exactly the model without [UNC] and the
      output does not depend on padding or truncation. Its positional embedding is a separate
      parameter, so the caption positions keep open_clip's table.
    * :class:`UncPooledHead` (bag-of-words text and timm / plain-CNN images): a small MLP
      ``in -> in -> D`` (GELU; output bias ``sigma_bias_init``) on a pooled vector. Bag of words:
      a learned [UNC] word embedding joins every caption's bag in a masked mean that feeds only
      this head, ``(sum of the n word embeddings + unc_emb) / (n + 1)`` (mu's pooling is
      unchanged), so the [UNC] word weighs 1 / (n + 1): fewer (or less informative) words can
      mean more uncertainty, and each word can push log sigma^2 up or down. CNN: the trunk's
      globally pooled last-stage features (timm's own pooling, shared with the mean branch).

``"pcme"`` - :class:`PCMEUncertaintyHead`: PCME's local-attention uncertainty modules
    (naver-ai/pcme ``models/uncertainty_module.py``, PCME Sec. 3): torch's Linear, GRU and packed
    sequences; attention over a tower's local features plus a residual fc of the pooled feature
    (image) or a bidirectional GRU over the local features (text). Local features: a ViT's patch
    tokens and a text transformer's tokens (after the final LayerNorm), a timm CNN's last-stage
    H x W cells (the official module reads a ResNet's 7 x 7 map), a bag of words' word vectors (the
    official module reads the GloVe word vectors). The tower adapters of
    :mod:`zsprob.models.towers` say which (``local_features``); a tower without them is refused.

``sigma_param`` / ``sigma_shape`` (:data:`SIGMA_PARAMS`, :data:`SIGMA_SHAPES`) post-process any
head's D outputs: log sigma instead of log sigma^2 (PCME's code), and Pishdad et al.'s spherical
covariances (:func:`spherical_readout`).

Parameter names of the ``"unc"`` heads (one to one with ProLIP's state dict; D = embed dim,
w = tower width; prefix ``image_sigma.`` <-> ProLIP ``visual.``, ``text_sigma.`` <-> ``text.``):

==========================================  ===========  ==========================================
zsprob                                      shape        ProLIP official
==========================================  ===========  ==========================================
image_sigma.unc_embedding                   [w]          visual.unc_embedding
image_sigma.unc_pos_embedding               [w]          visual.positional_embedding[1]
image_sigma.uncertainty_proj.weight / bias  [D, w] / [D] visual.uncertainty_proj.weight / bias
text_sigma.unc_emb                          [w]          text.unc_emb
text_sigma.unc_pos_embedding                [w]          text.positional_embedding[context_length]
text_sigma.text_uncertainty_projection.*    [D, w] / [D] text.text_uncertainty_projection.*
text_sigma.unc_emb (bag of words)           [w]          (no ProLIP counterpart)
{image,text}_sigma.mlp.fc1 / fc2 .*         Linear       (no ProLIP counterpart)
{image,text}_sigma.sigma_ln.weight / bias   [D]          (PCME++ ``image_std_ln`` / ``text_std_ln``)
==========================================  ===========  ==========================================

The rest of ProLIP's image positional table (rows 0 and 2..) is open_clip's
``clip.visual.positional_embedding`` (CLS, patches); of its text table (``[tokens, UNC, CLS]``)
every row but the [UNC] one is ``clip.text.positional_embedding`` (``zsprob.models.convert.prolip``
splits them). Two details of ProLIP's released code differ from the paper's description:
its image tower applies ``ln_post`` twice to the class token, and its text tower feeds
``text_uncertainty_projection`` with the *projected [CLS] output* rather than the [UNC] output
(it overwrites ``std_pooled``; it only runs because width = D there). ``unc_layout``
(:data:`UNC_LAYOUTS`) chooses: ``"zsprob"`` (default) reads the [UNC] output as the paper
describes; ``"prolip"`` computes what the released code computes (the published weights load
with it).

``sigma_ln_init`` (both head kinds; off by default as in the official ``configs/pcmepp.yaml``):
a LayerNorm(D) on log sigma^2, weight ``sigma_ln_init`` (the official class default is 0.01),
bias ``sigma_ln_init_bias`` (official ProbEncoder*Clip ``image_std_ln`` / ``text_std_ln``).
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
# what the head's output is: log sigma^2, or log sigma as PCME's official code (logvar = 2 x output)
SIGMA_PARAMS = ("logvar", "logsigma")
# Pishdad et al.'s covariance shapes: diagonal, or one sigma per embedding (the average of the D
# variances, "spherical-avgpool", or one predicted value: a learned linear readout of them)
SIGMA_SHAPES = ("diagonal", "spherical_mean", "spherical_one")
# "unc" heads: zsprob's reading of the paper, or what ProLIP's released code computes (its published weights)
UNC_LAYOUTS = ("zsprob", "prolip")
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
    """``Linear(D, 1)`` giving one log-variance per embedding from the head's D log-variances;
    weight 1/D and bias 0, so it starts as their mean (the geometric mean of the variances)."""
    fc = nn.Linear(embed_dim, 1)
    nn.init.constant_(fc.weight, 1.0 / embed_dim)
    nn.init.zeros_(fc.bias)
    return fc


class PCMEUncertaintyHead(nn.Module):
    """PCME's local-attention uncertainty module (PCME Sec. 3; naver-ai/pcme
    ``models/uncertainty_module.py``), for any tower with local features x [B, T, w].

    Attention pooling over x (Lin et al.'s self-attention with one head: ``softmax_T(w2 tanh(w1 x))``,
    hidden w / 2, padding masked), then ``fc`` (Xavier-uniform, bias ``bias_init``), plus a residual
    branch: image - ``fc2`` (nn.Linear's default init) of the tower's pooled feature [B, w] (the
    official residual fc of the globally pooled CNN feature); text - a bidirectional GRU (D / 2 per
    direction, torch's default init) over the same local features, its output at the last valid
    position (as the official code gathers it). The output (D values) is log sigma or log sigma^2 as
    ``sigma_param`` says. Init and layout as the official modules: attention weights Xavier-uniform
    without biases, ``fc`` Xavier-uniform.

    Image inputs: ViT patch tokens (no class token), or a CNN's last-stage cells flattened to
    [B, H*W, C] with timm's global pool as the pooled feature (the official image module on a
    ResNet's 7 x 7 map and its average-pooled feature).

    Text inputs: a text transformer's output tokens, or a bag of words' word vectors (start-of-text
    to end-of-text, as the official captions run ``<start>`` .. ``<end>``). The bag of words keeps the
    GRU: the official text module runs its *own* bi-GRU over the word vectors (GloVe), separate from
    the caption encoder, so a bag of words' word embeddings are exactly its official input, and the
    module is the official one unchanged. That the GRU reads word order while the bag's mean does not
    is no contradiction: the order can only change how uncertain a caption is, never where its mean
    lies. (The mean word vector through ``fc`` would duplicate the attention branch, which already is
    a weighted mean of the same vectors.)
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

    ``side``: "image" (names ``unc_embedding``, ``uncertainty_proj``) or "text" (``unc_emb``,
    ``text_uncertainty_projection``), so ProLIP's keys map one to one. Init as ProLIP:
    image embedding N(0, w^-1/2) (``scale * randn``), text embedding N(0, 0.01); positions as the
    tower's own table (image N(0, w^-1/2), text N(0, 0.01)); projection weight N(0, w^-1/2),
    bias ``bias_init``.
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
    """log sigma^2 = MLP(pooled vector) for towers without tokens (bag of words, CNN).

    ``word_init_std``: when given (bag of words), a learned [UNC] word embedding ``unc_emb``
    (N(0, word_init_std), like the tower's word embeddings) joins every caption's bag:
    :meth:`pool_words` is the masked mean over the caption's words and [UNC].
    """

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


# --------------------------------------------------------------------------------------
# Init laws of the duplicated blocks and the block head's projection.
# --------------------------------------------------------------------------------------
def _is_norm_param(root: nn.Module, name: str) -> bool:
    mod_name = name.rsplit(".", 1)[0] if "." in name else ""
    mod = root.get_submodule(mod_name) if mod_name else root
    return isinstance(mod, nn.LayerNorm)


def _clip_weight_laws_(block: nn.Module, width: int, num_layers: int, *, others: bool = False) -> None:
    """CLIP's normal laws on a residual attention block's four weight matrices; with ``others``
    (the legacy init) also zero biases and N(0, 0.02) on every other matrix, LayerNorms left alone.
    One pass in parameter order, so the random draws come in the order of the parameters."""
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


def reset_block_defaults_(block: nn.Module) -> None:
    """Every layer's PyTorch construction-time init (Linear / LayerNorm first, attention after).

    ``nn.MultiheadAttention._reset_parameters`` zeroes its out-projection bias, which
    ``nn.Linear.reset_parameters`` of that out-projection would otherwise overwrite.
    """
    attention = []
    for mod in block.modules():
        if isinstance(mod, nn.MultiheadAttention):
            attention.append(mod)
        elif mod is not block and hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    for mod in attention:
        mod._reset_parameters()


def reinit_block_official_(block: nn.Module, side: str, width: int, num_layers: int) -> None:
    """PCME++'s official init: image blocks keep PyTorch defaults, text blocks get CLIP's weight laws on top."""
    reset_block_defaults_(block)
    if side == "text":
        _clip_weight_laws_(block, width, num_layers)


def reinit_projection_official_(head: SigmaHead, side: str, width: int, bias_init: float,
                                with_sigma_ln: bool) -> None:
    """The official sigma ``nn.Linear(width, D)`` laws, applied to ``proj`` (+ ``bias``)."""
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


__all__ = ["SIGMA_HEADS", "SIGMA_LAYOUTS", "UNC_LAYOUTS", "DEFAULT_BIAS_INIT", "UNC_EMBEDDING_NAMES", "SigmaHead",
           "UncTokenHead", "UncPooledHead", "make_sigma_ln", "reinit_block_legacy_", "reinit_block_official_",
           "reset_block_defaults_", "reinit_projection_official_", "reinit_projection_legacy_",
           "reinit_cnn_head_"]
