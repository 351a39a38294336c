"""Configuration: load a YAML file, validate it against the JSON schema, fill defaults, and
resolve named methods (recipe x token credit x overrides).

The schema (``oar/schemas/config.schema.yaml``, also ``workflow/schemas/config.schema.yaml``) is the
single place where defaults live. Snakemake's ``validate`` reads the same file.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Union

import yaml

if TYPE_CHECKING:
    from oar.credit.user import UserEstimator

__all__ = [
    "ConfigError",
    "ConfigSource",
    "Layer",
    "Assignment",
    "SET_KEY",
    "changed_settings",
    "REPLACE_KEY",
    "COMMAND_LINE",
    "SUGGEST_CUTOFF",
    "suggest",
    "parse_assignment",
    "parse_assignments",
    "parse_set_option",
    "override_value",
    "apply_assignments",
    "assigned_values",
    "schema",
    "schema_path",
    "section_defaults",
    "load_config",
    "fill_defaults",
    "resolve_extends",
    "typed_override",
    "workflow_config",
    "write_resolved",
    "validate_config",
    "ResolvedMethod",
    "resolve_method",
    "resolve_methods",
    "RESERVED_METHOD_KEYS",
]

#: Keys of a method entry that are not overrides.
RESERVED_METHOD_KEYS = ("base", "recipe", "credit", "label")


#: The top-level key of Snakemake's ``--config`` whose value is a space-separated list of dotted
#: assignments (``--config set="train.lr=1e-3 rollout.n=4"``): Snakemake's own parser refuses a dotted
#: key (``train.lr=...``), so the dotted assignments travel as the value of one plain key. The key
#: is consumed by :func:`workflow_config`: it is no config key (the schema does not allow it) and never
#: reaches the resolved config or a fingerprint; only its effect does.
SET_KEY = "set"

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


def _dotted(path: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _display(path: str | Path) -> str:
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
        return ConfigError(f"{self.locate(path)}: key {_dotted(path)}: {message}")


def _as_source(source: str | ConfigSource) -> ConfigSource:
    return source if isinstance(source, ConfigSource) else ConfigSource(str(source))


def schema_path() -> Path:
    """Path of the JSON schema (YAML) shipped with the package."""
    return Path(str(resources.files("oar") / "schemas" / "config.schema.yaml"))


@lru_cache(maxsize=1)
def _schema_cached() -> dict:
    return yaml.safe_load(schema_path().read_text(encoding="utf-8"))


def schema() -> dict:
    """The configuration schema as a dict (a fresh copy; the file is parsed once per process)."""
    return copy.deepcopy(_schema_cached())


def _extend_with_default(validator_class: type) -> type:
    """A validator that also fills in ``default`` values (the jsonschema FAQ recipe)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, sch):
        if isinstance(instance, dict):
            for prop, subschema in properties.items():
                if isinstance(subschema, dict) and "default" in subschema and prop not in instance:
                    instance[prop] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, sch)

    import jsonschema

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


@lru_cache(maxsize=1)
def _default_filling() -> type:
    """The default-filling Draft 2020-12 validator (jsonschema is imported on first use: the stock GPU
    image that ``benchmarks/gpu_check.py`` targets has no jsonschema, and needs no validation)."""
    import jsonschema

    return _extend_with_default(jsonschema.Draft202012Validator)


def section_defaults(section: str) -> dict:
    """The defaults the schema gives the top-level ``section`` (e.g. ``report``): what a config that
    leaves the section out gets. For library code that also accepts unvalidated dicts, so that the
    schema stays the one place a default is written.

    Raises:
        KeyError: naming an unknown section.
    """
    sub = schema()["properties"].get(section)
    if sub is None:
        raise KeyError(f"oar.config.section_defaults: the schema has no section {section!r}")
    return _defaults_of(sub)


def changed_settings(config: Mapping[str, Any]) -> dict[str, str]:
    """The settings of a validated ``config`` that differ from the schema's defaults, flattened
    (``{"train.lr": "0.002", ...}``, :func:`oar.core.flatten.flatten`): what a run's MLflow params show
    (the whole resolved config is the run's artifact). ``methods`` and ``recipes`` are left out (a
    training run logs its own method's settings)."""
    from oar.core.flatten import flatten

    props = schema()["properties"]
    defaults = flatten({k: section_defaults(k) if props[k].get("properties") else props[k].get("default")
                        for k in config if k in props and k not in ("methods", "recipes")})
    given = flatten({k: v for k, v in config.items() if k in props and k not in ("methods", "recipes")})
    return {k: v for k, v in given.items() if defaults.get(k) != v}


