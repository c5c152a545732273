"""`zsprob eval`: retrieval evaluation (COCO 1K/5K, CxC, ECCV Caption, PMRP; Flickr30k; SynthWorld; any embeddings).

Thin: parses options and calls :mod:`zsprob.retrieval` (torch is imported inside the commands). Refuses in one
line an output (``--out``, a file written beside it, ``--save-embeddings``) that would overwrite an input, options
that have no effect together, and ranking files that give a query two lists.
"""
from __future__ import annotations

from pathlib import Path

import click

from zsprob.cli.options import (eval_model_options, official_file_kwargs, refuse_given, refuse_overwriting_inputs,
                                resolve_device, scoring_device_option)
from zsprob.cli.types import EMBEDDINGS, OUT_FILE, InPath
from zsprob.prob.method_registry import SCORE_NAMES

#: the held-out splits a benchmark is scored on
SPLITS = ("test", "val")


def _common(f):
    f = click.option("--score", type=click.Choice(SCORE_NAMES), default="csd", show_default=True,
                     help="similarity used for ranking (zsprob.prob.score).")(f)
    f = click.option("--out", type=OUT_FILE, default="metrics.json", show_default=True,
                     help="metrics JSON; table.md, PNGs and pages go to the same folder.")(f)
    f = click.option("--no-analysis", is_flag=True, help="skip the uncertainty analyses.")(f)
    return f


def _load_model(checkpoint, model_name, pretrained, device):
    from zsprob.errors import UserError
    from zsprob.models import load_for_inference

    if checkpoint is None and model_name is None:
        raise UserError("give --checkpoint CKPT or --model NAME (or --embeddings E.npz)")
    return load_for_inference(checkpoint=checkpoint, model=model_name, pretrained=pretrained, device=device,
                              **official_file_kwargs())


def _eval_outputs(out: str) -> dict:
    """--out and what an evaluation may write beside it (:data:`zsprob.retrieval.analysis.FILES`, the thumbnails)."""
    from zsprob.retrieval.analysis import FILES, THUMBS

    outp = Path(out)
    return {"--out": out, **{f"--out (beside it, {name})": outp.parent / name for name in (*FILES.values(), THUMBS)}}


def _refuse_destroying_inputs(out, save_embeddings=None, files=None, *, checkpoint=None, pretrained=None,
                              root=None) -> None:
    """--out, the files beside it and --save-embeddings apart from every input and from each other (one line,
    before a model is loaded): not an input file, not inside the model's directory, not a file of --root."""
    given = {"checkpoint": checkpoint, "pretrained": pretrained, "data": {"--root": root}}
    refuse_overwriting_inputs(_eval_outputs(out), {**(files or {}), "--save-embeddings": save_embeddings}, **given)
    refuse_overwriting_inputs({"--save-embeddings": save_embeddings}, files or {}, **given)


def _finish(res: dict, out: str) -> None:
    click.echo(res["table"], nl=False)
    unc = res.get("uncertainty")
    dec = unc.get("deciles") if isinstance(unc, dict) and "deciles" in unc else unc
    if isinstance(dec, dict):
        for name, d in dec.items():
            sr2 = f", -SR^2 = {d['sr2']['neg_sr2']:.3f}" if "sr2" in d else ""
            click.echo(f"{name}: Spearman(uncertainty decile, R@1) = {d['spearman_bins']['rho']:.3f}{sr2}")
    if res.get("validity_table"):
        click.echo(res["validity_table"], nl=False)
    for k, v in res.get("files", {}).items():
        click.echo(f"wrote {k}: {v}")


@click.group("eval")
def eval_() -> None:
    """Retrieval evaluation: COCO 1K/5K, CxC, ECCV Caption, PMRP; SynthWorld; any embeddings."""


@eval_.command("coco")
@eval_model_options
@click.option("--root", type=InPath("COCO root directory"), default=None,
              help="COCO folder (Karpathy JSON, images, annotations).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--embeddings", type=EMBEDDINGS, default=None,
              help="precomputed E.npz (image_ids, caption_ids, image_mu, caption_mu[, *_logvar, caption_image]).")
@click.option("--save-embeddings", type=OUT_FILE, default=None,
              help="also save the embeddings the model computes (.npz); not with --embeddings.")
