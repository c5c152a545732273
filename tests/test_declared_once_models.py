"""Every model, published checkpoint and official layout is declared once: in zsprob/models/catalogue.py.

An AST scan of zsprob/ for the catalogue's names as string literals outside the catalogue module (a
message built from the catalogue's values holds none, so it passes), and the catalogue against the tower
configs in configs/models/, whose file names are the models' names.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from zsprob.models.catalogue import LAYOUTS, MODELS
from zsprob.utils.paths import model_configs_dir

PACKAGE = Path(__file__).resolve().parents[1] / "zsprob"
CATALOGUE = PACKAGE / "models" / "catalogue.py"
# "prolip" is also a training method, an unc_layout value and a ProLIP inclusion form: as a layout it can only
# be meant where layouts are handled, so only those places are scanned for it
LAYOUT_PLACES = {"prolip": ("models/convert/", "cli/convert.py")}
# names another module may refer to, and how often: the training config's default model
REFERENCES = {"zsprob-tiny": 1}
CHECKPOINT = re.compile(r"SanghyukChun/[\w.-]+")


def _string_literals():
    """(place, text) of every string constant in zsprob/ outside the catalogue module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == CATALOGUE:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield rel, f"zsprob/{rel}:{node.lineno}", node.value


def _declarations() -> dict[str, str]:
    """name -> what it is, for every name the catalogue declares."""
    names = {name: "model" for name in MODELS}
    names.update({name: "official layout" for name in LAYOUTS})
    names.update({repo: "published checkpoint" for model in MODELS.values() if model.fetch
                  for repo in CHECKPOINT.findall(model.fetch)})
    return names


def test_models_layouts_and_published_checkpoints_are_declared_only_in_the_catalogue():
    declared = _declarations()
    found: dict[str, list[str]] = {}
    for rel, place, text in _string_literals():
        hits = {text} & set(declared) | set(CHECKPOINT.findall(text)) & set(declared)
        for name in hits:
            if name in LAYOUT_PLACES and not rel.startswith(LAYOUT_PLACES[name]):
                continue
            found.setdefault(name, []).append(place)
    again = {name: places for name, places in found.items() if len(places) > REFERENCES.get(name, 0)}
    assert not again, "; ".join(f"{declared[name]} {name!r} is declared in zsprob/models/catalogue.py and again at "
                                f"{', '.join(places)}: read it from the catalogue" for name, places in again.items())


def test_every_catalogue_model_has_its_tower_config_and_every_tower_config_an_entry():
    towers = {p.stem for p in model_configs_dir().glob("*.json")}
    assert towers == set(MODELS), (f"configs/models without a catalogue entry: {sorted(towers - set(MODELS))}; "
                                   f"catalogue entries without configs/models/NAME.json: {sorted(set(MODELS) - towers)}")
    for model in MODELS.values():
        assert set(model.layouts) <= set(LAYOUTS), model.name


def test_the_scan_names_both_places(tmp_path, monkeypatch):
    """A second declaration fails with a message naming the catalogue and the place of the copy."""
    copy = tmp_path / "zsprob" / "copy.py"
    copy.parent.mkdir()
    copy.write_text('LAYOUTS = ("pcmepp-hf",)\nTOWER = "pcmepp-coco-ViT-B-32"\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy.parent)
    try:
        test_models_layouts_and_published_checkpoints_are_declared_only_in_the_catalogue()
    except AssertionError as e:
        message = str(e)
    else:
        raise AssertionError("a second declaration passed")
    assert "official layout 'pcmepp-hf' is declared in zsprob/models/catalogue.py and again at zsprob/copy.py:1" \
        in message
    assert "model 'pcmepp-coco-ViT-B-32' is declared in zsprob/models/catalogue.py and again at zsprob/copy.py:2" \
        in message
