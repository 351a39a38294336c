"""Training-run metrics (``metrics.jsonl``) and the efficiency table: seconds per step by phase."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from oar.config.tree import ResultsTree
from oar.core.io import read_jsonl
from oar.report.base import BASE_ROW, ReportError, require_files, results_root, rows_of
from oar.trainer.runs import TIMED_PHASES

__all__ = ["PHASES", "load_metrics", "efficiency_table"]

#: The columns of a training step's time: each of ``oar.trainer.runs.TIMED_PHASES`` and the whole step
#: (``time_<phase>`` columns of metrics.jsonl).
PHASES = (*TIMED_PHASES, "step")


def load_metrics(path: str | Path) -> "pd.DataFrame":  # noqa: F821
    """One run's ``metrics.jsonl`` training rows as a DataFrame indexed by step (the last row of a
    repeated step wins; the held-out rows are left out).

    Raises:
        ReportError: the file is missing or empty.
    """
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise ReportError(f"missing training metrics: {path}")
    rows = read_jsonl(path)
    if not rows:
        raise ReportError(f"empty training metrics: {path}")
    for k, r in enumerate(rows, 1):
        if "step" not in r:
            raise ValueError(f"{path}:{k}: metrics row without 'step'")
    from oar.evaluate.heldout import HELDOUT_KEYS

    # the held-out rows (oar.evaluate.heldout) are read by oar.report.learning_curves.load_heldout
    rows = [r for r in rows if set(r) - {"step", *HELDOUT_KEYS}] or rows[:0]
    if not rows:
        raise ReportError(f"no training rows in {path}")
    df = pd.DataFrame.from_records(rows)
    df = df.drop_duplicates("step", keep="last").set_index("step").sort_index()
    return df.apply(pd.to_numeric, errors="coerce")


def all_metrics(config: Mapping[str, Any], root: Path) -> dict[str, dict[int, "pd.DataFrame"]]:  # noqa: F821
    seeds = list(config.get("seeds") or [0])
    methods = [name for name, _ in rows_of(config) if name != BASE_ROW]
    tree = ResultsTree.at(root)
    require_files([Path(tree.run_metrics(m, s)) for m in methods for s in seeds])
    return {m: {s: load_metrics(Path(tree.run_metrics(m, s))) for s in seeds} for m in methods}


def efficiency_table(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str = "grpo",
    metrics: Mapping[str, Mapping[int, Any]] | None = None,
    skip_steps: int = 1,
) -> "pd.DataFrame":  # noqa: F821
    """Seconds per training step by phase (mean over steps, then over seeds) and overhead ratios.

    The first ``skip_steps`` steps of each run are left out of the means when the run has more
    steps than that: they carry one-off costs (worker pools starting, caches warming up) that would
    otherwise dominate short runs. A resumed run's first step after the restart is kept.

    Columns: ``method``, ``label``, ``n_seeds``, ``steps`` (rows per seed, mean), ``timed_steps``
    (rows per seed in the means, mean), ``time_<phase>``
    for each of :data:`PHASES` (a phase a run did not time counts as 0 s), ``step_std`` (std over
    seeds of the per-seed mean step time), ``overhead`` (mean step time / the reference's; NaN when
    the config has no ``reference``) and ``importance_share`` (importance time / step time).
    """
    import pandas as pd

    root = results_root(config, results)
    labels = dict(rows_of(config))
    metrics = metrics if metrics is not None else all_metrics(config, root)
    recs = []
    for m, per_seed in metrics.items():
        means = {p: [] for p in PHASES}
        steps = []
        timed = []
        for s, df in per_seed.items():
            steps.append(len(df))
            if len(df) > skip_steps:
                df = df.iloc[skip_steps:]
            timed.append(len(df))
            for p in PHASES:
                col = f"time_{p}"
                means[p].append(float(df[col].fillna(0.0).mean()) if col in df else 0.0)
        rec = {"method": m, "label": labels.get(m, m), "n_seeds": len(per_seed), "steps": float(np.mean(steps)),
               "timed_steps": float(np.mean(timed))}
        for p in PHASES:
            rec[f"time_{p}"] = float(np.mean(means[p]))
        rec["step_std"] = float(np.std(means["step"], ddof=1)) if len(means["step"]) > 1 else math.nan
        recs.append(rec)
    df = pd.DataFrame.from_records(recs)
    ref = df.loc[df["method"] == reference, "time_step"]
    df["overhead"] = df["time_step"] / float(ref.iloc[0]) if len(ref) and float(ref.iloc[0]) > 0 else math.nan
    df["importance_share"] = np.where(df["time_step"] > 0, df["time_importance"] / df["time_step"].where(df["time_step"] > 0, 1.0), math.nan)
    return df
