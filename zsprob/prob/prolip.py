"""ProLIP's training objective (Chun et al., ICLR 2025, Sec. 3) and the occlusion inclusion term.

    loss, stats = ProLIPLoss()(img_mu, img_logvar, txt_mu, txt_logvar, matched=None, all_img=None,
                               all_txt=None, offset=0, masked_img=None, masked_txt=None)

Arguments as :mod:`zsprob.prob.losses` says; ``masked_img`` / ``masked_txt``: ``(mu, logvar)`` of masked copies
of this process's first rows. Terms as naver-ai/prolip's ``loss.py``; formulas and zsprob's additions: docs/prob.md.
:class:`OcclusionTerm` is shared with PCMEPPLoss."""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zsprob.errors import UserError, check_range
from zsprob.methods import DEFAULT_DEGRADE_OPS, DEGRADE_OPS, IMAGE_MASK_MODES, TEXT_MASK_MODES
from zsprob.prob.pairs import PairBatch, guard_term, stat

#: the inclusion tests the occlusion term (and ProLIPLoss's image-in-caption term) can train with
INCLUSION_FORMS = ("prolip", "cover")
#: what the occlusion term's gradient reaches: "all" (means and log-variances, as ProLIP) or
#: "sigma" (the means are detached inside the term: it can shape sigma^2 but never move a mean)
OCCLUSION_GRADS = ("all", "sigma")

#: a VIB term above this is skipped for the step (ProLIP's ``kl_divergence``)
VIB_GUARD = 1e4
#: an inclusion term whose magnitude exceeds this is skipped for the step (ProLIP's ``inclusion_loss``)
INCLUSION_GUARD = 1e5


