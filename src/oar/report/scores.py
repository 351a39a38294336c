"""Per-problem scores of the evaluation files, and paired differences between table rows.

Loading: :func:`load_scores` (one row's seeds on one benchmark, aligned by problem id), cross-checked
against each ``summary.json``. Pairing: ``row - reference`` by (seed, problem id), summarised at the
seed level (:func:`oar.core.stats.seed_interval`) and by the problem-level bootstrap.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from oar.core.io import read_jsonl
from oar.report.base import METRICS, ReportError, RunScores
from oar.core.stats import paired_bootstrap, paired_se, per_seed_differences, seed_interval, seed_p_value

__all__ = ["load_scores"]


def _read_scores_file(path: Path, *, metric: str) -> dict[str, float]:
    """Per-problem score of one ``<bench>.jsonl``: greedy correctness (``pass@1``; the sampled answers'
    mean when there are no greedy ones), mean sampled correctness (``avg@k``), or whether any sampled
    answer is correct (``pass@k``).

    Raises:
        ReportError: the file is missing.
        ValueError: a malformed JSON line (``<file>:<line>``, from :func:`oar.core.io.read_jsonl`), a row
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


def check_summary(eval_dir: Path, benchmark: str, scores: dict[str, float] | np.ndarray, metric: str) -> None:
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


def compare_rows(row: dict[str, RunScores], ref: dict[str, RunScores], benches: Sequence[str], bidx: Sequence[int], *,
             n_boot: int, seed: int, confidence: float) -> dict[str, Any]:
    """Paired difference (points) of ``row`` minus ``ref`` over the benchmarks ``bidx`` (one, or all
    for the Average column): the estimate; the seed-level t interval, SE and sd of the per-seed
    differences (:func:`oar.core.stats.seed_interval`) and its p value (:func:`oar.core.stats.seed_p_value`); the
    problem-level bootstrap interval and SE."""
    ds = [_paired_diff(row[benches[i]], ref[benches[i]], benches[i]) * 100.0 for i in bidx]
    # the same resamples for every row: benchmark i always uses rng [seed, i]
    est, plo, phi = paired_bootstrap(ds, n_boot=n_boot, seed=seed, confidence=confidence, streams=list(bidx))
    seeds_diff = np.mean([per_seed_differences(d) for d in ds], axis=0)
    _, lo, hi, se = seed_interval(seeds_diff, confidence=confidence)
    sd = float(np.std(seeds_diff, ddof=1)) if len(seeds_diff) > 1 else math.nan
    return {"diff": est, "low": lo, "high": hi, "se": se, "p": seed_p_value(seeds_diff), "sd_seed": sd,
            "per_seed": seeds_diff,
            "problem_low": plo, "problem_high": phi, "problem_se": paired_se(ds)}
