"""Estimators from the user's own code, named by a method's ``credit``.

Two forms besides the built-in names of ``$defs.credit_options`` in the schema:

- ``credit: mypkg.credit:my_fn``: the attribute ``my_fn`` of the module ``mypkg.credit``, importable
  from ``sys.path`` (``PYTHONPATH``) or the current working directory (appended to ``sys.path`` when
  it is not on it: the ``oar`` console script and Snakemake do not put it there, ``python -m`` does);
- ``credit: my_credit``: an entry point of the group :data:`ENTRY_POINT_GROUP` (``oar.estimators``)
  of an installed distribution, e.g. in its ``pyproject.toml``
  ``[project.entry-points."oar.estimators"] my_credit = "mypkg.credit:my_fn"``.

The function is an estimator like the built-in ones, ``fn(batch: CreditBatch, *, opt=default, ...)
-> CreditResult`` with ``(B, T)`` token advantages (:mod:`oar.credit`). Its options are its keyword
parameters after the batch: a config may set exactly those (a parameter without a default must be
set), with the type of a ``bool`` / ``int`` / ``float`` / ``str`` annotation checked; a function that
takes ``**options`` accepts any option that is not a recipe key. The recipe's ``norm_by_std`` is
passed only when the function takes it. :func:`user_estimator` loads, checks and registers it under
the config's name, when the config is resolved (:func:`oar.config.resolve_method`) and again in any
process that asks :func:`oar.credit.get_estimator` for that name (a training job).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import traceback
import typing
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

from oar.credit import CreditResult, _register, estimator_flags

__all__ = [
    "ENTRY_POINT_GROUP",
    "EstimatorSpecError",
    "UnknownEstimatorError",
    "UserEstimator",
    "is_reference",
    "user_estimator",
]

#: The entry point group of estimators installed by other distributions.
ENTRY_POINT_GROUP = "oar.estimators"

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_REFERENCE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")
_SIMPLE_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


class EstimatorSpecError(ValueError):
    """A user estimator that cannot be used; the one-line message says why and what to do
    (:func:`oar.config.resolve_method` prefixes the config key)."""


class UnknownEstimatorError(EstimatorSpecError):
    """The name is neither ``module:attr`` nor an entry point of :data:`ENTRY_POINT_GROUP`."""


@dataclass(frozen=True)
class UserEstimator:
    """A user estimator, loaded and registered.

    Attributes:
        name: the config's ``credit`` (``module:attr`` or the entry point's name), its registry name.
        fn: the function, ``fn(batch, **options) -> CreditResult``.
        origin: where it was found (the module's file), for messages.
        options: the keyword options it takes, or None when it takes ``**options`` (any option).
        required: the options without a default (a config must set them).
        types: the options annotated ``bool`` / ``int`` / ``float`` / ``str``, with that type.
    """

    name: str
    fn: Callable[..., CreditResult]
    origin: str
    options: frozenset[str] | None
    required: frozenset[str] = frozenset()
    types: Mapping[str, type] = field(default_factory=dict)

    def takes(self, option: str) -> bool:
        """Whether the function takes the keyword ``option`` (by name or through ``**options``)."""
        return self.options is None or option in self.options

    def type_error(self, option: str, value: Any) -> str | None:
        """Why ``value`` does not fit the annotation of ``option`` (None when it fits or is not
        annotated with a simple type); a bool is not an int, an int is a float."""
        tp = self.types.get(option)
        if tp is None:
            return None
        if tp is bool or tp is str:
            ok = isinstance(value, tp)
        else:  # int, float
            ok = isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool)
        return None if ok else f"{value!r} is not of type {_SIMPLE_TYPES[tp]!r} (annotation of {self.name})"


def is_reference(name: str) -> bool:
    """Whether ``name`` is of the ``module:attr`` form (rather than a registered or entry point name)."""
    return ":" in name


def user_estimator(name: str) -> UserEstimator:
    """Load the estimator ``name`` (``module:attr``, or an entry point of :data:`ENTRY_POINT_GROUP`),
    check that it is a callable taking the batch first, register it as ``name`` (with the
    ``needs_model`` / ``needs_continuations`` flags of :func:`oar.credit.register_estimator` if it
    was decorated with it) and return it with its options.

    Raises:
        UnknownEstimatorError: ``name`` has no ``:`` and no entry point has that name.
        EstimatorSpecError: a malformed reference, a module that does not import, a missing or
            non-callable attribute, or a signature that cannot take the batch and config options.
    """
    if is_reference(name):
        m = _REFERENCE.match(name)
        if m is None:
            raise EstimatorSpecError(
                f"{name!r} is not a reference of the form module:function (dotted Python names, e.g. "
                "mypkg.credit:my_fn)")
        module_name, attr = m.group(1), m.group(2)
    else:
        ep = _entry_point(name)
        if ep is None:
            raise UnknownEstimatorError(f"no estimator {name!r}")
        m = _REFERENCE.match(ep.value.replace(" ", ""))
        if m is None:
            raise EstimatorSpecError(f"entry point {name!r} of group {ENTRY_POINT_GROUP!r} is {ep.value!r}, "
                                     "not module:function; fix the distribution that declares it")
        module_name, attr = m.group(1), m.group(2)
    module = _import(module_name, name)
    origin = getattr(module, "__file__", None) or module_name
    fn: Any = module
    for i, part in enumerate(attr.split(".")):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            where = ".".join([module_name, *attr.split(".")[:i]])
            defined = sorted(k for k, v in vars(module).items()
                             if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_"))
            raise EstimatorSpecError(
                f"{where!r} ({origin}) has no attribute {part!r}; define it there or fix the name after ':' "
                f"(functions defined in the module: {defined[:10]})") from None
    if not callable(fn):
        raise EstimatorSpecError(f"{name!r} ({origin}) is a {type(fn).__name__}, not a function; name an estimator "
                                 "fn(batch, *, option=default, ...) -> CreditResult")
    est = _inspect(name, fn, origin)
    needs_model, needs_continuations = estimator_flags(fn)
    _register(name, fn, needs_model=needs_model, needs_continuations=needs_continuations)
    return est


def _entry_point(name: str) -> Any:
    """The entry point ``name`` of :data:`ENTRY_POINT_GROUP`, or None."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
    return found[0] if found else None


def _import(module_name: str, name: str) -> ModuleType:
    """Import ``module_name`` with the working directory on ``sys.path`` (appended, so it shadows
    nothing); an import error becomes one :class:`EstimatorSpecError` line."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EstimatorSpecError(
                f"cannot import module {module_name!r} of {name!r} (no module named {e.name!r} on sys.path or in "
                f"the working directory {cwd}); put the folder that holds it on PYTHONPATH or run from it"
            ) from None
        raise EstimatorSpecError(_import_failure(module_name, e)) from None
    except Exception as e:  # the user's module raised while importing: one line, where it raised
        raise EstimatorSpecError(_import_failure(module_name, e)) from None


def _import_failure(module_name: str, e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        where = f"{e.filename}:{e.lineno}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else module_name
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"importing module {module_name!r} failed: {type(e).__name__}: {msg} (at {where}); fix the module"


def _inspect(name: str, fn: Callable[..., Any], origin: str) -> UserEstimator:
    """The options of ``fn`` from its signature (see the module docstring)."""
    usage = "an estimator is fn(batch, *, option=default, ...) -> CreditResult"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): any option
        return UserEstimator(name=name, fn=fn, origin=origin, options=None)
    P = inspect.Parameter
    if not params or params[0].kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL):
        raise EstimatorSpecError(f"{name!r} ({origin}) takes no positional batch argument; {usage}")
    rest = params[1:] if params[0].kind is not P.VAR_POSITIONAL else params
    options: set[str] | None = set()
    required: set[str] = set()
    for p in rest:
        if p.kind is P.VAR_KEYWORD:
            options = None
        elif p.kind is P.VAR_POSITIONAL:
            continue
        elif p.kind is P.POSITIONAL_ONLY:
            if p.default is P.empty:
                raise EstimatorSpecError(f"{name!r} ({origin}): parameter {p.name!r} is positional-only without "
                                         f"a default, so no config can set it; make it keyword-only; {usage}")
        else:
            if options is not None:
                options.add(p.name)
            if p.default is P.empty:
                required.add(p.name)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: no type checks
        hints = {}
    types = {k: v for k, v in hints.items() if v in _SIMPLE_TYPES and k != "return"
             and any(p.name == k for p in rest)}
    return UserEstimator(name=name, fn=fn, origin=origin, options=None if options is None else frozenset(options),
                         required=frozenset(required), types=types)