def _defaults_of(sub: dict) -> dict:
    """The ``default`` of every property of ``sub``, nested defaults filled into object defaults (as
    the default-filling validator does: a default is inserted, then its own properties' defaults)."""
    out: dict = {}
    for k, v in (sub.get("properties") or {}).items():
        if isinstance(v, dict) and "default" in v:
            d = copy.deepcopy(v["default"])
            if isinstance(d, dict) and v.get("properties"):
                d = deep_merge(_defaults_of(v), d)
            out[k] = d
    return out


def _key_path(err: Any) -> str:
    return _dotted(err.absolute_path)


def _unknown_key_message(path: KeyPath, key: str, valid: Iterable[str]) -> str:
    """``unknown key train.lrr; did you mean train.lr?`` (or the valid keys, when none is close)."""
    valid = sorted(valid)
    near = suggest(key, valid)
    hint = f"did you mean {_dotted((*path, near))}?" if near is not None else f"valid keys: {valid}"
    return f"unknown key {_dotted((*path, key))}; {hint}"


def _schema_error(err: Any, src: ConfigSource, more: str = "") -> ConfigError:
    """A jsonschema error as one line naming where the value came from; an unexpected key (a
    misspelling) names the nearest key the schema allows at that level."""
    path = tuple(err.absolute_path)
    if err.validator == "additionalProperties" and err.validator_value is False and isinstance(err.instance, dict):
        allowed = (err.schema.get("properties") or {}).keys()
        extra = [k for k in err.instance if k not in allowed]
        if extra:
            key = str(extra[0])
            return ConfigError(f"{src.locate((*path, key))}: {_unknown_key_message(path, key, allowed)}{more}")
    return ConfigError(f"{src.locate(path)}: key {_key_path(err)}: {err.message}{more}")


def validate_config(config: dict, *, source: str | ConfigSource = "<config>") -> dict:
    """Validate ``config`` in place against the schema, filling defaults; return it.

    Also resolves every method, so a bad method entry fails here, before any training.

    Args:
        source: the file name, or a :class:`ConfigSource` that knows the file, line and
            ``extends`` chain or the command-line override behind each value.

    Raises:
        ConfigError: naming where the offending value came from and its key path; a misspelt key
            names the nearest valid one.
    """
    src = _as_source(source)
    if not isinstance(config, dict):
        raise ConfigError(f"{src.fallback}: top level must be a mapping, got {type(config).__name__}")
    sch = schema()
    # fill defaults twice: nested defaults appear only once their parent exists
    for _ in range(2):
        errors = sorted(_default_filling()(sch).iter_errors(config),
                        key=lambda e: [str(p) for p in e.absolute_path])
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise _schema_error(errors[0], src, more)
    _fill_derived(config, sch)
    resolve_methods(config, source=src)
    return config


def _fill_derived(config: dict, sch: dict) -> None:
    """What filling a config sets beyond the schema's ``default`` keywords: ``tracking.experiment``
    (the config's name) and every recipe's defaults (validated and unvalidated loading alike)."""
    if config["tracking"].get("experiment") is None:
        config["tracking"]["experiment"] = config["name"]
    config.setdefault("recipes", {})
    for rec in config["recipes"].values():
        _fill_defaults(rec, sch["$defs"]["recipe"])


def _fill_defaults(obj: dict, sub: dict) -> None:
    for k, v in sub.get("properties", {}).items():
        if "default" in v and k not in obj:
            obj[k] = copy.deepcopy(v["default"])


