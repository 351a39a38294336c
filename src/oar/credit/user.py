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
the config's name, when the config is resolved (:func:`oar.config.methods.resolve_method`) and again in any
process that asks :func:`oar.credit.get_estimator` for that name (a training job). A process without
torch (Snakemake's own, under ``--use-conda``) cannot import an estimator; there the module is found
and its source read instead (``load=False``): the same checks, short of running the module. This
module and :mod:`oar.credit`'s registry import without torch.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import re
import sys
import traceback
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

from oar.credit import CreditResult, register_spec, spec_of

__all__ = [
    "ENTRY_POINT_GROUP",
    "EstimatorSource",
    "estimator_source",
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
    (:func:`oar.config.methods.resolve_method` prefixes the config key)."""


class UnknownEstimatorError(EstimatorSpecError):
    """The name is neither ``module:attr`` nor an entry point of :data:`ENTRY_POINT_GROUP`."""


@dataclass(frozen=True)
class UserEstimator:
    """A user estimator: loaded and registered, or (without torch) read from its source.

    Attributes:
        name: the config's ``credit`` (``module:attr`` or the entry point's name), its registry name.
        fn: the function, ``fn(batch, **options) -> CreditResult``; None when only its source was
            read (``user_estimator(name, load=False)``).
        origin: where it was found (the module's file), for messages.
        options: the keyword options it takes, or None for any option (it takes ``**options``, or
            its source binds it otherwise than by ``def``).
        required: the options without a default (a config must set them).
        types: the options annotated ``bool`` / ``int`` / ``float`` / ``str``, with that type.
        source: its source files and their hash (:func:`estimator_source`); None when it has no
            ``.py`` source.
    """

    name: str
    fn: Callable[..., CreditResult] | None
    origin: str
    options: frozenset[str] | None
    required: frozenset[str] = frozenset()
    types: Mapping[str, type] = field(default_factory=dict)
    source: "EstimatorSource | None" = None

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
        return None if ok else (f"{value!r} is not of type {_SIMPLE_TYPES[tp]!r} (annotated {tp.__name__} in "
                                f"{self.name})")


@dataclass(frozen=True)
class EstimatorSource:
    """The source of a user estimator, which is part of the identity of every run that uses it
    (:func:`oar.config.identity.method_fingerprint`): an edit of any of ``files`` gives another ``sha256``,
    another store key, and the workflow retrains exactly those runs.

    Attributes:
        name: the config's ``credit``.
        root: the folder the files are relative to (the one that holds the estimator's top-level
            module or package).
        files: the estimator's module first, then every module of the user's tree it imports,
            directly or through another (paths relative to ``root``, sorted after the first).
        sha256: the first 16 hex digits of the SHA-256 over ``(path, content)`` of every file.
        git: each file's git state (:func:`oar.core.provenance.path_git_state`: clean, modified,
            untracked, or None outside a checkout).
    """

    name: str
    root: str
    files: tuple[str, ...]
    sha256: str
    git: Mapping[str, str | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "root": self.root, "files": list(self.files), "sha256": self.sha256,
                "git": dict(self.git)}

    def paths(self) -> list[Path]:
        return [Path(self.root) / f for f in self.files]


def _module_spec(module_name: str) -> tuple[Any, str]:
    """The import spec of ``module_name`` found by the import system's finders without running any
    module (a package's ``__init__`` is not run), and the dotted name that was not found (when the
    spec is None)."""
    parts = module_name.split(".")
    path: Any = None
    spec: Any = None
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        if i and path is None:  # the parent is a module, not a package
            return None, full
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        if spec is None:
            try:
                spec = next((s for f in sys.meta_path if hasattr(f, "find_spec")
                             for s in [f.find_spec(full, path)] if s is not None), None)
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            return None, full
        path = spec.submodule_search_locations
    return spec, ""


def _py_origin(spec: Any) -> Path | None:
    origin = getattr(spec, "origin", None)
    return Path(origin).resolve() if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def _not_users(path: Path) -> bool:
    """A file of the installed software (the interpreter's prefixes, site-packages) or of oar itself
    (covered by the commit and dirty state of :mod:`oar.core.provenance`), not of the user's tree."""
    import oar

    text = str(path)
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(oar.__file__).resolve().parent)}
    return "site-packages" in path.parts or "dist-packages" in path.parts or any(
        text.startswith(str(Path(p).resolve()) + os.sep) for p in prefixes if p)


