"""The metrics each stage's MLflow run holds: evaluation scores (in percent, as every table shows
them), SFT's curves, the attribution benchmark's and the report's tables, under keys MLflow accepts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["EVAL_SCORES", "EVAL_EXTRAS", "PERCENT_KEYS", "ATTRIBUTION_TABLES", "metric_key", "eval_metrics", "sft_metrics", "attribution_metrics", "report_metrics_of"]


#: The scores of an evaluation (keys of each benchmark in ``summary.json``), logged onto the
#: training run too.
EVAL_SCORES: tuple[str, ...] = ("pass@1", "avg@k", "pass@k")
#: Further numbers of a benchmark's summary, logged on the evaluation's own run only.
EVAL_EXTRAS: tuple[str, ...] = ("answered", "mean_response_tokens", "n", "seconds")
#: The shares an evaluation logs in percent (the tables' unit), not as the summary's fraction.
PERCENT_KEYS: tuple[str, ...] = ("pass@1", "avg@k", "pass@k", "answered")
#: The attribution benchmark's tables: file stem -> the columns that name a row (the others,
#: where numeric, are metrics ``attribution/<stem>/<key columns>/<column>``).
ATTRIBUTION_TABLES: dict[str, tuple[str, ...]] = {
    "localisation": ("signal", "kind"),
    "fidelity": ("signal",),
    "stability": ("signal", "kind", "comparison"),
    "cost": ("signal",),
}
#: Columns of ``main.csv`` logged by the report run, per (metric, row, benchmark).
_REPORT_COLUMNS: tuple[str, ...] = ("mean", "std", "diff", "ci_low", "ci_high", "start_diff", "mde")
_BAD_METRIC_CHARS = re.compile(r"[^\w.\- /]")


def metric_key(*parts: Any) -> str:
    """An MLflow metric name from ``parts`` joined by ``/``: ``@`` becomes ``_at_`` and any other
    character MLflow refuses becomes ``_`` (``metric_key("eval", "gsm8k", "avg@k") ==
    "eval/gsm8k/avg_at_k"``)."""
    return "/".join(_BAD_METRIC_CHARS.sub("_", str(p).replace("@", "_at_")) for p in parts)


def as_number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def eval_metrics(summary: Mapping[str, Any], keys: Sequence[str] = EVAL_SCORES, prefix: str = "eval") -> dict[str, float]:
    """``{"eval/<benchmark>/<key>": value}`` for each benchmark of an evaluation ``summary``
    (``summary.json``) and ``eval/average/<key>`` for its average; the shares of
    :data:`PERCENT_KEYS` in percent, as every table shows them (the file holds them in [0, 1]);
    ``prefix`` in place of ``eval`` (``transfer`` for the transfer evaluation)."""
    out: dict[str, float] = {}

    def value(k: str, v: Any) -> float | None:
        x = as_number(v)
        return None if x is None else (100.0 * x if k in PERCENT_KEYS else x)

    for bench, r in (summary.get("benchmarks") or {}).items():
        for k in keys:
            v = value(k, r.get(k))
            if v is not None:
                out[metric_key(prefix, bench, k)] = v
    for k, v in (summary.get("average") or {}).items():
        if k in keys and value(k, v) is not None:
            out[metric_key(prefix, "average", k)] = value(k, v)
    return out


def sft_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The SFT's final numbers from ``sft_summary.json``: ``sft/accuracy_<split>``,
    ``sft/extracted_<split>``, and the numbers of its ``sft`` part (``sft/final_loss``,
    ``sft/final_loss_mean10``, ``sft/steps_per_s``, ...), and ``sft/seconds``."""
    out: dict[str, float] = {}
    for part in ("accuracy", "extracted"):
        for split, v in (summary.get(part) or {}).items():
            if as_number(v) is not None:
                out[metric_key("sft", f"{part}_{split}")] = float(v)
    for k, v in (summary.get("sft") or {}).items():
        if as_number(v) is not None:
            out[metric_key("sft", k)] = float(v)
    if as_number(summary.get("seconds")) is not None:
        out["sft/seconds"] = float(summary["seconds"])
    return out


def _table_metrics(path: Path, prefix: str, keys: Sequence[str]) -> dict[str, float]:
    import csv
    import math

    out: dict[str, float] = {}
    if not path.is_file():
        return out
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            name = [row.get(k) or "" for k in keys]
            for col, text in row.items():
                if col in keys:
                    continue
                try:
                    v = float(text)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(v):
                    out[metric_key(prefix, *name, col)] = v
    return out


def attribution_metrics(output_dir: str | os.PathLike) -> dict[str, float]:
    """The attribution benchmark's numbers from its folder: every numeric cell of the tables of
    :data:`ATTRIBUTION_TABLES` (``attribution/localisation/oar_p/sampled/top1``, ...) and the
    numbers at the top of ``summary.json`` (``attribution/summary/sample_accuracy``, ...)."""
    out_dir = Path(output_dir)
    out: dict[str, float] = {}
    for stem, keys in ATTRIBUTION_TABLES.items():
        out.update(_table_metrics(out_dir / f"{stem}.csv", metric_key("attribution", stem), keys))
    try:
        summary = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    for k, v in summary.items():
        if as_number(v) is not None:
            out[metric_key("attribution", "summary", k)] = float(v)
    return out


def report_metrics_of(main_csv: str | os.PathLike) -> dict[str, float]:
    """``report/<metric>/<row>/<benchmark>/<column>`` for the columns mean, std, diff, ci_low,
    ci_high, start_diff and mde of ``main.csv`` (points, as in the file)."""
    import csv
    import math

    out: dict[str, float] = {}
    with open(main_csv, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for col in _REPORT_COLUMNS:
                try:
                    v = float(row.get(col) or "nan")
                except ValueError:
                    continue
                if math.isfinite(v):
                    out[metric_key("report", row["metric"], row["row"], row["benchmark"], col)] = v
    return out
