"""No function of ``src/oar`` is longer than :data:`MAX_LINES` lines (issue 32).

A function's length is counted with ``ast`` from its ``def`` line to the last line of its body
(``end_lineno - lineno + 1``: signature, docstring and body; decorators not included), for every
function and method, nested ones included. A longer function is split into named, documented
helpers (its phases), not cut at an arbitrary line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src" / "oar"

#: The longest a function may be, in lines.
MAX_LINES = 80

#: Functions allowed over :data:`MAX_LINES`, by qualified name (module, then the enclosing classes
#: and functions). None: do not add to it, split the function instead.
EXEMPT: frozenset[str] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def function_lengths(source: str, module: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length in lines)`` of every function and method in the Python
    ``source`` of ``module``."""
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, name)
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}.{child.name}")
            else:
                walk(child, prefix)

    walk(ast.parse(source, filename=module), module)
    return out


def _all_lengths() -> list[tuple[Path, str, int, int]]:
    return [(path, name, line, n) for path in sorted(SRC.rglob("*.py"))
            for name, line, n in function_lengths(path.read_text(encoding="utf-8"), _module_name(path))]


def test_no_function_is_longer_than_max_lines():
    long = [f"{path.relative_to(ROOT)}:{line}: {name} has {n} lines"
            for path, name, line, n in _all_lengths() if n > MAX_LINES and name not in EXEMPT]
    assert not long, (f"functions over {MAX_LINES} lines (split them into named helpers, one per phase):\n"
                      + "\n".join(long))


def test_lengths_are_counted_from_def_to_the_end_of_the_body():
    source = ('@staticmethod\ndef f(\n    x,\n):\n    """Doc."""\n    return x\n\n\n'
              "class C:\n    def g(self):\n        def inner():\n            pass\n        return 1\n")
    assert function_lengths(source, "oar.m") == [("oar.m.f", 2, 5), ("oar.m.C.g", 10, 4), ("oar.m.C.g.inner", 11, 2)]



def test_nothing_is_exempt():
    """Every function of src/oar fits; the list is kept only to make an exemption a visible change."""
    assert not EXEMPT


#: Phrases that put a number measured on a machine into the code (a timing, a speed-up, a "measured
#: <value>"): such numbers live in the dated ledgers (benchmarks/README.md "Measured numbers",
#: docs/results/), where they say when and on what they were measured, and go stale in a docstring.
MEASURED = re.compile(r"measured (?:at |as |to be )?~?\d|\b\d+(?:\.\d+)? ?(?:ms|s/step|s per step|seconds per step)\b"
                      r"|\btook ~?\d|\b\d+(?:\.\d+)?x (?:faster|slower)\b")


def test_no_measured_numbers_in_the_code():
    """The package, its schema and gpu_check.py state no measured timings (the rule of issue 32)."""
    files = [*SRC.rglob("*.py"), *SRC.rglob("*.yaml"), ROOT / "benchmarks" / "gpu_check.py"]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MEASURED.search(line)]
    assert not hits, "measured numbers belong in benchmarks/README.md or docs/results/:\n" + "\n".join(hits)


def test_the_measured_numbers_pattern_finds_them():
    for text in ("(measured 5e-4 on the toy model)", "about 0.6 ms per item", "GRPO at 4.5 s/step",
                 "2 workers took 3.6 s", "1.7x faster"):
        assert MEASURED.search(text), text
    assert not MEASURED.search("a 2 x 4 batch; see benchmarks/README.md")


#: How each benchmark that trains reaches the library's training step (``oar.trainer.step``): through
#: ``oar.trainer.loop.train`` (which runs ``train_step``), ``oar train`` itself, or
#: ``train_step_on_batch`` on a batch it builds (gpu_check: the stock image lacks the reward's packages).
TRAINING_BENCHMARKS: dict[str, str] = {
    "bench_methods.py": "from oar.trainer.loop import train",
    "bench_trl.py": "from oar.trainer.loop import train",
    "bench_cell_step.py": '"oar.cli", "train"',
    "gpu_check.py": "train_step_on_batch",
}

#: Benchmarks that step an optimizer themselves, and why that is not a training step of their own.
OWN_OPTIMIZER_STEPS: dict[str, str] = {
    "bench_memory.py": "measures each phase of one update's memory against oar.plan's formulas, one phase "
                       "at a time (a probe between phases the library's step does not stop at)",
    "gpu_check.py": "its engine check moves the weights by a few plain steps to see the rollout engine's "
                    "weight sync follow; its training check runs the library's step",
}

_STEPS_ITSELF = re.compile(r"torch\.optim\.\w+\(|\.backward\(\)|\bopt(imizer)?\.step\(\)")


def test_the_benchmarks_train_through_the_librarys_step():
    """Every benchmark that trains reaches the library's step as :data:`TRAINING_BENCHMARKS` says, and
    only those of :data:`OWN_OPTIMIZER_STEPS` step an optimizer themselves (gpu_check's training
    check is proven to call the library's step in tests/test_gpu_check.py)."""
    sources = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    for name, marker in TRAINING_BENCHMARKS.items():
        assert marker in sources[name], (name, marker)
    stepping = {name for name, text in sources.items() if _STEPS_ITSELF.search(text)}
    assert stepping == set(OWN_OPTIMIZER_STEPS), stepping
    assert _STEPS_ITSELF.search("opt = torch.optim.AdamW(model.parameters())\nloss.backward()")
