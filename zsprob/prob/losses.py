"""The pairwise training objectives, as torch.nn.Modules with one forward signature.

    loss, stats = criterion(img_mu, img_logvar, txt_mu, txt_logvar, matched=None,
                            all_img=None, all_txt=None, offset=0)

``img_*`` / ``txt_*`` are this process's rows [n, D] (logvar None for a loss without sigma);
``all_img`` / ``all_txt`` the ``(mu, logvar)`` of the globally gathered batch [N, D], this process's rows
at ``offset`` (None in one process); ``matched`` the soft targets [N_img, N_txt] in [0, 1] of the global
batch (identity if None). Every loss is a mean over this process's rows, so the mean over processes equals
the single-process loss on the global batch. PCME++, PCME, CLIP, VSE++ and Pishdad et al. are here; ProLIP
is :mod:`zsprob.prob.prolip`, jWAE :mod:`zsprob.prob.jwae`; the methods: :mod:`zsprob.prob.method_registry`."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zsprob.errors import UserError, check_range
from zsprob.methods import DEFAULT_DEGRADE_OPS
from zsprob.prob import distances
from zsprob.prob.method_registry import PCMEPP_DISTANCES
from zsprob.prob.pairs import PairBatch, guard_term, hinge_rows, stat
from zsprob.prob.prolip import OCCLUSION_OPTIONS, OcclusionTerm
from zsprob.utils import host_sync

#: a VIB term above this is skipped for the step (the official code's guard)
VIB_GUARD = 1e4


def vib_kl(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, sigma^2) || N(0, I)) as PCME++ writes it: -0.5 mean(1 + logvar - mu^2 - exp(logvar))."""
    return -0.5 * (1.0 + logvar - mu.pow(2) - logvar.exp()).mean()


