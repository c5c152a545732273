"""Export a zsprob model to an open_clip / Hugging Face model directory, with a model card.

open_clip reads the means (``create_model_and_transforms("local-dir:DIR")``); the log-variance heads and
the checkpoint metadata go beside them, so zsprob loads the whole model back. A model whose means
open_clip cannot compute is refused before anything is written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from zsprob.errors import UserError
from zsprob.models.open_clip_dir import (CLIP_PREFIX, CONFIG_NAME, EXPORT_FORMAT, EXPORT_VERSION, SIGMA_NAME,
                                         WEIGHTS_NAME)

FORMATS = ("open_clip",)
#: files of a run directory the model card reads (beside the checkpoint: RUN/model)
RUN_FILES = ("config.yaml", "summary.json", "metrics.jsonl")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz")


def export_refusal(model) -> str | None:
    """Why open_clip cannot compute ``model``'s means (one phrase), or None when it can."""
    from zsprob.models.prob_clip import ProbCLIP

    if not isinstance(model, ProbCLIP):
        return f"it is a {type(model).__name__}, not an image-text ProbCLIP over open_clip towers"
    if model._text.kind == "bow":
        return "its text tower is zsprob's bag of words (SynthWorld), which open_clip cannot build"
    timm_name = model.config["open_clip_cfg"].get("vision_cfg", {}).get("timm_model_name", "")
    if str(timm_name).startswith("zsprob_"):
        return f"its image tower {timm_name} is a timm model that only zsprob registers"
    if model.mean_head != "proj":
        return f"its mean head is {model.mean_head!r} (PCME++'s COCO layout), not open_clip's projection"
    if model.pooling != "native":
        return "its means are pooled by GPO, which open_clip does not have (a model with pooling 'native' exports)"
    if model.sigma_head == "unc" and not model.deterministic:
        return "its [UNC] tokens run inside the towers, so open_clip's forward would give other means"
    return None


def _load_source(checkpoint):
    """The model of a zsprob checkpoint (or of an earlier export); a one-line refusal for anything else."""
    from zsprob.models.builder import load
    from zsprob.models.checkpoint import is_checkpoint
    from zsprob.models.open_clip_dir import export_section

    path = Path(checkpoint)
    if not (is_checkpoint(path) or (path.is_dir() and export_section(path) is not None)):
        raise UserError(f"{path} is not a zsprob checkpoint (no zsprob.json) nor a zsprob open_clip export; "
                        "convert a published file first with `zsprob convert`")
    model = load(path)
    why = export_refusal(model)
    if why is not None:
        raise UserError(f"cannot export {path} to open_clip: {why}")
    return model.eval()


def _split_state(model) -> tuple[dict, dict]:
    """(open_clip tensors under open_clip's names, the other model tensors: log-variance heads), on the CPU,
    contiguous and with shared storage broken (safetensors refuses aliases)."""
    clip, heads = {}, {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu").contiguous().clone()
        if k.startswith(CLIP_PREFIX):
            clip[k[len(CLIP_PREFIX):]] = v
        else:
            heads[k] = v
    return clip, heads


def _tokenizer_files(model) -> list[Path]:
    """The files of the model's Hugging Face tokenizer directory, the copy it was loaded from (none for open_clip's
    built-in tokenizers)."""
    from zsprob.models.checkpoint import tokenizer_directory

    d = tokenizer_directory(model)
    if not d:
        return []
    return sorted(f for f in Path(d).iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES)
                  and f.name not in (CONFIG_NAME, "zsprob.json", "README.md"))


def _model_cfg(model) -> dict:
    """open_clip's ``model_cfg`` of the wrapped model (with a Hugging Face tokenizer read from the directory)."""
    from zsprob.models.hf_tokenizer import PROLIP_TEXT_CLEANING

    cfg = json.loads(json.dumps(model.config["open_clip_cfg"]))
    cfg.pop("preprocess_cfg", None)
    if model.config.get("tokenizer_dir"):
        text = cfg.setdefault("text_cfg", {})
        text["hf_tokenizer_name"] = Path(model.config["tokenizer_dir"]).name or "tokenizer"
        text["tokenizer_kwargs"] = {"clean": PROLIP_TEXT_CLEANING}  # zsprob's load_hf_tokenizer cleaning
    return cfg


