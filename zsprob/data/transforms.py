"""naver-ai/pcmepp's COCO transforms, for the COCO recipe's ``data.preprocess: official``.

The model's own transforms are open_clip's (``model.preprocess_train`` / ``preprocess_val``, made by
:func:`zsprob.models.create_model`); :func:`apply_official_coco_preprocess` replaces them with the
official ones: a random-ratio crop, a squash resize and a flip for training, the whole image squashed
for evaluation, ImageNet normalisation. torchvision's functional ops do the work.
"""
from __future__ import annotations

__all__ = ["OfficialCocoTrainTransform", "apply_official_coco_preprocess", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class OfficialCocoTrainTransform:
    """pcmepp's COCO training transform: a window of r x (height, width), r ~ U(0.6, 1.0), resized to
    ``size`` x ``size`` (bilinear, not aspect-preserving, as the official ``cv2.resize``), a horizontal
    flip with probability 0.5, ImageNet normalisation. Python's ``random`` draws (seeded per worker)."""

    def __init__(self, size: int, min_ratio: float = 0.6, max_ratio: float = 1.0):
        self.size, self.min_ratio, self.max_ratio = int(size), float(min_ratio), float(max_ratio)

    def __call__(self, img):
        import random

        import torchvision.transforms.functional as TF

        from zsprob.data.images import to_rgb
        img = to_rgb(img)
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


def apply_official_coco_preprocess(model) -> None:
    """Give ``model`` (a ProbCLIP) the official COCO transforms; the evaluation one (the whole image squashed
    to size x size, bilinear, ImageNet normalisation) is written to ``model.config["preprocess_cfg"]``, so a
    saved model evaluates with it."""
    from open_clip.transform import image_transform

    cfg = dict(model.config["preprocess_cfg"], mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
               resize_mode="squash", interpolation="bilinear")
    model.config["preprocess_cfg"] = cfg
    size = int(model.image_size)
    model.preprocess_train = OfficialCocoTrainTransform(size)
    model.preprocess_val = image_transform(size, is_train=False, mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                                           resize_mode="squash", interpolation="bilinear")
