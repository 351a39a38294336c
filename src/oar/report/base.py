"""What the report's modules share: the row and metric names, the ``report`` config defaults,
:class:`ReportError`, :class:`RunScores`, and where a config's results lie.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from oar.config.tree import BASE_ROW, EVAL_FOLDER, TRANSFER_FOLDER, ResultsTree
from oar.config.validate import section_defaults

__all__ = ["BASE_ROW", "EVAL_FOLDER", "TRANSFER_FOLDER", "METRICS", "REPORT_DEFAULTS", "ReportError", "RunScores",
           "per_seed_values", "transfer_rows"]

#: Per-problem scores a table can show (see the module docstring).
METRICS = ("pass@1", "avg@k", "pass@k")
#: Defaults of the config's ``report`` section (the schema fills them in a validated config).
#: The schema's defaults of the ``report`` section (for configs that are not validated).
REPORT_DEFAULTS = section_defaults("report")


class ReportError(FileNotFoundError):
    """A missing or inconsistent piece of the results tree; the message names the file(s)."""


@dataclass
class RunScores:
    """Per-problem scores of one table row on one benchmark.

    Attributes:
        ids: problem ids, shape ``(n,)``, sorted.
        scores: ``(n_seeds, n)`` array of per-problem scores in [0, 1].
        seeds: the seeds of the rows of ``scores`` (``[None]`` for the base row).
        files: the files read.
    """

    ids: list[str]
    scores: np.ndarray
    seeds: list[int | None]
    files: list[Path] = field(default_factory=list)


# --------------------------------------------------------------------------------------- loading
def results_root(config: Mapping[str, Any], results: str | Path | None) -> Path:
    return Path(results) if results is not None else Path(config["results_dir"]) / config["name"]


def rows_of(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(row name, label)``: base first, then every method in config order."""
    from oar.config.methods import resolve_methods

    methods = resolve_methods(dict(config))
    return [(BASE_ROW, "Base")] + [(name, m.label or name) for name, m in methods.items()]


def transfer_rows(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(row name, label)`` of the transfer table: base first, then ``eval.transfer.methods`` in their order."""
    labels = dict(rows_of(config))
    return [(BASE_ROW, labels[BASE_ROW])] + [(m, labels[m]) for m in config["eval"]["transfer"]["methods"]]


def eval_dirs(root: Path, row: str, seeds: Sequence[int], *, folder: str = EVAL_FOLDER) -> dict[int | None, Path]:
    """The evaluation folders of ``row`` (one per seed; one, keyed None, for the base row): the main
    evaluation's, or ``folder`` (:data:`TRANSFER_FOLDER`: the transfer evaluation's)."""
    tree = ResultsTree.at(root)
    if row == BASE_ROW:
        return {None: Path(tree.eval_dir(BASE_ROW, folder=folder))}
    return {s: Path(tree.eval_dir(row, s, folder=folder)) for s in seeds}


def require_files(paths: Sequence[Path]) -> None:
    gone = [str(p) for p in paths if not Path(p).exists()]
    if gone:
        more = f" (and {len(gone) - 10} more)" if len(gone) > 10 else ""
        raise ReportError(f"missing result file(s): {', '.join(gone[:10])}{more}; run the workflow first")


def report_option(config: Mapping[str, Any], key: str, value: Any) -> Any:
    return (config.get("report") or {}).get(key, REPORT_DEFAULTS[key]) if value is None else value


def per_seed_values(joined: Any) -> list[float]:
    """A table's ";"-joined per-seed column (``per_seed``, ``diff_per_seed``, ...) as floats; empty for
    a missing value (NaN or ""). One seed's column holds a bare number, which pandas reads as one."""
    if isinstance(joined, (int, float)) and not isinstance(joined, bool):
        return [] if math.isnan(joined) else [float(joined)]
    if not isinstance(joined, str) or not joined:
        return []
    return [float(v) for v in joined.split(";")]
