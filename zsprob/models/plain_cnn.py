"""``zsprob_plaincnn`` / ``zsprob_plaincnn_small``: small VGG-style timm models that learn SynthWorld's shapes
in CPU minutes (docs/findings.md); open_clip's ``TimmModel`` wraps them and zsprob cuts them at their stages.
"""
from __future__ import annotations

import torch
from timm.layers import ConvNormAct, create_classifier
from timm.models import build_model_with_cfg, register_model
from torch import nn


class PlainConvNet(nn.Module):
    """stem (3x3 conv stride 2) -> stages [max-pool 2x2 (from the 2nd) + 3x3 conv-BN-ReLU] -> pool -> fc;
    overall stride 2 * 2 ** (len(widths) - 1) (64 px -> 4 x 4 with the defaults)."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256, 256), stem_width: int = 32, in_chans: int = 3,
                 num_classes: int = 1000, global_pool: str = "avg", drop_rate: float = 0.0, **_ignored):
        super().__init__()
        self.num_classes = num_classes
        self.drop_rate = float(drop_rate)
        self.grad_checkpointing = False
        self.stem = ConvNormAct(in_chans, stem_width, 3, stride=2)
        stages, prev, self.feature_info = [], stem_width, []
        stride = 2
        for i, w in enumerate(widths):
            layers: list[nn.Module] = []
            if i > 0:
                layers.append(nn.MaxPool2d(2))
                stride *= 2
            layers.append(ConvNormAct(prev, w, 3))
            stages.append(nn.Sequential(*layers))
            self.feature_info.append(dict(num_chs=w, reduction=stride, module=f"stages.{i}"))
            prev = w
        self.stages = nn.Sequential(*stages)
        self.num_features = self.head_hidden_size = prev
        self.global_pool, self.fc = create_classifier(prev, num_classes, pool_type=global_pool)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)")

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = bool(enable)

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str = "avg") -> None:
        self.num_classes = num_classes
        self.global_pool, self.fc = create_classifier(self.num_features, num_classes, pool_type=global_pool)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.grad_checkpointing and torch.is_grad_enabled():
            from timm.models._manipulate import checkpoint_seq

            return checkpoint_seq(self.stages, x)
        return self.stages(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate > 0:
            x = nn.functional.dropout(x, p=self.drop_rate, training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _build(variant: str, pretrained: bool, widths: tuple[int, ...], **kwargs) -> PlainConvNet:
    if pretrained:
        from zsprob.errors import UserError

        raise UserError(f"{variant} has no pretrained weights (it is trained from scratch on SynthWorld)")
    kwargs.pop("pretrained_cfg", None)
    kwargs.setdefault("widths", widths)
    return build_model_with_cfg(PlainConvNet, variant, pretrained=False, feature_cfg=dict(flatten_sequential=True),
                                **kwargs)


def zsprob_plaincnn(pretrained: bool = False, **kwargs) -> PlainConvNet:
    """Stages 64-128-256-256 after a 32-channel stem (1.0M parameters)."""
    return _build("zsprob_plaincnn", pretrained, (64, 128, 256, 256), **kwargs)


def zsprob_plaincnn_small(pretrained: bool = False, **kwargs) -> PlainConvNet:
    """Stages 32-64-128-256 after a 32-channel stem (0.4M parameters): zsprob-tiny-bow's image tower."""
    return _build("zsprob_plaincnn_small", pretrained, (32, 64, 128, 256), **kwargs)


def _cfg() -> dict:
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD  # what zsprob's transforms use

    return dict(url="", num_classes=1000, input_size=(3, 64, 64), pool_size=(4, 4), crop_pct=1.0,
                interpolation="bicubic", mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD,
                first_conv="stem.conv", classifier="fc")


default_cfgs: dict[str, dict] = {}  # filled by register() (timm reads it at registration)
_registered = False


def register() -> None:
    """Register ``zsprob_plaincnn`` and ``zsprob_plaincnn_small`` with timm's model registry (idempotent)."""
    global _registered
    if _registered:
        return
    default_cfgs.update(zsprob_plaincnn=_cfg(), zsprob_plaincnn_small=_cfg())
    register_model(zsprob_plaincnn)
    register_model(zsprob_plaincnn_small)
    _registered = True
