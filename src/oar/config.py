"""Configuration: load a YAML file, validate it against the JSON schema, fill defaults, and
resolve named methods (recipe x token credit x overrides).

The schema (``oar/schemas/config.schema.yaml``, also ``workflow/schemas/config.schema.yaml``) is the
single place where defaults live. Snakemake's ``validate`` reads the same file.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import yaml

if TYPE_CHECKING:
    from oar.credit.user import UserEstimator

__all__ = [
    "ConfigError",
    "schema",
    "schema_path",
    "section_defaults",
    "load_config",
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


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


def schema_path() -> Path:
    """Path of the JSON schema (YAML) shipped with the package."""
    return Path(str(resources.files("oar") / "schemas" / "config.schema.yaml"))


@lru_cache(maxsize=1)
def _schema_cached() -> str:
    return schema_path().read_text(encoding="utf-8")


def schema() -> dict:
    """The configuration schema as a dict (a fresh copy)."""
    return yaml.safe_load(_schema_cached())


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
    return ".".join(str(p) for p in err.absolute_path) or "<top level>"


def validate_config(config: dict, *, source: str = "<config>") -> dict:
    """Validate ``config`` in place against the schema, filling defaults; return it.

    Also resolves every method, so a bad method entry fails here, before any training.

    Raises:
        ConfigError: naming ``source`` and the offending key path.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(config).__name__}")
    sch = schema()
    # fill defaults twice: nested defaults appear only once their parent exists
    for _ in range(2):
        errors = sorted(_default_filling()(sch).iter_errors(config), key=lambda e: list(e.absolute_path))
        if errors:
            e = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ConfigError(f"{source}: key {_key_path(e)}: {e.message}{more}")
    if config["tracking"].get("experiment") is None:
        config["tracking"]["experiment"] = config["name"]
    config.setdefault("recipes", {})
    for name, rec in config["recipes"].items():
        _fill_defaults(rec, sch["$defs"]["recipe"])
    resolve_methods(config, source=source)
    return config


def _fill_defaults(obj: dict, sub: dict) -> None:
    for k, v in sub.get("properties", {}).items():
        if "default" in v and k not in obj:
            obj[k] = copy.deepcopy(v["default"])


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config file, apply ``overrides`` (a nested dict merged on top), validate it.

    Raises:
        FileNotFoundError: if the file does not exist.
        ConfigError: for YAML syntax errors (with line) and schema violations (with key path).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    config = resolve_extends(_read_yaml(path), path)
    if overrides:
        config = deep_merge(config, overrides)
    return validate_config(config, source=str(path))


def _read_yaml(path: Path, context: str = "") -> dict:
    """The YAML mapping in ``path`` ({} for an empty file).

    Raises:
        ConfigError: invalid YAML, naming the file, the line and ``context``.
    """
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML{context}: {getattr(e, 'problem', e)}") from None


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
    path = Path(path)
    top = dict(config)
    base_path = (path.parent / str(top.pop("extends"))).resolve()
    if base_path in _seen or base_path == path.resolve():
        raise ConfigError(f"{path}: key extends: {base_path} extends itself (a loop)")
    if not base_path.is_file():
        raise ConfigError(f"{path}: key extends: no such config file {base_path}")
    base = resolve_extends(_read_yaml(base_path, f" (extended by {path})"), base_path, (*_seen, path.resolve()))
    return deep_merge(base, top)


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


