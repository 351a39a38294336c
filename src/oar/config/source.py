"""Where a config's values come from, for errors that name the file, line and key: a YAML file read
with its line numbers, the layers of ``extends`` and of command-line assignments (:class:`Layer`,
:class:`ConfigSource`), and the one-line :class:`ConfigError` with a "did you mean" suggestion.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import yaml

__all__ = ["ConfigError", "ConfigSource", "Layer", "COMMAND_LINE", "SUGGEST_CUTOFF", "suggest"]


#: How an error names a value given on the command line (``command line: --set train.lr=abc``).
COMMAND_LINE = "command line"


#: The least :class:`difflib.SequenceMatcher` ratio at which a misspelt key or name gets a "did you
#: mean" suggestion (difflib's own default; ``lrr`` -> ``lr`` is 0.8, unrelated words score below).
SUGGEST_CUTOFF = 0.6


#: A key path into a config: mapping keys, and list indices.
KeyPath = tuple[Union[str, int], ...]


class ConfigError(ValueError):
    """A configuration problem; the message names where the value came from (the file and line, or
    the command-line override) and the key path."""


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib, at least :data:`SUGGEST_CUTOFF`), else None."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=SUGGEST_CUTOFF)
    return matches[0] if matches else None


def dotted_key(path: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def display_path(path: str | Path) -> str:
    """``path`` as messages show it: relative to the working directory when it lies below it."""
    p = Path(path)
    if p.is_absolute():
        try:
            return str(p.relative_to(Path.cwd()))
        except ValueError:
            return str(p)
    return str(p)


@dataclass(frozen=True)
class Layer:
    """One source of the values merged into a config: a file of an ``extends`` chain, or an override.

    Attributes:
        data: the values it gives (a nested mapping, as merged by :func:`deep_merge`).
        name: how a message names it: a file path, or ``command line: --set train.lr=abc``.
        note: said after the name and line, e.g. `` (extends config/config.yaml)``.
        lines: the 1-based line of each key path in the file (empty for an override).
    """

    data: Mapping[str, Any]
    name: str
    note: str = ""
    lines: Mapping[KeyPath, int] = field(default_factory=dict)

    def where(self, path: KeyPath) -> str:
        """``name[:line]note`` for the value at ``path`` of this layer."""
        line = self.lines.get(tuple(path))
        return f"{self.name}{'' if line is None else f':{line}'}{self.note}"

    def reach(self, path: KeyPath) -> tuple[int, bool]:
        """How many leading keys of ``path`` this layer holds, and whether it gives the merged value at
        ``path``: it holds the whole path, or a list or scalar above it (which replaces the lower
        layers' value whole when merged)."""
        node: Any = self.data
        for depth, key in enumerate(path):
            if isinstance(node, dict):
                if key in node:
                    node = node[key]
                elif str(key) in node:  # an override's "0" for a list index
                    node = node[str(key)]
                else:
                    return depth, False
            elif isinstance(node, list):
                if not (isinstance(key, int) and 0 <= key < len(node)):
                    return depth, True
                node = node[key]
            else:
                return depth, True
        return len(path), True


class ConfigSource:
    """Where a config's values came from: the layers merged into it (lowest first), to name, in an
    error, the file and line or the command-line override that gave the value at a key path.

    ``str()`` is ``label`` (the config file(s), as the resolved config's header and older messages
    name them); a plain string passed as a ``source`` is a ConfigSource with no layers.
    """

    def __init__(self, label: str, layers: Sequence[Layer] = (), *, fallback: str | None = None):
        self.label = label
        self.layers: list[Layer] = list(layers)
        top_file = next((lay for lay in reversed(self.layers) if lay.lines), None)
        self.fallback = fallback or (top_file.where(()) if top_file is not None else label)

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"ConfigSource({self.label!r}, {len(self.layers)} layers)"

    def add(self, layer: Layer) -> None:
        """Put ``layer`` on top (it was merged after every layer so far)."""
        self.layers.append(layer)

    def locate(self, path: Sequence[str | int]) -> str:
        """Where the value at ``path`` came from: the topmost layer that gives it (file:line and its
        ``extends`` note, or the override); for a path no layer holds whole (a default, a missing
        key), the layer holding the longest part of it (a file rather than an override); else
        ``fallback``."""
        path = tuple(path)
        best: tuple[int, bool, Layer] | None = None
        for layer in reversed(self.layers):
            depth, gives = layer.reach(path)
            if gives and depth > 0:
                return layer.where(path[:depth])
            has_line = tuple(path[:depth]) in layer.lines
            if depth > 0 and (best is None or (depth, has_line) > best[:2]):
                best = (depth, has_line, layer)
        if best is not None:
            return best[2].where(path[: best[0]])
        return self.fallback

    def error(self, path: Sequence[str | int], message: str) -> ConfigError:
        """``ConfigError("<where the value at path came from>: key <path>: <message>")``."""
        return ConfigError(f"{self.locate(path)}: key {dotted_key(path)}: {message}")


def as_source(source: str | ConfigSource) -> ConfigSource:
    return source if isinstance(source, ConfigSource) else ConfigSource(str(source))


def read_yaml(path: Path, context: str = "") -> dict:
    """The YAML mapping in ``path`` ({} for an empty file).

    Raises:
        ConfigError: invalid YAML, naming the file, the line and ``context``.
    """
    return read_yaml_lines(path, context)[0]


def read_yaml_lines(path: Path, context: str = "") -> tuple[Any, dict[KeyPath, int]]:
    """The YAML document in ``path`` ({} for an empty file) and the 1-based line of each key path in
    it (of a mapping's key, of a list's item), from the same parse.

    Raises:
        ConfigError: invalid YAML, naming the file, the line and ``context``.
    """
    loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, {}
        lines: dict[KeyPath, int] = {}
        _node_lines(loader, node, (), lines)
        return loader.construct_document(node) or {}, lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML{context}: {getattr(e, 'problem', e)}") from None
    finally:
        loader.dispose()


#: Deepest key path :func:`_node_lines` records (guards a recursive YAML alias).
_MAX_LINE_DEPTH = 32


def _node_lines(loader: yaml.SafeLoader, node: yaml.Node, path: KeyPath, out: dict[KeyPath, int]) -> None:
    """Record in ``out`` the line of every key path below ``node`` (a composed YAML node at ``path``)."""
    if len(path) >= _MAX_LINE_DEPTH:
        return
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node)
            out[(*path, key)] = key_node.start_mark.line + 1
            _node_lines(loader, value_node, (*path, key), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = item.start_mark.line + 1
            _node_lines(loader, item, (*path, i), out)


def deep_merge(base: dict, top: dict) -> dict:
    """Return ``base`` updated recursively with ``top`` (dicts merge, other values replace)."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