def caption_nll(targets: torch.Tensor, img_mu: torch.Tensor, txt_mu: torch.Tensor,
                txt_logvar: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Mean over caption rows of -log N(mu_v; mu_t, diag scale * sigma_t^2) + const over the matched images.

    ``targets`` [n, M]: each caption row's match weights over the image columns ``img_mu`` [M, D] (normalised per
    row; rows without a match are left out); ``txt_mu`` / ``txt_logvar`` [n, D]. The weighted residual is
    W mu^2 - 2 mu_t W mu + mu_t^2, so no [n, M, D] tensor; with the roles swapped it is the image likelihood term."""
    weight = targets.clamp(min=0)
    total = weight.sum(dim=1)
    keep = total > 0  # rows without a positive column add nothing
    if host_sync.host_read_is_free(keep.device):  # the CPU: index the kept rows (a host read costs nothing)
        if not bool(keep.any()):
            return txt_logvar.sum() * 0.0
        w = weight[keep] / total[keep, None]
        mu_t, lv = txt_mu[keep], txt_logvar[keep]
        sq = w @ img_mu.square() - 2.0 * mu_t * (w @ img_mu) + mu_t.square()
        return 0.5 * (sq.clamp(min=0) * torch.exp(-lv) / scale + lv).sum(-1).mean()
    # an accelerator: the mean over kept rows is the mean over all rows times n / kept (exactly the plain
    # mean when every row is kept), so no data-dependent indexing waits for the device
    w = weight / torch.where(keep, total, torch.ones_like(total))[:, None]
    sq = w @ img_mu.square() - 2.0 * txt_mu * (w @ img_mu) + txt_mu.square()
    per_row = 0.5 * (sq.clamp(min=0) * torch.exp(-txt_logvar) / scale + txt_logvar).sum(-1)
    scale_up = keep.shape[0] / keep.sum().clamp(min=1).to(per_row.dtype)
    return torch.where(keep, per_row, per_row * 0.0).mean() * scale_up


def _guarded_vib(mu, logvar) -> tuple[torch.Tensor, torch.Tensor]:
    return guard_term(vib_kl(mu, logvar), VIB_GUARD)


def pseudo_positive_targets(logits: torch.Tensor, targets: torch.Tensor):
    """PCME++ pseudo-positives (Sec. 2.3) for the rows of a [n, M] logit matrix, row-wise as the official code.

    In each row every column whose logit is >= the ground truth's (the column with the largest target)
    takes the ground truth's label. Returns (new targets, selected entries minus rows, the official count).
    """
    gt_label, gt_idx = targets.max(dim=1)
    gt_val = logits.detach().gather(1, gt_idx.unsqueeze(1))
    sel = logits.detach() >= gt_val
    new = torch.where(sel, gt_label.unsqueeze(1).expand_as(targets), targets)
    return new, sel.sum() - sel.shape[0]


def _bce(logits, targets):
    return F.binary_cross_entropy_with_logits(logits, targets)


# ----------------------------------------------------------------------------- PCME++

class PCMEPPLoss(OcclusionTerm, nn.Module):
    """PCME++: L_match (i2t + t2i) + pp_alpha L_pseudo-match (i2t + t2i) + vib_beta L_VIB (:func:`vib_kl`).

    Logits -a * distance + b with learnable a (``self.scale``) and b (``self.shift``); ``distance`` "csd",
    "wd" (2-Wasserstein ablation) or "mu" (mean-only match loss). ``match_sigma="detach"`` and zsprob's terms
    (occlusion inclusion, :class:`~zsprob.prob.prolip.OcclusionTerm`; caption / image likelihood,
    :func:`caption_nll`), all off by default: docs/prob.md."""

    DISTANCES = PCMEPP_DISTANCES + ("mu",)
    MATCH_SIGMA = ("train", "detach")

    def __init__(self, init_scale: float = 5.0, init_shift: float = 5.0, pp_alpha: float = 0.1,
                 vib_beta: float = 1e-4, distance: str = "csd", match_sigma: str = "train",
                 inclusion_alpha_occ: float = 0.0, drop_ratio: float = 0.5, drop_prob: float = 0.5,
                 image_drop_prob: float = 0.25, mask_patch_size: int = 16, text_mask_mode: str = "delete",
                 inclusion_scale: float = 1000.0, inclusion_eps: float = -20.0, inclusion_form: str = "prolip",
                 cover_scale: float = 5.0, cover_lambda: float = 1.0, inclusion_start_step: int = 0,
                 inclusion_warmup_steps: int = 0, occlusion_grad: str = "all", image_mask_mode: str = "cells",
                 image_degrade_ops=DEFAULT_DEGRADE_OPS, caption_nll_alpha: float = 0.0, caption_nll_scale: float = 1.0,
                 image_nll_alpha: float = 0.0, image_nll_scale: float = 1.0):
        arguments = dict(locals())  # the occlusion term's options are relayed from here
        super().__init__()
        if distance not in self.DISTANCES:
            raise UserError(f"unknown PCME++ distance {distance!r} (choose from {', '.join(self.DISTANCES)})")
        if match_sigma not in self.MATCH_SIGMA:
            raise UserError(f"match_sigma must be one of {', '.join(self.MATCH_SIGMA)}, got {match_sigma!r}")
        self.match_sigma = match_sigma
        self.scale = nn.Parameter(torch.tensor(float(init_scale)))
        self.shift = nn.Parameter(torch.tensor(float(init_shift)))
        self.pp_alpha = float(pp_alpha)
        self.vib_beta = float(vib_beta)
        self.distance = distance
        self.set_occlusion_options(**{key: arguments[key] for key in OCCLUSION_OPTIONS})
        self.caption_nll_alpha = check_range(caption_nll_alpha, "PCME++ caption_nll_alpha", 0.0)
        self.caption_nll_scale = check_range(caption_nll_scale, "PCME++ caption_nll_scale", 0.0, low_open=True)
        self.image_nll_alpha = check_range(image_nll_alpha, "PCME++ image_nll_alpha", 0.0)
        self.image_nll_scale = check_range(image_nll_scale, "PCME++ image_nll_scale", 0.0, low_open=True)

    def extra_repr(self) -> str:
        return (f"distance={self.distance!r}, match_sigma={self.match_sigma!r}, pp_alpha={self.pp_alpha}, "
                f"vib_beta={self.vib_beta}, inclusion_alpha_occ={self.inclusion_alpha_occ}, "
                f"caption_nll_alpha={self.caption_nll_alpha}, caption_nll_scale={self.caption_nll_scale}, "
                f"image_nll_alpha={self.image_nll_alpha}, image_nll_scale={self.image_nll_scale}")

    def pairwise_distance(self, mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
        if self.distance == "csd":
            return distances.csd(mu_a, logvar_a, mu_b, logvar_b)
        if self.distance == "wd":
            return distances.wasserstein2(mu_a, logvar_a, mu_b, logvar_b, form="std", squared=True)
        return distances.sq_euclidean(mu_a, mu_b)

    def logits(self, mu_a, logvar_a, mu_b, logvar_b) -> torch.Tensor:
        """-a * d + b, [N, M] (for evaluation or plotting)."""
        d = self.pairwise_distance(mu_a, logvar_a, mu_b, logvar_b)
        return -self.scale.to(d.dtype) * d + self.shift.to(d.dtype)

    def forward(self, img_mu, img_logvar, txt_mu, txt_logvar, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0, masked_img=None, masked_txt=None,
                step: int | None = None):
        # distance "mu" with the occlusion or likelihood terms: the match loss sees the means only,
        # sigma^2 is trained by those terms and VIB alone
        uses_sigma = (self.distance != "mu" or self.inclusion_alpha_occ > 0 or self.caption_nll_alpha > 0
                      or self.image_nll_alpha > 0)
        B = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset,
                      need_sigma=uses_sigma)
        a, b = self.scale.to(B.dtype), self.shift.to(B.dtype)
        lv = (lambda t: None if t is None else t.detach()) if self.match_sigma == "detach" else (lambda t: t)
        l_i2t = -a * self.pairwise_distance(B.img_mu, lv(B.img_lv), B.all_txt_mu, lv(B.all_txt_lv)) + b
        if B.transpose_ok:
            l_t2i = l_i2t.t()
        else:
            l_t2i = -a * self.pairwise_distance(B.txt_mu, lv(B.txt_lv), B.all_img_mu, lv(B.all_img_lv)) + b

        match_i2t = _bce(l_i2t, B.t_i2t)
        match_t2i = match_i2t if B.transpose_ok else _bce(l_t2i, B.t_t2i)  # same pairs when transposed
        loss = match_i2t + match_t2i
        stats = {"match_i2t": stat(match_i2t), "match_t2i": stat(match_t2i)}

        pp_count = torch.zeros((), device=l_i2t.device, dtype=torch.long)
        if self.pp_alpha != 0:
            pp_t_i2t, c1 = pseudo_positive_targets(l_i2t, B.t_i2t)
            pp_t_t2i, c2 = pseudo_positive_targets(l_t2i, B.t_t2i)
            pp_i2t, pp_t2i = _bce(l_i2t, pp_t_i2t), _bce(l_t2i, pp_t_t2i)
            loss = loss + self.pp_alpha * (pp_i2t + pp_t2i)
            pp_count = c1 + c2
            stats.update(pp_match_i2t=stat(pp_i2t), pp_match_t2i=stat(pp_t2i))

        if uses_sigma:
            if self.vib_beta != 0:
                v_img, trip_img = _guarded_vib(B.img_mu, B.img_lv)
                v_txt, trip_txt = _guarded_vib(B.txt_mu, B.txt_lv)
                loss = loss + self.vib_beta * (v_img + v_txt)
                stats.update(vib_guard_trips=trip_img + trip_txt)
            else:
                with torch.no_grad():
                    v_img, v_txt = vib_kl(B.img_mu, B.img_lv), vib_kl(B.txt_mu, B.txt_lv)
            stats.update(vib_img=stat(v_img), vib_txt=stat(v_txt),
                         img_sigma2=stat(B.img_lv.detach().exp().mean()),
                         txt_sigma2=stat(B.txt_lv.detach().exp().mean()))
        if self.caption_nll_alpha > 0:  # trains the caption log-variances only: both means are constants
            nll = caption_nll(B.t_t2i, B.all_img_mu.detach(), B.txt_mu.detach(), B.txt_lv, self.caption_nll_scale)
            loss = loss + self.caption_nll_alpha * nll
            stats.update(caption_nll=stat(nll))
        if self.image_nll_alpha > 0:  # the same with the roles swapped: the image log-variances only
            nll = caption_nll(B.t_i2t, B.all_txt_mu.detach(), B.img_mu.detach(), B.img_lv, self.image_nll_scale)
            loss = loss + self.image_nll_alpha * nll
            stats.update(image_nll=stat(nll))
        loss = self.add_occlusion_term(loss, stats, B, masked_img, masked_txt, step)
        stats.update(loss=stat(loss), scale=stat(self.scale), shift=stat(self.shift),
                     n_pseudo_positives=pp_count.detach())
        return loss, stats


class MuOnlyLoss(PCMEPPLoss):
    """PCME++'s BCE matching loss on the mean-only distance ||mu_v - mu_t||^2 (no sigma, no VIB)."""

    def __init__(self, init_scale: float = 5.0, init_shift: float = 5.0, pp_alpha: float = 0.1):
        super().__init__(init_scale=init_scale, init_shift=init_shift, pp_alpha=pp_alpha,
                         vib_beta=0.0, distance="mu")


