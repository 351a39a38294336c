"""The package's layers point down only, and no module imports another module's private name.

Every import of ``src/oar`` (module level and inside functions, read from the source with ``ast``)
is checked against the layer of the importing and the imported module: an import from a higher
layer fails. Layers, bottom to top (a module may import its own layer and those below):

0. foundations: io, answer, stats, preemption, tracking, provenance, seeds, markdown (the table writer),
   optim (the schedule and weight-decay groups SFT, RL and the step verifier share)
1. data and task: data, task, models, fetch, packing, reward
2. credit: credit
3. configuration: config, preflight, identity (what identifies each result: fingerprints, store keys)
4. training and measuring: rollout, loss, strategy, runs, evaluate, heldout, sft, train (with run_setup, batch, update,
   checkpoint, run_end), attribution,
   plan, launch, layout, stage_runs (the MLflow runs of every stage; the report's is oar.report.logged),
   integrations (oar's estimators inside verl and TRL), manifest and data_checks (the data stage, oar data)
5. reports: report, learning_curves, regimes
6. the command line: cli
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src" / "oar"

LAYERS: dict[str, int] = {
    **dict.fromkeys(["io", "answer", "stats", "preemption", "tracking", "provenance", "seeds", "markdown", "optim"], 0),
    **dict.fromkeys(["data", "task", "models", "fetch", "packing", "reward"], 1),
    "credit": 2,
    **dict.fromkeys(["config", "preflight", "identity"], 3),
    **dict.fromkeys(["rollout", "loss", "strategy", "runs", "evaluate", "heldout", "sft", "train", "run_setup", "batch", "update", "checkpoint",
                     "run_end", "attribution",
                     "plan", "launch", "layout", "stage_runs", "integrations", "manifest", "data_checks"], 4),
    **dict.fromkeys(["report", "learning_curves", "regimes"], 5),
    "cli": 6,
}


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