def prolip_vib(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """ProLIP's VIB term, -0.5 mean(1 + h - mu^2 - exp(h)) with h = logvar / 2, as means and a dot product."""
    flat_mu = mu.reshape(-1)
    mean_sq = torch.dot(flat_mu, flat_mu) / flat_mu.numel()
    return -0.5 * (1.0 + 0.5 * logvar.mean() - mean_sq - (0.5 * logvar).exp().mean())


class _InclusionLoss(torch.autograd.Function):
    """mean(softplus(-scale * logit)) with ProLIP's closed-form inclusion logit (docs/prob.md), in in-place steps
    and a hand-written backward that recomputes them (fewer passes over [N, D], none of the intermediates
    autograd would keep). With r_k = 1 / W_k, q = e^eps (mu_1 - mu_2)^2:
    d logit / d mu_1 = -2 e^eps (mu_1 - mu_2) (r_2 - r_1) = -d logit / d mu_2,
    d logit / d logvar_1 = -1 - s_1 (r_2 - 2 r_1) / 2 - q s_1 (2 r_1^2 - r_2^2),
    d logit / d logvar_2 = 1 - s_2 (2 r_2 - r_1) / 2 - q s_2 (r_1^2 - 2 r_2^2)."""

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


def _check_whole(name: str, value, low: float, unit: str) -> int:
    number = _check_range(name, value, low)
    if number != int(number):
        raise UserError(f"{name} must be a whole number of {unit}, got {value!r}")
    return int(number)


def _check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise UserError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


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


def check_occlusion_options(*, inclusion_alpha_occ, drop_ratio, drop_prob, image_drop_prob, mask_patch_size,
                            text_mask_mode, inclusion_scale, inclusion_eps, inclusion_start_step=0,
                            inclusion_warmup_steps=0, occlusion_grad="all", image_mask_mode="cells",
                            image_degrade_ops=DEFAULT_DEGRADE_OPS, inclusion_form="prolip", cover_scale=5.0,
                            cover_lambda=1.0) -> dict:
    """The occlusion term's options (shared by ProLIPLoss and PCMEPPLoss), checked: one UserError line each."""
    return {"inclusion_alpha_occ": _check_range("inclusion_alpha_occ", inclusion_alpha_occ, 0.0),
            "drop_ratio": _check_range("drop_ratio", drop_ratio, 0.0, 1.0),
            "drop_prob": _check_range("drop_prob", drop_prob, 0.0, 1.0),
            "image_drop_prob": _check_range("image_drop_prob", image_drop_prob, 0.0, 1.0),
            "mask_patch_size": _check_whole("mask_patch_size", mask_patch_size, 1.0, "pixels"),
            "text_mask_mode": _check_choice("text_mask_mode", text_mask_mode, TEXT_MASK_MODES),
            "inclusion_scale": _check_range("inclusion_scale", inclusion_scale, 0.0, low_open=True),
            "inclusion_eps": _check_range("inclusion_eps", inclusion_eps, -math.inf),
            "inclusion_start_step": _check_whole("inclusion_start_step", inclusion_start_step, 0.0, "steps"),
            "inclusion_warmup_steps": _check_whole("inclusion_warmup_steps", inclusion_warmup_steps, 0.0, "steps"),
            "occlusion_grad": _check_choice("occlusion_grad", occlusion_grad, OCCLUSION_GRADS),
            "image_mask_mode": _check_choice("image_mask_mode", image_mask_mode, IMAGE_MASK_MODES),
            "image_degrade_ops": _check_degrade_ops(image_degrade_ops),
            "inclusion_form": _check_choice("inclusion_form", inclusion_form, INCLUSION_FORMS),
            "cover_scale": _check_range("cover_scale", cover_scale, 0.0, low_open=True),
            "cover_lambda": _check_range("cover_lambda", cover_lambda, 0.0)}


#: the occlusion term's constructor arguments, relayed as they are by PCMEPPLoss and ProLIPLoss
OCCLUSION_OPTIONS = tuple(inspect.signature(check_occlusion_options).parameters)


class OcclusionTerm:
    """Mixin of the losses with the occlusion inclusion term, "each original row is included in its masked
    copy" per modality: its options, its inclusion test and its weight at the 0-based training step the
    trainer passes to ``forward`` (0 before ``inclusion_start_step``, then a linear ramp; the masked copies
    are not even encoded while it is 0; a call without a step weighs the term fully)."""

    inclusion_alpha_occ: float
    drop_ratio: float
    inclusion_start_step: int = 0
    inclusion_warmup_steps: int = 0

    def set_occlusion_options(self, **options) -> None:
        """Check the occlusion term's options (:func:`check_occlusion_options`) and keep them."""
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

    def inclusion(self, mu_in, logvar_in, mu_out, logvar_out) -> torch.Tensor:
        """The inclusion loss of "in" inside "out" in the configured form (docs/prob.md)."""
        if self.inclusion_form == "cover":
            return cover_loss(mu_in, logvar_in, mu_out, logvar_out, self.cover_scale, self.cover_lambda)
        return inclusion_loss(mu_in, logvar_in, mu_out, logvar_out, self.inclusion_scale, self.inclusion_eps)

    def add_occlusion_term(self, loss, stats: dict, batch: PairBatch, masked_img, masked_txt, step):
        """``loss`` plus the weighted occlusion term at ``step``; its terms go into ``stats``. A masked pair
        ``(mu, logvar)`` holds the copies of the batch's first rows (None or empty: no term)."""
        weight = self.occlusion_weight(step)
        if weight <= 0:
            return loss
        total = 0.0
        for name, pair, mu, logvar in (("img", masked_img, batch.img_mu, batch.img_lv),
                                       ("txt", masked_txt, batch.txt_mu, batch.txt_lv)):
            n_masked = 0 if pair is None else pair[0].shape[0]
            if n_masked == 0:
                continue
            mu_in, mu_out = mu[:n_masked], pair[0].to(batch.dtype)
            if self.occlusion_grad == "sigma":
                mu_in, mu_out = mu_in.detach(), mu_out.detach()
            occ = self.inclusion(mu_in, logvar[:n_masked], mu_out, pair[1].to(batch.dtype))
            occ, stats[f"{name}_inclusion_guard_trips"] = guard_term(occ, INCLUSION_GUARD)
            total = total + occ
            stats[f"{name}_inclusion"] = stat(occ)
            stats["n_masked"] = torch.tensor(n_masked)
        stats["occ_weight"] = torch.tensor(weight)
        return loss + weight * total


class ProLIPLoss(OcclusionTerm, nn.Module):
    """ppcl_weight * PPCL + inclusion_alpha * L_incl(image in caption)
    + inclusion_alpha_occ * (L_incl(image in masked image) + L_incl(text in masked text))
    + vib_beta * (VIB_image + VIB_text); docs/prob.md describes every term."""

    def __init__(self, ppcl_weight: float = 1.0, inclusion_alpha: float = 1e-7, inclusion_alpha_occ: float = 1e-3,
                 vib_beta: float = 1e-4, inclusion_scale: float = 1000.0, inclusion_eps: float = -20.0,
                 init_logit_scale: float = math.log(1 / 0.07), init_logit_bias: float = -10.0,
                 max_logit_scale: float = 100.0, drop_ratio: float = 0.125, drop_prob: float = 0.75,
                 image_drop_prob: float = 0.25, mask_patch_size: int = 16, inclusion_form: str = "prolip",
                 cover_scale: float = 5.0, cover_lambda: float = 1.0, text_mask_mode: str = "replace",
                 inclusion_start_step: int = 0, inclusion_warmup_steps: int = 0, occlusion_grad: str = "all",
                 image_mask_mode: str = "cells", image_degrade_ops=DEFAULT_DEGRADE_OPS):
        arguments = dict(locals())  # the occlusion term's options are relayed from here
        super().__init__()
        self.set_occlusion_options(**{key: arguments[key] for key in OCCLUSION_OPTIONS})
        self.ppcl_weight = _check_range("ppcl_weight", ppcl_weight, 0.0)
        self.inclusion_alpha = _check_range("inclusion_alpha", inclusion_alpha, 0.0)
        self.vib_beta = _check_range("vib_beta", vib_beta, 0.0)
        self.max_logit_scale = _check_range("max_logit_scale", max_logit_scale, 1.0)
        init_scale = _check_range("init_logit_scale", init_logit_scale, 0.0, math.log(self.max_logit_scale))
        init_bias = _check_range("init_logit_bias", init_logit_bias, -math.inf)
        self.logit_scale = nn.Parameter(torch.tensor(init_scale))
        self.logit_bias = nn.Parameter(torch.tensor(init_bias))

    def extra_repr(self) -> str:
        return (f"ppcl_weight={self.ppcl_weight}, inclusion_alpha={self.inclusion_alpha}, "
                f"inclusion_alpha_occ={self.inclusion_alpha_occ}, vib_beta={self.vib_beta}, "
                f"inclusion_scale={self.inclusion_scale}, inclusion_eps={self.inclusion_eps}, "
                f"inclusion_form={self.inclusion_form!r}, text_mask_mode={self.text_mask_mode!r}")

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
                            "use a probabilistic model or a method without sigma")
        batch = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=True)
        n_rows = batch.img_mu.shape[0]
        logits = self.logits(batch.img_mu, batch.img_lv, batch.all_txt_mu, batch.all_txt_lv)
        ppcl = _PairwiseBCESum.apply(logits, batch.t_i2t) / n_rows
        loss = self.ppcl_weight * ppcl
        stats = {"ppcl": stat(ppcl)}

        if self.inclusion_alpha > 0:  # row i of the images in row i of the texts
            incl, stats["inclusion_guard_trips"] = guard_term(
                self.inclusion(batch.img_mu, batch.img_lv, batch.txt_mu, batch.txt_lv), INCLUSION_GUARD)
            loss = loss + self.inclusion_alpha * incl
            stats["inclusion"] = stat(incl)
        loss = self.add_occlusion_term(loss, stats, batch, masked_img, masked_txt, step)

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