def _file_info(path: Path) -> dict:
    from zsprob.models.checkpoint import sha256_file

    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _check_out(out: Path, overwrite: bool, checkpoint, eval_files) -> None:
    """--out apart from the inputs, and empty unless --overwrite names an earlier export (nothing else is
    replaced: a zsprob checkpoint or a user's folder that gained an export would load as another model)."""
    from zsprob.utils.checks import check_outputs_apart

    src = Path(checkpoint)
    check_outputs_apart({"--out": out}, {**({} if src.is_dir() else {"the checkpoint": src}),
                                         **{f"--eval-file {f}": f for f in eval_files}},
                        {"checkpoint": src} if src.is_dir() else None)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} is not empty; pass --overwrite to replace an earlier export there")
        if not (is_export_dir(out) or _killed_export(out)):
            raise UserError(f"--out {out} holds files but no earlier zsprob export (its {CONFIG_NAME}); "
                            "--overwrite replaces an export only: write to an empty or new directory")
        for tmp in out.glob(".*.tmp"):  # a killed export's temporary files (zsprob.utils.io.atomic_write)
            tmp.unlink()


def _killed_export(path: Path) -> bool:
    """Whether ``path`` holds only what an export killed before its last file leaves: its weights files and
    their temporary files."""
    names = (WEIGHTS_NAME, SIGMA_NAME)
    return all(p.is_file() and (p.name in names or any(p.name.startswith(f".{n}.") and p.name.endswith(".tmp")
                                                       for n in names)) for p in path.iterdir())


def is_export_dir(path: Path) -> bool:
    """Whether ``path`` holds a directory written by :func:`export_open_clip` (and no zsprob checkpoint)."""
    try:
        doc = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    z = doc.get("zsprob") if isinstance(doc, dict) else None
    return isinstance(z, dict) and z.get("format") == EXPORT_FORMAT and not (Path(path) / "zsprob.json").exists()


def export_open_clip(checkpoint, out, *, fmt: str = "open_clip", overwrite: bool = False,
                     eval_files=()) -> Path:
    """Write the open_clip directory of the zsprob checkpoint ``checkpoint`` to ``out``; returns ``out``.
    ``eval_files``: ``zsprob eval`` / ``zsprob zeroshot`` results whose figures go into the model card.
    Every refusal comes before anything is written."""
    from safetensors.torch import save_file

    from zsprob.utils.io import atomic_write, atomic_write_json, atomic_write_text

    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    model = _load_source(checkpoint)
    _check_out(out, overwrite, checkpoint, eval_files)
    evals = [_read_eval_file(f) for f in eval_files]
    _check_made_with(evals, model, checkpoint)
    src = Path(checkpoint)
    meta = model.checkpoint_meta
    tok_files = _tokenizer_files(model)
    clip_sd, heads = _split_state(model)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(clip_sd, tmp, metadata={"format": "pt"}))
    files = {"open_clip": _file_info(out / WEIGHTS_NAME), "sigma": None}
    if heads:
        atomic_write(out / SIGMA_NAME, lambda tmp: save_file(heads, tmp, metadata={"format": "pt"}))
        files["sigma"] = _file_info(out / SIGMA_NAME)
    elif (out / SIGMA_NAME).is_file():  # an earlier export's heads (--overwrite)
        (out / SIGMA_NAME).unlink()
    for f in tok_files:
        if f.resolve() != (out / f.name).resolve():
            shutil.copyfile(f, out / f.name)
    zmeta = {k: v for k, v in meta.items() if k not in ("weights", "tokenizer")}  # its tokenizer: beside it
    doc = {"model_cfg": _model_cfg(model), "preprocess_cfg": dict(model.config["preprocess_cfg"]),
           "zsprob": {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "meta": zmeta, "files": files}}
    atomic_write_text(out / "README.md", model_card(model, meta, _run_dir(src), evals, heads))
    atomic_write_json(out / CONFIG_NAME, doc)  # last: a directory without it is no export
    return out


def _run_dir(src: Path) -> Path | None:
    """The training run a checkpoint (not an export) came from (RUN/model -> RUN), when its files are there."""
    from zsprob.models.checkpoint import is_checkpoint

    run = src.resolve().parent
    return run if is_checkpoint(src) and any((run / f).is_file() for f in RUN_FILES) else None


def _read_eval_file(path) -> dict:
    from zsprob.utils.io import read_json

    doc = read_json(path, "evaluation results")
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a zsprob eval metrics.json or zeroshot results.json object")
    rows = doc.get("rows") if isinstance(doc.get("rows"), list) else []
    if rows and not doc.get("summary"):  # `zsprob zeroshot --compare`: each strategy's top-1
        doc["summary"] = {f"top-1 ({r.get('label') or r.get('name')})": r["metrics"]["top1"] for r in rows
                          if isinstance(r, dict) and isinstance(r.get("metrics"), dict) and "top1" in r["metrics"]}
    if not _flat(doc.get("summary") or doc.get("metrics") or {}):
        raise UserError(f"{path} holds no evaluation figures (no 'summary' or 'metrics' numbers): give a zsprob eval "
                        "metrics.json or zeroshot results.json")
    return {"file": str(path), **doc}