def _imported_names(tree: ast.AST, module_name: str, is_package: bool) -> list[str]:
    """The absolute names of the modules a module's source imports (relative imports resolved; for
    ``from x import y`` both ``x`` and ``x.y``, as ``y`` may be a submodule)."""
    package = module_name if is_package else module_name.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)] if node.level > 1 else base_parts
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                out.append(base)
            out += [f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*"]
    return out


def estimator_source(name: str, module_name: str) -> EstimatorSource | None:
    """The source of the user estimator ``name`` in ``module_name`` (:class:`EstimatorSource`): the
    module's file and, followed through their imports without running them, every module of the
    user's tree (files under the folder that holds the top-level module or package, outside the
    installed software and oar) it imports. None when the module has no ``.py`` source."""
    import hashlib

    from oar.core.provenance import path_git_state

    _cwd_on_path()
    spec, _ = _module_spec(module_name)
    first = _py_origin(spec) if spec is not None else None
    if first is None:
        return None
    depth = module_name.count(".") + (1 if first.name == "__init__.py" else 0)
    root = first.parents[depth]
    seen: dict[Path, None] = {}
    todo = [(module_name, first)]
    while todo:
        mod, path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for imported in _imported_names(tree, mod, path.name == "__init__.py"):
            sub, _ = _module_spec(imported)
            file = _py_origin(sub) if sub is not None else None
            if file is not None and file not in seen and root in file.parents and not _not_users(file):
                todo.append((imported, file))
    files = [first] + sorted(p for p in seen if p != first)
    digest = hashlib.sha256()
    for f in files:
        rel = f.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    rels = tuple(f.relative_to(root).as_posix() for f in files)
    return EstimatorSource(name=name, root=str(root), files=rels, sha256=digest.hexdigest()[:16],
                           git={r: path_git_state(f) for r, f in zip(rels, files)})


def is_reference(name: str) -> bool:
    """Whether ``name`` is of the ``module:attr`` form (rather than a registered or entry point name)."""
    return ":" in name


def user_estimator(name: str, *, load: bool = True) -> UserEstimator:
    """The estimator ``name`` (``module:attr``, or an entry point of :data:`ENTRY_POINT_GROUP`) and
    its options.

    With ``load`` (a process that has the credit layer's software, torch): import the module, check
    that the attribute is a callable taking the batch first, register it as ``name`` (with the
    ``needs_model`` / ``needs_continuations`` flags of :func:`oar.credit.register_estimator` if it
    was decorated with it). Without (Snakemake's own process under ``--use-conda``, which has no
    torch): find the module's file without running it and read the function's signature from its
    source (:func:`_read`); a name the source binds otherwise than by ``def`` is left to the jobs,
    which load it.

    Raises:
        UnknownEstimatorError: ``name`` has no ``:`` and no entry point has that name.
        EstimatorSpecError: a malformed reference, a module that does not import (or cannot be
            found / parsed), a missing or non-callable attribute, or a signature that cannot take
            the batch and the config's options.
    """
    module_name, attr = _split(name)
    if not load:
        return _read(name, module_name, attr)
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
            raise EstimatorSpecError(_no_attribute(where, origin, part, defined)) from None
    if not callable(fn):
        raise EstimatorSpecError(f"{name!r} ({origin}) is a {type(fn).__name__}, not a function; name an estimator "
                                 f"{_USAGE}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): any option
        params = None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: no type checks
        hints = {}
    est = dataclasses.replace(_options(name, origin, params, hints, fn), source=estimator_source(name, module_name))
    register_spec(name, spec_of(fn))
    return est


_USAGE = "fn(batch, *, option=default, ...) -> CreditResult"


def _split(name: str) -> tuple[str, str]:
    """``(module, attr)`` of ``name``: the reference itself, or the entry point's value."""
    if is_reference(name):
        m = _REFERENCE.match(name)
        if m is None:
            raise EstimatorSpecError(
                f"{name!r} is not a reference of the form module:function (dotted Python names, e.g. "
                "mypkg.credit:my_fn)")
        return m.group(1), m.group(2)
    ep = _entry_point(name)
    if ep is None:
        raise UnknownEstimatorError(f"no estimator {name!r}")
    m = _REFERENCE.match(ep.value.replace(" ", ""))
    if m is None:
        raise EstimatorSpecError(f"entry point {name!r} of group {ENTRY_POINT_GROUP!r} is {ep.value!r}, "
                                 "not module:function; fix the distribution that declares it")
    return m.group(1), m.group(2)


def _no_attribute(where: str, origin: str, part: str, defined: list[str]) -> str:
    return (f"{where!r} ({origin}) has no attribute {part!r}; define it there or fix the name after ':' "
            f"(functions defined in the module: {defined[:10]})")


def _entry_point(name: str) -> Any:
    """The entry point ``name`` of :data:`ENTRY_POINT_GROUP`, or None."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
    return found[0] if found else None


def _cwd_on_path() -> str:
    """Append the working directory to ``sys.path`` (so it shadows nothing) unless it is there; return it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return cwd


def _not_found(module_name: str, missing: str, name: str, cwd: str) -> str:
    return (f"cannot import module {module_name!r} of {name!r} (no module named {missing!r} on sys.path or in "
            f"the working directory {cwd}); put the folder that holds it on PYTHONPATH or run from it")


def _import(module_name: str, name: str) -> ModuleType:
    """Import ``module_name`` with the working directory on ``sys.path``; an import error becomes one
    :class:`EstimatorSpecError` line."""
    cwd = _cwd_on_path()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EstimatorSpecError(_not_found(module_name, e.name, name, cwd)) from None
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


def _read(name: str, module_name: str, attr: str) -> UserEstimator:
    """:func:`user_estimator` without running the user's code: the module's spec found by the import
    system's finders (a package's ``__init__`` is not run), its source parsed, the top-level ``def``
    of ``attr`` read. A module without a ``.py`` source, a dotted ``attr``, or a name bound by an
    import, an assignment or a class takes any option here (the jobs load it and check)."""
    cwd = _cwd_on_path()
    spec, missing = _module_spec(module_name)
    if spec is None:
        raise EstimatorSpecError(_not_found(module_name, missing, name, cwd))
    origin = spec.origin if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin) else None
    source = estimator_source(name, module_name) if origin else None
    unchecked = UserEstimator(name=name, fn=None, origin=origin or module_name, options=None, source=source)
    if origin is None or "." in attr:
        return unchecked
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
    except SyntaxError as e:
        raise EstimatorSpecError(_import_failure(module_name, e)) from None
    node, defined = _top_level_binding(tree.body, attr)
    if node is None:
        if "*" in defined or "__getattr__" in defined:
            return unchecked
        raise EstimatorSpecError(_no_attribute(module_name, origin, attr, sorted(
            k for k, v in defined.items() if isinstance(v, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not k.startswith("_"))))
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return unchecked
    params, hints = _ast_parameters(node.args)
    return dataclasses.replace(_options(name, origin, params, hints, None), source=source)


def _top_level_binding(body: list[ast.stmt], attr: str) -> tuple[ast.stmt | None, dict[str, ast.stmt]]:
    """The last statement of a module's top level (``if`` / ``try`` / ``with`` blocks included) that
    binds ``attr``, and every name bound there (``*`` for a star import) with its statement."""
    bound: dict[str, ast.stmt] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound[st.name] = st
            elif isinstance(st, (ast.Import, ast.ImportFrom)):
                for a in st.names:
                    bound[a.asname or a.name.split(".")[0]] = st
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            bound[n.id] = st
            for block in ("body", "orelse", "finalbody"):
                if isinstance(st, (ast.If, ast.Try, ast.With, ast.For, ast.While)) and hasattr(st, block):
                    visit(getattr(st, block))
            for h in getattr(st, "handlers", []) if isinstance(st, ast.Try) else []:
                visit(h.body)

    visit(body)
    return bound.get(attr), bound


_PRESENT = object()  # a default that is there (its value is not read)


def _ast_parameters(a: ast.arguments) -> tuple[list[inspect.Parameter], dict[str, type]]:
    """The parameters of a ``def`` from its source, as :func:`inspect.signature` gives them (defaults
    present or not), and the options annotated with a plain ``bool`` / ``int`` / ``float`` / ``str``."""
    P = inspect.Parameter
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=_PRESENT if i >= first_default else P.empty) for i, arg in enumerate(positional)]
    if a.vararg is not None:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _PRESENT)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg is not None:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    by_name = {k.__name__: k for k in _SIMPLE_TYPES}
    hints: dict[str, type] = {}
    for arg in [*positional, *a.kwonlyargs]:
        ann = arg.annotation
        text = ann.id if isinstance(ann, ast.Name) else ann.value if isinstance(ann, ast.Constant) else None
        if isinstance(text, str) and text in by_name:
            hints[arg.arg] = by_name[text]
    return params, hints


def _options(name: str, origin: str, params: list[inspect.Parameter] | None, hints: Mapping[str, Any],
             fn: Callable[..., CreditResult] | None) -> UserEstimator:
    """The options of an estimator with parameters ``params`` (None: unknown, any option) and type
    hints ``hints`` (see the module docstring)."""
    if params is None:
        return UserEstimator(name=name, fn=fn, origin=origin, options=None)
    P = inspect.Parameter
    if not params or params[0].kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL):
        raise EstimatorSpecError(f"{name!r} ({origin}) takes no positional batch argument; an estimator is {_USAGE}")
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
                                         f"a default, so no config can set it; make it keyword-only: {_USAGE}")
        else:
            if options is not None:
                options.add(p.name)
            if p.default is P.empty:
                required.add(p.name)
    names = {p.name for p in rest}
    types = {k: v for k, v in hints.items() if k in names and v in _SIMPLE_TYPES}
    return UserEstimator(name=name, fn=fn, origin=origin, options=None if options is None else frozenset(options),
                         required=frozenset(required), types=types)
