"""CLIP_benchmark model type "zsprob": zsprob models in CLIP_benchmark's own evaluation.

:func:`register` adds the type (``encode_*`` give zsprob's means, ``encode_*_sigma2`` sigma^2) and repairs
CLIP_benchmark's zero-shot ``accuracy()`` where the installed numpy breaks it; :func:`run_cli` runs its
command line with the type registered. CLIP_benchmark does the datasets, loaders and metrics.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from zsprob.errors import UserError, one_line

MODEL_TYPE = "zsprob"
INSTALL_HINT = "CLIP_benchmark is not installed: pip install 'zsprob[clip-benchmark]'"


class MeanEncoder(nn.Module):
    """A zsprob model as CLIP_benchmark sees it: ``encode_image`` / ``encode_text`` give the means
    [B, D]; ``encode_*_sigma2`` give sigma^2 [B, D] (None for a deterministic model)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images, with_sigma=False)[0]

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(tokens, with_sigma=False)[0]

    def encode_image_sigma2(self, images: torch.Tensor) -> torch.Tensor | None:
        logvar = self.model.encode_image(images)[1]
        return None if logvar is None else logvar.exp()

    def encode_text_sigma2(self, tokens: torch.Tensor) -> torch.Tensor | None:
        logvar = self.model.encode_text(tokens)[1]
        return None if logvar is None else logvar.exp()


def load_zsprob(model_name: str, pretrained: str | None = "", cache_dir: str | None = None,
                device: str | torch.device = "cpu"):
    """CLIP_benchmark's loader signature -> ``(MeanEncoder, transform, tokenizer)``. ``model_name``: a zsprob
    checkpoint or export (``pretrained`` empty), or a model name with ``pretrained`` what zsprob's
    ``--pretrained`` takes (an open_clip tag, a weights file, a published file, a zsprob checkpoint)."""
    from zsprob.models import load_for_inference
    from zsprob.models.checkpoint import is_checkpoint
    from zsprob.models.open_clip_dir import export_section

    pretrained = pretrained or None
    path = os.path.expanduser(str(model_name))
    if is_checkpoint(path) or (os.path.isdir(path) and export_section(path) is not None):
        if pretrained is not None:
            raise UserError(f"{model_name} is a zsprob checkpoint; pretrained ({pretrained!r}) applies to a model "
                            "name (leave it empty)")
        model = load_for_inference(checkpoint=path)
    else:
        extra = {"cache_dir": cache_dir} if cache_dir else {}
        model = load_for_inference(model=str(model_name), pretrained=pretrained, **extra)
    model = model.to(device).eval()
    return MeanEncoder(model), model.preprocess_val, model.tokenizer


def topk_accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[float]:
    """Fraction of rows of ``output`` [N, C] whose ``target`` is among the k largest, for each k
    (CLIP_benchmark's ``accuracy()`` contract; each count read as a 0-dimensional value)."""
    ranked = output.topk(max(topk), dim=1, largest=True, sorted=True).indices.t()
    hits = ranked.eq(target.view(1, -1).expand_as(ranked))
    n = len(target)
    return [hits[:k].sum().item() / n for k in topk]


def _accuracy_works(fn) -> bool:
    try:
        fn(torch.tensor([[0.0, 1.0]]), torch.tensor([1]), topk=(1,))
    except TypeError:
        return False
    return True


def register() -> None:
    """Add model type "zsprob" to CLIP_benchmark (idempotent); repair its zero-shot accuracy() where the
    installed numpy breaks it (module docstring). UserError when CLIP_benchmark is not installed."""
    try:
        import clip_benchmark.metrics.zeroshot_classification as zsc
        import clip_benchmark.models as cb_models
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    cb_models.TYPE2FUNC[MODEL_TYPE] = load_zsprob
    if MODEL_TYPE not in cb_models.MODEL_TYPES:
        cb_models.MODEL_TYPES.append(MODEL_TYPE)  # the same list object CLIP_benchmark's CLI offers as choices
    if not _accuracy_works(zsc.accuracy):
        zsc.accuracy = topk_accuracy


def cli_args(args: list[str]) -> list[str]:
    """CLIP_benchmark arguments with zsprob's defaults for ``eval``: ``--model_type zsprob`` and an empty
    ``--pretrained`` (CLIP_benchmark's default names an open_clip tag) unless given."""
    args = list(args)
    if args[:1] != ["eval"]:
        return args
    given = {a.split("=", 1)[0] for a in args}
    if "--model_type" not in given:
        args += ["--model_type", MODEL_TYPE]
    if "--pretrained" not in given and "--pretrained_model" not in given:
        args += ["--pretrained", ""]
    return args


def run_cli(args: list[str]) -> int:
    """CLIP_benchmark's own command line (``clip_benchmark.cli.main``) on ``args``, type "zsprob" registered."""
    import sys

    register()
    try:
        from clip_benchmark import cli as cb_cli
    except ImportError as e:  # e.g. requests: clip-benchmark 1.6.2 imports it without declaring it
        raise UserError(f"CLIP_benchmark's command line cannot start: {e} (pip install "
                        f"{getattr(e, 'name', None) or 'the missing package'}; zsprob's clip-benchmark extra "
                        "brings it)") from None

    argv = sys.argv
    sys.argv = ["clip_benchmark", *cli_args(args)]
    try:
        rv = cb_cli.main()
    except ValueError as e:
        if "Unsupported dataset" not in str(e):
            raise
        raise UserError(f"clip-benchmark: {one_line(e)[:400]} (its dataset names: the README of CLIP_benchmark, "
                        "e.g. cifar10, imagenet1k, mscoco_captions, wds/...)") from None
    except OSError as e:  # a dataset it would download (no network here), a file missing or unreadable
        raise UserError(f"clip-benchmark: {type(e).__name__}: {one_line(e)[:400]}{_download_hint(e)}") from None
    finally:
        sys.argv = argv
    return int(rv or 0)


def _download_hint(e: OSError) -> str:
    """What to do when CLIP_benchmark tried to download a dataset this machine cannot reach."""
    import socket
    import urllib.error

    network = isinstance(e, (urllib.error.URLError, ConnectionError, TimeoutError, socket.gaierror))
    try:
        import requests
        network = network or isinstance(e, requests.exceptions.RequestException)
    except ImportError:
        pass
    return ("; CLIP_benchmark downloads a dataset missing under --dataset_root: fetch it where there is a network "
            "and give that folder as --dataset_root") if network else ""


__all__ = ["MODEL_TYPE", "MeanEncoder", "load_zsprob", "topk_accuracy", "register", "cli_args", "run_cli"]