# ----------------------------------------------------------------------------- PCME

def _mc_log_probs_block(fa: torch.Tensor, fb: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        ja: int, jb: int, slope: float = 1.0, eps: float = 1e-12):
    """log p and log(1 - p) of the MC match probability for flattened sample blocks, with
    p = mean_jj' sigmoid(slope * (-a * sqrt(d^2 + eps) + b))."""
    dist = (distances.sample_sq_dist(fa, fb).clamp(min=0.0) + eps).sqrt()
    logit = (-a * dist + b).view(fa.shape[0] // ja, ja, fb.shape[0] // jb, jb).permute(0, 2, 1, 3)
    logit = slope * logit.reshape(logit.shape[0], logit.shape[1], ja * jb)
    log_j2 = math.log(ja * jb)
    logp = torch.logsumexp(F.logsigmoid(logit), dim=-1) - log_j2
    log1mp = torch.logsumexp(F.logsigmoid(-logit), dim=-1) - log_j2
    return torch.stack([logp, log1mp], dim=-1)


def mc_log_match_probs(z_a: torch.Tensor, z_b: torch.Tensor, a, b,
                       chunk_elements: int = distances.DEFAULT_CHUNK_ELEMENTS, use_checkpoint: bool | None = None,
                       slope: float = 1.0, eps: float = 1e-12):
    """[n, m, 2] = (log p, log(1 - p)) of the MC match probability between sample sets z_a [n, J, D] and
    z_b [m, J, D], in blocks of at most ``chunk_elements`` sample pairs, each recomputed in the backward
    pass (memory stays bounded). ``slope`` = 2 and ``eps`` = 1e-6 are the official PCME code's."""
    a = torch.as_tensor(a, dtype=z_a.dtype, device=z_a.device)
    b = torch.as_tensor(b, dtype=z_a.dtype, device=z_a.device)
    if use_checkpoint is None:
        use_checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in (z_a, z_b, a, b))
    return distances.sample_blocks(z_a, z_b, _mc_log_probs_block, chunk_elements, use_checkpoint,
                                   a, b, z_a.shape[1], z_b.shape[1], slope, eps)


