"""Reports: comparison tables and figures from a finished results tree (``oar report``).

Layout read (``R`` = ``<results_dir>/<name>``, written by the workflow)::

    R/base/eval/<bench>.jsonl                    the starting model (SFT output or model.source)
    R/<method>/seed<seed>/eval/<bench>.jsonl     rows {id, correct, sample, ...}; sample -1 = greedy
    R/<method>/seed<seed>/eval/summary.json      {"benchmarks": {bench: {"pass@1": ...}}, ...}
    R/<method>/seed<seed>/metrics.jsonl          one row per training step (reward, accuracy, time_*, ...)
                                                 and the held-out rows (heldout_acc, train_seconds)

Layout written::

    R/tables/main.csv        long format: one row per (metric, row, benchmark incl. "Average"): mean,
                             std, per-seed values; difference from the reference method with its
                             interval, SE and per-seed differences; difference from the start model
                             with its interval; the column's minimum detectable difference
    R/tables/main.md         the start model's pass@1 / avg@k / pass@k, then per metric (avg@k, pass@1)
                             the scores, the differences with intervals and the MDE line, the per-seed
                             differences, the differences from the start; the steps-to-threshold table
    R/tables/main.tex        the scores and differences as LaTeX tabulars
    R/tables/steps_to_threshold.csv   steps and seconds each method needs to reach report.threshold
    R/tables/learning_speed.csv       held-out AUC and steps to the threshold, differences from the
                             reference with seed-level intervals
    R/tables/efficiency.csv  seconds per step by phase, overhead ratio of step time vs the reference
    R/figures/learning_curves.png        held-out accuracy vs step and vs training seconds
    R/figures/training_curves.png        reward and accuracy per method over steps (mean over seeds)
    R/figures/credit_concentration.png   ESS ratio and top-10% advantage mass over steps

Scores are per problem: ``pass@1`` the greedy answer's correctness (``sample == -1``; the sampled
answers' mean when the evaluation has no greedy ones), ``avg@k`` the mean correctness of the k
sampled answers, ``pass@k`` whether any of them is correct. Table cells are in percent. ``mean ± std``
is over seeds (sample standard deviation, ddof 1; a single seed shows no ±). The "Average" column is
the unweighted mean over benchmarks, computed per seed.

Paired differences (:mod:`oar.stats`): for each benchmark, the per-problem difference
``d[s, i] = score_m[s, i] - score_ref[s, i]`` is paired by (seed, problem id) over the seeds both have
(the base row, one evaluation, is paired with every seed); the estimate is the mean of ``d``. The
training seed is the unit of replication: each seed gives one difference ``D_s = mean_i d[s, i]``
(the Average column: the mean over benchmarks, per seed), and the interval is the t interval over
the ``S`` values ``D_s`` (:func:`oar.stats.seed_interval`); the minimum detectable difference under
each table is ``(t_{S-1, 1-alpha/2} + t_{S-1, power}) sd / sqrt(S)`` with ``sd`` the median over
methods of the sd of their ``D_s`` (:func:`column_mde`), with the seeds that would bring it to
``report.target_mde``. The problem-level bootstrap (resampling problems with the problem's
difference averaged over seeds, rng ``numpy.random.default_rng([seed, benchmark_index])``) and its
SE stay in main.csv (``problem_*``) for comparison.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from oar.io import atomic_path, atomic_write_json, atomic_write_text, read_jsonl
from oar.stats import paired_bootstrap, paired_se, per_seed_differences, seed_interval, seed_mde, seeds_for_mde

__all__ = [
    "BASE_ROW",
    "PHASES",
    "ReportError",
    "RunScores",
    "METRICS",
    "REPORT_DEFAULTS",
    "load_scores",
    "paired_bootstrap",
    "main_table",
    "column_mde",
    "start_model_table",
    "efficiency_table",
    "load_metrics",
    "plot_training_curves",
    "plot_credit_concentration",
    "build_report",
    "report_metrics",
    "data_manifest",
    "write_data_manifest",
]

#: Name of the row of the starting model.
BASE_ROW = "base"
#: Per-problem scores a table can show (see the module docstring).
METRICS = ("pass@1", "avg@k", "pass@k")
#: Defaults of the config's ``report`` section (the schema fills them in a validated config).
REPORT_DEFAULTS = {"reference": "grpo", "confidence": 0.95, "power": 0.8, "threshold": None, "band": "minmax",
                   "target_mde": 2.0}
#: Timed phases of a training step (``time_<phase>`` columns of metrics.jsonl).
PHASES = ("rollout", "reward", "importance", "update", "step")


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
def _results_root(config: Mapping[str, Any], results: str | Path | None) -> Path:
    return Path(results) if results is not None else Path(config["results_dir"]) / config["name"]


def _read_scores_file(path: Path, *, metric: str) -> dict[str, float]:
    """Per-problem score of one ``<bench>.jsonl``: greedy correctness (``pass@1``; the sampled answers'
    mean when there are no greedy ones), mean sampled correctness (``avg@k``), or whether any sampled
    answer is correct (``pass@k``).

    Raises:
        ReportError: the file is missing.
        ValueError: a malformed JSON line (``<file>:<line>``, from :func:`oar.io.read_jsonl`), a row
            without ``id``/``correct`` or with a non-integer ``sample``, a second greedy answer for a
            problem (``<file>: row <k>``), or no answers of the kind ``metric`` needs.
    """
    if metric not in METRICS:
        raise ValueError(f"metric: unknown metric {metric!r}; valid: {list(METRICS)}")
    if not path.exists():
        raise ReportError(f"missing evaluation file: {path}")
    greedy: dict[str, float] = {}
    sampled: dict[str, list[float]] = {}
    # read_jsonl skips blank lines, so row k is line k of the files oar writes (no blank lines)
    for k, row in enumerate(read_jsonl(path), 1):
        try:
            pid, sample, correct = str(row["id"]), int(row.get("sample", -1)), float(bool(row["correct"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {k}: bad evaluation row ({type(e).__name__}: {e})") from None
        if sample < 0:
            if pid in greedy:
                raise ValueError(f"{path}: row {k}: second greedy answer for problem {pid!r}")
            greedy[pid] = correct
        else:
            sampled.setdefault(pid, []).append(correct)
    if metric == "pass@1" and greedy:
        return greedy
    if metric in ("pass@1", "avg@k") and sampled:
        return {k: float(np.mean(v)) for k, v in sampled.items()}
    if metric == "pass@k" and sampled:
        return {k: float(max(v)) for k, v in sampled.items()}
    raise ValueError(f"{path}: no {'greedy' if metric == 'pass@1' else 'sampled'} answers to score ({metric})")


def load_scores(
    eval_dirs: Mapping[int | None, Path], benchmark: str, *, metric: str = "pass@1"
) -> RunScores:
    """Scores of one row (one eval folder per seed) on ``benchmark``, aligned by problem id.

    Raises:
        ReportError: a missing ``<bench>.jsonl``.
        ValueError: the seeds were evaluated on different problems.
    """
    per_seed = {}
    files = []
    for seed, d in eval_dirs.items():
        path = Path(d) / f"{benchmark}.jsonl"
        per_seed[seed] = _read_scores_file(path, metric=metric)
        files.append(path)
    seeds = list(per_seed)
    ids = sorted(per_seed[seeds[0]])
    for s, f in zip(seeds[1:], files[1:]):
        if sorted(per_seed[s]) != ids:
            raise ValueError(f"{f}: problem ids differ from {files[0]}; seeds must be evaluated on the same problems")
    scores = np.array([[per_seed[s][i] for i in ids] for s in seeds], dtype=np.float64).reshape(len(seeds), len(ids))
    return RunScores(ids=ids, scores=scores, seeds=seeds, files=files)


def _check_summary(eval_dir: Path, benchmark: str, scores: dict[str, float] | np.ndarray, metric: str) -> None:
    """Cross-check the mean of the per-problem scores against ``summary.json`` (if it has the value)."""
    path = eval_dir / "summary.json"
    if not path.exists():
        raise ReportError(f"missing evaluation summary: {path}")
    summary = json.loads(path.read_text(encoding="utf-8"))
    value = ((summary.get("benchmarks") or {}).get(benchmark) or {}).get(metric)
    if value is None:
        return
    mean = float(np.mean(scores))
    if abs(float(value) - mean) > 1e-6:
        raise ValueError(
            f"{path}: {benchmark} {metric} = {value} but {eval_dir / (benchmark + '.jsonl')} gives {mean}; "
            "the evaluation files are out of sync (rerun the evaluation)"
        )


# ------------------------------------------------------------------------------------- pairing
def _paired_diff(row: RunScores, ref: RunScores, benchmark: str) -> np.ndarray:
    """``(n_seeds, n)`` differences row - reference, paired by (seed, problem id); a single evaluation
    (the base row, seeds ``[None]``) is paired with every seed of the other side."""
    if row.ids != ref.ids:
        raise ValueError(
            f"{benchmark}: {row.files[0]} and {ref.files[0]} hold different problems; "
            "rows can be compared only on the same problems"
        )
    if row.seeds == [None]:  # base: one evaluation, paired with every seed of the reference
        return row.scores[0][None, :] - ref.scores
    if ref.seeds == [None]:  # a method against its start model
        return row.scores - ref.scores[0][None, :]
    common = [s for s in row.seeds if s in ref.seeds]
    if not common:
        raise ValueError(f"{benchmark}: {row.files[0]} shares no seed with the reference {ref.files[0]}")
    a = row.scores[[row.seeds.index(s) for s in common]]
    b = ref.scores[[ref.seeds.index(s) for s in common]]
    return a - b


def _compare(row: dict[str, RunScores], ref: dict[str, RunScores], benches: Sequence[str], bidx: Sequence[int], *,
             n_boot: int, seed: int, confidence: float) -> dict[str, Any]:
    """Paired difference (points) of ``row`` minus ``ref`` over the benchmarks ``bidx`` (one, or all
    for the Average column): the estimate; the seed-level t interval, SE and sd of the per-seed
    differences (:func:`oar.stats.seed_interval`); the problem-level bootstrap interval and SE."""
    ds = [_paired_diff(row[benches[i]], ref[benches[i]], benches[i]) * 100.0 for i in bidx]
    # the same resamples for every row: benchmark i always uses rng [seed, i]
    est, plo, phi = paired_bootstrap(ds, n_boot=n_boot, seed=seed, confidence=confidence, streams=list(bidx))
    seeds_diff = np.mean([per_seed_differences(d) for d in ds], axis=0)
    _, lo, hi, se = seed_interval(seeds_diff, confidence=confidence)
    sd = float(np.std(seeds_diff, ddof=1)) if len(seeds_diff) > 1 else math.nan
    return {"diff": est, "low": lo, "high": hi, "se": se, "sd_seed": sd, "per_seed": seeds_diff,
            "problem_low": plo, "problem_high": phi, "problem_se": paired_se(ds)}


# ----------------------------------------------------------------------------------------- tables
def _rows_of(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(row name, label)``: base first, then every method in config order."""
    from oar.config import resolve_methods

    methods = resolve_methods(dict(config))
    return [(BASE_ROW, "Base")] + [(name, m.label or name) for name, m in methods.items()]


