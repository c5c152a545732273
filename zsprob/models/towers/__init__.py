"""Tower adapters: where each kind of tower keeps its blocks, norms, projections and pooling, so ProbCLIP
cuts trunk and heads without looking at the tower's classes (one module per family)."""
from __future__ import annotations

from torch import nn

from zsprob.errors import UserError
from zsprob.models.towers.bow import BowTextTower
from zsprob.models.towers.openclip import TextTower, ViTTower
from zsprob.models.towers.timm_trunk import TimmVisionTower


def vision_tower(clip_model: nn.Module):
    """The adapter of ``clip_model``'s image tower: open_clip's ViT or a timm trunk."""
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    visual = clip_model.visual
    if isinstance(visual, VisionTransformer):
        return ViTTower(clip_model)
    if isinstance(visual, TimmModel):
        return TimmVisionTower(clip_model)
    raise UserError(f"zsprob needs an open_clip VisionTransformer or timm image tower; this model has "
                    f"{type(visual).__name__} (open_clip's ModifiedResNet is not supported; timm ResNets are)")


def text_tower(clip_model: nn.Module, truncate: bool):
    """The adapter of ``clip_model``'s text tower: zsprob's bag of words or open_clip's text transformer."""
    from zsprob.models.bow_text import BagOfWordsText

    if isinstance(getattr(clip_model, "text", None), BagOfWordsText):
        return BowTextTower(clip_model.text)
    return TextTower(clip_model, truncate)