def load_config(path: str | Path, overrides: dict | None = None, *, sets: Sequence[str] = (),
                overrides_source: str = "overrides", validate: bool = True) -> dict:
    """Read a YAML config file (following its ``extends`` chain), merge ``overrides`` (a nested dict) on
    top, then the dotted assignments ``sets`` (``["train.lr=1e-3", "rollout.n=4"]``, the ``--set`` of
    every ``oar`` command: :func:`parse_assignments`), and validate it.

    Args:
        overrides_source: how an error names a value of ``overrides`` (e.g. ``command line: --steps 5``).
        validate: False fills the schema's defaults without checking anything (:func:`fill_defaults`),
            for a process without jsonschema, such as the stock GPU image ``benchmarks/gpu_check.py``
            runs on; the file must be one that validates (its methods are not resolved either).

    Raises:
        FileNotFoundError: if the file does not exist.
        ConfigError: for YAML syntax errors (with line), a malformed assignment, and schema violations:
            naming where the value came from (``config/ablations.yaml:12 (extends config/config.yaml)``,
            ``command line: --set train.lr=abc``) and its key path.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    data, lines = _read_yaml_lines(path)
    layers = _extends_layers(data, path, lines)
    config = _merge_layers(layers)
    src = ConfigSource(str(path), layers)
    if overrides:
        config = deep_merge(config, overrides)
        src.add(Layer(overrides, overrides_source))
    assignments = parse_assignments(sets)
    config = apply_assignments(config, assignments, source=src)
    if not validate:
        return fill_defaults(config)
    return validate_config(config, source=src)


def fill_defaults(config: dict) -> dict:
    """Fill ``config`` in place with the schema's defaults, as validation does but checking nothing
    and without jsonschema; return it.

    Walks the schema's ``properties`` (through ``$ref``, ``additionalProperties`` and array ``items``)
    twice, as :func:`validate_config` does, so that a default inserted on the first pass gets its own
    properties' defaults on the second, then what validation derives (:func:`_fill_derived`).
    ``tests/test_defaults.py`` checks that every config of ``config/`` comes out as validation leaves it.
    """
    sch = schema()
    for _ in range(2):
        _fill_from(config, sch, sch)
    _fill_derived(config, sch)
    return config


def _fill_from(obj: Any, sub: dict, sch: dict) -> None:
    """The defaults of the (sub)schema ``sub`` into ``obj``, recursively (:func:`fill_defaults`)."""
    while isinstance(sub, dict) and "$ref" in sub:
        sub = sch["$defs"][sub["$ref"].rsplit("/", 1)[-1]]
    if isinstance(obj, list) and isinstance(sub.get("items"), dict):
        for item in obj:
            _fill_from(item, sub["items"], sch)
    if not isinstance(obj, dict):
        return
    props = sub.get("properties") or {}
    for k, v in props.items():
        if "default" in v and k not in obj:
            obj[k] = copy.deepcopy(v["default"])
        if k in obj:
            _fill_from(obj[k], v, sch)
    extra = sub.get("additionalProperties")
    if isinstance(extra, dict):
        for k, v in obj.items():
            if k not in props:
                _fill_from(v, extra, sch)


def _read_yaml(path: Path, context: str = "") -> dict:
    """The YAML mapping in ``path`` ({} for an empty file).

    Raises:
        ConfigError: invalid YAML, naming the file, the line and ``context``.
    """
    return _read_yaml_lines(path, context)[0]


def _read_yaml_lines(path: Path, context: str = "") -> tuple[Any, dict[KeyPath, int]]:
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


def resolve_extends(config: dict, path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """``config`` merged on top of the config its ``extends`` key names (recursively).

    ``extends: config.yaml`` (a path relative to the file ``path`` that holds ``config``) makes a
    config a set of changes to another: mappings merge key by key (so ``methods`` adds methods to
    the base's), other values replace. The result has no ``extends`` key.

    Raises:
        ConfigError: the base does not exist, is not valid YAML, or the chain loops; the message
            names the file that says ``extends``.
    """
    if not isinstance(config, dict) or "extends" not in config:
        return config
    return _merge_layers(_extends_layers(config, path, {}, _seen))


def _extends_chain(config: dict, path: Path, lines: dict[KeyPath, int], seen: tuple[Path, ...],
                   ) -> list[tuple[str, dict, dict[KeyPath, int]]]:
    """``(shown path, own values without extends, lines)`` of ``config`` (the file ``path``) and of
    every file its ``extends`` chain reaches, the deepest base first."""
    own = {k: v for k, v in config.items() if k != "extends"} if isinstance(config, dict) else config
    shown = str(path) if not seen else _display(path)
    if not isinstance(config, dict) or "extends" not in config:
        return [(shown, own, lines)]
    base_path = (path.parent / str(config["extends"])).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: key extends: {base_path} extends itself (a loop)")
    if not base_path.is_file():
        raise ConfigError(f"{path}: key extends: no such config file {base_path}")
    base, base_lines = _read_yaml_lines(base_path, f" (extended by {path})")
    if not isinstance(base, dict):
        raise ConfigError(f"{_display(base_path)} (extended by {path}): top level must be a mapping, "
                          f"got {type(base).__name__}")
    return [*_extends_chain(base, base_path, base_lines, (*seen, path.resolve())), (shown, own, lines)]


def _extends_layers(config: dict, path: str | Path, lines: dict[KeyPath, int],
                    seen: tuple[Path, ...] = ()) -> list[Layer]:
    """The layers of ``config`` (the file ``path``) and of its ``extends`` chain, the deepest base
    first, each noting its place in the chain: ``(extends config/config.yaml)`` for the file that
    says it, ``(extended by config/ablations.yaml)`` for the base."""
    chain = _extends_chain(config, Path(path), lines, seen)
    names = [name for name, _, _ in chain]
    layers = []
    for i, (name, data, file_lines) in enumerate(chain):
        notes = []
        if i > 0:
            notes.append("extends " + ", which extends ".join(reversed(names[:i])))
        if i < len(chain) - 1:
            notes.append("extended by " + ", which is extended by ".join(names[i + 1:]))
        layers.append(Layer(data, name, f" ({'; '.join(notes)})" if notes else "", file_lines))
    return layers


#: The key of a config that extends another listing the mappings it replaces instead of merging
#: into (dotted key paths, e.g. ``[attribution.credit_signals]``); like ``extends``, it is in no
#: resolved config.
REPLACE_KEY = "replace"


def _merge_layers(layers: Sequence[Layer]) -> dict:
    """The layers' data merged in order (:func:`deep_merge`), the first lowest.

    A layer's ``replace`` list (:data:`REPLACE_KEY`) first drops each mapping it names from the
    layers below, so that the layer's own value for it is the whole value.

    Raises:
        ConfigError: ``replace`` is not a list of dotted keys, or names a key that is not a mapping
            of the config below (naming the file and line).
    """
    out: dict = {}
    for layer in layers:
        if not isinstance(layer.data, dict):
            out = layer.data
            continue
        data = dict(layer.data)
        if REPLACE_KEY in data:
            _drop_replaced(out, data.pop(REPLACE_KEY), layer)
        out = deep_merge(out, data)
    return out


def _drop_replaced(config: dict, keys: Any, layer: Layer) -> None:
    """Remove from ``config`` (the merged layers below ``layer``) every mapping ``keys`` names."""
    where = layer.where((REPLACE_KEY,))
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"{where}: key {REPLACE_KEY}: a list of dotted keys of the config it extends, "
                          f"e.g. [attribution.credit_signals]; got {keys!r}")
    for dotted in keys:
        *parents, last = dotted.split(".")
        node: Any = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(last), dict):
            raise ConfigError(f"{where}: key {REPLACE_KEY}: {dotted} is not a mapping of the config it extends "
                              f"(only a mapping merges, so only a mapping needs replacing)")
        del node[last]


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
                    raise ConfigError(f"{a.origin}: key {_dotted(a.path[:depth])} is a list of {len(node)}; "
                                      f"{part!r} is no index of it")
                key: str | int = int(part)
            elif isinstance(node, dict):
                key = part
                if not last and node.get(key) is None:
                    node[key] = {}
            else:
                raise ConfigError(f"{a.origin}: key {_dotted(a.path[:depth])} is a {type(node).__name__}, not a "
                                  f"mapping; cannot set {_dotted(a.path)}")
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


def _show(value: Any) -> str:
    """A ``--config`` value as typed on the command line (JSON for a mapping or a list)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def workflow_config(given: dict, *, configfiles: Sequence[str | Path], default_configfile: str | Path,
                    cli_config: Mapping[str, Any],
                    config_args: Sequence[str] | None = None) -> tuple[dict, ConfigSource]:
    """The config the workflow runs, before validation, and where its values came from.

    ``given`` is Snakemake's ``config``. Without ``--configfile`` it is merged onto the embedded
    default ``default_configfile``; a ``--configfile`` replaces the default instead (so a config's
    ``methods`` are exactly the ones it lists), and one that says ``extends: <file>`` is a set of
    changes to that file (:func:`resolve_extends`). The mapping and list values of ``--config
    KEY=VALUE`` (``cli_config``) are merged on top with their scalars typed (:func:`typed_override`),
    then the dotted assignments of ``--config set="train.lr=1e-3 rollout.n=4"`` (:data:`SET_KEY`,
    :func:`parse_set_option`) are applied; the ``set`` key itself is dropped. ``config_args``: the
    raw ``--config`` arguments (Snakemake's ``config_settings.config_args``), where several ``set=``
    entries are all kept (Snakemake's ``config`` holds only the last): they apply in order, as the
    ``oar`` command's repeated ``--set``.

    Returns:
        ``(config, source)``: ``str(source)`` is the config file(s) (the default's name without
        ``--configfile``); :meth:`ConfigSource.locate` names the file and line, ``extends`` chain or
        command-line override behind a key path, for :func:`validate_config`'s messages.

    Raises:
        ConfigError: the default config file is missing, an ``extends`` chain is broken, or a ``set``
            assignment is malformed or cannot be applied (naming it).
    """
    config = dict(given)
    files = [Path(f) for f in configfiles] or [Path(default_configfile)]
    if not configfiles:
        path = files[0]
        if not path.exists():
            raise ConfigError(f"no --configfile given and the default {path} does not exist "
                              f"(working directory {Path.cwd()}); run snakemake from the repository root")
        config = deep_merge(_read_yaml(path), config)
    elif "extends" in config:
        config = resolve_extends(config, configfiles[-1])
    layers: list[Layer] = []
    for path in files:
        if path.is_file():  # Snakemake has read each already; read again for the lines
            data, lines = _read_yaml_lines(path)
            layers += _extends_layers(data, path, lines) if configfiles else [Layer(data, str(path), "", lines)]
    source = ConfigSource(", ".join(map(str, configfiles)) or str(default_configfile), layers)
    set_values = [a.split("=", 1)[1] for a in config_args or () if a.startswith(f"{SET_KEY}=")]
    if len(set_values) < 2:  # one (or none): Snakemake's own parsed value
        set_values = [cli_config[SET_KEY]] if SET_KEY in cli_config else []
    assignments = [a for value in set_values for a in parse_set_option(value)]
    if SET_KEY in cli_config:
        config.pop(SET_KEY, None)
    for key, value in cli_config.items():
        if key != SET_KEY:
            source.add(Layer({key: typed_override(value)}, f"{COMMAND_LINE}: --config {key}={_show(value)}"))
    # only mapping and list values went through the BaseLoader; top-level scalars keep Snakemake's type
    nested = {k: typed_override(v) for k, v in cli_config.items() if isinstance(v, (dict, list)) and k != SET_KEY}
    if nested:
        config = deep_merge(config, nested)
    return apply_assignments(config, assignments, source=source), source


def deep_merge(base: dict, top: dict) -> dict:
    """Return ``base`` updated recursively with ``top`` (dicts merge, other values replace)."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


@dataclass(frozen=True)
class ResolvedMethod:
    """A method with its chain of bases flattened.

    Attributes:
        name: the method's config key (e.g. ``oar_g_q50``).
        recipe_name: ``grpo``, ``drgrpo``, ``dapo`` or any recipe of the config.
        recipe: every recipe setting (clip range, loss aggregation, reward values, dynamic sampling,
            overlong shaping, KL coefficient), defaults filled.
        credit: ``none`` or a registered estimator (``ktae``, ``oar_p``, ``oar_g``, the controls of
            :mod:`oar.credit.controls`), or a user estimator (``module:attr`` or an ``oar.estimators``
            entry point, :mod:`oar.credit.user`), registered under that name when resolved.
        credit_options: options passed to the estimator.
        estimator: registered estimator name (``grpo``/``drgrpo`` when credit is ``none``).
        label: display name for tables.
        takes_norm_by_std: whether the estimator is passed the recipe's ``norm_by_std`` (every
            built-in is; a user estimator only when it takes that keyword).
        credit_source: a user estimator's source files, their hash and git state
            (:class:`oar.credit.user.EstimatorSource`, as a dict); part of the run's identity, so an
            edit retrains the runs that use it. None for a built-in (its code is the commit's).
    """

    name: str
    recipe_name: str
    recipe: dict[str, Any]
    credit: str
    credit_options: dict[str, Any] = field(default_factory=dict)
    estimator: str = "grpo"
    label: str = ""
    takes_norm_by_std: bool = True
    credit_source: dict[str, Any] | None = None

    def estimator_options(self) -> dict[str, Any]:
        """Options for the registered estimator: the credit options plus ``norm_by_std`` (when the
        estimator takes it)."""
        base = {"norm_by_std": self.recipe["norm_by_std"]} if self.takes_norm_by_std else {}
        return {**base, **self.credit_options}

    def as_params(self) -> dict[str, Any]:
        """Flat dict for logging (MLflow params)."""
        out = {"method": self.name, "recipe": self.recipe_name, "credit": self.credit, "estimator": self.estimator}
        out.update({f"recipe.{k}": v for k, v in self.recipe.items()})
        out.update({f"credit.{k}": v for k, v in self.credit_options.items()})
        if self.credit_source is not None:
            out["credit_source.sha256"] = self.credit_source["sha256"]
        return out


def _unknown_name(kind: str, name: Any, defined: Iterable[str]) -> str:
    """``unknown method 'oar_gg'; did you mean oar_g?`` (or the defined names, when none is close)."""
    defined = sorted(defined)
    near = suggest(str(name), defined)
    return f"unknown {kind} {name!r}; " + (f"did you mean {near}?" if near is not None else f"defined: {defined}")


def _flatten_method(config: dict, name: str, src: ConfigSource, seen: tuple[str, ...] = ()) -> dict:
    """Method ``name``'s entry with its chain of ``base`` methods merged in (the entry's own keys win).

    Raises:
        ConfigError: a ``base`` that names no method (reported at ``methods.<x>.base``, with the
            nearest method name), or a cycle.
    """
    methods = config.get("methods") or {}
    if name not in methods:
        raise src.error(("methods", name), _unknown_name("method", name, methods))
    if name in seen:
        raise src.error(("methods", name), f"cycle in 'base' chain: {' -> '.join(seen + (name,))}")
    entry = dict(methods[name] or {})
    if "base" in entry:
        base_name = entry.pop("base")
        if base_name not in methods:
            raise src.error(("methods", name, "base"), _unknown_name("method", base_name, methods))
        base = _flatten_method(config, base_name, src, seen + (name,))
        base.pop("label", None)
        base.update(entry)
        return base
    return entry


def resolve_method(config: dict, name: str, *, source: str | ConfigSource = "<config>",
                   validate: bool = True) -> ResolvedMethod:
    """Flatten method ``name`` (following ``base``) into a :class:`ResolvedMethod`.

    ``validate=False`` leaves out the schema check of its options (which needs jsonschema), for a
    config read by ``load_config(validate=False)``.

    A built-in credit is one of the schema's ``$defs.credit_options`` (its options listed there); any
    other is a user estimator, ``module:attr`` or an ``oar.estimators`` entry point, imported,
    checked and registered here (:func:`oar.credit.user.user_estimator`; its options are its keyword
    parameters). The estimator is looked up in the registry (:func:`oar.credit.get_estimator`), so a
    built-in estimator module that fails to import raises here, before any job runs. (In a process
    without torch, Snakemake's own under ``--use-conda``, nothing is imported: a user estimator's
    source is read instead, and the built-in modules are left to the jobs, where the first ``oar``
    command fails the same way.)

    Raises:
        ConfigError: unknown method/recipe/credit (with the nearest name), a user estimator that cannot
            be loaded, an override that neither the recipe nor the credit estimator accepts, one of the
            wrong type, or a missing required option of a user estimator (naming ``methods.<name>.<key>``
            and where it came from).
        ImportError: a built-in estimator module does not import (a broken installation).
    """
    src = _as_source(source)
    sch = schema()
    flat = _flatten_method(config, name, src)
    recipe_name = flat.get("recipe", "grpo")
    recipes = config.get("recipes") or {}
    if recipe_name not in recipes:
        raise src.error(("methods", name, "recipe"), _unknown_name("recipe", recipe_name, recipes))
    credit = flat.get("credit", "none")
    credit_schemas = sch["$defs"]["credit_options"]
    recipe_schema = sch["$defs"]["recipe"]
    user = None
    load = _credit_layer_here()
    where = f"{src.locate(('methods', name, 'credit'))}: key methods.{name}.credit"
    if credit not in credit_schemas or credit == "description":
        user = _user_estimator(credit, where, credit_schemas, load=load)
    recipe = copy.deepcopy(recipes[recipe_name])
    _fill_defaults(recipe, recipe_schema)
    credit_options = _split_method_options(flat, recipe, recipe_schema, credit_schemas, user, name=name,
                                           recipe_name=recipe_name, credit=credit, src=src)
    if validate:
        _check_method_options(recipe, credit_options, recipe_schema, credit_schemas.get(credit), user,
                              name=name, credit=credit, src=src)
    estimator = credit if credit != "none" else ("grpo" if recipe["norm_by_std"] else "drgrpo")
    if load:
        _check_registered(estimator, where)
    _check_control_task(config, name, credit, credit_schemas, user, src)
    return ResolvedMethod(
        name=name,
        recipe_name=recipe_name,
        recipe=recipe,
        credit=credit,
        credit_options=credit_options,
        estimator=estimator,
        label=flat.get("label", name),
        takes_norm_by_std=user is None or user.takes("norm_by_std"),
        credit_source=user.source.as_dict() if user is not None and user.source is not None else None,
    )


def _split_method_options(
    flat: Mapping[str, Any],
    recipe: dict,
    recipe_schema: Mapping[str, Any],
    credit_schemas: Mapping[str, Any],
    user: UserEstimator | None,
    *,
    name: str,
    recipe_name: str,
    credit: str,
    src: ConfigSource,
) -> dict[str, Any]:
    """Sort the keys of the flattened method ``flat`` (all but :data:`RESERVED_METHOD_KEYS`) into the
    recipe and the credit estimator's options; return the latter.

    A key the credit estimator takes (its schema's properties, or a user estimator's keyword
    parameters; any key but the recipe's for a user estimator taking ``**options``) is a credit
    option; else a recipe key overrides ``recipe`` (updated in place).

    Raises:
        ConfigError: a key neither accepts (at ``methods.<name>.<key>``, with the nearest allowed key).
    """
    credit_keys = set(credit_schemas[credit]["properties"]) if user is None else set(user.options or ())
    credit_options: dict[str, Any] = {}
    for key, value in flat.items():
        if key in RESERVED_METHOD_KEYS:
            continue
        if key in credit_keys or (user is not None and user.options is None and key not in recipe_schema["properties"]):
            credit_options[key] = value
        elif key in recipe_schema["properties"]:
            recipe[key] = value
        else:
            allowed = sorted(set(recipe_schema["properties"]) | credit_keys)
            near = suggest(key, allowed)
            hint = f"did you mean {near}? (allowed: {allowed})" if near is not None else f"allowed: {allowed}"
            raise src.error(("methods", name, key),
                            f"not an option of recipe {recipe_name!r} or credit {credit!r}; {hint}")
    return credit_options


def _check_method_options(
    recipe: Mapping[str, Any],
    credit_options: Mapping[str, Any],
    recipe_schema: Mapping[str, Any],
    credit_schema: Mapping[str, Any] | None,
    user: UserEstimator | None,
    *,
    name: str,
    credit: str,
    src: ConfigSource,
) -> None:
    """Check a method's recipe and credit options: against the schema (a built-in credit; the recipe
    always), or a user estimator's annotations and required keyword parameters.

    Raises:
        ConfigError: the first schema error (``(recipe setting)`` / ``(credit setting)``), a value of
            the wrong type for a user estimator, or its missing required options.
    """
    import jsonschema

    for obj, sub, what in ((recipe, recipe_schema, "recipe"), (credit_options, credit_schema, "credit")):
        if sub is None:  # a user estimator: its annotations
            continue
        errs = list(jsonschema.Draft202012Validator(sub).iter_errors(obj))
        if errs:
            e = errs[0]
            raise src.error(("methods", name, *e.absolute_path), f"{e.message} ({what} setting)")
    if user is not None:
        for key, value in credit_options.items():
            why = user.type_error(key, value)
            if why is not None:
                raise src.error(("methods", name, key), why)
        missing = sorted(user.required - set(credit_options))
        if missing:
            raise src.error(("methods", name, "credit"),
                            f"{credit!r} ({user.origin}) needs option(s) {missing} (keyword parameters without a "
                            f"default); set them in methods.{name} or give them defaults")


def _check_control_task(config: Mapping[str, Any], name: str, credit: str, credit_schemas: Mapping[str, Any],
                        user: UserEstimator | None, src: ConfigSource) -> None:
    """A credit that reads one task's steps or ground truth says so in the schema (``x-task``): raise
    :class:`ConfigError` when the config's ``task.kind`` is another (checked before any work)."""
    needs_task = (credit_schemas.get(credit) or {}).get("x-task") if user is None else None
    task_kind = (config.get("task") or {}).get("kind")
    if needs_task is not None and task_kind is not None and task_kind != needs_task:
        raise src.error(("methods", name, "credit"),
                        f"{credit!r} reads the {needs_task} task's steps (a control: also its ground truth); it cannot run "
                        f"with task.kind {task_kind!r}")