def _soft_nll(logps: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * logps[..., 0] + (1.0 - targets) * logps[..., 1]).mean()


def _uniformity(z: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """log mean_{i != j} exp(-t ||z_i - z_j||^2) over the rows of z [K, D]."""
    k = z.shape[0]
    if k < 2:
        return z.new_zeros(())
    flat = torch.arange(k * (k - 1), device=z.device)
    rows, cols = flat // (k - 1), flat % (k - 1)
    off = rows * k + cols + (cols >= rows)  # the off-diagonal entries row by row, in a shape known without a sync
    return torch.logsumexp((-t * distances._sq_dist(z, z)).flatten()[off], dim=0) - math.log(k * (k - 1))


PCME_FORMS = ("official", "zsprob")


def _samples(mu, lv, eps):
    return mu.unsqueeze(1) + (0.5 * lv).exp().unsqueeze(1) * eps


class PCMELoss(nn.Module):
    """PCME's soft contrastive loss on the Monte Carlo match probability (J samples per input).

    BCE on p_vt = mean_jj' s(-a ||z_v^j - z_t^j'||_2 + b) in both directions, plus ``vib_beta`` * KL and
    ``uniform_weight`` * the samples' uniformity. ``form`` (:data:`PCME_FORMS`; the table in docs/prob.md):
    "official" is naver-ai/pcme's ``MCSoftContrastiveLoss`` (so its config's weights apply unchanged), "zsprob"
    averages. Noise is drawn for the whole global batch (``generator=`` in forward), the same on every process."""

    def __init__(self, n_samples: int = 7, init_scale: float | None = None, init_shift: float | None = None,
                 vib_beta: float = 1e-5, uniform_weight: float = 0.0, uniform_max_samples: int | None = None,
                 chunk_elements: int = distances.DEFAULT_CHUNK_ELEMENTS, form: str = "official"):
        super().__init__()
        if n_samples < 1:
            raise UserError("PCMELoss needs n_samples >= 1")
        if form not in PCME_FORMS:
            raise UserError(f"loss.pcme.form must be one of {', '.join(PCME_FORMS)}, got {form!r}")
        official = form == "official"
        self.form = form
        self.n_samples = int(n_samples)
        init = 15.0 if official else 5.0
        self.scale = nn.Parameter(torch.tensor(float(init if init_scale is None else init_scale)))
        self.shift = nn.Parameter(torch.tensor(float(init if init_shift is None else init_shift)))
        self.vib_beta = float(vib_beta)
        self.uniform_weight = float(uniform_weight)
        self.uniform_max_samples = int(uniform_max_samples or (128 if official else 1024))
        self.chunk_elements = int(chunk_elements)
        self.slope, self.dist_eps = (2.0, 1e-6) if official else (1.0, 1e-12)

    def extra_repr(self) -> str:
        return (f"form={self.form!r}, n_samples={self.n_samples}, vib_beta={self.vib_beta}, "
                f"uniform_weight={self.uniform_weight}")

    def _noise(self, n: int, d: int, like: torch.Tensor, generator):
        dev = generator.device if generator is not None else like.device
        return torch.randn((n, self.n_samples, d), generator=generator, device=dev, dtype=like.dtype).to(like.device)

    def _vib(self, B, z_img, z_txt) -> torch.Tensor:
        if self.form == "zsprob":
            return _guarded_vib(B.img_mu, B.img_lv)[0] + _guarded_vib(B.txt_mu, B.txt_lv)[0]
        # official: h = log sigma in the log-variance slot, mu = the mean of the samples, summed
        dim = B.img_mu.shape[1]
        return (vib_kl(z_img.mean(dim=1), 0.5 * B.img_lv) * (B.all_img_mu.shape[0] * dim)
                + vib_kl(z_txt.mean(dim=1), 0.5 * B.txt_lv) * (B.all_txt_mu.shape[0] * dim))

    def _uniform(self, z_img, z_txt, generator) -> torch.Tensor:
        dim = z_img.shape[-1]
        z = torch.cat([z_img.reshape(-1, dim), z_txt.reshape(-1, dim)], dim=0)
        k = self.uniform_max_samples
        dev = generator.device if generator is not None else z.device
        if self.form == "official" and z.shape[0] ** 2 > k * k:  # with replacement, as np.random.choice
            idx = torch.randint(z.shape[0], (k,), generator=generator, device=dev)
            z = z[idx.to(z.device)]
        elif self.form == "zsprob" and z.shape[0] > k:
            z = z[torch.randperm(z.shape[0], generator=generator, device=dev)[:k].to(z.device)]
        return _uniformity(z)

    def forward(self, img_mu, img_logvar, txt_mu, txt_logvar, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0, generator: torch.Generator | None = None):
        B = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=True)
        a, b = self.scale.to(B.dtype), self.shift.to(B.dtype)
        dim = B.img_mu.shape[1]
        eps_img = self._noise(B.all_img_mu.shape[0], dim, B.img_mu, generator)
        eps_txt = self._noise(B.all_txt_mu.shape[0], dim, B.img_mu, generator)
        o = B.offset
        z_img = _samples(B.img_mu, B.img_lv, eps_img[o:o + B.img_mu.shape[0]])
        z_txt = _samples(B.txt_mu, B.txt_lv, eps_txt[o:o + B.txt_mu.shape[0]])
        if B.single:
            z_all_img, z_all_txt = z_img, z_txt
        else:
            z_all_img = _samples(B.all_img_mu, B.all_img_lv, eps_img)
            z_all_txt = _samples(B.all_txt_mu, B.all_txt_lv, eps_txt)

        mc = dict(slope=self.slope, eps=self.dist_eps)
        lp_i2t = mc_log_match_probs(z_img, z_all_txt, a, b, self.chunk_elements, **mc)
        nll_i2t = _soft_nll(lp_i2t, B.t_i2t)
        if B.transpose_ok:
            nll_t2i = _soft_nll(lp_i2t.transpose(0, 1), B.t_t2i)
        else:
            nll_t2i = _soft_nll(mc_log_match_probs(z_txt, z_all_img, a, b, self.chunk_elements, **mc), B.t_t2i)
        if self.form == "official":  # summed over every pair of the global batch
            pairs = B.all_img_mu.shape[0] * B.all_txt_mu.shape[0]
            nll_i2t, nll_t2i = nll_i2t * pairs, nll_t2i * pairs
        loss = nll_i2t + nll_t2i
        stats = {"match_i2t": stat(nll_i2t), "match_t2i": stat(nll_t2i)}
        if self.vib_beta != 0:
            v = self._vib(B, z_img, z_txt)
            loss = loss + self.vib_beta * v
            stats["vib"] = stat(v)
        if self.uniform_weight != 0:
            u = self._uniform(z_img, z_txt, generator)
            loss = loss + self.uniform_weight * u
            stats["uniformity"] = stat(u)
        stats.update(loss=stat(loss), scale=stat(self.scale), shift=stat(self.shift),
                     img_sigma2=stat(B.img_lv.detach().exp().mean()),
                     txt_sigma2=stat(B.txt_lv.detach().exp().mean()))
        return loss, stats