def _eval_dirs(root: Path, row: str, seeds: Sequence[int]) -> dict[int | None, Path]:
    if row == BASE_ROW:
        return {None: root / BASE_ROW / "eval"}
    return {s: root / row / f"seed{s}" / "eval" for s in seeds}


def _missing(paths: Sequence[Path]) -> None:
    gone = [str(p) for p in paths if not Path(p).exists()]
    if gone:
        more = f" (and {len(gone) - 10} more)" if len(gone) > 10 else ""
        raise ReportError(f"missing result file(s): {', '.join(gone[:10])}{more}; run the workflow first")


def _report_option(config: Mapping[str, Any], key: str, value: Any) -> Any:
    return (config.get("report") or {}).get(key, REPORT_DEFAULTS[key]) if value is None else value


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
    interval over the per-seed differences, :func:`oar.stats.seed_interval`), ``se`` (its SE),
    ``sd_seed`` (sd of the per-seed differences), ``diff_per_seed`` (";"-joined per-seed mean
    differences), ``problem_ci_low``, ``problem_ci_high``, ``problem_se`` (the problem-level paired
    bootstrap and :func:`oar.stats.paired_se`, for comparison), all NaN for the reference itself or
    when the config has no method named ``reference``; against the start model (the base row):
    ``start_diff``, ``start_ci_low``, ``start_ci_high``, ``start_se`` (seed level) and
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

    reference = _report_option(config, "reference", reference)
    confidence = float(_report_option(config, "confidence", confidence))
    power = float(_report_option(config, "power", power))
    root = _results_root(config, results)
    seeds = list(config.get("seeds") or [0])
    benches = [b["name"] for b in config["eval"]["benchmarks"]]
    if not benches:
        raise ValueError("config: eval.benchmarks is empty; nothing to report")
    n_boot = int(config["eval"].get("bootstrap", 1000)) if n_boot is None else int(n_boot)
    rows = _rows_of(config)
    files = []
    for row, _ in rows:
        for d in _eval_dirs(root, row, seeds).values():
            files += [d / "summary.json"] + [d / f"{b}.jsonl" for b in benches]
    _missing(files)

    scores: dict[str, dict[str, RunScores]] = {}
    for row, _ in rows:
        dirs = _eval_dirs(root, row, seeds)
        scores[row] = {}
        for b in benches:
            rs = load_scores(dirs, b, metric=metric)
            for k, (s, d) in enumerate(dirs.items()):
                _check_summary(d, b, rs.scores[k], metric)
            scores[row][b] = rs
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
                vs_ref = _compare(scores[row], scores[reference], benches, bidx, **opts)
            if row != BASE_ROW:
                vs_start = _compare(scores[row], scores[BASE_ROW], benches, bidx, **opts)
            nan = math.nan
            records.append({
                "row": row,
                "label": label,
                "metric": metric,
                "benchmark": bname,
                "n_problems": int(sum(len(scores[row][b].ids) for b in benches)) if bname == "Average"
                else len(scores[row][bname].ids),
                "n_seeds": len(values),
                "mean": float(np.mean(values)),
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else nan,
                "per_seed": ";".join(f"{v:.4f}" for v in values),
                "diff": vs_ref["diff"] if vs_ref else nan,
                "ci_low": vs_ref["low"] if vs_ref else nan,
                "ci_high": vs_ref["high"] if vs_ref else nan,
                "se": vs_ref["se"] if vs_ref else nan,
                "sd_seed": vs_ref["sd_seed"] if vs_ref else nan,
                "diff_per_seed": ";".join(f"{v:.4f}" for v in vs_ref["per_seed"]) if vs_ref else "",
                "problem_ci_low": vs_ref["problem_low"] if vs_ref else nan,
                "problem_ci_high": vs_ref["problem_high"] if vs_ref else nan,
                "problem_se": vs_ref["problem_se"] if vs_ref else nan,
                "start_diff": vs_start["diff"] if vs_start else nan,
                "start_ci_low": vs_start["low"] if vs_start else nan,
                "start_ci_high": vs_start["high"] if vs_start else nan,
                "start_se": vs_start["se"] if vs_start else nan,
                "start_sd_seed": vs_start["sd_seed"] if vs_start else nan,
                "start_problem_ci_low": vs_start["problem_low"] if vs_start else nan,
                "start_problem_ci_high": vs_start["problem_high"] if vs_start else nan,
            })
    df = pd.DataFrame.from_records(records)
    target = float(_report_option(config, "target_mde", target_mde))
    mdes = column_mde(df, reference=reference, alpha=1.0 - confidence, power=power, target=target)
    for j, key in enumerate(("mde", "seeds_for_target", "mde_source")):
        df[key] = df["benchmark"].map(lambda b, j=j: mdes[b][j])
    df["target_mde"] = target
    return df


