"""Tower adapter for open_clip's ``TimmModel`` image towers (timm CNN trunks), cut at their stages: the
log-variance head copies the last ``n`` stages, what follows them (:class:`TimmPost`) and the projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zsprob.errors import UserError
from zsprob.models.towers.openclip import ViTTower


class TimmPost(nn.Module):
    """What a timm trunk does after its last stage, as one module the log-variance head can copy:
    ``pooled(x)`` what open_clip's TimmModel projects, ``forward(x)`` tokens [B, H*W, C] for GPO."""

    def __init__(self, tail: list[nn.Module], head: nn.Module | None, global_pool: nn.Module | None,
                 drop_rate: float, token_norm: str | None):
        super().__init__()
        self.tail = nn.Sequential(*tail)
        self.head = head
        self.global_pool = global_pool
        self.drop_rate = float(drop_rate)
        self.token_norm = token_norm  # path of the norm inside ``head`` (not registered twice)

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tail(x)
        if self.head is not None:
            return self.head(x)
        x = self.global_pool(x)
        if self.drop_rate > 0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tail(x)
        if self.token_norm is not None:
            x = self.head.get_submodule(self.token_norm)(x)
        return x.flatten(2).transpose(1, 2)


def timm_layout(trunk: nn.Module) -> dict:
    """Stem / stages / tail / head of the timm families zsprob can cut into trunk and heads."""
    from timm.models.convnext import ConvNeXt
    from timm.models.efficientnet import EfficientNet
    from timm.models.regnet import RegNet
    from timm.models.resnet import ResNet

    if isinstance(trunk, ResNet):
        return dict(family="resnet", stem=["conv1", "bn1", "act1", "maxpool"],
                    stages=[f"layer{i}" for i in range(1, 5)], tail=[], head=None, pool="global_pool",
                    token_norm=None)
    if isinstance(trunk, EfficientNet):
        return dict(family="efficientnet", stem=["conv_stem", "bn1"],
                    stages=[f"blocks.{i}" for i in range(len(trunk.blocks))], tail=["conv_head", "bn2"],
                    head=None, pool="global_pool", token_norm=None)
    if isinstance(trunk, RegNet):
        return dict(family="regnet", stem=["stem"], stages=["s1", "s2", "s3", "s4"], tail=["final_conv"],
                    head="head", pool=None, token_norm=None)
    from zsprob.models.plain_cnn import PlainConvNet

    if isinstance(trunk, PlainConvNet):
        return dict(family="plaincnn", stem=["stem"], stages=[f"stages.{i}" for i in range(len(trunk.stages))],
                    tail=[], head=None, pool="global_pool", token_norm=None)
    if isinstance(trunk, ConvNeXt):
        return dict(family="convnext", stem=["stem"], stages=[f"stages.{i}" for i in range(len(trunk.stages))],
                    tail=["norm_pre"], head="head", pool=None, token_norm="norm")
    raise UserError(
        f"timm image tower {type(trunk).__name__} is not supported: zsprob cuts timm towers into a trunk "
        f"and heads for the ResNet, EfficientNet, RegNet and ConvNeXt families and zsprob_plaincnn "
        f"(or use a ViT config)")


class TimmVisionTower:
    """An open_clip ``TimmModel`` image tower (a CNN from timm), seen as stem + stages (the "blocks") + head."""

    kind = "timm"

    def __init__(self, clip_model: nn.Module):
        visual = clip_model.visual
        trunk = visual.trunk
        names = dict(visual.head.named_children())
        if "pool" in names or not any(k in names for k in ("proj", "mlp")):
            raise UserError("zsprob needs an open_clip timm image tower with timm_proj 'linear' or 'mlp' "
                            "and timm's own pooling (attention pooling / classifier-as-projection are not "
                            "supported)")
        lay = timm_layout(trunk)
        self.visual = visual
        self.trunk = trunk
        self.layout = lay
        self.stem = [trunk.get_submodule(n) for n in lay["stem"]]
        self.blocks = [trunk.get_submodule(n) for n in lay["stages"]]
        self.num_blocks = len(self.blocks)
        self.width = int(trunk.num_features)  # channels of the final feature map (and of the pooled feature)
        self._post = TimmPost(
            [trunk.get_submodule(n) for n in lay["tail"]],
            trunk.get_submodule(lay["head"]) if lay["head"] else None,
            trunk.get_submodule(lay["pool"]) if lay["pool"] else None,
            float(getattr(trunk, "drop_rate", 0.0) or 0.0),
            lay["token_norm"])

    @property
    def ln(self) -> nn.Module:
        return self._post

    @property
    def proj(self):
        return self.visual.head

    def embed(self, images: torch.Tensor):
        x = images
        for m in self.stem:
            x = m(x)
        return x, None, None

    @staticmethod
    def run_block(block: nn.Module, x: torch.Tensor, mask) -> torch.Tensor:
        return block(x)

    @staticmethod
    def num_tokens(x: torch.Tensor) -> int:
        return x.shape[2] * x.shape[3]

    def native_pool(self, x: torch.Tensor, ln: nn.Module, ctx) -> torch.Tensor:
        return ln.pooled(x)

    def local_features(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """PCME's image module inputs, as it reads a ResNet: the last stage's cells [B, H*W, C], the pooled [B, C]."""
        return self._post(x), self._post.pooled(x)

    def depth_of(self, rest: str) -> int:
        if rest.startswith("trunk."):
            sub = rest[len("trunk."):]
            for i, n in enumerate(self.layout["stages"]):
                if sub.startswith(n + "."):
                    return i + 1
            if any(sub.startswith(n + ".") for n in self.layout["stem"]):
                return 0
        return self.num_blocks + 1

    project = staticmethod(ViTTower.project)
