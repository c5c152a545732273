"""YAML configs with dotted command-line overrides.

A config is a nested dict read from a YAML file, built on the ``base:`` file it names, then patched with
``a.b.c=value`` overrides parsed as YAML (``1e-4`` -> float, ``[1, 2]`` -> list); malformed input is a
:class:`zsprob.UserError`. :class:`Config` is a dict with attribute access (``cfg.optim.lr``).
The training config's keys and checks are :mod:`zsprob.train.defaults`'.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from zsprob.errors import UserError
from zsprob.utils.paths import configs_dir, resolve_resource


class Config(dict):
    """A nested dict with attribute access (read and write)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __deepcopy__(self, memo):
        return Config({k: copy.deepcopy(v, memo) for k, v in self.items()})

    def to_dict(self) -> dict:
        return _plain(self)


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def to_config(x: Any) -> Any:
    """Recursively wrap mappings as :class:`Config`."""
    if isinstance(x, Mapping):
        return Config({k: to_config(v) for k, v in x.items()})
    if isinstance(x, list):
        return [to_config(v) for v in x]
    return x


#: a config nested deeper, or whose aliases expand to more values, is refused before it is built
YAML_MAX_DEPTH, YAML_MAX_VALUES = 64, 100_000


class _Refused(yaml.YAMLError):
    pass


class _GuardedLoader(yaml.SafeLoader):
    """yaml's SafeLoader that refuses nesting past :data:`YAML_MAX_DEPTH` (deeper, the composer's recursion
    fails) and documents whose aliases expand past :data:`YAML_MAX_VALUES` values (a few hundred bytes of
    nested aliases can stand for billions, which merging the config would then walk)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > YAML_MAX_DEPTH:
                raise _Refused(f"it is nested more than {YAML_MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node):
        sizes: dict[int, int | None] = {}

        def size(n) -> int:
            if id(n) in sizes:
                if sizes[id(n)] is None:
                    raise _Refused("an alias refers to a collection that holds it")
                return sizes[id(n)]
            sizes[id(n)] = None
            parts = [x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            sizes[id(n)] = 1 + sum(size(x) for x in parts)
            return sizes[id(n)]
        if size(node) > YAML_MAX_VALUES:
            raise _Refused(f"its aliases expand to more than {YAML_MAX_VALUES:,} values")
        return super().construct_document(node)


def load_yaml(text: str):
    """``text`` parsed as YAML by :class:`_GuardedLoader` (plain data only, as ``yaml.safe_load``)."""
    return yaml.load(text, Loader=_GuardedLoader)


def refuse_pipes(data: Any, source, key: str = "") -> None:
    """A ``pipe:`` value runs a shell command when its data is opened: from a config file only with
    ``--allow-pipe`` (the command line's own ``--shards`` / ``--set`` may name one)."""
    if isinstance(data, Mapping):
        for k, v in data.items():
            refuse_pipes(v, source, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for v in data:
            refuse_pipes(v, source, key)
    elif isinstance(data, str) and data.lstrip().startswith("pipe:"):
        raise UserError(f"config {source}: {key} runs a shell command ({data[:60]!r}); a config file may not run "
                        "commands unless --allow-pipe is given (or name it on the command line: --shards, --set)")


def deep_merge(base: Mapping, update: Mapping) -> dict:
    """``update`` merged into a copy of ``base``; nested mappings merge, everything else replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_value(text: str) -> Any:
    """Parse an override value as a YAML scalar / flow collection."""
    try:
        return load_yaml(text) if text.strip() != "" else ""
    except yaml.YAMLError:
        return text


def apply_override(cfg: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override in place."""
    if "=" not in item:
        raise UserError(f"override must look like key.sub=value, got {item!r}")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip():
        raise UserError(f"override has an empty key: {item!r}")
    if not all(p.strip() for p in parts):
        raise UserError(f"override {item!r}: the key has an empty part (two dots in a row, or a dot at an end)")
    parts = [p.strip() for p in parts]
    node = cfg
    for p in parts[:-1]:
        if p not in node or node[p] is None:
            node[p] = Config()
        elif not isinstance(node[p], dict):
            raise UserError(f"override {item!r}: {p!r} is a value, not a section")
        node = node[p]
    node[parts[-1]] = to_config(parse_value(value))


def read_yaml(path: str | os.PathLike, _chain: tuple = ()) -> dict:
    """A YAML config as a dict, its ``base:`` chain merged under it (a base that names a file of its own chain,
    or that is not one path, is one line)."""
    p = resolve_resource(path, configs_dir())
    if not p.is_file():
        raise UserError(f"config file not found: {path} (looked in . and {configs_dir()})")
    try:
        data = load_yaml(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise UserError(f"config file {p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); "
                        "save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read config file {p}: {e.strerror or e}") from None
    except _Refused as e:
        raise UserError(f"config file {p} is refused: {e}") from None
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())
        raise UserError(f"malformed YAML in {p}: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"config {p} must be a mapping at the top level, got {type(data).__name__}")
    base = data.pop("base", None)
    if base:
        if not isinstance(base, str):
            raise UserError(f"config {p}: base must be the path of one config file, got {base!r}")
        base_path = Path(base)
        if not base_path.is_absolute() and not base_path.exists():
            base_path = p.parent / base
        chain = (*_chain, p.resolve())
        if resolve_resource(base_path, configs_dir()).resolve() in chain:
            raise UserError(f"config {p}: base {base} is already in its own base chain "
                            f"({' -> '.join(str(c) for c in chain)}); a base cannot include itself")
        data = deep_merge(read_yaml(base_path, chain), data)
    return data


def dump_yaml(cfg: Mapping) -> str:
    return yaml.safe_dump(_plain(cfg), sort_keys=False)
