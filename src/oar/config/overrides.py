"""Values given on the command line: ``--set key.sub=value`` assignments (``oar`` commands) and
Snakemake's ``--config`` values (typed as YAML reads them), applied on top of a config.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import yaml

from oar.config.source import COMMAND_LINE, ConfigError, ConfigSource, Layer, dotted_key

__all__ = ["Assignment", "SET_KEY", "parse_assignment", "parse_assignments", "parse_set_option", "override_value", "apply_assignments", "assigned_values", "typed_override"]


#: The top-level key of Snakemake's ``--config`` whose value is a space-separated list of dotted
#: assignments (``--config set="train.lr=1e-3 rollout.n=4"``): Snakemake's own parser refuses a dotted
#: key (``train.lr=...``), so the dotted assignments travel as the value of one plain key. The key
#: is consumed by :func:`workflow_config`: it is no config key (the schema does not allow it) and never
#: reaches the resolved config or a fingerprint; only its effect does.
SET_KEY = "set"


#: A YAML 1.2 float without a dot (1e-3), which YAML 1.1 (PyYAML) reads as a string.
_YAML12_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def typed_override(value: Any) -> Any:
    """A Snakemake ``--config`` value with the scalars inside its mappings and lists given their YAML types.

    Snakemake parses a --config value that is a mapping or a list with YAML's BaseLoader, which
    leaves every scalar in it a string (``'train={"lr": 0.001}'`` gives ``{"lr": "0.001"}``), while a
    top-level value such as ``steps=30`` is typed. Nested scalars become int, float, bool or null as
    in a config file (plus 1e-3 without a dot, a float in YAML 1.2); anything else (text, paths,
    dates) stays the string it was.
    """
    if isinstance(value, dict):
        return {k: typed_override(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed_override(v) for v in value]
    if not isinstance(value, str) or not value.strip():
        return value
    if _YAML12_EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    try:
        typed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return typed if typed is None or isinstance(typed, (bool, int, float)) else value


def override_value(text: str) -> Any:
    """The value of a dotted assignment (``--set KEY.SUB=VALUE``) with its YAML type: a scalar as
    :func:`typed_override` types it (``1e-3`` a float, ``4`` an int, ``true``, ``null``), a quoted
    one the string inside the quotes (``"'1'"`` -> ``'1'``), a flow list or mapping (``[0,1]``,
    ``{lr: 0.1}``) with its scalars typed the same way; anything else the text as given."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return typed_override(yaml.load(stripped, Loader=yaml.BaseLoader))
        except yaml.YAMLError:
            return text
    typed = typed_override(text)
    if isinstance(typed, str) and stripped[:1] in ("'", '"'):
        try:
            unquoted = yaml.safe_load(stripped)
        except yaml.YAMLError:
            return typed
        return unquoted if isinstance(unquoted, str) else typed
    return typed


@dataclass(frozen=True)
class Assignment:
    """One dotted override ``KEY.SUB=VALUE``.

    Attributes:
        path: the key path (``("train", "lr")``); a component of digits indexes a list.
        value: the value, typed by :func:`override_value`.
        origin: how an error names it: ``command line: --set train.lr=abc``.
    """

    path: tuple[str, ...]
    value: Any
    origin: str