def column_mde(df: "pd.DataFrame", *, reference: str, alpha: float = 0.05,  # noqa: F821
               power: float = 0.8, target: float = 2.0) -> dict[str, tuple[float, int | None, str]]:
    """Per benchmark column: the seed-level minimum detectable difference from ``reference`` of this
    design, the seeds that would bring it to ``target`` points, and where its sd comes from.

    ``MDE = (t_{S-1, 1-alpha/2} + t_{S-1, power}) sd / sqrt(S)`` (:func:`oar.stats.seed_mde`) with
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
    least one correct answer among its k samples); NaN for what the evaluation did not produce."""
    import pandas as pd

    root = _results_root(config, results)
    d = {None: root / BASE_ROW / "eval"}
    recs = []
    for b in [b["name"] for b in config["eval"]["benchmarks"]]:
        rec: dict[str, Any] = {"benchmark": b}
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


# ------------------------------------------------------------------------------------ efficiency
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
    from oar.heldout import HELDOUT_KEYS

    # the held-out rows (oar.heldout) are read by oar.learning_curves.load_heldout
    rows = [r for r in rows if set(r) - {"step", *HELDOUT_KEYS}] or rows[:0]
    if not rows:
        raise ReportError(f"no training rows in {path}")
    df = pd.DataFrame.from_records(rows)
    df = df.drop_duplicates("step", keep="last").set_index("step").sort_index()
    return df.apply(pd.to_numeric, errors="coerce")


