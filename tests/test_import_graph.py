"""The package's import graph, built from the source with ast (lazy in-function imports included), has no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zsprob"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path, name: str) -> list[tuple[str, str]]:
    """Every import of ``path``, at any depth of the file (functions included), as (module, name)
    pairs: ``import a.b`` gives ("a.b", "a.b"); ``from a import b`` gives ("a", "a.b"), where "a.b"
    may be a module or a name defined in "a"."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found += [(stem, f"{stem}.{alias.name}") for alias in node.names]
    return [(stem, full) for stem, full in found if stem == "zsprob" or stem.startswith("zsprob.")]


def import_graph() -> dict[str, set[str]]:
    """Edges module -> module it imports; ``from pkg import sub`` counts as importing ``pkg.sub`` (not
    ``pkg``), ``from pkg import function`` as importing ``pkg``, and ``import a.b.c`` as importing
    ``a.b.c`` only (its parents' __init__ run too, but an edge to each would make every sub-module
    import its own package)."""
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for stem, full in imported_names(path, name):
            imported = full if full in modules else stem  # ``from m import sub`` or ``from m import function``
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None; iterative depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_a_planted_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_imports_and_the_known_edges():
    graph = import_graph()
    # a lazy in-function import (evaluate_coco imports zsprob.retrieval.analysis inside the function)
    assert "zsprob.retrieval.analysis" in graph["zsprob.retrieval.coco"]
    assert "zsprob.models.checkpoint" in graph["zsprob.models.sources"]
    assert "zsprob.models.factory" in graph["zsprob.models.builder"]
    assert len(graph) > 50


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("kernel, forbidden", [
    ("zsprob.retrieval.index_format", "zsprob.retrieval"),  # the index's names, read by the CLI without torch
    ("zsprob.models.checkpoint", "zsprob.models"),  # the file format imports nothing from models/
    # the shard pipeline's leaves: URLs, options and seeds know nothing of the stream or the loader
    ("zsprob.data.webdataset.shards", "zsprob.data.webdataset"),
    ("zsprob.data.webdataset.options", "zsprob.data.webdataset"),
    ("zsprob.data.webdataset.seeding", "zsprob.data.webdataset"),
])
def test_kernels_import_nothing_from_their_package(kernel, forbidden):
    graph = import_graph()
    assert not {m for m in graph[kernel] if m == forbidden or m.startswith(forbidden + ".")}


def test_layering_rules_of_the_design():
    """prob/ never imports models/ or data/, and of utils/ only host_sync; models/ never imports train/."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("zsprob.prob"):
            assert not {t for t in targets if t.startswith(("zsprob.models", "zsprob.data"))}, name
            assert {t for t in targets if t.startswith("zsprob.utils")} <= {"zsprob.utils.host_sync"}, name
        if name.startswith("zsprob.models"):
            assert not {t for t in targets if t.startswith("zsprob.train")}, name


#: what each package may import besides itself, as its __init__ docstring says (leaves: errors, methods,
#: utils, config and the root package for the version)
ALLOWED = {
    "prob": {"errors", "methods", "utils"},  # utils: host_sync alone (where a host read is free)
    "utils": {"errors"},
    "config": {"errors", "utils"},
    "data": {"errors", "utils", "methods", "zsprob"},
    "models": {"errors", "utils", "zsprob"},
    "report": {"errors", "utils", "zsprob"},
    "retrieval": {"data", "models", "prob", "report", "errors", "utils"},
    "train": {"config", "data", "models", "prob", "methods", "errors", "utils"},
    "zeroshot": {"data", "models", "prob", "report", "methods", "errors", "utils", "zsprob"},
    "integrations": {"models", "errors", "utils"},
    "posthoc": {"data", "models", "prob", "errors", "utils", "zsprob"},
}


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_packages_import_only_what_their_docstrings_allow():
    graph = import_graph()
    broken = sorted((name, target) for name, targets in graph.items() for target in targets
                    if package_of(name) in ALLOWED and package_of(target) != package_of(name)
                    and package_of(target) not in ALLOWED[package_of(name)])
    assert not broken, broken


#: modules that only the named modules of their own package may import (the top of a package's layering: a
#: module below it that imported it back would run in a circle through the package)
IMPORTED_ONLY_BY = {
    "zsprob.models.factory": {"zsprob.models", "zsprob.models.builder"},
    "zsprob.data.webdataset.loader": {"zsprob.data.webdataset"},
    "zsprob.data.webdataset.stream": {"zsprob.data.webdataset.loader"},
}


@pytest.mark.parametrize("top, importers", sorted(IMPORTED_ONLY_BY.items()))
def test_tops_of_a_package_are_imported_only_from_above(top, importers):
    graph = import_graph()
    package = top.rsplit(".", 1)[0]
    inside = {name for name, targets in graph.items() if top in targets
              and (name == package or name.startswith(package + "."))}
    assert inside <= importers, sorted(inside - importers)


#: no function in the package is longer than this many lines (no exceptions)
LONG_FUNCTION = 80


#: nor any module longer than this many lines
LONG_MODULE = 700


def long_functions(root: Path = PACKAGE) -> dict[str, int]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION:
                    found[f"{path.relative_to(root.parent).as_posix()}:{node.name}"] = length
    return found


def long_modules(root: Path = PACKAGE) -> dict[str, int]:
    lengths = {path.relative_to(root.parent).as_posix(): len(path.read_text().splitlines())
               for path in sorted(root.rglob("*.py"))}
    return {name: n for name, n in lengths.items() if n > LONG_MODULE}


def test_the_length_finders_find_a_planted_long_function_and_module(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(LONG_FUNCTION))  # def line + 80 = 81 lines
    (pkg / "a.py").write_text("def short():\n    return 1\n\n\ndef long():\n" + body)
    (pkg / "b.py").write_text("y = 0\n" * (LONG_MODULE + 1))
    assert long_functions(pkg) == {"pkg/a.py:long": LONG_FUNCTION + 1}
    assert long_modules(pkg) == {"pkg/b.py": LONG_MODULE + 1}


def test_no_function_over_80_lines():
    assert not long_functions()


def test_no_module_over_700_lines():
    assert not long_modules()


def test_the_open_clip_directory_reader_and_the_integrations_stay_at_their_places():
    """The open_clip directory reader imports only the checkpoint format (sources.py asks it); only the
    CLI imports the integrations."""
    graph = import_graph()
    assert graph["zsprob.models.open_clip_dir"] <= {"zsprob.models.checkpoint", "zsprob.errors"}
    users = {name for name, targets in graph.items() if any(t.startswith("zsprob.integrations") for t in targets)}
    assert {package_of(u) for u in users} <= {"cli", "integrations"}, users