def workflow_config(given: dict, *, configfiles: Sequence[str | Path], default_configfile: str | Path,
                    cli_config: Mapping[str, Any]) -> tuple[dict, str]:
    """The config the workflow runs, before validation, and the name of its source.

    ``given`` is Snakemake's ``config``. Without ``--configfile`` it is merged onto the embedded
    default ``default_configfile``; a ``--configfile`` replaces the default instead (so a config's
    ``methods`` are exactly the ones it lists), and one that says ``extends: <file>`` is a set of
    changes to that file (:func:`resolve_extends`). The mapping and list values of ``--config
    KEY=VALUE`` (``cli_config``) are merged on top with their scalars typed (:func:`typed_override`).

    Raises:
        ConfigError: the default config file is missing, or an ``extends`` chain is broken.
    """
    config = dict(given)
    if not configfiles:
        path = Path(default_configfile)
        if not path.exists():
            raise ConfigError(f"no --configfile given and the default {path} does not exist "
                              f"(working directory {Path.cwd()}); run snakemake from the repository root")
        config = deep_merge(yaml.safe_load(path.read_text(encoding="utf-8")) or {}, config)
    elif "extends" in config:
        config = resolve_extends(config, configfiles[-1])
    # only mapping and list values went through the BaseLoader; top-level scalars keep Snakemake's type
    nested = {k: typed_override(v) for k, v in cli_config.items() if isinstance(v, (dict, list))}
    if nested:
        config = deep_merge(config, nested)
    return config, ", ".join(map(str, configfiles)) or str(default_configfile)


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
    """

    name: str
    recipe_name: str
    recipe: dict[str, Any]
    credit: str
    credit_options: dict[str, Any] = field(default_factory=dict)
    estimator: str = "grpo"
    label: str = ""
    takes_norm_by_std: bool = True

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
        return out


def _flatten_method(config: dict, name: str, source: str, seen: tuple[str, ...] = ()) -> dict:
    methods = config.get("methods") or {}
    if name not in methods:
        raise ConfigError(f"{source}: key methods.{name}: unknown method; defined: {sorted(methods)}")
    if name in seen:
        raise ConfigError(f"{source}: key methods.{name}: cycle in 'base' chain: {' -> '.join(seen + (name,))}")
    entry = dict(methods[name] or {})
    if "base" in entry:
        base = _flatten_method(config, entry.pop("base"), source, seen + (name,))
        base.pop("label", None)
        base.update(entry)
        return base
    return entry


def resolve_method(config: dict, name: str, *, source: str = "<config>") -> ResolvedMethod:
    """Flatten method ``name`` (following ``base``) into a :class:`ResolvedMethod`.

    A built-in credit is one of the schema's ``$defs.credit_options`` (its options listed there); any
    other is a user estimator, ``module:attr`` or an ``oar.estimators`` entry point, imported,
    checked and registered here (:func:`oar.credit.user.user_estimator`; its options are its keyword
    parameters). The estimator is looked up in the registry (:func:`oar.credit.get_estimator`), so a
    built-in estimator module that fails to import raises here, before any job runs. (In a process
    without torch, Snakemake's own under ``--use-conda``, nothing is imported: a user estimator's
    source is read instead, and the built-in modules are left to the jobs, where the first ``oar``
    command fails the same way.)

    Raises:
        ConfigError: unknown method/recipe/credit, a user estimator that cannot be loaded, or an
            override that neither the recipe nor the credit estimator accepts, or one of the wrong
            type, or a missing required option of a user estimator (naming ``methods.<name>.<key>``).
        ImportError: a built-in estimator module does not import (a broken installation).
    """
    sch = schema()
    flat = _flatten_method(config, name, source)
    recipe_name = flat.get("recipe", "grpo")
    recipes = config.get("recipes") or {}
    if recipe_name not in recipes:
        raise ConfigError(f"{source}: key methods.{name}.recipe: unknown recipe {recipe_name!r}; defined: {sorted(recipes)}")
    credit = flat.get("credit", "none")
    credit_schemas = sch["$defs"]["credit_options"]
    recipe_schema = sch["$defs"]["recipe"]
    user = None
    load = _credit_layer_here()
    if credit not in credit_schemas or credit == "description":
        user = _user_estimator(credit, f"{source}: key methods.{name}.credit", credit_schemas, load=load)
    credit_keys = set(credit_schemas[credit]["properties"]) if user is None else set(user.options or ())
    recipe = copy.deepcopy(recipes[recipe_name])
    _fill_defaults(recipe, recipe_schema)
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
            raise ConfigError(
                f"{source}: key methods.{name}.{key}: not an option of recipe {recipe_name!r} or credit {credit!r}; "
                f"allowed: {allowed}"
            )
    import jsonschema

    for obj, sub, what in ((recipe, recipe_schema, "recipe"), (credit_options, credit_schemas.get(credit), "credit")):
        if sub is None:  # a user estimator: its annotations
            continue
        errs = list(jsonschema.Draft202012Validator(sub).iter_errors(obj))
        if errs:
            e = errs[0]
            raise ConfigError(f"{source}: key methods.{name}.{_key_path(e)}: {e.message} ({what} setting)")
    if user is not None:
        for key, value in credit_options.items():
            why = user.type_error(key, value)
            if why is not None:
                raise ConfigError(f"{source}: key methods.{name}.{key}: {why}")
        missing = sorted(user.required - set(credit_options))
        if missing:
            raise ConfigError(
                f"{source}: key methods.{name}.credit: {credit!r} ({user.origin}) needs option(s) {missing} (keyword "
                f"parameters without a default); set them in methods.{name} or give them defaults")
    estimator = credit if credit != "none" else ("grpo" if recipe["norm_by_std"] else "drgrpo")
    if load:
        _check_registered(estimator, f"{source}: key methods.{name}.credit")
    # a control that reads a task's ground truth says so in the schema (x-task), checked before any work
    needs_task = (credit_schemas.get(credit) or {}).get("x-task") if user is None else None
    task_kind = (config.get("task") or {}).get("kind")
    if needs_task is not None and task_kind is not None and task_kind != needs_task:
        raise ConfigError(
            f"{source}: key methods.{name}.credit: {credit!r} is a control that reads the {needs_task} task's "
            f"ground truth; it cannot run with task.kind {task_kind!r}"
        )
    return ResolvedMethod(
        name=name,
        recipe_name=recipe_name,
        recipe=recipe,
        credit=credit,
        credit_options=credit_options,
        estimator=estimator,
        label=flat.get("label", name),
        takes_norm_by_std=user is None or user.takes("norm_by_std"),
    )


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


def resolve_methods(config: dict, *, source: str = "<config>") -> dict[str, ResolvedMethod]:
    """Resolve the methods the config runs: ``only_methods`` in its order, or every key of
    ``methods`` (fails on the first bad one).

    Raises:
        ConfigError: a name of ``only_methods`` is not a key of ``methods``, or an
            ``attribution.trained`` entry is not a run of the config.
    """
    methods = config.get("methods") or {}
    names = config.get("only_methods") or list(methods)
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise ConfigError(f"{source}: key only_methods: unknown method(s) {unknown}; defined: {sorted(methods)}")
    for i, t in enumerate((config.get("attribution") or {}).get("trained") or []):
        if t["method"] not in names or t["seed"] not in config.get("seeds", []):
            raise ConfigError(f"{source}: key attribution.trained[{i}]: {t['method']} seed {t['seed']} is not a run of "
                              f"this config (methods {names}, seeds {config.get('seeds')})")
    return {name: resolve_method(config, name, source=source) for name in names}


def write_resolved(config: Mapping[str, Any], path: str | Path, *, source: str) -> bool:
    """Write the resolved ``config`` (what every ``oar`` command of a workflow run reads) to ``path``,
    atomically and only when its content changed (so its mtime means something). Returns whether it
    wrote."""
    import json

    from oar.io import atomic_write_text

    text = (f"# resolved by the workflow from {source} (defaults filled, --config overrides applied)\n"
            + yaml.safe_dump(json.loads(json.dumps(dict(config))), sort_keys=False))
    path = Path(path)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    atomic_write_text(path, text)
    return True