# ----------------------------------------------------------------------------- InfoNCE

def _soft_ce_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    p = targets / targets.sum(dim=1, keepdim=True).clamp(min=1e-12)
    return -(p * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


class InfoNCELoss(nn.Module):
    """CLIP's symmetric InfoNCE on the (L2-normalised) means; logit scale exp(s) learnable,
    initialised to 1 / init_temperature and clamped at ``max_scale`` = 100 as in CLIP. Soft
    targets are normalised per row into distributions."""

    def __init__(self, init_temperature: float = 0.07, max_scale: float = 100.0, normalize: bool = True):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / float(init_temperature))))
        self.max_scale = float(max_scale)
        self.normalize = bool(normalize)

    def _sim(self, x, y):
        if self.normalize:
            x, y = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
        return x @ y.t()

    def forward(self, img_mu, img_logvar=None, txt_mu=None, txt_logvar=None, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0):
        B = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=False)
        scale = self.logit_scale.exp().clamp(max=self.max_scale).to(B.dtype)
        l_i2t = scale * self._sim(B.img_mu, B.all_txt_mu)
        l_t2i = l_i2t.t() if B.transpose_ok else scale * self._sim(B.txt_mu, B.all_img_mu)
        i2t, t2i = _soft_ce_rows(l_i2t, B.t_i2t), _soft_ce_rows(l_t2i, B.t_t2i)
        loss = 0.5 * (i2t + t2i)
        return loss, {"loss": stat(loss), "i2t": stat(i2t), "t2i": stat(t2i), "logit_scale": stat(scale)}


