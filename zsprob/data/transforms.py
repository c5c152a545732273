"""Image transforms for training and evaluation, including PCME++'s SizeAugment.

What comes from libraries: the geometric / photometric pipeline itself is open_clip's
(:func:`open_clip.transform.image_transform`: resize, ``RandomResizedCrop`` with
``AugmentationCfg.scale``, RGB conversion, normalisation with the model's mean / std), built
on torchvision. A model created with :func:`zsprob.models.create_model` already carries these
as ``model.preprocess_train`` / ``model.preprocess_val``; the helpers below build the same
transforms from an image size when no model is at hand (benchmarks, tests, dataset tools).

What zsprob writes itself: **SizeAugment**, the VSE-infinity augmentation that PCME++ uses
on COCO "for the generalizability of GPO" (PCME++ Sec. 3.1; VSE-infinity, Chen et al. 2021).

SizeAugment, what it is and what we do for ViTs
-----------------------------------------------
In VSE-infinity and in the official PCME++ code the augmentation is applied to the *set of
visual tokens* that the pooling operator (GPO) aggregates, not to pixels: for every training
image draw ``u ~ U(0, 1)``; if ``u > p`` (p = 0.2, so 80% of the images), drop every token
independently with probability ``p * u`` (so at most 20% of the tokens); the remaining
tokens are packed to the front, padded, and their count is passed to GPO as the set length.
GPO thereby sees sets of varying size, which is what it must generalise over.

For a ViT the faithful place is therefore the token sequence after the transformer, before
pooling, and zsprob provides exactly that as :func:`size_augment_tokens` (token tensor in,
packed tensor + lengths out; the class token can be kept). The model owner calls it inside
the image tower in training mode.

The data pipeline works on images, so it also offers an image-level approximation,
:class:`SizeAugment`: with the same random law it masks whole patch cells of the normalised
image tensor (patch grid = the ViT's patch size) with 0, which after normalisation is the
dataset mean colour. Masked cells still become tokens (a ViT needs a full grid), so this is
closer to "random erasing on the patch grid" than to a shorter set; it is offered because
it needs no model cooperation, and documented as such. Random-size crops are the other
image-level ingredient; they are open_clip's ``RandomResizedCrop`` (``scale`` argument of
:func:`build_train_transform`). The RedCaps recipe (PCME++ Table B.1) uses no SizeAugment;
the COCO recipe does.

All randomness goes through torch's default generator (and Python's ``random`` inside
open_clip / torchvision), which :mod:`zsprob.data.webdataset` seeds per sample, so
augmentations are reproducible.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "SizeAugment",
    "size_augment_tokens",
    "build_train_transform",
    "build_val_transform",
    "with_size_augment",
    "OfficialCocoTrainTransform",
    "official_coco_preprocess_cfg",
    "apply_official_coco_preprocess",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class OfficialCocoTrainTransform:
    """naver-ai/pcmepp's COCO training transform (``pcmepp/datasets.py``), on torchvision's functional
    ops: crop a random window of r x (height, width) with r ~ U(0.6, 1.0) (one ratio for both sides,
    so the aspect ratio is kept and the area share is r^2), resize it to ``size`` x ``size``
    (bilinear, not aspect-preserving, as the official ``cv2.resize``), flip horizontally with
    probability 0.5, ImageNet normalisation. Randomness: Python's ``random`` (seeded per worker)."""

    def __init__(self, size: int, min_ratio: float = 0.6, max_ratio: float = 1.0):
        self.size, self.min_ratio, self.max_ratio = int(size), float(min_ratio), float(max_ratio)

    def __call__(self, img):
        import random

        import torchvision.transforms.functional as TF

        img = img.convert("RGB")
        w, h = img.size
        r = random.uniform(self.min_ratio, self.max_ratio)
        ch, cw = max(1, int(h * r)), max(1, int(w * r))
        top, left = random.randint(0, h - ch), random.randint(0, w - cw)
        img = TF.resized_crop(img, top, left, ch, cw, [self.size, self.size],
                              interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
        if random.random() < 0.5:
            img = TF.hflip(img)
        return TF.normalize(TF.to_tensor(img), IMAGENET_MEAN, IMAGENET_STD)

    def __repr__(self) -> str:
        return f"OfficialCocoTrainTransform(size={self.size}, ratio=({self.min_ratio}, {self.max_ratio}), hflip=0.5)"


def official_coco_preprocess_cfg(preprocess_cfg: dict) -> dict:
    """A model's ``preprocess_cfg`` changed to the official evaluation transform: the whole image
    resized to size x size (open_clip's ``resize_mode="squash"``, bilinear), ImageNet normalisation."""
    out = dict(preprocess_cfg)
    out.update(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD), resize_mode="squash", interpolation="bilinear")
    return out