@_common
def coco(checkpoint, model_name, pretrained, device, workers, precision, batch_size, root, split, embeddings,
         save_embeddings, score, out, no_analysis):
    """Evaluate on COCO (official ids: COCO 1K/5K, CxC and ECCV Caption via eccv_caption; PMRP with instance labels)."""
    from zsprob.errors import UserError
    from zsprob.retrieval.coco import evaluate_coco

    device = resolve_device(device)
    model = None
    label = Path(embeddings).stem if embeddings else (checkpoint or model_name or "model")
    if embeddings is None:
        if root is None:
            raise UserError("--root COCO_DIR is required unless --embeddings is given")
    elif checkpoint or model_name:
        raise UserError("give either --embeddings or a model (--checkpoint / --model), not both")
    else:
        refuse_given("with --embeddings (the file already holds the embeddings): drop it, or evaluate a model instead",
                     "root", "pretrained", "tokenizer", "weights")
        if save_embeddings:
            raise UserError("--save-embeddings saves the embeddings a model computes; with --embeddings nothing is "
                            "computed (the file already holds them), so give one or the other")
        # what only encoding reads (the file's split is the one it was encoded from)
        refuse_given("with --embeddings (they set how a model encodes; the file already holds the embeddings)",
                     "workers", "precision", "batch_size", "split")
    _refuse_destroying_inputs(out, save_embeddings, {"--embeddings": embeddings}, checkpoint=checkpoint,
                              pretrained=pretrained, root=root)
    if embeddings is None:
        model = _load_model(checkpoint, model_name, pretrained, device)
    outp = Path(out)
    res = evaluate_coco(model, root, split, score, outp.parent, embeddings=embeddings, batch_size=batch_size,
                        device=device, num_workers=workers, precision=precision, analyses=not no_analysis,
                        save_embeddings=save_embeddings, label=str(label),
                        metrics_file=outp.name)
    _finish(res, out)


@eval_.command("flickr30k")
@eval_model_options
@click.option("--root", type=InPath("Flickr30k root directory"), required=True,
              help="Flickr30k folder (dataset_flickr30k.json, flickr30k-images/).")
@click.option("--karpathy-json", type=InPath("Flickr30k Karpathy split JSON", "file"), default=None,
              help="dataset_flickr30k.json if not under ROOT.")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--save-embeddings", type=OUT_FILE, default=None, help="also save the embeddings (.npz).")
@_common
def flickr30k(checkpoint, model_name, pretrained, device, workers, precision, batch_size, root, karpathy_json, split,
              save_embeddings, score, out, no_analysis):
    """Evaluate on Flickr30k (Karpathy 1K test: R@1/5/10 both ways, RSUM; the COCO-style set "coco")."""
    from zsprob.data.flickr import Flickr30kCaptions
    from zsprob.retrieval.coco import evaluate_coco

    _refuse_destroying_inputs(out, save_embeddings, {"--karpathy-json": karpathy_json}, checkpoint=checkpoint,
                              pretrained=pretrained, root=root)
    dataset = Flickr30kCaptions(root, split=split, karpathy_json=karpathy_json)  # before the model: data errors first
    device = resolve_device(device)
    model = _load_model(checkpoint, model_name, pretrained, device)
    outp = Path(out)
    res = evaluate_coco(model, root, split, score, outp.parent, batch_size=batch_size, device=device,
                        num_workers=workers, precision=precision, analyses=not no_analysis,
                        save_embeddings=save_embeddings, label=str(checkpoint or model_name),
                        metrics_file=outp.name, dataset=dataset)
    _finish(res, out)


@eval_.command("embeddings")
@click.argument("embeddings", type=EMBEDDINGS)
@_common
@scoring_device_option
def embeddings_cmd(embeddings, score, out, no_analysis, device):
    """Evaluate precomputed embeddings E.npz (official COCO 5K ids, or any set with caption_image)."""
    from zsprob.retrieval.coco import evaluate_coco

    refuse_overwriting_inputs(_eval_outputs(out), {"EMBEDDINGS": embeddings})
    device = resolve_device(device)
    outp = Path(out)
    res = evaluate_coco(None, None, "test", score, outp.parent, embeddings=embeddings, analyses=not no_analysis,
                        label=Path(embeddings).stem, metrics_file=outp.name, progress=False, device=device)
    _finish(res, out)


def _unique_keys(path: Path, pairs: list) -> dict:
    """json object_pairs_hook: a key given twice (a query with two ranked lists) is an error, not "last wins"."""
    from zsprob.errors import UserError

    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise UserError(f"{path}: key {key!r} appears twice (a query needs exactly one ranked list)")
        out[key] = value
    return out


