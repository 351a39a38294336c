"""The config's JSON schema (``oar/schemas/config.schema.yaml``, the one home of every default):
validation with errors that name the key and where it was set, defaults filled in, each section's
defaults, and the settings a config changed from them.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from oar.config.source import ConfigError, ConfigSource, KeyPath, as_source, deep_merge, dotted_key, suggest

__all__ = ["changed_settings", "schema", "schema_path", "section_defaults", "fill_defaults", "validate_config"]


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
def default_filling() -> type:
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


def error_key_path(err: Any) -> str:
    return dotted_key(err.absolute_path)


def unknown_key_message(path: KeyPath, key: str, valid: Iterable[str]) -> str:
    """``unknown key train.lrr; did you mean train.lr?`` (or the valid keys, when none is close)."""
    valid = sorted(valid)
    near = suggest(key, valid)
    hint = f"did you mean {dotted_key((*path, near))}?" if near is not None else f"valid keys: {valid}"
    return f"unknown key {dotted_key((*path, key))}; {hint}"


def schema_error(err: Any, src: ConfigSource, more: str = "") -> ConfigError:
    """A jsonschema error as one line naming where the value came from; an unexpected key (a
    misspelling) names the nearest key the schema allows at that level."""
    path = tuple(err.absolute_path)
    if err.validator == "additionalProperties" and err.validator_value is False and isinstance(err.instance, dict):
        allowed = (err.schema.get("properties") or {}).keys()
        extra = [k for k in err.instance if k not in allowed]
        if extra:
            key = str(extra[0])
            return ConfigError(f"{src.locate((*path, key))}: {unknown_key_message(path, key, allowed)}{more}")
    return ConfigError(f"{src.locate(path)}: key {error_key_path(err)}: {err.message}{more}")


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
    src = as_source(source)
    if not isinstance(config, dict):
        raise ConfigError(f"{src.fallback}: top level must be a mapping, got {type(config).__name__}")
    sch = schema()
    # fill defaults twice: nested defaults appear only once their parent exists
    for _ in range(2):
        errors = sorted(default_filling()(sch).iter_errors(config),
                        key=lambda e: [str(p) for p in e.absolute_path])
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise schema_error(errors[0], src, more)
    _fill_derived(config, sch)
    from oar.config.methods import resolve_methods  # it validates with this module's schema

    resolve_methods(config, source=src)
    return config


def _fill_derived(config: dict, sch: dict) -> None:
    """What filling a config sets beyond the schema's ``default`` keywords: ``tracking.experiment``
    (the config's name) and every recipe's defaults (validated and unvalidated loading alike)."""
    if config["tracking"].get("experiment") is None:
        config["tracking"]["experiment"] = config["name"]
    config.setdefault("recipes", {})
    for rec in config["recipes"].values():
        fill_section_defaults(rec, sch["$defs"]["recipe"])


def fill_section_defaults(obj: dict, sub: dict) -> None:
    for k, v in sub.get("properties", {}).items():
        if "default" in v and k not in obj:
            obj[k] = copy.deepcopy(v["default"])


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
