"""Reports: comparison tables and figures from a finished results tree (``oar report``).

Layout read (``R`` = ``<results_dir>/<name>``, written by the workflow)::

    R/base/eval/<bench>.jsonl                    the starting model (SFT output or model.source)
    R/<method>/seed<seed>/eval/<bench>.jsonl     rows {id, correct, sample, ...}; sample -1 = greedy
    R/<method>/seed<seed>/eval/summary.json      {"benchmarks": {bench: {"pass@1": ...}}, ...}
    R/<method>/seed<seed>/metrics.jsonl          one row per training step (reward, accuracy, time_*, ...)

Layout written::

    R/tables/main.csv        long format: one row per (row, benchmark incl. "Average"): mean, std,
                             per-seed values, difference from the reference method and its CI
    R/tables/main.md         the same as two readable tables (mean ± std; difference [95% CI])
    R/tables/main.tex        the same as two LaTeX tabulars
    R/tables/efficiency.csv  seconds per step by phase, overhead ratio of step time vs the reference
    R/figures/training_curves.png        reward and accuracy per method over steps (mean over seeds)
    R/figures/credit_concentration.png   ESS ratio and top-10% advantage mass over steps

Scores are per problem: the greedy answer's correctness (``sample == -1``) when the evaluation has
greedy answers, else the mean correctness of the sampled answers (avg@k). Table cells are in percent.
``mean ± std`` is over seeds (sample standard deviation, ddof 1; a single seed shows no ±). The
"Average" column is the unweighted mean over benchmarks, computed per seed.

Paired bootstrap of the difference from the reference method (GRPO by default): for each benchmark,
the per-problem difference ``d[s, i] = score_m[s, i] - score_ref[s, i]`` is paired by (seed, problem
id) over the seeds both have; problems are resampled with replacement (``n_boot`` times, rng
``numpy.random.default_rng([seed, benchmark_index])``, the same resamples for every method) and the
statistic is the mean of ``d`` over seeds and resampled problems; the Average column resamples every
benchmark and averages the per-benchmark statistics. The interval is the percentile interval. The
base row has a single evaluation; it is paired with every seed of the reference.
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

__all__ = [
    "BASE_ROW",
    "PHASES",
    "ReportError",
    "RunScores",
    "load_scores",
    "paired_bootstrap",
    "main_table",
    "efficiency_table",
    "load_metrics",
    "plot_training_curves",
    "plot_credit_concentration",
    "build_report",
    "data_manifest",
    "write_data_manifest",
]

#: Name of the row of the starting model.
BASE_ROW = "base"
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
    """Per-problem score of one ``<bench>.jsonl``: greedy correctness, or mean sampled correctness.

    Raises:
        ReportError: the file is missing.
        ValueError: a malformed JSON line (``<file>:<line>``, from :func:`oar.io.read_jsonl`), a row
            without ``id``/``correct`` or with a non-integer ``sample``, a second greedy answer for a
            problem (``<file>: row <k>``), or no answers of the kind ``metric`` needs.
    """
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


# ------------------------------------------------------------------------------------- bootstrap
def paired_bootstrap(
    diffs: Sequence[np.ndarray],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
    streams: Sequence[int] | None = None,
) -> tuple[float, float, float]:
    """Percentile bootstrap interval of a mean paired difference, resampling problems.

    Args:
        diffs: one array per benchmark of shape ``(n_seeds, n_problems)``: the paired per-problem
            differences. With several benchmarks the statistic is the unweighted mean over
            benchmarks of each benchmark's mean difference (each benchmark resampled on its own).
        n_boot: number of resamples (0: no interval, NaN bounds).
        seed: base seed; benchmark ``k`` uses ``numpy.random.default_rng([seed, streams[k]])``
            (``streams`` defaults to ``0, 1, ...``), so an interval depends only on the seed, the
            streams and the data; give a benchmark the same stream everywhere (its index in the
            config) and every comparison on it sees the same resamples.
        confidence: coverage of the interval.

    Returns:
        ``(estimate, low, high)`` in the units of ``diffs``.
    """
    if not diffs:
        raise ValueError("paired_bootstrap: no benchmarks")
    streams = list(range(len(diffs))) if streams is None else list(streams)
    if len(streams) != len(diffs):
        raise ValueError(f"paired_bootstrap: {len(diffs)} benchmarks but {len(streams)} streams")
    estimate = float(np.mean([np.mean(d) for d in diffs]))
    if n_boot <= 0:
        return estimate, math.nan, math.nan
    stats = np.zeros(n_boot)
    for j, d in enumerate(diffs):
        d = np.asarray(d, dtype=np.float64)
        if d.ndim != 2 or d.shape[1] == 0:
            raise ValueError(f"paired_bootstrap: benchmark {j}: expected (n_seeds, n_problems>0), got {d.shape}")
        per_problem = d.mean(axis=0)  # equal seeds per problem: mean over (seed, problem) = mean of these
        rng = np.random.default_rng([seed, streams[j]])
        idx = rng.integers(0, per_problem.shape[0], size=(n_boot, per_problem.shape[0]))
        stats += per_problem[idx].mean(axis=1)
    stats /= len(diffs)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return estimate, float(low), float(high)


def _paired_diff(row: RunScores, ref: RunScores, benchmark: str) -> np.ndarray:
    """``(n_seeds, n)`` differences row - reference, paired by (seed, problem id)."""
    if row.ids != ref.ids:
        raise ValueError(
            f"{benchmark}: {row.files[0]} and {ref.files[0]} hold different problems; "
            "rows can be compared only on the same problems"
        )
    if row.seeds == [None]:  # base: one evaluation, paired with every seed of the reference
        return row.scores[0][None, :] - ref.scores
    common = [s for s in row.seeds if s in ref.seeds]
    if not common:
        raise ValueError(f"{benchmark}: {row.files[0]} shares no seed with the reference {ref.files[0]}")
    a = row.scores[[row.seeds.index(s) for s in common]]
    b = ref.scores[[ref.seeds.index(s) for s in common]]
    return a - b


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


def main_table(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str = "grpo",
    n_boot: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    metric: str = "pass@1",
) -> "pd.DataFrame":  # noqa: F821
    """The main comparison table in long format (values in percent).

    Columns: ``row``, ``label``, ``benchmark`` (each benchmark, then ``Average``), ``n_problems``,
    ``n_seeds``, ``mean``, ``std`` (NaN for one seed), ``per_seed`` (";"-joined values),
    ``diff`` (mean difference from ``reference`` in points), ``ci_low``, ``ci_high`` (NaN for the
    reference itself, or when the config has no method named ``reference``).

    Args:
        config: a validated config (``eval.benchmarks``, ``seeds``, ``methods``).
        results: the results folder ``R``; default ``<results_dir>/<name>``.
        reference: the method differences are taken against.
        n_boot: bootstrap resamples (default ``eval.bootstrap``).
        seed: bootstrap seed.
        confidence: interval coverage.
        metric: ``pass@1`` (greedy; falls back to sampled answers when there are none) or ``avg@k``.
    """
    import pandas as pd

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
                _check_summary(d, b, rs.scores[k], "pass@1" if metric == "pass@1" else "avg@k")
            scores[row][b] = rs
    has_ref = reference in scores and reference != BASE_ROW

    records = []
    for row, label in rows:
        per_bench = {b: scores[row][b].scores.mean(axis=1) * 100.0 for b in benches}  # (n_seeds,)
        cols = [(b, per_bench[b], [scores[row][b]]) for b in benches]
        cols.append(("Average", np.mean([per_bench[b] for b in benches], axis=0), [scores[row][b] for b in benches]))
        for j, (bname, values, _) in enumerate(cols):
            diff = lo = hi = math.nan
            if has_ref and row != reference:
                bidx = list(range(len(benches))) if bname == "Average" else [j]
                ds = [_paired_diff(scores[row][benches[i]], scores[reference][benches[i]], benches[i]) * 100.0
                      for i in bidx]
                # the same resamples for every row: benchmark i always uses rng [seed, i]
                est, lo, hi = paired_bootstrap(ds, n_boot=n_boot, seed=seed, confidence=confidence, streams=bidx)
                diff = est
            records.append({
                "row": row,
                "label": label,
                "benchmark": bname,
                "n_problems": int(sum(len(scores[row][b].ids) for b in benches)) if bname == "Average"
                else len(scores[row][bname].ids),
                "n_seeds": len(values),
                "mean": float(np.mean(values)),
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else math.nan,
                "per_seed": ";".join(f"{v:.4f}" for v in values),
                "diff": diff,
                "ci_low": lo,
                "ci_high": hi,
            })
    return pd.DataFrame.from_records(records)


def _fmt_cell(mean: float, std: float, digits: int = 1) -> str:
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_diff(diff: float, lo: float, hi: float, digits: int = 1) -> str:
    if math.isnan(diff):
        return "—"
    if math.isnan(lo):
        return f"{diff:+.{digits}f}"
    return f"{diff:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def _wide(df, column: str) -> "pd.DataFrame":  # noqa: F821
    import pandas as pd

    order = list(dict.fromkeys(df["benchmark"]))
    rows = list(dict.fromkeys(df["label"]))
    fmt = _fmt_cell if column == "cell" else _fmt_diff
    cells = {}
    for r in df.itertuples(index=False):
        cells[(r.label, r.benchmark)] = fmt(r.mean, r.std) if column == "cell" else fmt(r.diff, r.ci_low, r.ci_high)
    return pd.DataFrame([[cells[(lab, b)] for b in order] for lab in rows], index=pd.Index(rows, name="Method"),
                        columns=order)


def _markdown(df, *, reference_label: str, metric: str, confidence: float, n_boot: int, seed: int) -> str:
    def table(w):
        head = "| " + " | ".join([w.index.name] + list(w.columns)) + " |"
        sep = "|" + "|".join(["---"] + ["---:"] * len(w.columns)) + "|"
        body = ["| " + " | ".join([str(i)] + list(map(str, r))) + " |" for i, r in zip(w.index, w.values)]
        return "\n".join([head, sep, *body])

    n_seeds = int(df.loc[df["row"] != BASE_ROW, "n_seeds"].max()) if (df["row"] != BASE_ROW).any() else 1
    parts = [
        f"### {metric} (%), mean ± std over {n_seeds} seed(s)",
        "",
        table(_wide(df, "cell")),
        "",
    ]
    if df["diff"].notna().any():
        parts += [
            f"### Difference from {reference_label} (points), paired bootstrap {confidence:.0%} interval",
            f"({n_boot} resamples of problems, seed {seed}; pairs = same seed and problem)",
            "",
            table(_wide(df, "diff")),
            "",
        ]
    return "\n".join(parts)


def _latex(df, *, reference_label: str, metric: str, confidence: float) -> str:
    def esc(s: str) -> str:
        for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#"),
                     ("±", r"$\pm$"), ("—", "--")):
            s = s.replace(a, b)
        return s

    def tabular(w, caption):
        cols = "l" + "r" * len(w.columns)
        lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(caption)}}}", rf"\begin{{tabular}}{{{cols}}}",
                 r"\toprule", " & ".join([esc(w.index.name)] + [esc(c) for c in w.columns]) + r" \\", r"\midrule"]
        for i, r in zip(w.index, w.values):
            cells = [esc(str(v)) for v in r]
            lines.append(" & ".join([esc(str(i))] + cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
        return "\n".join(lines)

    out = [tabular(_wide(df, "cell"), f"{metric} (%), mean ± std over seeds")]
    if df["diff"].notna().any():
        out.append(tabular(_wide(df, "diff"),
                           f"Difference from {reference_label} (points), paired bootstrap {confidence:.0%} interval"))
    return "% generated by oar.report (needs \\usepackage{booktabs})\n" + "\n\n".join(out) + "\n"


# ------------------------------------------------------------------------------------ efficiency
def load_metrics(path: str | Path) -> "pd.DataFrame":  # noqa: F821
    """One run's ``metrics.jsonl`` as a DataFrame indexed by step (the last row of a repeated step wins).

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
def build_report(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str = "grpo",
    seed: int = 0,
    n_boot: int | None = None,
    confidence: float = 0.95,
    metric: str = "pass@1",
    skip_steps: int = 1,
) -> dict[str, Path]:
    """Write the tables and figures of a finished results tree (see the module docstring).

    Args:
        config: a validated config (:func:`oar.config.load_config`).
        results: the results folder ``R`` (default ``<results_dir>/<name>``).
        reference: the method differences and overheads are relative to.
        seed: bootstrap seed.
        n_boot: bootstrap resamples (default ``eval.bootstrap``).
        confidence: interval coverage.
        metric: ``pass@1`` (greedy) or ``avg@k`` (sampled).
        skip_steps: warm-up steps left out of the efficiency means (see :func:`efficiency_table`).

    Returns:
        ``{"main_csv", "main_md", "main_tex", "efficiency_csv", "training_curves",
        "credit_concentration"}`` -> the paths written.

    Raises:
        ReportError: a result file is missing (every missing file is named).
    """
    root = _results_root(config, results)
    labels = dict(_rows_of(config))
    n_boot = int(config["eval"].get("bootstrap", 1000)) if n_boot is None else int(n_boot)
    table = main_table(config, root, reference=reference, n_boot=n_boot, seed=seed, confidence=confidence,
                       metric=metric)
    metrics = _all_metrics(config, root)
    eff = efficiency_table(config, root, reference=reference, metrics=metrics, skip_steps=skip_steps)
    ref_label = labels.get(reference, reference)
    out = {
        "main_csv": root / "tables" / "main.csv",
        "main_md": root / "tables" / "main.md",
        "main_tex": root / "tables" / "main.tex",
        "efficiency_csv": root / "tables" / "efficiency.csv",
        "training_curves": root / "figures" / "training_curves.png",
        "credit_concentration": root / "figures" / "credit_concentration.png",
    }
    atomic_write_text(out["main_csv"], table.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["main_md"], _markdown(table, reference_label=ref_label, metric=metric,
                                                confidence=confidence, n_boot=n_boot, seed=seed))
    atomic_write_text(out["main_tex"], _latex(table, reference_label=ref_label, metric=metric, confidence=confidence))
    atomic_write_text(out["efficiency_csv"], eff.to_csv(index=False, float_format="%.6g"))
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
