"""The comparison tables: :func:`main_table` (one metric, long format, differences from the reference
and from the start model with their intervals), :func:`column_mde` and :func:`start_model_table`; and
:func:`transfer_table`, the transfer benchmarks' scores (``eval.transfer``), compared with nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from oar.report.base import (
    BASE_ROW,
    EVAL_FOLDER,
    METRICS,
    TRANSFER_FOLDER,
    RunScores,
    eval_dirs,
    require_files,
    report_option,
    results_root,
    rows_of,
    transfer_rows,
)
from oar.report.scores import check_summary, compare_rows, load_scores
from oar.core.stats import seed_interval, seed_mde, seeds_for_mde

__all__ = ["main_table", "column_mde", "start_model_table", "transfer_table"]


def main_table(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str | None = None,
    n_boot: int | None = None,
    seed: int = 0,
    confidence: float | None = None,
    metric: str = "pass@1",
    power: float | None = None,
    target_mde: float | None = None,
) -> "pd.DataFrame":  # noqa: F821
    """The main comparison table of one metric in long format (values in percent, differences in points).

    Columns: ``row``, ``label``, ``metric``, ``benchmark`` (each benchmark, then ``Average``),
    ``n_problems``, ``n_seeds``, ``mean``, ``std`` (NaN for one seed), ``per_seed`` (";"-joined values);
    against ``reference``: ``diff`` (mean paired difference), ``ci_low``, ``ci_high`` (seed-level t
    interval over the per-seed differences, :func:`oar.core.stats.seed_interval`), ``se`` (its SE), ``p``
    (the t test's p value, :func:`oar.core.stats.seed_p_value`; Holm's correction is the renderer's),
    ``sd_seed`` (sd of the per-seed differences), ``diff_per_seed`` (";"-joined per-seed mean
    differences), ``problem_ci_low``, ``problem_ci_high``, ``problem_se`` (the problem-level paired
    bootstrap and :func:`oar.core.stats.paired_se`, for comparison), all NaN for the reference itself or
    when the config has no method named ``reference``; against the start model (the base row):
    ``start_diff``, ``start_ci_low``, ``start_ci_high``, ``start_se``, ``start_p`` (seed level) and
    ``start_problem_ci_low``, ``start_problem_ci_high`` (NaN for the base row); ``mde``: the
    seed-level minimum detectable difference of the column, ``seeds_for_target``: the seeds that
    would bring it to ``report.target_mde`` (see :func:`column_mde`; the same on every row), and
    ``mde_source``.

    Args:
        config: a validated config (``eval.benchmarks``, ``seeds``, ``methods``, ``report``).
        results: the results folder ``R``; default ``<results_dir>/<name>``.
        reference: the method differences are taken against (default ``report.reference``).
        n_boot: bootstrap resamples (default ``eval.bootstrap``).
        seed: bootstrap seed.
        confidence: interval coverage (default ``report.confidence``); the MDE's alpha is 1 - confidence.
        metric: ``pass@1`` (greedy; falls back to sampled answers when there are none), ``avg@k``
            or ``pass@k``.
        power: power of the MDE (default ``report.power``).
        target_mde: the MDE (points) ``seeds_for_target`` is computed for (default ``report.target_mde``).
    """
    import pandas as pd

    reference = report_option(config, "reference", reference)
    confidence = float(report_option(config, "confidence", confidence))
    power = float(report_option(config, "power", power))
    root = results_root(config, results)
    seeds = list(config.get("seeds") or [0])
    benches = [b["name"] for b in config["eval"]["benchmarks"]]
    if not benches:
        raise ValueError("config: eval.benchmarks is empty; nothing to report")
    n_boot = int(config["eval"]["bootstrap"]) if n_boot is None else int(n_boot)
    rows = rows_of(config)
    scores = _table_scores(root, rows, seeds, benches, metric)
    has_ref = reference in scores and reference != BASE_ROW
    opts = dict(n_boot=n_boot, seed=seed, confidence=confidence)

    records = []
    for row, label in rows:
        per_bench = {b: scores[row][b].scores.mean(axis=1) * 100.0 for b in benches}  # (n_seeds,)
        cols = [(b, per_bench[b], [j]) for j, b in enumerate(benches)]
        cols.append(("Average", np.mean([per_bench[b] for b in benches], axis=0), list(range(len(benches)))))
        for bname, values, bidx in cols:
            vs_ref = vs_start = None
            if has_ref and row != reference:
                vs_ref = compare_rows(scores[row], scores[reference], benches, bidx, **opts)
            if row != BASE_ROW:
                vs_start = compare_rows(scores[row], scores[BASE_ROW], benches, bidx, **opts)
            n_problems = (int(sum(len(scores[row][b].ids) for b in benches)) if bname == "Average"
                          else len(scores[row][bname].ids))
            records.append(_table_record(row, label, metric, bname, n_problems, values, vs_ref, vs_start))
    df = pd.DataFrame.from_records(records)
    target = float(report_option(config, "target_mde", target_mde))
    mdes = column_mde(df, reference=reference, alpha=1.0 - confidence, power=power, target=target)
    for j, key in enumerate(("mde", "seeds_for_target", "mde_source")):
        df[key] = df["benchmark"].map(lambda b, j=j: mdes[b][j])
    df["target_mde"] = target
    return df


def _table_scores(root: Path, rows: list[tuple[str, str]], seeds: list[int], benches: list[str],
                  metric: str, *, folder: str = EVAL_FOLDER) -> dict[str, dict[str, RunScores]]:
    """The ``metric`` scores of every row and benchmark (``{row: {benchmark: RunScores}}``) in the
    evaluation folders ``folder`` (:func:`eval_dirs`), after checking that every evaluation file exists
    (:func:`require_files` names all missing ones) and that each summary agrees with its rows
    (:func:`check_summary`)."""
    files = []
    for row, _ in rows:
        for d in eval_dirs(root, row, seeds, folder=folder).values():
            files += [d / "summary.json"] + [d / f"{b}.jsonl" for b in benches]
    require_files(files)

    scores: dict[str, dict[str, RunScores]] = {}
    for row, _ in rows:
        dirs = eval_dirs(root, row, seeds, folder=folder)
        scores[row] = {}
        for b in benches:
            rs = load_scores(dirs, b, metric=metric)
            for k, (s, d) in enumerate(dirs.items()):
                check_summary(d, b, rs.scores[k], metric)
            scores[row][b] = rs
    return scores


def _table_record(row: str, label: str, metric: str, bname: str, n_problems: int, values: np.ndarray,
                  vs_ref: dict | None, vs_start: dict | None) -> dict[str, Any]:
    """One row of :func:`main_table`: the per-seed ``values`` (percent) of ``row`` on benchmark
    ``bname``, with its comparisons (:func:`oar.report.scores.compare_rows`) against the reference
    (``vs_ref``) and the start model (``vs_start``), NaN (``""`` for ``diff_per_seed``) where None."""
    nan = math.nan
    return {
        "row": row,
        "label": label,
        "metric": metric,
        "benchmark": bname,
        "n_problems": n_problems,
        "n_seeds": len(values),
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else nan,
        "per_seed": ";".join(f"{v:.4f}" for v in values),
        "diff": vs_ref["diff"] if vs_ref else nan,
        "ci_low": vs_ref["low"] if vs_ref else nan,
        "ci_high": vs_ref["high"] if vs_ref else nan,
        "se": vs_ref["se"] if vs_ref else nan,
        "p": vs_ref["p"] if vs_ref else nan,
        "sd_seed": vs_ref["sd_seed"] if vs_ref else nan,
        "diff_per_seed": ";".join(f"{v:.4f}" for v in vs_ref["per_seed"]) if vs_ref else "",
        "problem_ci_low": vs_ref["problem_low"] if vs_ref else nan,
        "problem_ci_high": vs_ref["problem_high"] if vs_ref else nan,
        "problem_se": vs_ref["problem_se"] if vs_ref else nan,
        "start_diff": vs_start["diff"] if vs_start else nan,
        "start_ci_low": vs_start["low"] if vs_start else nan,
        "start_ci_high": vs_start["high"] if vs_start else nan,
        "start_se": vs_start["se"] if vs_start else nan,
        "start_p": vs_start["p"] if vs_start else nan,
        "start_sd_seed": vs_start["sd_seed"] if vs_start else nan,
        "start_problem_ci_low": vs_start["problem_low"] if vs_start else nan,
        "start_problem_ci_high": vs_start["problem_high"] if vs_start else nan,
    }


def column_mde(df: "pd.DataFrame", *, reference: str, alpha: float = 0.05,  # noqa: F821
               power: float = 0.8, target: float = 2.0) -> dict[str, tuple[float, int | None, str]]:
    """Per benchmark column: the seed-level minimum detectable difference from ``reference`` of this
    design, the seeds that would bring it to ``target`` points, and where its sd comes from.

    ``MDE = (t_{S-1, 1-alpha/2} + t_{S-1, power}) sd / sqrt(S)`` (:func:`oar.core.stats.seed_mde`) with
    ``S`` the seeds and ``sd`` the median over the methods (every row but the base row and the
    reference) of the sd of their per-seed differences from the reference; with no such method, the
    sd of the reference's per-seed differences from the start model. NaN with one seed.
    """
    out = {}
    for b in dict.fromkeys(df["benchmark"]):
        col = df[df["benchmark"] == b]
        others = col.loc[(col["row"] != BASE_ROW) & (col["row"] != reference)]
        sds = others["sd_seed"].dropna()
        if len(sds):
            sd, source = float(np.median(sds)), (f"median over {len(sds)} method(s) of the sd of the per-seed "
                                                 "differences from the reference")
        else:
            ref = col.loc[col["row"] == reference, "start_sd_seed"].dropna()
            sd, source = ((float(ref.iloc[0]), "sd of the reference's per-seed differences from the start")
                          if len(ref) else (math.nan, "no paired comparison over 2 or more seeds"))
        n = int(col.loc[col["row"] != BASE_ROW, "n_seeds"].max()) if (col["row"] != BASE_ROW).any() else 1
        out[b] = (seed_mde(sd, n, alpha=alpha, power=power), seeds_for_mde(sd, target, alpha=alpha, power=power),
                  f"{source} (sd {sd:.2f} points over {n} seeds)")
    return out


def start_model_table(config: Mapping[str, Any], results: str | Path | None = None) -> "pd.DataFrame":  # noqa: F821
    """The start model's (base row's) accuracy per benchmark, in percent: ``pass@1`` (greedy),
    ``avg@k`` (pass@1 of a sample at ``eval.temperature``) and ``pass@k`` (share of problems with at
    least one correct answer among its k samples) and ``answered`` (share of all its answers with a
    final answer the reward can read, from ``<bench>.json``; NaN in evaluations older than it); NaN
    for what the evaluation did not produce."""
    import pandas as pd

    root = results_root(config, results)
    d = {None: root / BASE_ROW / "eval"}
    recs = []
    for b in [b["name"] for b in config["eval"]["benchmarks"]]:
        rec: dict[str, Any] = {"benchmark": b}
        try:
            answered = json.loads((d[None] / f"{b}.json").read_text(encoding="utf-8")).get("answered")
        except (OSError, ValueError, AttributeError):
            answered = None
        rec["answered"] = math.nan if answered is None else float(answered) * 100.0
        for metric in METRICS:
            try:
                rs = load_scores(d, b, metric=metric)
                rec[metric] = float(rs.scores.mean()) * 100.0
                rec["n_problems"] = len(rs.ids)
            except ValueError:  # no answers of that kind
                rec[metric] = math.nan
        if config["eval"].get("greedy") is False:  # pass@1 fell back to the samples
            rec["pass@1"] = math.nan
        recs.append(rec)
    return pd.DataFrame.from_records(recs)


def transfer_table(config: Mapping[str, Any], results: str | Path | None = None, *, metric: str = "pass@1",
                   confidence: float | None = None) -> "pd.DataFrame":  # noqa: F821
    """The transfer benchmarks' scores of one metric in long format (percent), compared with nothing:
    one row per (table row, benchmark) of the start model and each method of ``eval.transfer.methods``
    (:func:`oar.report.base.transfer_rows`), from their transfer evaluations (``<row>/transfer/``).

    Columns: ``row``, ``label``, ``metric``, ``benchmark``, ``n_problems``, ``n_seeds``, ``mean`` (over
    seeds), ``std`` (the seed-level sd, ddof 1; NaN for one seed), ``ci_low``, ``ci_high`` (the t
    interval of the mean over the training seeds, :func:`oar.core.stats.seed_interval`; NaN for one seed,
    so for the base row, one evaluation), ``per_seed`` (";"-joined values).

    Args:
        config: a validated config with ``eval.transfer.benchmarks``.
        results: the results folder ``R``; default ``<results_dir>/<name>``.
        metric: as in :func:`main_table`.
        confidence: interval coverage (default ``report.confidence``).

    Raises:
        ValueError: the config has no transfer benchmark.
        oar.report.ReportError: a transfer evaluation's file is missing (every missing file is named).
    """
    import pandas as pd

    confidence = float(report_option(config, "confidence", confidence))
    benches = [b["name"] for b in config["eval"]["transfer"]["benchmarks"]]
    if not benches:
        raise ValueError("config: eval.transfer.benchmarks is empty; no transfer table")
    rows = transfer_rows(config)
    scores = _table_scores(results_root(config, results), rows, list(config.get("seeds") or [0]), benches, metric,
                           folder=TRANSFER_FOLDER)
    records = []
    for row, label in rows:
        for b in benches:
            values = scores[row][b].scores.mean(axis=1) * 100.0  # (n_seeds,)
            mean, low, high, _ = seed_interval(values, confidence=confidence)
            records.append({"row": row, "label": label, "metric": metric, "benchmark": b,
                            "n_problems": len(scores[row][b].ids), "n_seeds": len(values), "mean": mean,
                            "std": float(np.std(values, ddof=1)) if len(values) > 1 else math.nan,
                            "ci_low": low, "ci_high": high, "per_seed": ";".join(f"{v:.4f}" for v in values)})
    return pd.DataFrame.from_records(records)