def _pairs_to_dict(path: str, query_ids, lists) -> dict:
    """`zsprob index search` output's parallel lists as {query id: list}, a repeated query id refused."""
    from zsprob.errors import UserError

    if not isinstance(query_ids, list) or not isinstance(lists, list):
        raise UserError(f"{path}: query_ids and ids must be lists")
    if len(query_ids) != len(lists):
        raise UserError(f"{path}: {len(query_ids)} query_ids but {len(lists)} ranked lists")
    out: dict = {}
    for q, ranked in zip(query_ids, lists):
        if not isinstance(q, (int, str)) or isinstance(q, bool):
            raise UserError(f"{path}: query_ids must be integers, got {q!r}")
        if q in out:
            raise UserError(f"{path}: query id {q} appears twice in query_ids (a query needs exactly one ranked list)")
        out[q] = ranked
    return out


def _read_rankings(path: str, direction: str) -> dict:
    """A `zsprob index search --out` file (query_ids, ids) or a JSON object {query id: [ids]}."""
    import json
    from functools import partial

    from zsprob.errors import UserError

    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"), object_pairs_hook=partial(_unique_keys, p))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{direction} rankings is not valid JSON: {p} ({e})") from None
    if isinstance(obj, dict) and "query_ids" in obj and "ids" in obj:
        return _pairs_to_dict(path, obj["query_ids"], obj["ids"])
    if isinstance(obj, dict) and direction in obj and isinstance(obj[direction], dict):
        return obj[direction]  # {"i2t": {...}, "t2i": {...}} in one file
    if isinstance(obj, dict):
        return obj
    raise UserError(f"{path}: expected a JSON object {{query id: [ranked ids]}} or `zsprob index search` output")


@eval_.command("rankings")
@click.option("--i2t", "i2t_path", type=InPath("i2t rankings", "file"), required=True,
              help="image->caption rankings: `zsprob index search --out` JSON or {image id: [caption ids]}.")
@click.option("--t2i", "t2i_path", type=InPath("t2i rankings", "file"), required=True,
              help="caption->image rankings, same formats ({caption id: [image ids]}).")
@click.option("--out", type=OUT_FILE, default="metrics.json", show_default=True)
def rankings_cmd(i2t_path, t2i_path, out):
    """Metrics of ranked id lists on the official COCO 5K test ids (COCO 1K/5K, CxC, ECCV Caption), e.g. from
    `zsprob index search` or eccv_caption-style dicts: one list of integer gallery ids per query, each id once."""
    from zsprob.retrieval.coco import evaluate_coco_rankings
    from zsprob.utils.io import atomic_write_json

    refuse_overwriting_inputs({"--out": out}, {"--i2t": i2t_path, "--t2i": t2i_path})
    res = evaluate_coco_rankings(_read_rankings(i2t_path, "i2t"), _read_rankings(t2i_path, "t2i"))
    click.echo(res["table"], nl=False)
    for n in res["notes"]:
        click.echo(f"note: {n}")
    path = atomic_write_json(out, {k: res[k] for k in ("metrics", "summary", "notes")})
    click.echo(f"wrote metrics: {path}")


@eval_.command("synthetic")
@eval_model_options
@click.option("--root", type=InPath("SynthWorld folder", hint="generate it with `zsprob data synthetic --out DIR`"),
              required=True, help="SynthWorld folder (from `zsprob data synthetic`).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--no-corruption", is_flag=True, help="skip the corruption sweep.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="seed of the uncertainty probes (inclusion pairs, crop-test scenes, bootstrap, corruption "
                   "sweep) and of --score mc's samples; another seed gives pairs a recipe was not chosen on.")
@_common
def synthetic(checkpoint, model_name, pretrained, device, workers, precision, batch_size, root, split, no_corruption,
              seed, score, out, no_analysis):
    """Evaluate on SynthWorld's retrieval split (five-caption R@K and exact plausible-match mAP@R / R-P)."""
    from zsprob.retrieval.synthetic import evaluate_synthetic

    _refuse_destroying_inputs(out, checkpoint=checkpoint, pretrained=pretrained, root=root)
    device = resolve_device(device)
    model = _load_model(checkpoint, model_name, pretrained, device)
    outp = Path(out)
    res = evaluate_synthetic(model, root, split, score, outp.parent, batch_size=batch_size, device=device,
                             num_workers=workers, precision=precision,
                             corruption=not (no_corruption or no_analysis), progress=True, metrics_file=outp.name,
                             validity=not no_analysis, seed=seed)
    _finish(res, out)