def _credit_layer_here() -> bool:
    """Whether this process can import the estimators (torch is importable): every ``oar`` command
    and job; not Snakemake's own process under ``--use-conda``, which plans the DAG without the rules'
    software. Only then are estimators imported and looked up while methods are resolved."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _user_estimator(credit: str, where: str, credit_schemas: Mapping[str, Any], *, load: bool) -> UserEstimator:
    """The user estimator ``credit`` (:func:`oar.credit.user.user_estimator`: imported, checked and
    registered with ``load``, else its source read), its problems as a :class:`ConfigError` prefixed
    with ``where`` (the config key)."""
    from oar.credit.user import EstimatorSpecError, UnknownEstimatorError, user_estimator

    try:
        return user_estimator(credit, load=load)
    except UnknownEstimatorError:
        valid = sorted(k for k in credit_schemas if k != "description")
        raise ConfigError(f"{where}: unknown credit {credit!r}; valid: {valid}, or an estimator of your own as "
                          "module:function (e.g. mypkg.credit:my_fn) or an oar.estimators entry point") from None
    except EstimatorSpecError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_registered(estimator: str, where: str) -> None:
    """Raise unless ``estimator`` is in :mod:`oar.credit`'s registry (importing the built-in estimator
    modules: one that fails to import raises its ImportError here)."""
    from oar.credit import get_estimator

    try:
        get_estimator(estimator)
    except KeyError:
        raise ConfigError(f"{where}: the schema lists {estimator!r} but oar.credit registers no such estimator "
                          "(register it with oar.credit.register_estimator and import it in _load_builtin)") from None


def resolve_methods(config: dict, *, source: str | ConfigSource = "<config>") -> dict[str, ResolvedMethod]:
    """Resolve the methods the config runs: ``only_methods`` in its order, or every key of
    ``methods`` (fails on the first bad one).

    Raises:
        ConfigError: a name of ``only_methods`` is not a key of ``methods`` (with the nearest), an
            ``attribution.trained`` entry is not a run of the config, or a name of
            ``eval.transfer.methods`` is not a method the config runs (with the nearest).
    """
    src = _as_source(source)
    methods = config.get("methods") or {}
    names = config.get("only_methods") or list(methods)
    unknown = [(i, n) for i, n in enumerate(names) if n not in methods]
    if unknown:
        i = unknown[0][0]
        near = [suggest(n, methods) for _, n in unknown]
        hint = "; did you mean " + ", ".join(map(str, near)) + "?" if all(near) else ""
        raise src.error(("only_methods", i),
                        f"unknown method(s) {[n for _, n in unknown]}{hint}; defined: {sorted(methods)}")
    for i, t in enumerate((config.get("attribution") or {}).get("trained") or []):
        if t["method"] not in names or t["seed"] not in config.get("seeds", []):
            raise ConfigError(f"{src.locate(('attribution', 'trained', i))}: key attribution.trained[{i}]: "
                              f"{t['method']} seed {t['seed']} is not a run of this config (methods {names}, "
                              f"seeds {config.get('seeds')})")
    transfer = ((config.get("eval") or {}).get("transfer") or {}).get("methods") or []
    for i, name in enumerate(transfer):
        if name not in names:
            why = (f"method {name!r} is not in only_methods {names} (a transfer row is a method the config runs)"
                   if name in methods else _unknown_name("method", name, names))
            raise src.error(("eval", "transfer", "methods", i), why)
    return {name: resolve_method(config, name, source=src) for name in names}


def write_resolved(config: Mapping[str, Any], path: str | Path, *, source: str) -> bool:
    """Write the resolved ``config`` (what every ``oar`` command of a workflow run reads) to ``path``,
    atomically and only when its content changed (so its mtime means something). Returns whether it
    wrote."""
    import json

    from oar.core.io import atomic_write_text

    text = (f"# resolved by the workflow from {source} (defaults filled, --config overrides applied)\n"
            + yaml.safe_dump(json.loads(json.dumps(dict(config))), sort_keys=False))
    path = Path(path)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    atomic_write_text(path, text)
    return True
