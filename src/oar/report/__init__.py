"""Reports: comparison tables and figures from a finished results tree (``oar report``).

Layout read (``R`` = ``<results_dir>/<name>``, written by the workflow)::

    R/base/eval/<bench>.jsonl                    the starting model (SFT output or model.source)
    R/<method>/seed<seed>/eval/<bench>.jsonl     rows {id, correct, sample, ...}; sample -1 = greedy
    R/<method>/seed<seed>/eval/summary.json      {"benchmarks": {bench: {"pass@1": ...}}, ...}
    R/<method>/seed<seed>/metrics.jsonl          one row per training step (reward, accuracy, time_*, ...)
                                                 and the held-out rows (heldout_acc, train_seconds)
    R/base/transfer/, R/<method>/seed<seed>/transfer/   the transfer evaluation (eval.transfer), as eval/:
                                                 the start model and the methods of eval.transfer.methods

Layout written::

    R/tables/main.csv        long format: one row per (metric, row, benchmark incl. "Average"): mean,
                             std, per-seed values; difference from the reference method with its
                             interval, SE and per-seed differences; difference from the start model
                             with its interval; the column's minimum detectable difference
    R/tables/main.md         the start model's pass@1 / avg@k / pass@k, then per metric (avg@k, pass@1)
                             the scores, the differences with intervals and the MDE line, the per-seed
                             differences, the differences from the start; the steps-to-threshold table;
                             last, a line naming the provenance of the results (commit, dirty, CPU
                             model and capability, torch; values that differ counted), when recorded
    R/tables/main.tex        the scores and differences as LaTeX tabulars
    R/tables/steps_to_threshold.csv   steps and seconds each method needs to reach report.threshold
    R/tables/learning_speed.csv       held-out AUC and steps to the threshold, differences from the
                             reference with seed-level intervals
    R/tables/efficiency.csv  seconds per step by phase, overhead ratio of step time vs the reference
    R/tables/transfer.csv    with eval.transfer.benchmarks: per (metric, row, transfer benchmark) the mean
                             over seeds, its seed-level sd and t interval, the per-seed values; main.md's
                             "Transfer (no claim)" section shows them, before the footer, with no
                             difference and nothing bold
    R/figures/learning_curves.png        held-out accuracy vs step and vs training seconds
    R/figures/training_curves.png        reward and accuracy per method over steps (mean over seeds)
    R/figures/credit_concentration.png   ESS ratio and top-10% advantage mass over steps

Scores are per problem: ``pass@1`` the greedy answer's correctness (``sample == -1``; the sampled
answers' mean when the evaluation has no greedy ones), ``avg@k`` the mean correctness of the k
sampled answers, ``pass@k`` whether any of them is correct. Table cells are in percent. ``mean ± std``
is over seeds (sample standard deviation, ddof 1; a single seed shows no ±). The "Average" column is
the unweighted mean over benchmarks, computed per seed.

Paired differences (:mod:`oar.core.stats`): for each benchmark, the per-problem difference
``d[s, i] = score_m[s, i] - score_ref[s, i]`` is paired by (seed, problem id) over the seeds both have
(the base row, one evaluation, is paired with every seed); the estimate is the mean of ``d``. The
training seed is the unit of replication: each seed gives one difference ``D_s = mean_i d[s, i]``
(the Average column: the mean over benchmarks, per seed), and the interval is the t interval over
the ``S`` values ``D_s`` (:func:`oar.core.stats.seed_interval`); the minimum detectable difference under
each table is ``(t_{S-1, 1-alpha/2} + t_{S-1, power}) sd / sqrt(S)`` with ``sd`` the median over
methods of the sd of their ``D_s`` (:func:`column_mde`), with the seeds that would bring it to
``report.target_mde``. The problem-level bootstrap (resampling problems with the problem's
difference averaged over seeds, rng ``numpy.random.default_rng([seed, benchmark_index])``) and its
SE stay in main.csv (``problem_*``) for comparison.

Modules (every name is importable from ``oar.report``):

- :mod:`oar.report.base` -- row and metric names, ``REPORT_DEFAULTS``, :class:`ReportError`, :class:`RunScores`.
- :mod:`oar.report.scores` -- per-problem scores of the evaluation files; paired differences.
- :mod:`oar.report.tables` -- :func:`main_table`, :func:`column_mde`, :func:`start_model_table`,
  :func:`transfer_table`.
- :mod:`oar.report.efficiency` -- :func:`load_metrics`, :func:`efficiency_table` (``PHASES``).
- :mod:`oar.report.figures` -- training curves and credit concentration.
- :mod:`oar.report.render` -- ``main.md`` / ``main.tex`` from the long tables.
- :mod:`oar.report.build` -- :func:`build_report`, :func:`report_metrics`.

The data manifest (:func:`data_manifest`, :func:`write_data_manifest`) is :mod:`oar.pipeline.data_stage`,
re-exported here.
"""

from __future__ import annotations

from oar.pipeline.data_stage import data_manifest, write_data_manifest
from oar.report.base import BASE_ROW, METRICS, REPORT_DEFAULTS, ReportError, RunScores
from oar.report.build import build_report, report_metrics
from oar.report.efficiency import PHASES, efficiency_table, load_metrics
from oar.report.figures import plot_credit_concentration, plot_training_curves
from oar.report.scores import load_scores
from oar.report.tables import column_mde, main_table, start_model_table, transfer_table
from oar.core.stats import paired_bootstrap

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
    "transfer_table",
    "efficiency_table",
    "load_metrics",
    "plot_training_curves",
    "plot_credit_concentration",
    "build_report",
    "report_metrics",
    "data_manifest",
    "write_data_manifest",
]
