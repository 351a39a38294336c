"""Methods: a recipe (GRPO, Dr. GRPO, DAPO and their settings) and a token credit (a registered
estimator with its options), resolved by name with their chain of ``base`` methods, every option
checked against the recipe's and the credit's schema (:class:`ResolvedMethod`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from oar.config.source import ConfigError, ConfigSource, as_source, suggest
from oar.config.validate import fill_section_defaults, schema

if TYPE_CHECKING:
    from oar.credit.user import UserEstimator

__all__ = ["ResolvedMethod", "resolve_method", "resolve_methods", "RESERVED_METHOD_KEYS"]


#: Keys of a method entry that are not overrides.
RESERVED_METHOD_KEYS = ("base", "recipe", "credit", "label")


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
    src = as_source(source)
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
    fill_section_defaults(recipe, recipe_schema)
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
    src = as_source(source)
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