def _all_metrics(config: Mapping[str, Any], root: Path) -> dict[str, dict[int, "pd.DataFrame"]]:  # noqa: F821
    seeds = list(config.get("seeds") or [0])
    methods = [name for name, _ in _rows_of(config) if name != BASE_ROW]
    _missing([root / m / f"seed{s}" / "metrics.jsonl" for m in methods for s in seeds])
    return {m: {s: load_metrics(root / m / f"seed{s}" / "metrics.jsonl") for s in seeds} for m in methods}


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

    root = _results_root(config, results)
    labels = dict(_rows_of(config))
    metrics = metrics if metrics is not None else _all_metrics(config, root)
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


# --------------------------------------------------------------------------------------- figures
def _curves(metrics, key: str):
    """Per method: (steps, mean over seeds, std over seeds) of ``key``; methods without it are skipped."""
    import pandas as pd

    out = {}
    for m, per_seed in metrics.items():
        cols = [df[key].rename(s) for s, df in per_seed.items() if key in df]
        if not cols:
            continue
        frame = pd.concat(cols, axis=1)
        out[m] = (frame.index.to_numpy(), frame.mean(axis=1).to_numpy(), frame.std(axis=1, ddof=0).to_numpy())
    return out


def _plot_panels(path: Path, metrics, panels: Sequence[tuple[str, str]], labels: Mapping[str, str], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.0 * len(panels) + 1.5, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, ylabel) in zip(axes, panels):
        for m, (x, mean, std) in _curves(metrics, key).items():
            (line,) = ax.plot(x, mean, label=labels.get(m, m), linewidth=1.4)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    fig.suptitle(title)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def plot_training_curves(path: str | Path, metrics, labels: Mapping[str, str] | None = None) -> None:
    """Reward and accuracy of the rollouts per step, one line per method (mean ± std over seeds)."""
    _plot_panels(Path(path), metrics, [("reward", "mean reward"), ("accuracy", "rollout accuracy")],
                 labels or {}, "Training curves (mean ± std over seeds)")