def _check_made_with(evals: list[dict], model, checkpoint) -> None:
    """One line when an evaluation file names another model than the one exported (one naming none is taken)."""
    from zsprob.models.fingerprint import is_model, model_fingerprint

    made_with = [(ev["file"], ev["model"]) for ev in evals
                 if isinstance(ev.get("model"), dict) and ev["model"].get("id")]
    if not made_with:
        return
    own = model_fingerprint(model)
    for path, m in made_with:
        if not is_model(m["id"], model, own):
            raise UserError(f"--eval-file {path} was made with another model ({m.get('name') or 'unnamed'}, "
                            f"{m.get('checkpoint') or m['id']}) than {checkpoint}; give the results of this model")


# ----------------------------------------------------------------------------- the model card
def _front_matter(meta: dict) -> str:
    method = meta.get("method") or (meta.get("extra") or {}).get("method")
    tags = ["open_clip", "clip", "zsprob", "probabilistic-embeddings", "zero-shot-image-classification"]
    if method:
        tags.append(str(method))
    lines = ["---", "library_name: open_clip", "pipeline_tag: zero-shot-image-classification", "tags:"]
    lines += [f"- {t}" for t in tags]
    return "\n".join(lines + ["---", ""])


def _recipe(run: Path | None, meta: dict) -> list[str]:
    lines = ["## Training recipe", ""]
    method = meta.get("method") or "unknown"
    lines.append(f"- method: `{method}`; step: {meta.get('step')}; zsprob {meta.get('zsprob_version')}")
    if run is None:
        return lines + ["- (the run's config.yaml was not beside the checkpoint)", ""]
    summary = run / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        lines.append(f"- steps: {s.get('steps')}; global batch: {s.get('global_batch_size')}; processes: "
                     f"{s.get('world_size')}; final loss: {s.get('final_loss')}")
    cfg = run / "config.yaml"
    if cfg.is_file():
        lines += ["", "The run's `config.yaml`:", "", "```yaml", cfg.read_text().rstrip(), "```"]
    return lines + [""]


def _last_eval(run: Path | None) -> dict | None:
    if run is None:
        return None
    from zsprob.utils.io import read_jsonl
    return next((rec for rec in reversed(read_jsonl(run / "metrics.jsonl")) if rec.get("eval")), None)


def _figures(run: Path | None, evals: list[dict]) -> list[str]:
    lines = ["## Evaluation", ""]
    rec = _last_eval(run)
    if rec is not None:
        lines.append(f"During training (step {rec.get('step')}, metrics.jsonl):")
        lines += [f"- {k}: {_fmt(v)}" for k, v in sorted(_flat(rec["eval"]).items())]
    for doc in evals:
        figures = doc.get("summary") or doc.get("metrics") or {}
        lines.append(f"From `{Path(doc['file']).name}`:")
        lines += [f"- {k}: {_fmt(v)}" for k, v in sorted(_flat(figures).items())]
    if len(lines) == 2:
        lines.append("No evaluation files were given (`zsprob export ... --eval-file metrics.json`).")
    return lines + [""]


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(model, meta: dict, run: Path | None, evals: list[dict], heads: dict) -> str:
    """README.md of an export: front matter, what the model is, how to load it, recipe and figures."""
    pre = model.config["preprocess_cfg"]
    body = [_front_matter(meta), f"# {model.name} (zsprob, probabilistic)", "",
            f"A probabilistic image-text model trained with zsprob (method {meta.get('method')}): "
            f"each image and caption maps to a Gaussian N(mu, sigma^2) in {model.embed_dim} dimensions. "
            "This directory holds the mean path as an open_clip model (its features are zsprob's mu) and, "
            f"in `{SIGMA_NAME}`, the log-variance heads ({model.sigma_head}, depth {model.sigma_depth})"
            + ("" if heads else " (none: a deterministic model)") + ".", "",
            "## Use", "", "```python", "import open_clip",
            'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:THIS_DIR")  # or hf-hub:ORG/REPO',
            'tokenizer = open_clip.get_tokenizer("local-dir:THIS_DIR")',
            "mu = model.encode_image(preprocess(image)[None], normalize=True)", "```", "",
            "With sigma^2 (zsprob): `zsprob zeroshot ... --model " + model.name + " --pretrained THIS_DIR`, or "
            "`zsprob.models.load(\"THIS_DIR\")`.", "",
            f"Preprocessing: size {pre.get('size')}, mean {pre.get('mean')}, std {pre.get('std')}, "
            f"interpolation {pre.get('interpolation')}, resize mode {pre.get('resize_mode')}.", ""]
    body += _recipe(run, meta) + _figures(run, evals)
    return "\n".join(body)
