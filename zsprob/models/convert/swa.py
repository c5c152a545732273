"""The SWA copies in a PCME++ COCO trainer checkpoint: choose the weights to load, check the other copy.

``swa_img_enc.module.<rest>`` (+ ``swa_img_enc.n_averaged``) averages ``img_enc.<rest>``. ``weights``:
``"swa-text"`` what the official code evaluates at the end of training (SWA text encoder, raw image encoder
and criterion; the default when averaged), ``"swa"`` every averaged copy, ``"raw"`` the trained modules.
"""
from __future__ import annotations

import os

from zsprob.errors import UserError
from zsprob.models.catalogue import LAYOUTS
from zsprob.models.convert.pcmepp import SWA_COUNT, SWA_MODULE

WEIGHTS = ("swa-text", "swa", "raw")
# the raw modules each choice replaces by their averaged copies
AVERAGED = {"swa-text": ("txt_enc",), "swa": ("img_enc", "txt_enc", "criterion"), "raw": ()}


def _split(state: dict, kind: str, source) -> tuple[dict, dict, dict]:
    """(raw state, {copy: {rest: tensor}}, {copy: n_averaged tensor}); an unknown ``swa_`` key is an error."""
    allowed = set(LAYOUTS[kind].swa_copies.values())
    raw, copies, counts = {}, {}, {}
    for key, value in state.items():
        if not key.startswith("swa_"):
            raw[key] = value
            continue
        copy, _, rest = key.partition(".")
        if copy not in allowed:
            raise UserError(f"{source}: unexpected key {key!r} (the SWA copies of a {kind} trainer file are "
                            f"{', '.join(LAYOUTS[kind].swa_copies.values())})")
        if rest == SWA_COUNT:
            if value.ndim != 0 or value.is_floating_point() or value.is_complex():
                raise UserError(f"{source}: key {key!r} is not an integer count (shape {tuple(value.shape)}, "
                                f"{value.dtype})")
            counts[copy] = value
        elif rest.startswith(SWA_MODULE):
            copies.setdefault(copy, {})[rest[len(SWA_MODULE):]] = value
        else:
            raise UserError(f"{source}: unexpected key {key!r} (an SWA copy holds {copy}.{SWA_COUNT} and "
                            f"{copy}.{SWA_MODULE}*)")
    return raw, copies, counts


def _check_copy(raw: dict, module: str, copy: str, averaged: dict, counts: dict, source) -> None:
    """The SWA copy of ``module`` has its count and exactly the raw module's keys and shapes."""
    if copy not in counts:
        raise UserError(f"{source}: missing key '{copy}.{SWA_COUNT}' (the file holds {copy}.{SWA_MODULE}* "
                        "without the count torch's AveragedModel saves with it)")
    prefix = module + "."
    own = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    for rest, value in own.items():
        twin = f"{copy}.{SWA_MODULE}{rest}"
        if rest not in averaged:
            raise UserError(f"{source}: missing key {twin!r} (the raw copy has '{module}.{rest}'; a half-written "
                            "file?)")
        if tuple(averaged[rest].shape) != tuple(value.shape):
            raise UserError(f"{source}: key {twin!r} has shape {tuple(averaged[rest].shape)}, its raw copy "
                            f"'{module}.{rest}' {tuple(value.shape)}")
    extra = [rest for rest in averaged if rest not in own]
    if extra:
        raise UserError(f"{source}: missing key '{module}.{extra[0]}' (the SWA copy has "
                        f"'{copy}.{SWA_MODULE}{extra[0]}'; a half-written file?)")


def _count(counts: dict, source) -> int:
    values = {copy: int(v) for copy, v in counts.items()}
    if len(set(values.values())) > 1:
        raise UserError(f"{source}: the SWA copies were averaged different numbers of times "
                        f"({', '.join(f'{c}.{SWA_COUNT}={n}' for c, n in values.items())}); the official trainer "
                        "updates them together")
    return next(iter(values.values()))


def select_weights(state: dict, kind: str, weights: str | None, source: str | os.PathLike = "checkpoint"
                   ) -> tuple[dict, str | None]:
    """(``state`` in the plain layout ``kind`` with the chosen copy, the choice); a layout without copies: (state,
    None)."""
    if weights is not None and weights not in WEIGHTS:
        raise UserError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    expected = LAYOUTS[kind].swa_copies
    if not expected:
        if weights is not None:
            with_copies = ", ".join(name for name, lay in LAYOUTS.items() if lay.swa_copies)
            raise UserError(f"{source} is an official {kind} checkpoint: weights={weights!r} chooses between the SWA "
                            f"and raw copies of a PCME++ COCO trainer checkpoint (layouts {with_copies})")
        return state, None
    raw, copies, counts = _split(state, kind, source)
    present = set(copies) | set(counts)
    if not present:
        if weights not in (None, "raw"):
            raise UserError(f"{source}: weights={weights!r}, but the file holds no SWA copies (swa_img_enc.*, "
                            "swa_txt_enc.*: a run with train.swa_start_epoch); its weights are the raw ones "
                            "(weights='raw')")
        return raw, "raw"
    missing = [copy for copy in expected.values() if copy not in present]
    if missing:
        raise UserError(f"{source}: SWA copies for only some modules: it has {', '.join(sorted(present))} but no "
                        f"{', '.join(f'{c}.*' for c in missing)} (the official trainer averages "
                        f"{', '.join(expected)} together)")
    for module, copy in expected.items():
        _check_copy(raw, module, copy, copies.get(copy, {}), counts, source)
    n = _count(counts, source)
    choice = weights or ("swa-text" if n > 0 else "raw")
    if choice != "raw" and n == 0:
        raise UserError(f"{source}: weights={choice!r}, but '{expected['txt_enc']}.{SWA_COUNT}' is 0: the SWA "
                        "copies were never averaged (the run stopped before swa_start_epoch); use weights='raw'")
    out = dict(raw)
    for module in AVERAGED[choice]:
        if module in expected:
            out.update({f"{module}.{rest}": v for rest, v in copies.get(expected[module], {}).items()})
    return out, choice