def plot_credit_concentration(path: str | Path, metrics, labels: Mapping[str, str] | None = None) -> None:
    """ESS ratio of the token weights and top-10% advantage mass per step, one line per method."""
    _plot_panels(Path(path), metrics, [("ess_ratio", "ESS ratio of token weights"),
                                       ("top10_mass", "top-10% |advantage| mass")],
                 labels or {}, "Credit concentration (mean ± std over seeds)")


# ---------------------------------------------------------------------------------------- report
def report_metrics(config: Mapping[str, Any]) -> list[str]:
    """The metrics the main tables show: ``avg@k`` when ``eval.samples`` > 0, ``pass@1`` when
    ``eval.greedy`` (at least one of them)."""
    ev = config["eval"]
    out = (["avg@k"] if ev.get("samples") else []) + (["pass@1"] if ev.get("greedy", True) else [])
    return out or ["pass@1"]


def _all_heldout(config: Mapping[str, Any], root: Path) -> dict[str, dict[int, "pd.DataFrame"]]:  # noqa: F821
    from oar.learning_curves import load_heldout

    seeds = list(config.get("seeds") or [0])
    methods = [name for name, _ in _rows_of(config) if name != BASE_ROW]
    return {m: {s: load_heldout(root / m / f"seed{s}" / "metrics.jsonl") for s in seeds} for m in methods}


