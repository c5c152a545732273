"""ProLIP's training objective (Chun et al., ICLR 2025, Sec. 3), with zsprob's loss signature.

    loss, stats = ProLIPLoss()(img_mu, img_logvar, txt_mu, txt_logvar, matched=None,
                               all_img=None, all_txt=None, offset=0,
                               masked_img=None, masked_txt=None)

Rows, gathered columns, ``offset`` and soft ``matched`` targets mean what
:mod:`zsprob.prob.losses` says. ``masked_img`` / ``masked_txt`` are ``(mu, logvar)`` of masked
copies of this process's FIRST ``n_masked`` image / text rows (:mod:`zsprob.data.masking` makes
them; ``zsprob.train.loop.ContrastiveStep`` encodes them).

Terms (official code: naver-ai/prolip ``src/prolip/loss.py``; recipe values from its
``scripts/prolip_datacomp_*.sh`` and ``src/prolip_train/params.py``):

- PPCL (probabilistic pairwise contrastive loss), weight ``ppcl_weight`` (1):
  logits[i, t] = s * (mu_i . mu_t - (||sigma_i^2||_1 + ||sigma_t^2||_1) / 2) + b over local image
  rows x global text columns, as one matmul and two row sums; loss = sum over pairs of
  BCE(logits, m) / number of local rows, which for m in {0, 1} is the official
  -log sigmoid(y * logits) with y = 2 m - 1. Each image-text pair is counted once, on the process
  that holds the image, so the mean over processes is the single-process loss on the global batch.
  s = exp(logit_scale), the log stored as the parameter, initialised to log(1 / 0.07) (the
  official model's default; the ProLIP configs do not override it) and clamped to
  [0, log 100] in the forward pass (the official trainer clamps the parameter after every step);
  b = ``logit_bias`` initialised to -10 (``init_logit_bias`` in every ProLIP model config).
- Inclusion (Sec. 3.3), ``-log sigmoid(inclusion_scale * logit)`` with logit = test(1 in 2) -
  test(2 in 1), the logit of :func:`zsprob.prob.distances.inclusion_logit`, applied PER DIMENSION
  and then averaged over rows and dimensions as the official code does (its inclusion test
  returns [N, D] and the loss means -log sigmoid over both; zsprob's ``inclusion_logit``
  averages over D first). The loss evaluates the difference in closed form: with
  w_k = e^eps / s_k, s_k = sigma_k^2, the quadratic parts B^2 / 4A - C of both tests reduce to
  -w_1 w_2 (mu_1 - mu_2)^2 / 2A, and the eps factors cancel in the log terms, giving
  :func:`inclusion_logit_per_dim` (a quarter of the element-wise operations, and no e^eps / s
  underflow in float32 at eps = -100). So eps only weighs the mean term: at the recipe's
  eps = -20 (e^-20 = 2e-9) the inclusion loss is, in practice, a loss on the variances.
  Image i in its caption i: weight
  ``inclusion_alpha`` (1e-7); original in masked, for images and for texts: weight
  ``inclusion_alpha_occ`` (1e-3) each. ``inclusion_scale`` 1000; ``inclusion_eps`` -20: the
  ProLIP class defaults to -10, but its trainer passes ``--inclusion-eps``, whose default is -20
  and which the released ViT recipes do not set (the long-context recipe sets scale 10, eps -100).
  A term whose magnitude exceeds 1e5 is skipped for the step, as in the official code.
- VIB, weight ``vib_beta`` (1e-4), per modality, exactly ProLIP's ``kl_divergence``: with
  h = logvar / 2 (log sigma), KL = -0.5 mean(1 + h - mu^2 - exp(h)). This is ProLIP's fix of
  naver-ai/pcmepp's GitHub issue #4 as it is written (the PCME++ expression with log sigma in place of
  log sigma^2); it is not the textbook KL(N(mu, sigma^2) || N(0, I)) (that is :func:`zsprob.prob.vib_kl`). Its
  minimum over sigma is at sigma = 1 as well. A term above 1e4 is skipped, as in the official code.

zsprob's options (off by default; SynthWorld's recipe turns them on, docs/findings.md says why):

- ``inclusion_form="cover"`` replaces ProLIP's per-dimension test in the inclusion terms by a
  covering condition on whole embeddings: the outer Gaussian must hold the inner one's variance
  AND the displacement of its mean,
  loss = mean -log sigmoid(cover_scale * (log S_out - log(S_in + cover_lambda ||mu_in - mu_out||^2)))
  with S = ||sigma^2||_1. ProLIP's test at eps = -20 compares variances only, so dropping a filler
  word ("photo") and dropping an attribute ("red") ask for the same growth of sigma; under
  "cover" the growth must match how far the mean moved, so informative words carry more of the
  certainty.
- ``inclusion_start_step`` / ``inclusion_warmup_steps``: the occlusion term's weight is 0 before
  the start step and rises linearly to ``inclusion_alpha_occ`` over the warm-up
  (:class:`OcclusionSchedule`), so a model trained from scratch learns its means first.
- ``text_mask_mode="delete"``: the masked caption copies DELETE the chosen tokens
  (:func:`zsprob.data.masking.delete_tokens`) instead of replacing them with a mask token, so the
  copy is a more general caption of the same grammar, not a caption with an unknown word.

Masking hyper-parameters live here too, so one config section says the whole objective:
``drop_ratio`` (0.125: share of each process's batch that gets a masked copy), ``drop_prob``
(0.75: each text token replaced by the mask token with this probability) and
``image_drop_prob`` (0.25: share of an image's patch-grid cells blanked). The official ViT
keeps ``int(n_patches * drop_prob)`` patches of the masked images (``image_mask_ratio``), i.e.
it drops 1 - 0.75 = 25% of them, hence 0.25; see :mod:`zsprob.data.masking` for how zsprob
masks inputs instead of tokens. ``mask_patch_size`` is the grid cell size in pixels (16, the
ViT-B/16 patch).

Written on plain torch (matmul, ``binary_cross_entropy_with_logits``, ``logsigmoid``); the
row / column bookkeeping comes from :mod:`zsprob.prob.losses`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zsprob.errors import UserError, check_range
from zsprob.methods import DEFAULT_DEGRADE_OPS, DEGRADE_OPS, IMAGE_MASK_MODES, TEXT_MASK_MODES
from zsprob.prob.pairs import PairBatch, guard_term, stat
__all__ = ["ProLIPLoss", "prolip_vib", "inclusion_logit_per_dim", "inclusion_loss", "cover_loss", "occlusion_terms", "prolip_inclusion", "cover_inclusion", "check_occlusion_options", "VIB_GUARD",
           "INCLUSION_GUARD", "INCLUSION_FORMS", "TEXT_MASK_MODES"]

#: the inclusion tests ProLIPLoss can train with (module docstring)
INCLUSION_FORMS = ("prolip", "cover")
#: what the occlusion term's gradient reaches: "all" (means and log-variances, as ProLIP) or
#: "sigma" (the means are detached inside the term: it can shape sigma^2 but never move a mean)
OCCLUSION_GRADS = ("all", "sigma")

#: a VIB term above this is skipped for the step (ProLIP's ``kl_divergence``)
VIB_GUARD = 1e4
#: an inclusion term whose magnitude exceeds this is skipped for the step (ProLIP's ``inclusion_loss``)
INCLUSION_GUARD = 1e5


def prolip_vib(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """ProLIP's VIB term: h = logvar / 2, -0.5 mean(1 + h - mu^2 - exp(h)) (module docstring),
    evaluated as means and a dot product (no [N, D] temporaries besides exp(h))."""
    flat_mu = mu.reshape(-1)
    mean_sq = torch.dot(flat_mu, flat_mu) / flat_mu.numel()
    return -0.5 * (1.0 + 0.5 * logvar.mean() - mean_sq - (0.5 * logvar).exp().mean())


def inclusion_logit_per_dim(mu_1, logvar_1, mu_2, logvar_2, eps: float) -> torch.Tensor:
    """test(1 in 2) - test(2 in 1) per dimension, [N, D], in closed form (module docstring).

    Equal to :func:`zsprob.prob.distances.inclusion_logit` on [N, D, 1] views (tests check it in
    float64 for eps in {0, -20, -100}), with s = sigma^2, W_2 = s_1 + 2 s_2, W_1 = 2 s_1 + s_2:
    (logvar_2 - logvar_1) - log(W_2 / W_1) / 2 - e^eps (mu_1 - mu_2)^2 (1 / W_2 - 1 / W_1).
    """
    var_1, var_2 = logvar_1.exp(), logvar_2.exp()
    wide_2 = var_1 + 2.0 * var_2
    wide_1 = 2.0 * var_1 + var_2
    mean_term = math.exp(eps) * (mu_1 - mu_2).square() * (wide_2.reciprocal() - wide_1.reciprocal())
    return (logvar_2 - logvar_1) - 0.5 * (wide_2 / wide_1).log() - mean_term


class _InclusionLoss(torch.autograd.Function):
    """mean(softplus(-scale * logit)) with logit = :func:`inclusion_logit_per_dim`, evaluated with
    in-place element-wise steps and a hand-written backward that recomputes them (fewer passes
    over [N, D] and none of the intermediates autograd would keep; gradcheck in
    tests/test_prob_prolip.py). With r_k = 1 / W_k, q = e^eps (mu_1 - mu_2)^2:
    d logit / d mu_1 = -2 e^eps (mu_1 - mu_2) (r_2 - r_1) = -d logit / d mu_2,
    d logit / d logvar_1 = -1 - s_1 (r_2 - 2 r_1) / 2 - q s_1 (2 r_1^2 - r_2^2),
    d logit / d logvar_2 = 1 - s_2 (2 r_2 - r_1) / 2 - q s_2 (r_1^2 - 2 r_2^2).
    """

    @staticmethod
    def _parts(mu_1, logvar_1, mu_2, logvar_2, eps: float):
        var_1, var_2 = logvar_1.exp(), logvar_2.exp()
        inv_2 = torch.add(var_1, var_2, alpha=2.0).reciprocal_()
        inv_1 = torch.add(var_2, var_1, alpha=2.0).reciprocal_()
        diff = mu_1 - mu_2
        return var_1, var_2, inv_1, inv_2, diff

    @staticmethod
    def forward(ctx, mu_1, logvar_1, mu_2, logvar_2, scale: float, eps: float):
        var_1, var_2, inv_1, inv_2, diff = _InclusionLoss._parts(mu_1, logvar_1, mu_2, logvar_2, eps)
        # -scale * logit = scale * [(lv_1 - lv_2) + log(W_2 / W_1) / 2 + e^eps diff^2 (r_2 - r_1)]
        neg_logit = torch.sub(logvar_1, logvar_2)
        neg_logit.sub_(torch.div(inv_2, inv_1).log_(), alpha=0.5)       # log(W_2 / W_1) = log(r_1 / r_2)
        neg_logit.addcmul_(diff.square_(), inv_2.sub_(inv_1), value=math.exp(eps))
        neg_logit.mul_(scale)
        ctx.save_for_backward(mu_1, logvar_1, mu_2, logvar_2, neg_logit)
        ctx.scale, ctx.eps = scale, eps
        return F.softplus(neg_logit).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        mu_1, logvar_1, mu_2, logvar_2, neg_logit = ctx.saved_tensors
        # d loss / d logit = -sigmoid(-scale logit) * scale / numel
        grad_logit = torch.sigmoid(neg_logit).mul_(-grad_out * ctx.scale / neg_logit.numel())
        var_1, var_2, inv_1, inv_2, diff = _InclusionLoss._parts(mu_1, logvar_1, mu_2, logvar_2, ctx.eps)
        c = math.exp(ctx.eps)
        grad_mu_1 = (inv_2 - inv_1).mul_(diff).mul_(grad_logit).mul_(-2.0 * c)
        quad = diff.square_().mul_(c)
        sq_1, sq_2 = inv_1.square(), inv_2.square()
        grad_lv_1 = torch.add(inv_2, inv_1, alpha=-2.0).mul_(-0.5)                 # -(r_2 - 2 r_1) / 2
        grad_lv_1.sub_(torch.add(sq_2, sq_1, alpha=-2.0).mul_(-1.0).mul_(quad))    # - q (2 r_1^2 - r_2^2)
        grad_lv_1.mul_(var_1).sub_(1.0).mul_(grad_logit)
        grad_lv_2 = torch.add(inv_1, inv_2, alpha=-2.0).mul_(0.5)                  # -(2 r_2 - r_1) / 2
        grad_lv_2.sub_(torch.add(sq_1, sq_2, alpha=-2.0).mul_(quad))               # - q (r_1^2 - 2 r_2^2)
        grad_lv_2.mul_(var_2).add_(1.0).mul_(grad_logit)
        return grad_mu_1, grad_lv_1, -grad_mu_1, grad_lv_2, None, None


class _PairwiseBCESum(torch.autograd.Function):
    """sum over [n, N] of BCE(logits, targets) = softplus(l) - m l; backward (sigmoid(l) - m) g
    in place: one [n, N] temporary per pass (targets are constants, as in every zsprob loss)."""

    @staticmethod
    def forward(ctx, logits, targets):
        ctx.save_for_backward(logits, targets)
        return F.softplus(logits).sum() - torch.dot(targets.reshape(-1), logits.reshape(-1))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, targets = ctx.saved_tensors
        return torch.sigmoid(logits).sub_(targets).mul_(grad_out), None


def inclusion_loss(mu_in, logvar_in, mu_out, logvar_out, scale: float, eps: float) -> torch.Tensor:
    """mean over rows and dimensions of -log sigmoid(scale * (test(in in out) - test(out in in)))."""
    return _InclusionLoss.apply(mu_in, logvar_in, mu_out, logvar_out, float(scale), float(eps))


def cover_loss(mu_in, logvar_in, mu_out, logvar_out, scale: float, spread: float) -> torch.Tensor:
    """mean over rows of -log sigmoid(scale * (log S_out - log(S_in + spread ||mu_in - mu_out||^2))),
    S = ||sigma^2||_1: "out" covers "in", its variance and the displacement of its mean."""
    var_in = logvar_in.exp().sum(-1)
    var_out = logvar_out.exp().sum(-1)
    gap = (mu_in - mu_out).square().sum(-1)
    logit = torch.log(var_out) - torch.log(var_in + spread * gap)
    return -F.logsigmoid(scale * logit).mean()




def _check_range(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    return check_range(value, f"ProLIP {name}", low, high, low_open)


def _check_count(name: str, value) -> int:
    number = _check_range(name, value, 0.0)
    if number != int(number):
        raise UserError(f"{name} must be a whole number of steps, got {value!r}")
    return int(number)


def occlusion_ramp(step: int | None, start: int, warmup: int) -> float:
    """Share of ``inclusion_alpha_occ`` applied at 0-based ``step``: 0 before ``start``, then a
    linear rise to 1 over ``warmup`` steps (1 at once when ``warmup`` is 0); 1 when step is None."""
    if step is None:
        return 1.0
    if step < start:
        return 0.0
    if warmup <= 0:
        return 1.0
    return min(1.0, (step - start + 1) / warmup)


def _check_degrade_ops(ops) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = [part.strip() for part in ops.split(",") if part.strip()]
    ops = tuple(str(op) for op in (ops or ()))
    unknown = [op for op in ops if op not in DEGRADE_OPS]
    if not ops or unknown:
        raise UserError(f"image_degrade_ops must be a non-empty list of {', '.join(DEGRADE_OPS)}, got "
                        f"{', '.join(map(repr, unknown)) if unknown else 'none'}")
    return ops


#: the occlusion term's constructor arguments, relayed as they are by PCMEPPLoss and ProLIPLoss
OCCLUSION_OPTIONS = ("inclusion_alpha_occ", "drop_ratio", "drop_prob", "image_drop_prob", "mask_patch_size",
                     "text_mask_mode", "inclusion_scale", "inclusion_eps", "inclusion_start_step",
                     "inclusion_warmup_steps", "occlusion_grad", "image_mask_mode", "image_degrade_ops")


def check_occlusion_options(*, inclusion_alpha_occ, drop_ratio, drop_prob, image_drop_prob, mask_patch_size,
                            text_mask_mode, inclusion_scale, inclusion_eps, inclusion_start_step=0,
                            inclusion_warmup_steps=0, occlusion_grad="all", image_mask_mode="cells",
                            image_degrade_ops=DEFAULT_DEGRADE_OPS) -> dict:
    """Validated options of the occlusion inclusion term (shared by ProLIPLoss and PCMEPPLoss)."""
    if text_mask_mode not in TEXT_MASK_MODES:
        raise UserError(f"text_mask_mode must be one of {', '.join(TEXT_MASK_MODES)}, got {text_mask_mode!r}")
    if image_mask_mode not in IMAGE_MASK_MODES:
        raise UserError(f"image_mask_mode must be one of {', '.join(IMAGE_MASK_MODES)}, got {image_mask_mode!r}")
    if occlusion_grad not in OCCLUSION_GRADS:
        raise UserError(f"occlusion_grad must be one of {', '.join(OCCLUSION_GRADS)}, got {occlusion_grad!r}")
    patch = _check_range("mask_patch_size", mask_patch_size, 1.0)
    if patch != int(patch):
        raise UserError(f"mask_patch_size must be a whole number of pixels, got {mask_patch_size!r}")
    return {"inclusion_alpha_occ": _check_range("inclusion_alpha_occ", inclusion_alpha_occ, 0.0),
            "drop_ratio": _check_range("drop_ratio", drop_ratio, 0.0, 1.0),
            "drop_prob": _check_range("drop_prob", drop_prob, 0.0, 1.0),
            "image_drop_prob": _check_range("image_drop_prob", image_drop_prob, 0.0, 1.0),
            "mask_patch_size": int(patch), "text_mask_mode": text_mask_mode,
            "inclusion_scale": _check_range("inclusion_scale", inclusion_scale, 0.0, low_open=True),
            "inclusion_eps": _check_range("inclusion_eps", inclusion_eps, -math.inf),
            "inclusion_start_step": _check_count("inclusion_start_step", inclusion_start_step),
            "inclusion_warmup_steps": _check_count("inclusion_warmup_steps", inclusion_warmup_steps),
            "occlusion_grad": occlusion_grad, "image_mask_mode": image_mask_mode,
            "image_degrade_ops": _check_degrade_ops(image_degrade_ops)}


class OcclusionSchedule:
    """Mixin of the losses with the occlusion inclusion term: its weight at a training step.

    ``inclusion_start_step`` / ``inclusion_warmup_steps`` (0 / 0: the full weight from the first
    step, as ProLIP) delay the term and ramp it in linearly; before the start the trainer does not
    even encode the masked copies. The trainer passes the 0-based step to ``forward``; a call
    without a step (evaluation, direct use) weighs the term fully.
    """

    inclusion_alpha_occ: float
    drop_ratio: float
    inclusion_start_step: int = 0
    inclusion_warmup_steps: int = 0

    def set_occlusion_options(self, **options) -> None:
        """Validate the occlusion term's options (:func:`check_occlusion_options`) and keep them."""
        for key, value in check_occlusion_options(**options).items():
            setattr(self, key, value)

    def occlusion_weight(self, step: int | None = None) -> float:
        """``inclusion_alpha_occ`` times the ramp at ``step`` (:func:`occlusion_ramp`)."""
        return self.inclusion_alpha_occ * occlusion_ramp(step, self.inclusion_start_step,
                                                         self.inclusion_warmup_steps)

    @property
    def wants_masked(self) -> bool:
        """Whether the trainer must encode masked copies at all (the occlusion term is on)."""
        return self.inclusion_alpha_occ > 0 and self.drop_ratio > 0

    def n_masked(self, n_rows: int, step: int | None = None) -> int:
        """Masked copies per process for ``n_rows`` local rows at ``step``: int(n_rows * drop_ratio),
        as ProLIP, and 0 while the term's weight is 0."""
        if not self.wants_masked or self.occlusion_weight(step) == 0:
            return 0
        return int(n_rows * self.drop_ratio)


