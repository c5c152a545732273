"""The objective terms of the joint Wasserstein autoencoders (jWAE) for image-text embeddings.

Per modality a reconstruction and an adversarial JS prior term (one shared discriminator, its own optimiser),
plus an alignment of the paired codes: MSE (jWAE-MSE) or a bidirectional max-margin hinge (jWAE-MH). Unpaired
rows enter only their modality's terms. The weighted sum and its presets (:data:`JWAE_PRESETS`): docs/training.md."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zsprob.errors import UserError
from zsprob.prob.pairs import hinge_rows

JWAE_PRESETS = {
    "jwae-mse": {"lambda1": 1.0, "lambda2": 1.0, "lambda3": 0.2, "lambda4": 0.2, "align": "mse"},
    "jwae-mh": {"lambda1": 0.5, "lambda2": 0.005, "lambda3": 0.01, "lambda4": 0.01, "align": "mh"},
}


def reconstruction_loss(x: torch.Tensor, x_rec: torch.Tensor, kind: str = "l2") -> torch.Tensor:
    """Mean over the batch of ||x - x_rec||_1 ("l1"), ||x - x_rec||_2 ("l2"), or the mean squared
    error over all elements ("mse")."""
    diff = (x - x_rec).flatten(1)
    if kind == "l1":
        return diff.abs().sum(1).mean()
    if kind == "l2":
        return (diff.pow(2).sum(1) + 1e-12).sqrt().mean()
    if kind == "mse":
        return diff.pow(2).mean()
    raise UserError(f"unknown reconstruction loss {kind!r} (choose from l1, l2, mse)")


class PriorDiscriminator(nn.Module):
    """Discriminates prior samples N(0, I) (class 1) from encodings (class 0): 3 FC layers."""

    def __init__(self, dim: int, hidden: int = 256, negative_slope: float = 0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.LeakyReLU(negative_slope),
            nn.Linear(hidden, hidden), nn.LeakyReLU(negative_slope),
            nn.Linear(hidden, 2),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def sample_prior(n: int, dim: int, *, like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """n samples of N(0, I_dim) on the device and in the dtype of ``like`` (``generator``: one on that device)."""
    return torch.randn((n, dim), generator=generator, device=like.device, dtype=like.dtype)


def discriminator_loss(disc: nn.Module, z_codes: torch.Tensor, z_prior: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Cross-entropy of the discriminator: prior samples -> 1, (detached) encodings -> 0.
    As many prior samples as encodings are drawn when ``z_prior`` is None."""
    if z_prior is None:
        z_prior = sample_prior(z_codes.shape[0], z_codes.shape[1], like=z_codes, generator=generator)
    logits = disc(torch.cat([z_prior, z_codes.detach()], dim=0))
    labels = (torch.arange(logits.shape[0], device=logits.device) < z_prior.shape[0]).long()  # made on the device
    return F.cross_entropy(logits, labels)


def generator_loss(disc: nn.Module, z_codes: torch.Tensor) -> torch.Tensor:
    """Non-saturating adversarial term for the encoder: make the discriminator call the codes prior samples."""
    logits = disc(z_codes)
    return F.cross_entropy(logits, torch.ones(z_codes.shape[0], dtype=torch.long, device=logits.device))


def mse_alignment(z_img: torch.Tensor, z_txt: torch.Tensor) -> torch.Tensor:
    """jWAE-MSE alignment (Eq. 7): mean over pairs of ||f_v(x) - f_t(y)||^2."""
    return (z_img - z_txt).pow(2).sum(-1).mean()


def max_margin_alignment(z_img: torch.Tensor, z_txt: torch.Tensor, margin: float = 0.2,
                         negatives: str = "all", normalize: bool = True) -> torch.Tensor:
    """jWAE-MH alignment (Eq. 1): bidirectional hinge on cosine similarity of paired codes,
    summed over negatives (``negatives="hardest"``: VSE++ max violation); mean over pairs."""
    if normalize:
        z_img, z_txt = F.normalize(z_img, dim=-1), F.normalize(z_txt, dim=-1)
    s = z_img @ z_txt.t()
    eye = torch.eye(s.shape[0], device=s.device, dtype=s.dtype)
    return hinge_rows(s, eye, margin, negatives).mean() + hinge_rows(s.t(), eye, margin, negatives).mean()


