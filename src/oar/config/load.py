"""Loading a config: a YAML file and its ``extends`` chain (with ``replace``), overrides and
``--set`` assignments on top, validated (:mod:`oar.config.validate`: the schema is the single place
where defaults live; Snakemake's ``validate`` reads the same file) and its methods resolved
(:mod:`oar.config.methods`); Snakemake's config (:func:`workflow_config`) and the resolved config the
workflow's jobs read (:func:`write_resolved`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from oar.config.overrides import (SET_KEY, apply_assignments, parse_assignments, parse_set_option, show_value,
                                  typed_override)
from oar.config.source import (COMMAND_LINE, ConfigError, ConfigSource, KeyPath, Layer, deep_merge, display_path, read_yaml,
                               read_yaml_lines)
from oar.config.validate import fill_defaults, validate_config

__all__ = ["REPLACE_KEY", "load_config", "resolve_extends", "workflow_config", "write_resolved"]


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
    data, lines = read_yaml_lines(path)
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
    shown = str(path) if not seen else display_path(path)
    if not isinstance(config, dict) or "extends" not in config:
        return [(shown, own, lines)]
    base_path = (path.parent / str(config["extends"])).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: key extends: {base_path} extends itself (a loop)")
    if not base_path.is_file():
        raise ConfigError(f"{path}: key extends: no such config file {base_path}")
    base, base_lines = read_yaml_lines(base_path, f" (extended by {path})")
    if not isinstance(base, dict):
        raise ConfigError(f"{display_path(base_path)} (extended by {path}): top level must be a mapping, "
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
        config = deep_merge(read_yaml(path), config)
    elif "extends" in config:
        config = resolve_extends(config, configfiles[-1])
    layers: list[Layer] = []
    for path in files:
        if path.is_file():  # Snakemake has read each already; read again for the lines
            data, lines = read_yaml_lines(path)
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
            source.add(Layer({key: typed_override(value)}, f"{COMMAND_LINE}: --config {key}={show_value(value)}"))
    # only mapping and list values went through the BaseLoader; top-level scalars keep Snakemake's type
    nested = {k: typed_override(v) for k, v in cli_config.items() if isinstance(v, (dict, list)) and k != SET_KEY}
    if nested:
        config = deep_merge(config, nested)
    return apply_assignments(config, assignments, source=source), source


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