def occlusion_terms(items, inclusion, dtype, detach_mu: bool = False) -> tuple[torch.Tensor | float, dict]:
    """Sum over the modalities of the inclusion loss "original row in its masked copy".

    ``items``: ``(masked_pair or None, mu, logvar)`` per modality (image first, then text), the
    masked pair holding the copies of the first n rows; ``inclusion(mu_in, lv_in, mu_out, lv_out)``
    is the loss of one modality; ``detach_mu``: the means enter as constants (``occlusion_grad``
    "sigma"). Returns (sum, stats with ``img_inclusion`` / ``txt_inclusion``).
    """
    total, stats = 0.0, {}
    for name, (pair, mu, lv) in zip(("img", "txt"), items):
        pair = _as_pair(f"masked_{name}", pair)
        if pair is None:
            continue
        m_mu, m_lv = pair
        if m_lv is None:
            raise UserError("the occlusion inclusion term needs sigma of the masked inputs, "
                            "but the model is deterministic")
        n_masked = m_mu.shape[0]
        if n_masked == 0:
            continue
        if n_masked > mu.shape[0]:
            raise ValueError(f"masked_{name} has {n_masked} rows, more than the {mu.shape[0]} local rows")
        mu_in, mu_out = mu[:n_masked], m_mu.to(dtype)
        if detach_mu:
            mu_in, mu_out = mu_in.detach(), mu_out.detach()
        occ = inclusion(mu_in, lv[:n_masked], mu_out, m_lv.to(dtype))
        occ, tripped = guard_term(occ, INCLUSION_GUARD)
        stats[f"{name}_inclusion_guard_trips"] = tripped
        total = total + occ
        stats[f"{name}_inclusion"] = stat(occ)
        stats["n_masked"] = torch.tensor(n_masked)
    return total, stats