# ----------------------------------------------------------------------------- triplets

class TripletLoss(nn.Module):
    """VSE++ hinge triplet on cosine similarity of the means, both directions, margin 0.2;
    ``hardest=True``: hardest negative in the batch (VSE++), else the sum over negatives.
    The per-row hinges are averaged over the local rows (VSE++ sums them; only the lr scale differs)."""

    def __init__(self, margin: float = 0.2, hardest: bool = True, normalize: bool = True):
        super().__init__()
        self.margin = float(margin)
        self.hardest = bool(hardest)
        self.normalize = bool(normalize)

    def forward(self, img_mu, img_logvar=None, txt_mu=None, txt_logvar=None, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0):
        B = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=False)
        f = (lambda x: F.normalize(x, dim=-1)) if self.normalize else (lambda x: x)
        s_i2t = f(B.img_mu) @ f(B.all_txt_mu).t()
        s_t2i = s_i2t.t() if B.transpose_ok else f(B.txt_mu) @ f(B.all_img_mu).t()
        mode = "hardest" if self.hardest else "all"
        i2t = hinge_rows(s_i2t, B.t_i2t, self.margin, mode).mean()
        t2i = hinge_rows(s_t2i, B.t_t2i, self.margin, mode).mean()
        loss = i2t + t2i
        return loss, {"loss": stat(loss), "i2t": stat(i2t), "t2i": stat(t2i)}