def parse_assignment(text: str, *, origin: str) -> Assignment:
    """``KEY.SUB=VALUE`` as an :class:`Assignment` (the value typed by :func:`override_value`).

    Raises:
        ConfigError: no ``=``, an empty key or an empty key component (``train..lr``), naming ``origin``.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{origin}: expected KEY.SUB=VALUE (e.g. train.lr=1e-3)")
    path = tuple(key.split("."))
    if any(not part for part in path):
        raise ConfigError(f"{origin}: empty key component in {key!r}")
    return Assignment(path, override_value(raw), origin)


def parse_assignments(items: Iterable[str], *, flag: str = "--set") -> list[Assignment]:
    """The assignments of the command-line flag ``flag``, each naming itself as its origin
    (``command line: --set train.lr=abc``).

    Raises:
        ConfigError: a malformed assignment (:func:`parse_assignment`).
    """
    return [parse_assignment(text, origin=f"{COMMAND_LINE}: {flag} {text}") for text in items]


def parse_set_option(value: Any) -> list[Assignment]:
    """The assignments in the value of Snakemake's ``--config set="train.lr=1e-3 rollout.n=4"``
    (:data:`SET_KEY`): space-separated, shell-quoted where a value holds a space; each names itself
    as ``command line: --config set=train.lr=1e-3``.

    Raises:
        ConfigError: the value is not such a list (Snakemake typed it as a number, a mapping, ...), or
            an assignment is malformed.
    """
    flag = f"--config {SET_KEY}="
    if not isinstance(value, str):
        raise ConfigError(f"{COMMAND_LINE}: {flag}{value!r}: expected space-separated KEY.SUB=VALUE assignments, "
                          f"e.g. {SET_KEY}=\"train.lr=1e-3 rollout.n=4\"")
    try:
        items = shlex.split(value)
    except ValueError as e:
        raise ConfigError(f"{COMMAND_LINE}: {flag}{value}: {e}") from None
    return [parse_assignment(text, origin=f"{COMMAND_LINE}: {flag}{text}") for text in items]


def _assignment_layer(a: Assignment) -> Layer:
    """An assignment as the layer of its own value (``train.lr=x`` -> ``{"train": {"lr": x}}``)."""
    data: Any = a.value
    for part in reversed(a.path):
        data = {part: data}
    return Layer(data, a.origin)


def apply_assignments(config: dict, assignments: Sequence[Assignment], *,
                      source: ConfigSource | None = None) -> dict:
    """``config`` with each assignment set, in order (a copy; ``config`` is left as it is). Missing
    mappings on the way are created (a null one too: ``train.init: null``); a component of digits
    indexes an existing list. Each assignment is added to ``source`` (when given) as a layer, so that
    an error in its value names it.

    Raises:
        ConfigError: a key on the way holds a value that is neither a mapping nor a list, or an index
            outside a list, naming the assignment.
    """
    if not assignments:
        return config
    out = copy.deepcopy(config)
    for a in assignments:
        node: Any = out
        for depth, part in enumerate(a.path):
            last = depth == len(a.path) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{a.origin}: key {dotted_key(a.path[:depth])} is a list of {len(node)}; "
                                      f"{part!r} is no index of it")
                key: str | int = int(part)
            elif isinstance(node, dict):
                key = part
                if not last and node.get(key) is None:
                    node[key] = {}
            else:
                raise ConfigError(f"{a.origin}: key {dotted_key(a.path[:depth])} is a {type(node).__name__}, not a "
                                  f"mapping; cannot set {dotted_key(a.path)}")
            if last:
                node[key] = copy.deepcopy(a.value)
            else:
                node = node[key]
        if source is not None:
            source.add(_assignment_layer(a))
    return out


def assigned_values(config: Mapping[str, Any], assignments: Sequence[Assignment]) -> dict:
    """The values of ``config`` at the assignments' key paths, as a nested mapping to merge on top of
    another config (:func:`deep_merge`) to the same effect: a path into a list gives the whole list.
    For writing a config file that must carry command-line assignments (e.g. a regime cell's)."""
    out: dict = {}
    for a in assignments:
        node: Any = config
        keep: list[str] = []
        for part in a.path:
            if not isinstance(node, dict) or part not in node:
                break
            keep.append(part)
            node = node[part]
            if isinstance(node, list):
                break
        if not keep:
            continue
        target = out
        for part in keep[:-1]:
            target = target.setdefault(part, {})
        target[keep[-1]] = copy.deepcopy(node)
    return out


def show_value(value: Any) -> str:
    """A ``--config`` value as typed on the command line (JSON for a mapping or a list)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)