def prolip_inclusion(scale: float, eps: float):
    """ProLIP's inclusion loss as a function of (mu_in, lv_in, mu_out, lv_out), for :func:`occlusion_terms`."""
    return lambda mu_in, lv_in, mu_out, lv_out: inclusion_loss(mu_in, lv_in, mu_out, lv_out, scale, eps)


def cover_inclusion(scale: float, spread: float):
    """:func:`cover_loss` as a function of (mu_in, lv_in, mu_out, lv_out), for :func:`occlusion_terms`."""
    return lambda mu_in, lv_in, mu_out, lv_out: cover_loss(mu_in, lv_in, mu_out, lv_out, scale, spread)


def _as_pair(name: str, pair):
    if pair is None:
        return None
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"{name} must be a (mu, logvar) pair")
    return pair


class ProLIPLoss(OcclusionSchedule, nn.Module):
    """ppcl_weight * PPCL + inclusion_alpha * L_incl(image in caption)
    + inclusion_alpha_occ * (L_incl(image in masked image) + L_incl(text in masked text))
    + vib_beta * (VIB_image + VIB_text); see the module docstring for every term."""

    def __init__(self, ppcl_weight: float = 1.0, inclusion_alpha: float = 1e-7, inclusion_alpha_occ: float = 1e-3,
                 vib_beta: float = 1e-4, inclusion_scale: float = 1000.0, inclusion_eps: float = -20.0,
                 init_logit_scale: float = math.log(1 / 0.07), init_logit_bias: float = -10.0,
                 max_logit_scale: float = 100.0, drop_ratio: float = 0.125, drop_prob: float = 0.75,
                 image_drop_prob: float = 0.25, mask_patch_size: int = 16, inclusion_form: str = "prolip",
                 cover_scale: float = 5.0, cover_lambda: float = 1.0, text_mask_mode: str = "replace",
                 inclusion_start_step: int = 0, inclusion_warmup_steps: int = 0, occlusion_grad: str = "all",
                 image_mask_mode: str = "cells", image_degrade_ops=DEFAULT_DEGRADE_OPS):
        arguments = dict(locals())  # the occlusion options are relayed from here
        super().__init__()
        if inclusion_form not in INCLUSION_FORMS:
            raise UserError(f"ProLIP inclusion_form must be one of {', '.join(INCLUSION_FORMS)}, got {inclusion_form!r}")
        self.inclusion_form = inclusion_form
        self.cover_scale = _check_range("cover_scale", cover_scale, 0.0, low_open=True)
        self.cover_lambda = _check_range("cover_lambda", cover_lambda, 0.0)
        self.ppcl_weight = _check_range("ppcl_weight", ppcl_weight, 0.0)
        self.inclusion_alpha = _check_range("inclusion_alpha", inclusion_alpha, 0.0)
        self.vib_beta = _check_range("vib_beta", vib_beta, 0.0)
        self.max_logit_scale = _check_range("max_logit_scale", max_logit_scale, 1.0)
        init_scale = _check_range("init_logit_scale", init_logit_scale, 0.0, math.log(self.max_logit_scale))
        init_bias = _check_range("init_logit_bias", init_logit_bias, -math.inf)
        self.set_occlusion_options(**{key: arguments[key] for key in OCCLUSION_OPTIONS})
        self.logit_scale = nn.Parameter(torch.tensor(init_scale))
        self.logit_bias = nn.Parameter(torch.tensor(init_bias))

    def extra_repr(self) -> str:
        return (f"ppcl_weight={self.ppcl_weight}, inclusion_alpha={self.inclusion_alpha}, "
                f"inclusion_alpha_occ={self.inclusion_alpha_occ}, vib_beta={self.vib_beta}, "
                f"inclusion_scale={self.inclusion_scale}, inclusion_eps={self.inclusion_eps}, "
                f"inclusion_form={self.inclusion_form!r}, text_mask_mode={self.text_mask_mode!r}")

    def inclusion(self, mu_in, logvar_in, mu_out, logvar_out) -> torch.Tensor:
        """The inclusion loss of "in" inside "out" in the configured form (module docstring)."""
        if self.inclusion_form == "cover":
            return cover_loss(mu_in, logvar_in, mu_out, logvar_out, self.cover_scale, self.cover_lambda)
        return inclusion_loss(mu_in, logvar_in, mu_out, logvar_out, self.inclusion_scale, self.inclusion_eps)

    def scale(self, dtype=None) -> torch.Tensor:
        """exp(logit_scale) with the log clamped to [0, log max_logit_scale]."""
        s = self.logit_scale.clamp(0.0, math.log(self.max_logit_scale)).exp()
        return s if dtype is None else s.to(dtype)

    def logits(self, img_mu, img_logvar, txt_mu, txt_logvar) -> torch.Tensor:
        """s * (mu_i . mu_t - (||sigma_i^2||_1 + ||sigma_t^2||_1) / 2) + b, [N_img, N_txt].

        One matmul of augmented rows: [s mu_i, -s ||sigma_i^2||_1 / 2, s, b] . [mu_t, 1,
        -||sigma_t^2||_1 / 2, 1], so no [N_img, N_txt] temporary besides the result.
        """
        dtype = img_mu.dtype
        scale, bias = self.scale(dtype), self.logit_bias.to(dtype)
        ones_img = torch.ones_like(img_mu[:, :1])
        ones_txt = torch.ones_like(txt_mu[:, :1])
        half_var_img = 0.5 * img_logvar.exp().sum(-1, keepdim=True)
        half_var_txt = 0.5 * txt_logvar.exp().sum(-1, keepdim=True)
        rows = torch.cat([scale * img_mu, -scale * half_var_img, scale * ones_img, bias * ones_img], dim=1)
        cols = torch.cat([txt_mu, ones_txt, -half_var_txt, ones_txt], dim=1)
        return rows @ cols.t()

    def forward(self, img_mu, img_logvar, txt_mu, txt_logvar, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0, masked_img=None, masked_txt=None,
                step: int | None = None):
        if img_logvar is None or txt_logvar is None or (all_img is not None and all_img[1] is None) \
                or (all_txt is not None and all_txt[1] is None):
            raise UserError("--method prolip needs sigma (log sigma^2 heads), but the model is deterministic; "
                            "use a probabilistic model or a method without sigma (infonce, triplet, mu-only)")
        batch = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=True)
        dtype = batch.dtype
        n_rows = batch.img_mu.shape[0]
        logits = self.logits(batch.img_mu, batch.img_lv, batch.all_txt_mu, batch.all_txt_lv)
        ppcl = _PairwiseBCESum.apply(logits, batch.t_i2t) / n_rows
        loss = self.ppcl_weight * ppcl
        stats = {"ppcl": stat(ppcl)}

        if self.inclusion_alpha > 0:
            if batch.txt_mu.shape[0] != n_rows:
                raise ValueError("the image-in-caption inclusion term pairs row i of the images with row i "
                                 "of the texts: give as many local texts as images")
            incl, stats["inclusion_guard_trips"] = guard_term(
                self.inclusion(batch.img_mu, batch.img_lv, batch.txt_mu, batch.txt_lv), INCLUSION_GUARD)
            loss = loss + self.inclusion_alpha * incl
            stats["inclusion"] = stat(incl)
        occ_weight = self.occlusion_weight(step)
        if occ_weight > 0:
            occ, occ_stats = occlusion_terms(((masked_img, batch.img_mu, batch.img_lv),
                                              (masked_txt, batch.txt_mu, batch.txt_lv)), self.inclusion, dtype,
                                             detach_mu=self.occlusion_grad == "sigma")
            loss = loss + occ_weight * occ
            stats.update(occ_stats, occ_weight=torch.tensor(occ_weight))

        vib_img, trip_img = guard_term(prolip_vib(batch.img_mu, batch.img_lv), VIB_GUARD)
        vib_txt, trip_txt = guard_term(prolip_vib(batch.txt_mu, batch.txt_lv), VIB_GUARD)
        stats["vib_guard_trips"] = trip_img + trip_txt
        if self.vib_beta > 0:
            loss = loss + self.vib_beta * (vib_img + vib_txt)
        stats.update(vib_img=stat(vib_img), vib_txt=stat(vib_txt),
                     img_sigma2=stat(batch.img_lv.detach().exp().mean()),
                     txt_sigma2=stat(batch.txt_lv.detach().exp().mean()),
                     loss=stat(loss), scale=stat(self.scale()), bias=stat(self.logit_bias))
        return loss, stats