class ProbTripletLoss(nn.Module):
    """Pishdad et al.'s hinge triplet on a distribution similarity: "kl" = -KL(N_i || N_c), "minkl",
    "w2" = -W2 (sigma) and "w2var" (variances, as the paper prints it); the formulas: docs/prob.md.
    Variances are clamped to ``var_bounds`` (default [0.1, 10]; None: no clamp)."""

    SIMILARITIES = ("kl", "minkl", "w2", "w2var")

    def __init__(self, similarity: str = "kl", margin: float = 0.2, negatives: str = "hardest",
                 var_bounds: tuple[float, float] | None = (0.1, 10.0)):
        super().__init__()
        if similarity not in self.SIMILARITIES:
            raise UserError(f"unknown similarity {similarity!r} (choose from {', '.join(self.SIMILARITIES)})")
        self.similarity = similarity
        self.margin = float(margin)
        self.negatives = negatives
        self.var_bounds = None if var_bounds is None else (float(var_bounds[0]), float(var_bounds[1]))

    def _bound(self, lv):
        if self.var_bounds is None or lv is None:
            return lv
        return lv.clamp(math.log(self.var_bounds[0]), math.log(self.var_bounds[1]))

    def sim(self, img_mu, img_logvar, txt_mu, txt_logvar) -> torch.Tensor:
        """sim(image i, text c) [N_img, N_txt]."""
        img_logvar, txt_logvar = self._bound(img_logvar), self._bound(txt_logvar)
        if self.similarity == "kl":
            return -distances.kl(img_mu, img_logvar, txt_mu, txt_logvar)
        if self.similarity == "minkl":
            return -distances.min_kl(img_mu, img_logvar, txt_mu, txt_logvar)
        form = "std" if self.similarity == "w2" else "var"
        return -distances.wasserstein2(img_mu, img_logvar, txt_mu, txt_logvar, form=form, squared=False)

    def forward(self, img_mu, img_logvar, txt_mu, txt_logvar, matched=None, *,
                all_img=None, all_txt=None, offset: int = 0):
        B = PairBatch(img_mu, img_logvar, txt_mu, txt_logvar, matched, all_img, all_txt, offset, need_sigma=True)
        s_i2t = self.sim(B.img_mu, B.img_lv, B.all_txt_mu, B.all_txt_lv)  # [n_img, N_txt]
        if B.transpose_ok:
            s_t2i = s_i2t.t()
        else:  # rows: local texts, columns: all images, still sim(image, text)
            s_t2i = self.sim(B.all_img_mu, B.all_img_lv, B.txt_mu, B.txt_lv).t()
        i2t = hinge_rows(s_i2t, B.t_i2t, self.margin, self.negatives).mean()
        t2i = hinge_rows(s_t2i, B.t_t2i, self.margin, self.negatives).mean()
        loss = i2t + t2i
        return loss, {"loss": stat(loss), "i2t": stat(i2t), "t2i": stat(t2i),
                      "img_sigma2": stat(self._bound(B.img_lv).detach().exp().mean()),
                      "txt_sigma2": stat(self._bound(B.txt_lv).detach().exp().mean())}
