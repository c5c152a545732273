"""What ``pretrained`` names (nothing, open_clip weights, a published file, a zsprob checkpoint), resolved in
one place for the factory, the builder and the CLI; open_clip weights found without downloading.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zsprob.errors import UserError
from zsprob.models.checkpoint import checkpoint_dir, is_checkpoint, load_meta, read_tensors
from zsprob.models.convert.load import sniff
from zsprob.models.open_clip_dir import export_meta, export_section, pretrained_cfg, read_config

@dataclass
class Source:
    """A resolved ``pretrained``: its ``kind``, a zsprob checkpoint's ``meta`` (zsprob.json), a published
    file's ``state`` and ``layout`` (an export's layout is "open_clip")."""

    kind: str  # "none" (random init), "open_clip" (a tag, file or directory), "official" or "zsprob"
    path: str | os.PathLike | None = None
    meta: dict | None = None
    state: dict | None = None
    layout: str | None = None

    def read_tensors(self, verify: bool = True) -> dict[str, torch.Tensor]:
        """A zsprob checkpoint's (or export's) tensors, size checked and with ``verify`` SHA-256."""
        if self.layout == "open_clip":
            from zsprob.models.open_clip_dir import read_export_tensors

            return read_export_tensors(self.path, export_section(self.path), verify)
        return read_tensors(checkpoint_dir(self.path), self.meta, verify)


def zsprob_source(path: str | os.PathLike) -> Source:
    """The zsprob checkpoint at ``path`` (its directory or a file in it) or export; UserError when neither."""
    section = export_section(path)
    if section is not None:
        return Source("zsprob", path, meta=export_meta(path, section), layout="open_clip")
    return Source("zsprob", path, meta=load_meta(path))


def identify(pretrained) -> Source:
    """Which kind of weights ``pretrained`` names: a zsprob checkpoint by its zsprob.json, a published file by
    its key names, anything else an open_clip tag or path (resolved when loaded)."""
    if pretrained is None or str(pretrained) == "":
        return Source("none")
    if is_checkpoint(pretrained) or export_section(pretrained) is not None:
        return zsprob_source(pretrained)
    official = sniff(pretrained)
    if official is not None:
        return Source("official", pretrained, state=official[0], layout=official[1])
    return Source("open_clip", pretrained)


_CKPT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
               "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
               "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


def _cached_hf(repo: str, filename: str, cache_dir: str | None) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        got = try_to_load_from_cache(repo_id=repo, filename=filename, cache_dir=cache_dir)
    except Exception:  # noqa: BLE001 - malformed cache entries count as missing
        return None
    return got if isinstance(got, str) and os.path.isfile(got) else None


def resolve_pretrained(name: str, pretrained: str | os.PathLike, cache_dir: str | None = None) -> tuple[Path, dict]:
    """(checkpoint file, open_clip pretrained cfg) for a tag or a path (a directory's cfg is its
    ``open_clip_config.json``); never downloads."""
    import open_clip as oc

    p = Path(pretrained).expanduser()
    if p.is_file():
        return p, {}
    if p.is_dir():
        doc = read_config(p)
        dir_cfg = pretrained_cfg(doc) if doc is not None else {}
        for fn in _CKPT_NAMES:
            if (p / fn).is_file():
                return p / fn, dir_cfg
        cands = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) + sorted(p.glob("*.pt")) \
            + sorted(p.glob("*.pth"))
        if cands:
            return cands[0], dir_cfg
        raise UserError(f"no open_clip checkpoint file (.safetensors/.bin/.pt/.pth) in directory {p}")
    tag = str(pretrained)
    looks_like_path = os.sep in tag or tag.endswith((".pt", ".pth", ".bin", ".safetensors", ".npz"))
    cfg = oc.get_pretrained_cfg(name.replace("/", "-"), tag) if not looks_like_path else {}
    if not cfg:
        if looks_like_path:
            raise UserError(f"pretrained checkpoint file not found: {p}")
        tags = oc.list_pretrained_tags_by_model(name.replace("/", "-"))
        raise UserError(f"{tag!r} is neither a pretrained tag of {name} nor an existing file "
                        f"(known tags: {', '.join(tags) if tags else 'none'})")
    if cfg.get("file") and os.path.isfile(cfg["file"]):
        return Path(cfg["file"]), cfg
    wanted = []
    hf = cfg.get("hf_hub", "")
    if hf:
        repo, filename = (hf.rstrip("/"), "") if hf.endswith("/") else os.path.split(hf)
        names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
        if filename.endswith((".bin", ".pth")):
            names.insert(0, filename[:-4] + ".safetensors")
        for fn in names:
            got = _cached_hf(repo, fn, cache_dir)
            if got:
                return Path(got), cfg
        from huggingface_hub.constants import HF_HUB_CACHE

        wanted.append(f"https://huggingface.co/{repo} file {names[-1]} into the Hugging Face cache "
                      f"{cache_dir or HF_HUB_CACHE} (e.g. `huggingface-cli download {repo} {names[-1]}`)")
    url = cfg.get("url", "")
    if url:
        target = Path(cache_dir or os.path.expanduser("~/.cache/clip")) / os.path.basename(url)
        if target.is_file():
            return target, cfg
        wanted.append(f"{url} to {target}")
    raise UserError(f"pretrained weights {name}/{tag} are not in the local cache and zsprob does not download "
                    f"at run time: download {' or '.join(wanted)}; or pass the checkpoint file path as pretrained")