class JWAEObjective(nn.Module):
    """jWAE's losses with a preset ("jwae-mse" or "jwae-mh") and a shared prior discriminator:
    :meth:`generator_terms` is minimised by the autoencoders, :meth:`discriminator_terms` by the
    discriminator (its own optimiser); both return ``(loss, stats)``."""

    def __init__(self, latent_dim: int, preset: str = "jwae-mh", rec_kind_img: str = "l2",
                 rec_kind_txt: str = "mse", margin: float = 0.2, negatives: str = "all", **overrides):
        super().__init__()
        if preset not in JWAE_PRESETS:
            raise UserError(f"unknown jWAE preset {preset!r} (choose from {', '.join(JWAE_PRESETS)})")
        cfg = dict(JWAE_PRESETS[preset])
        unknown = set(overrides) - set(cfg)
        if unknown:
            raise UserError(f"unknown jWAE options {sorted(unknown)}")
        cfg.update(overrides)
        self.cfg = cfg
        self.rec_kind_img, self.rec_kind_txt = rec_kind_img, rec_kind_txt
        self.margin, self.negatives = float(margin), negatives
        self.discriminator = PriorDiscriminator(latent_dim)

    def generator_terms(self, img, txt, u_img=None, u_txt=None):
        """Semi-supervised encoder objective. ``img`` / ``txt``: ``(x, x_rec, z)`` of the paired
        rows (row i of both is a pair); ``u_img``: ``(x, x_rec, z)`` of unpaired images (None: none),
        ``u_txt`` of unpaired captions. Reconstruction and adversarial terms run over paired +
        unpaired rows of their own modality; the alignment over the paired rows only."""
        c = self.cfg
        x_v, r_v, z_v = _rows(img, u_img)
        x_t, r_t, z_t = _rows(txt, u_txt)
        rec_v = reconstruction_loss(x_v, r_v, self.rec_kind_img)
        rec_t = reconstruction_loss(x_t, r_t, self.rec_kind_txt)
        adv_v = generator_loss(self.discriminator, z_v)
        adv_t = generator_loss(self.discriminator, z_t)
        align = self.alignment(img[2], txt[2])
        loss = c["lambda1"] * rec_v + c["lambda2"] * rec_t + c["lambda3"] * adv_v + c["lambda4"] * adv_t + align
        stats = {"rec_img": rec_v.detach(), "rec_txt": rec_t.detach(), "adv_img": adv_v.detach(),
                 "adv_txt": adv_t.detach(), "align": align.detach(), "gen_loss": loss.detach(),
                 "n_img": z_v.shape[0], "n_txt": z_t.shape[0]}
        return loss, stats

    def alignment(self, z_img: torch.Tensor, z_txt: torch.Tensor) -> torch.Tensor:
        """The preset's alignment of paired codes: MSE (Eq. 7) or the max-margin hinge (Eq. 1)."""
        if self.cfg["align"] == "mse":
            return mse_alignment(z_img, z_txt)
        return max_margin_alignment(z_img, z_txt, self.margin, self.negatives)

    def discriminator_terms(self, z_img, z_txt, generator: torch.Generator | None = None):
        """Discriminator objective over every code of each modality (paired and unpaired rows together;
        the codes are detached inside), as many prior samples as codes drawn per modality."""
        d_v = discriminator_loss(self.discriminator, z_img, generator=generator)
        d_t = discriminator_loss(self.discriminator, z_txt, generator=generator)
        loss = d_v + d_t
        return loss, {"disc_img": d_v.detach(), "disc_txt": d_t.detach(), "disc_loss": loss.detach()}


def _rows(paired, unpaired):
    """(x, x_rec, z) of paired rows followed by the unpaired ones (None: paired only)."""
    if unpaired is None:
        return paired
    return tuple(torch.cat([a, b], dim=0) for a, b in zip(paired, unpaired))