def build_report(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str | None = None,
    seed: int = 0,
    n_boot: int | None = None,
    confidence: float | None = None,
    metric: str | None = None,
    skip_steps: int = 1,
) -> dict[str, Path]:
    """Write the tables and figures of a finished results tree (see the module docstring).

    Args:
        config: a validated config (:func:`oar.config.load_config`).
        results: the results folder ``R`` (default ``<results_dir>/<name>``).
        reference: the method differences and overheads are relative to (default ``report.reference``).
        seed: bootstrap seed.
        n_boot: bootstrap resamples (default ``eval.bootstrap``).
        confidence: interval coverage (default ``report.confidence``).
        metric: only this metric's tables (default: :func:`report_metrics`).
        skip_steps: warm-up steps left out of the efficiency means (see :func:`efficiency_table`).

    Returns:
        ``{"main_csv", "main_md", "main_tex", "steps_to_threshold_csv", "learning_speed_csv", "efficiency_csv",
        "learning_curves", "training_curves", "credit_concentration"}`` -> the paths written.

    Raises:
        ReportError: a result file is missing (every missing file is named).
    """
    import pandas as pd

    from oar.learning_curves import (
        auto_threshold,
        learning_speed_markdown,
        learning_speed_table,
        plot_learning_curves,
        steps_to_threshold,
        threshold_markdown,
    )
    from oar.report_format import main_latex, main_markdown

    root = _results_root(config, results)
    labels = dict(_rows_of(config))
    reference = _report_option(config, "reference", reference)
    confidence = float(_report_option(config, "confidence", confidence))
    power = float(_report_option(config, "power", None))
    n_boot = int(config["eval"].get("bootstrap", 1000)) if n_boot is None else int(n_boot)
    metrics_shown = [metric] if metric else report_metrics(config)
    tables = {m: main_table(config, root, reference=reference, n_boot=n_boot, seed=seed, confidence=confidence,
                            metric=m, power=power) for m in metrics_shown}
    start = start_model_table(config, root)
    metrics = _all_metrics(config, root)
    eff = efficiency_table(config, root, reference=reference, metrics=metrics, skip_steps=skip_steps)
    heldout = _all_heldout(config, root)
    threshold = _report_option(config, "threshold", None)
    ref_label = labels.get(reference, reference)
    if threshold is None:
        threshold = auto_threshold(heldout, reference)
        how = f"halfway between the start model's held-out accuracy and {ref_label}'s last one"
    else:
        how = "report.threshold"
    if not any(len(df) for per_seed in heldout.values() for df in per_seed.values()):
        threshold, how = math.nan, "no held-out evaluation during training (train.heldout.every is 0)"
    elif math.isnan(threshold):
        how = (f"{ref_label}'s last held-out accuracy is not above the start model's, so no accuracy lies "
               "between them; set report.threshold")
    steps = steps_to_threshold(heldout, threshold, labels) if not math.isnan(threshold) else steps_to_threshold({}, 0.0)
    speed = learning_speed_table(heldout, threshold, reference, labels=labels, confidence=confidence)
    out = {
        "main_csv": root / "tables" / "main.csv",
        "main_md": root / "tables" / "main.md",
        "main_tex": root / "tables" / "main.tex",
        "steps_to_threshold_csv": root / "tables" / "steps_to_threshold.csv",
        "learning_speed_csv": root / "tables" / "learning_speed.csv",
        "efficiency_csv": root / "tables" / "efficiency.csv",
        "learning_curves": root / "figures" / "learning_curves.png",
        "training_curves": root / "figures" / "training_curves.png",
        "credit_concentration": root / "figures" / "credit_concentration.png",
    }
    ev = config["eval"]
    k = int(ev.get("samples") or 0) or None
    temperature = float(ev.get("temperature", 0.6))
    rollout_t = (config.get("rollout") or {}).get("temperature")
    atomic_write_text(out["main_csv"], pd.concat(list(tables.values()), ignore_index=True)
                      .to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["main_md"], main_markdown(
        tables, start=start, reference=reference, reference_label=ref_label, confidence=confidence, power=power,
        n_boot=n_boot, seed=seed, k=k, temperature=temperature, rollout_temperature=rollout_t,
        seeds=list(config.get("seeds") or [0]),
        extra=threshold_markdown(steps, threshold=threshold, how=how) + "\n" + learning_speed_markdown(
            speed, threshold=threshold, reference_label=ref_label, confidence=confidence)))
    atomic_write_text(out["main_tex"], main_latex(tables, reference=reference, reference_label=ref_label,
                                                  confidence=confidence, k=k, temperature=temperature))
    atomic_write_text(out["steps_to_threshold_csv"], steps.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["learning_speed_csv"], speed.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["efficiency_csv"], eff.to_csv(index=False, float_format="%.6g"))
    plot_learning_curves(out["learning_curves"], heldout, labels, band=_report_option(config, "band", None),
                         threshold=threshold)
    plot_training_curves(out["training_curves"], metrics, labels)
    plot_credit_concentration(out["credit_concentration"], metrics, labels)
    return out