class SizeAugment:
    """Image-level SizeAugment on a normalised CHW (or BCHW) tensor: mask random patch cells.

    With probability ``1 - p`` nothing happens; otherwise, with ``u ~ U(p, 1)`` the draw that
    triggered it, every ``patch_size`` x ``patch_size`` cell is replaced by ``fill``
    independently with probability ``p * u`` (the VSE-infinity / PCME++ law, see the module
    docstring). ``p=0`` disables it.
    """

    def __init__(self, p: float = 0.2, patch_size: int = 16, fill: float = 0.0,
                 generator: Optional[torch.Generator] = None):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"SizeAugment p must be in [0, 1), got {p}")
        if patch_size < 1:
            raise ValueError(f"patch_size must be >= 1, got {patch_size}")
        self.p = float(p)
        self.patch_size = int(patch_size)
        self.fill = float(fill)
        self.generator = generator

    def _one(self, img: torch.Tensor) -> torch.Tensor:
        if self.p <= 0:
            return img
        u = float(torch.rand((), generator=self.generator))
        if u <= self.p:
            return img
        h, w = img.shape[-2:]
        ps = self.patch_size
        gh, gw = -(-h // ps), -(-w // ps)
        drop = torch.rand((gh, gw), generator=self.generator) < self.p * u
        if not bool(drop.any()):
            return img
        mask = drop.repeat_interleave(ps, 0).repeat_interleave(ps, 1)[:h, :w]
        out = img.clone()
        out[..., mask] = self.fill
        return out

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if not isinstance(img, torch.Tensor):
            raise TypeError("SizeAugment works on tensors; put it after ToTensor/Normalize")
        if img.dim() == 4:
            return torch.stack([self._one(x) for x in img])
        return self._one(img)

    def __repr__(self) -> str:
        return f"SizeAugment(p={self.p}, patch_size={self.patch_size}, fill={self.fill})"


def size_augment_tokens(tokens: torch.Tensor, p: float = 0.2, *, keep_first: int = 1,
                        generator: Optional[torch.Generator] = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level SizeAugment (VSE-infinity / official PCME++): drop tokens, pack, pad.

    ``tokens``: [B, N, D] (e.g. ViT output tokens before GPO). For each row, with
    ``u ~ U(0,1)``: if ``u > p`` each of the tokens after the first ``keep_first`` (the class
    token) is dropped with probability ``p * u``. Kept tokens keep their order, are packed to
    the front and zero-padded; the result is cut to the longest kept row.

    Returns ``(packed [B, N', D], lengths [B] long)``, the input GPO expects.
    """
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be [B, N, D], got shape {tuple(tokens.shape)}")
    b, n, _ = tokens.shape
    dev = tokens.device
    if p <= 0 or n == 0:
        return tokens, torch.full((b,), n, dtype=torch.long, device=dev)
    u = torch.rand((b, 1), generator=generator).to(dev)
    r = torch.rand((b, n), generator=generator).to(dev)
    keep = (u <= p) | (r > p * u)
    keep[:, :keep_first] = True
    lengths = keep.sum(1)
    # stable sort puts kept tokens (key 0) first in their original order
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    packed = torch.gather(tokens, 1, order.unsqueeze(-1).expand_as(tokens))
    pos = torch.arange(n, device=dev).unsqueeze(0)
    packed = packed * (pos < lengths.unsqueeze(1)).unsqueeze(-1).to(packed.dtype)
    return packed[:, : int(lengths.max())], lengths


def _compose_with(preprocess: Callable, extra: Sequence[Callable]) -> Callable:
    from torchvision.transforms import Compose

    if not extra:
        return preprocess
    if isinstance(preprocess, Compose):
        return Compose(list(preprocess.transforms) + list(extra))
    return Compose([preprocess, *extra])


def with_size_augment(preprocess: Callable, p: float = 0.2, patch_size: int = 16) -> Callable:
    """Append image-level :class:`SizeAugment` to an existing transform (e.g. ``model.preprocess_train``)."""
    if p <= 0:
        return preprocess
    return _compose_with(preprocess, [SizeAugment(p=p, patch_size=patch_size)])


def build_train_transform(image_size: int, *, mean: Optional[Sequence[float]] = None,
                          std: Optional[Sequence[float]] = None,
                          scale: tuple[float, float] = (0.9, 1.0),
                          size_augment: float = 0.0, patch_size: int = 16,
                          **aug_kwargs) -> Callable:
    """open_clip's training transform (RandomResizedCrop(scale), RGB, ToTensor, Normalize),
    optionally followed by image-level :class:`SizeAugment`.

    ``aug_kwargs`` go to :class:`open_clip.transform.AugmentationCfg` (``ratio``,
    ``color_jitter``, ``re_prob``, ``use_timm``, ...). ``mean``/``std`` default to OpenAI CLIP's.
    """
    from open_clip.transform import AugmentationCfg, image_transform

    aug = AugmentationCfg(scale=tuple(scale), **aug_kwargs)
    t = image_transform(image_size, is_train=True, mean=mean, std=std, aug_cfg=aug)
    return with_size_augment(t, size_augment, patch_size)


def build_val_transform(image_size: int, *, mean: Optional[Sequence[float]] = None,
                        std: Optional[Sequence[float]] = None, resize_mode: Optional[str] = None) -> Callable:
    """open_clip's evaluation transform (resize shortest side, center crop, RGB, ToTensor, Normalize)."""
    from open_clip.transform import image_transform

    return image_transform(image_size, is_train=False, mean=mean, std=std, resize_mode=resize_mode)


def apply_official_coco_preprocess(model) -> None:
    """Give ``model`` (a ProbCLIP) the official COCO transforms: :class:`OfficialCocoTrainTransform`
    for training and the squash-resize ImageNet transform for evaluation; the latter is written to
    ``model.config["preprocess_cfg"]``, so a saved model evaluates with it."""
    from open_clip.transform import image_transform

    cfg = official_coco_preprocess_cfg(model.config["preprocess_cfg"])
    model.config["preprocess_cfg"] = cfg
    size = int(model.image_size)
    model.preprocess_train = OfficialCocoTrainTransform(size)
    model.preprocess_val = image_transform(size, is_train=False, mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                                           resize_mode="squash", interpolation="bilinear")
