"""The package's layers point down only, no two packages import each other (not even through others),
no module imports another module's private name, and the package stays readable: at most 6 modules at
the top of ``src/oar`` beside the packages, no module over 500 lines, no function over 80.

Every import of ``src/oar`` (module level and inside functions, read from the source with ``ast``)
is checked against the layer of the importing and the imported package: an import from a higher
layer fails. Layers, bottom to top (a package may import its own layer and those below; there are no
exemptions):

0. core: atomic files (io), seeds, the markdown table writer, statistics, provenance, the untruncated
   flatten, the device a job runs on, the problems a check reports
1. task, data, models (loading, fetch, packing), reward (answer, verification, the pool)
2. credit (the estimators and their registry), rollout (the engines)
3. config (loading, overrides, method resolution, typed settings, identity, the results tree)
4. plan (the memory plan), tracking (MLflow, stage runs)
5. evaluate (benchmarks, the held-out evaluation, prompt checks)
6. trainer (the loop and its phases, setup, end, batch, update, loss, optim, checkpoint, preemption,
   the parallel strategy, run folders, SFT, the verifier's training)
7. attribution, integrations (oar's estimators inside verl and TRL)
8. pipeline (what the workflow calls: the results store's links, launch, pre-flight, the data stage)
9. report (tables, figures, learning curves, the regime map)
10. cli
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src" / "oar"

LAYERS: dict[str, int] = {
    "core": 0,
    **dict.fromkeys(["task", "data", "models", "reward"], 1),
    **dict.fromkeys(["credit", "rollout"], 2),
    "config": 3,
    **dict.fromkeys(["plan", "tracking"], 4),
    "evaluate": 5,
    "trainer": 6,
    **dict.fromkeys(["attribution", "integrations"], 7),
    "pipeline": 8,
    "report": 9,
    "cli": 10,
}
#: The most modules the top of ``src/oar`` may hold beside the packages, and the size limits.
MAX_TOP_MODULES, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 6, 500, 80


def _top(module: str) -> str:
    """``oar.credit.importance.oar_g`` -> ``credit``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every ``oar`` import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("oar"):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("oar.")]
    return out


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "egg-info" not in str(p))


def test_every_module_has_a_layer():
    tops = {_top(_module_name(p)) for p in _files()} - {""}
    assert tops <= set(LAYERS), f"modules without a layer in tests/test_layers.py: {sorted(tops - set(LAYERS))}"


def test_imports_point_down_only():
    upward = []
    for path in _files():
        here = _module_name(path)
        if not _top(here):
            continue
        for line, module, _ in _imports(path):
            there = _top(module)
            if there and LAYERS[there] > LAYERS[_top(here)]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {here} (layer {LAYERS[_top(here)]}) imports "
                              f"{module} (layer {LAYERS[there]})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_module_imports_another_modules_private_name():
    private = []
    for path in _files():
        here = _module_name(path)
        for line, module, names in _imports(path):
            if module == here:
                continue
            bad = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if bad or any(part.startswith("_") and not part.startswith("__") for part in module.split(".")):
                private.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {', '.join(bad) or '...'}")
    assert not private, "imports of another module's private name:\n" + "\n".join(private)


def _package_edges() -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package: ["file:line", ...]}}`` between different top-level packages."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _files():
        here = _top(_module_name(path))
        for line, module, _ in _imports(path):
            there = _top(module)
            if here and there and there != here:
                edges[here][there].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def test_no_two_packages_import_each_other():
    """No loop between packages, also within one layer (a loop through several is found too)."""
    edges = _package_edges()
    loops = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in edges.get(node, {}):
            if nxt == start:
                loops.append(" -> ".join(path + [start]))
            elif nxt not in path and nxt > start:  # each loop once, from its smallest name
                walk(start, nxt, path + [nxt])

    for pkg in sorted(edges):
        walk(pkg, pkg, [pkg])
    assert not loops, "loops between packages:\n" + "\n".join(
        f"{loop}: " + "; ".join(edges[a][b][0] for a, b in zip(loop.split(" -> "), loop.split(" -> ")[1:]))
        for loop in loops)


def test_the_top_of_the_package_stays_small():
    tops = sorted(p.name for p in SRC.glob("*.py"))
    assert len(tops) <= MAX_TOP_MODULES, f"{len(tops)} modules at the top of src/oar (at most {MAX_TOP_MODULES}): {tops}"


def test_no_module_or_function_is_too_long():
    long_modules, long_functions = [], []
    for path in _files():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long_modules + long_functions, (
        f"modules over {MAX_MODULE_LINES} lines, functions over {MAX_FUNCTION_LINES}:\n" + "\n".join(long_modules + long_functions))