# ------------------------------------------------------------------------------------ data check
def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _describe_source(name: str, source: str | None, default_file: str) -> dict[str, Any]:
    if source is None:
        return {"source": None}
    p = Path(source)
    if p.is_dir():
        p = p / default_file
    if p.exists():
        return {"source": str(source), "file": str(p.resolve()), "sha256": _sha256(p), "bytes": p.stat().st_size}
    return {"source": str(source), "hub": True}


def data_manifest(config: Mapping[str, Any]) -> dict[str, Any]:
    """Load every data set the config names and describe it (provenance and an early failure).

    Returns ``{"train": {...}, "eval": [{...}, ...]}``: for local files the resolved path, sha256 and
    size; the number of records after filters and the number used (``n``); for generated
    (synthetic) splits the generator options and seed.

    Raises:
        FileNotFoundError / ValueError / HubUnavailableError: from :func:`oar.data.benchmarks.load_benchmark`,
        naming the benchmark and file; ValueError also when the training set or an eval benchmark
        has no records (:func:`oar.data.benchmarks.require_records`).
    """
    from oar.data.benchmarks import BENCHMARKS, load_benchmark, require_records

    task = config["task"]
    out: dict[str, Any] = {"name": config["name"]}
    synth = {"options": dict(task.get("synthetic") or {}), "seed": task.get("seed")}
    if task["kind"] == "synthetic":
        out["train"] = {"name": "synthetic-train", "generated": True, "n": task.get("train_size"), **synth}
    else:
        b = task.get("benchmark") or {}
        if "name" not in b:
            raise ValueError("config: task.benchmark.name is required when task.kind is 'benchmark'")
        levels = b.get("levels")
        recs = load_benchmark(b["name"], b.get("source"), **({"levels": levels} if levels else {}))
        require_records(recs, b["name"], b.get("source"), key="task.benchmark (training set)", levels=levels or None)
        out["train"] = {"name": b["name"], "levels": levels, "records": len(recs),
                        **_describe_source(b["name"], b.get("source"), BENCHMARKS[b["name"]].default_file)}
    evals = []
    for i, b in enumerate(config["eval"]["benchmarks"]):
        name = b["name"]
        if name.startswith("synthetic-"):
            evals.append({"name": name, "generated": True, "n": b.get("n"), **synth})
            continue
        if name not in BENCHMARKS:
            raise ValueError(f"config: eval.benchmarks.{i}.name: unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)}")
        recs = load_benchmark(name, b.get("source"), **(b.get("filters") or {}))
        require_records(recs, name, b.get("source"), key=f"eval.benchmarks.{i}", **(b.get("filters") or {}))
        n = len(recs) if not b.get("n") else min(int(b["n"]), len(recs))
        evals.append({"name": name, "records": len(recs), "n": n, "filters": b.get("filters") or {},
                      "first_ids": [r["id"] for r in recs[: min(3, n)]],
                      **_describe_source(name, b.get("source"), BENCHMARKS[name].default_file)})
    out["eval"] = evals
    return out


def write_data_manifest(config: Mapping[str, Any], output: str | Path) -> dict[str, Any]:
    """:func:`data_manifest`, written atomically as JSON to ``output``; returns it."""
    manifest = data_manifest(config)
    atomic_write_json(output, manifest)
    return manifest
