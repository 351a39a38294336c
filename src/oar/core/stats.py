"""Statistics of the reports: seed-level intervals and power, problem-level intervals, steps to a
threshold.

Plain numpy functions on small arrays, used by :mod:`oar.report` and :mod:`oar.report.learning_curves`.

Paired design. Two rows of a table (a method and GRPO, or a method and its start model) are scored
on the same problems with the same seeds; ``d[s, i]`` is the score difference on problem ``i`` of
seed ``s`` of one minus seed ``s`` of the other (a single start-model evaluation is paired with every
seed). The estimate is the mean of ``d``.

- **Seed level** (what the reports print): the training seed is the unit of replication. Each seed
  gives one difference ``D_s = mean_i d[s, i]`` (its evaluation noise on the problems included), and
  :func:`seed_interval` is the t interval over the ``S`` values ``D_s`` (``S - 1`` degrees of
  freedom); :func:`seed_mde` the minimum detectable difference of that design and
  :func:`seeds_for_mde` the seeds that would bring it to a target. Why a t interval over per-seed
  differences and not a two-level bootstrap or a mixed model: with 3 seeds a bootstrap over seeds has
  10 distinct resamples and covers far less than its nominal level, and a mixed model cannot estimate
  a seed variance component from 3 values any better than the sample variance the t interval uses;
  the t interval is exact when the ``D_s`` are normal, and every ``D_s`` is a mean over hundreds of
  problems. It does not resample *which* problems were drawn (every seed is scored on the same
  ones); that part is :func:`paired_se`, reported beside it and smaller on the default run.
- **Problem level**: :func:`paired_bootstrap` / :func:`paired_se` resample the problems only, with
  the per-problem difference averaged over seeds, ``dbar_i = mean_s d[s, i]``, as the unit: how far
  the estimate could move on another draw of problems, for these trained seeds.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = [
    "welch_interval",
    "fieller_ratio_interval_unpaired",
    "seed_interval",
    "seed_p_value",
    "fieller_ratio_interval",
    "holm_significant",
    "seed_mde",
    "seeds_for_mde",
    "z_power",
    "paired_bootstrap",
    "paired_se",
    "mde",
    "per_seed_differences",
    "first_crossing",
    "pass_at_k",
]


def _z(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


def z_power(alpha: float = 0.05, power: float = 0.8) -> float:
    """``z_{1-alpha/2} + z_{power}`` (2.8016 for two-sided alpha 0.05 and 80% power)."""
    return _z(1.0 - alpha / 2.0) + _z(power)


def seed_interval(per_seed: Sequence[float], *, confidence: float = 0.95) -> tuple[float, float, float, float]:
    """t interval of a mean over training seeds, each seed one replicate.

    ``est = mean_s D_s``, ``se = sd(D, ddof=1) / sqrt(S)``, ``est -+ t_{S-1, (1+confidence)/2} se``.

    Args:
        per_seed: ``(S,)`` one value per seed (a per-seed difference, or a per-seed endpoint);
            NaN entries are dropped.
        confidence: coverage.

    Returns:
        ``(estimate, low, high, se)``; the bounds and ``se`` are NaN with fewer than 2 seeds.
    """
    from scipy.stats import t

    v = np.asarray(per_seed, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan, math.nan
    est = float(v.mean())
    if v.size < 2:
        return est, math.nan, math.nan, math.nan
    se = float(v.std(ddof=1) / math.sqrt(v.size))
    half = float(t.ppf(0.5 + confidence / 2.0, v.size - 1)) * se
    return est, est - half, est + half, se


def seed_p_value(per_seed: Sequence[float]) -> float:
    """Two-sided p value of the one-sample t test that the mean of the per-seed values is 0 (the test
    :func:`seed_interval` inverts: the interval excludes 0 exactly when ``p < 1 - confidence``).

    Args:
        per_seed: ``(S,)`` one value per seed; NaN entries are dropped.

    Returns:
        The p value; NaN with fewer than 2 seeds; 0 when every seed gives the same non-zero value,
        1 when every value is 0.
    """
    from scipy.stats import t

    v = np.asarray(per_seed, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size < 2:
        return math.nan
    sd = float(v.std(ddof=1))
    mean = float(v.mean())
    if sd == 0.0:
        return 0.0 if mean != 0.0 else 1.0
    stat = abs(mean) / (sd / math.sqrt(v.size))
    return float(2.0 * t.sf(stat, v.size - 1))


def fieller_ratio_interval(numerator: Sequence[float], denominator: Sequence[float], *,
                           confidence: float = 0.95) -> tuple[float, float, float]:
    """Fieller interval of a ratio of two paired means over training seeds, ``mean(N) / mean(D)``.

    Used for the credit efficiency ``(method - GRPO) / (oracle - GRPO)``: ``N_s`` and ``D_s`` are seed
    ``s``'s differences of the method and of the oracle from GRPO (paired: same seed, same start model).
    The interval is the set of ratios ``r`` that the paired t test of ``mean(N - r D) = 0`` does not
    reject: the roots of ``(b^2 - t^2 v_D) r^2 - 2 (a b - t^2 c) r + (a^2 - t^2 v_N) = 0`` with
    ``a, b`` the means, ``v_N, v_D, c`` the variances and covariance of the means (``ddof=1`` over
    ``S``) and ``t = t_{S-1, (1+confidence)/2}``. It widens as the denominator's own interval nears 0,
    and is unbounded when that interval contains 0 (the oracle does not separate from GRPO).

    Args:
        numerator: ``(S,)`` per-seed numerator values.
        denominator: ``(S,)`` per-seed denominator values, same seeds in the same order; seeds with a
            NaN in either are dropped.
        confidence: coverage.

    Returns:
        ``(ratio, low, high)``: ``low = -inf, high = +inf`` when the interval is unbounded (including
        the case of a union of two half-lines); NaN bounds with fewer than 2 seeds.
    """
    from scipy.stats import t as student_t

    n = np.asarray(numerator, dtype=np.float64)
    d = np.asarray(denominator, dtype=np.float64)
    if n.shape != d.shape:
        raise ValueError(f"numerator {n.shape} and denominator {d.shape} need one value per seed each")
    keep = ~(np.isnan(n) | np.isnan(d))
    n, d = n[keep], d[keep]
    if n.size == 0:
        return math.nan, math.nan, math.nan
    a, b = float(n.mean()), float(d.mean())
    if n.size < 2:
        return (a / b if b != 0.0 else math.nan), math.nan, math.nan
    cov = np.cov(np.stack([n, d]), ddof=1) / n.size
    v_n, v_d, c = float(cov[0, 0]), float(cov[1, 1]), float(cov[0, 1])
    return _quadratic_interval(a, b, v_n, v_d, c, float(student_t.ppf(0.5 + confidence / 2.0, n.size - 1)))


def _quadratic_interval(a: float, b: float, v_n: float, v_d: float, c: float, t: float) -> tuple[float, float, float]:
    """Fieller's interval of ``a / b`` from the means ``a, b``, their variances ``v_n, v_d``, covariance
    ``c`` and the quantile ``t``: the roots of ``(b^2 - t^2 v_D) r^2 - 2 (a b - t^2 c) r + (a^2 - t^2 v_N)``
    (unbounded when ``b``'s own interval contains 0)."""
    ratio = a / b if b != 0.0 else math.nan
    t2 = t * t
    qa, qb, qc = b * b - t2 * v_d, -2.0 * (a * b - t2 * c), a * a - t2 * v_n
    disc = qb * qb - 4.0 * qa * qc
    if qa <= 0.0 or disc < 0.0:
        return ratio, -math.inf, math.inf
    root = math.sqrt(disc)
    return ratio, (-qb - root) / (2.0 * qa), (-qb + root) / (2.0 * qa)


def welch_interval(x: Sequence[float], y: Sequence[float], *, confidence: float = 0.95
                   ) -> tuple[float, float, float, float, float]:
    """``mean(x) - mean(y)`` of two independent samples (e.g. a method's and GRPO's per-seed scores,
    seeds not paired) with Welch's t interval and test.

    Returns:
        ``(diff, low, high, se, p)``: NaN bounds, se and p with fewer than 2 values on a side.
    """
    from scipy.stats import t as student_t

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x[~np.isnan(x)], y[~np.isnan(y)]
    if x.size == 0 or y.size == 0:
        return math.nan, math.nan, math.nan, math.nan, math.nan
    diff = float(x.mean() - y.mean())
    if x.size < 2 or y.size < 2:
        return diff, math.nan, math.nan, math.nan, math.nan
    vx, vy = float(x.var(ddof=1)) / x.size, float(y.var(ddof=1)) / y.size
    se = math.sqrt(vx + vy)
    if se == 0.0:
        return diff, diff, diff, 0.0, (1.0 if diff == 0.0 else 0.0)
    df = (vx + vy) ** 2 / (vx * vx / (x.size - 1) + vy * vy / (y.size - 1))
    t = float(student_t.ppf(0.5 + confidence / 2.0, df))
    p = float(2.0 * student_t.sf(abs(diff) / se, df))
    return diff, diff - t * se, diff + t * se, se, p


def fieller_ratio_interval_unpaired(method: Sequence[float], oracle: Sequence[float], reference: Sequence[float],
                                    *, confidence: float = 0.95) -> tuple[float, float, float]:
    """Fieller interval of the credit efficiency ``(mean(M) - mean(G)) / (mean(O) - mean(G))`` from three
    independent samples of per-seed scores (method ``M``, oracle ``O``, reference ``G``; any seeds,
    any counts: GRPO's extra seeds shared by every method's ratio). Numerator and denominator share
    ``mean(G)``, so their covariance is ``var(G) / n_G``; the quantile is the t's with the
    Satterthwaite degrees of freedom of ``var(M)/n_M + var(O)/n_O + var(G)/n_G``.

    Returns:
        ``(ratio, low, high)`` as :func:`fieller_ratio_interval` (unbounded when the oracle's lead's
        own interval contains 0; NaN bounds with fewer than 2 values on a side).
    """
    from scipy.stats import t as student_t

    m, o, g = (np.asarray(v, dtype=np.float64) for v in (method, oracle, reference))
    m, o, g = m[~np.isnan(m)], o[~np.isnan(o)], g[~np.isnan(g)]
    if not (m.size and o.size and g.size):
        return math.nan, math.nan, math.nan
    a, b = float(m.mean() - g.mean()), float(o.mean() - g.mean())
    if min(m.size, o.size, g.size) < 2:
        return (a / b if b != 0.0 else math.nan), math.nan, math.nan
    vm, vo, vg = (float(v.var(ddof=1)) / v.size for v in (m, o, g))
    terms = [(vm, m.size), (vo, o.size), (vg, g.size)]
    denom = sum(v * v / (n - 1) for v, n in terms)
    df = (vm + vo + vg) ** 2 / denom if denom > 0 else math.inf
    t = float(student_t.ppf(0.5 + confidence / 2.0, df))
    return _quadratic_interval(a, b, vm + vg, vo + vg, vg, t)


def holm_significant(p_values: Sequence[float], *, alpha: float = 0.05) -> np.ndarray:
    """Which of a family of tests are significant under Holm's step-down correction (familywise
    error ``alpha`` over every comparison of the family, with no assumption on their dependence).

    The ``m`` finite p values are sorted, ``p_(1) <= ... <= p_(m)``; ``p_(j)`` is significant when
    ``p_(i) <= alpha / (m - i + 1)`` for every ``i <= j``. NaN p values (no test: one seed, the
    reference itself) are never significant and do not count in ``m``.

    Args:
        p_values: ``(m,)`` p values of the comparisons shown together (one table).
        alpha: familywise error rate.

    Returns:
        ``(m,)`` bool, in the order given.
    """
    p = np.asarray(p_values, dtype=np.float64)
    out = np.zeros(p.shape, dtype=bool)
    finite = np.flatnonzero(~np.isnan(p))
    m = finite.size
    for rank, i in enumerate(finite[np.argsort(p[finite], kind="stable")]):
        if p[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


def seed_mde(sd: float, n_seeds: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable difference of a paired t test over ``n_seeds`` seeds whose per-seed
    differences have standard deviation ``sd``: ``(t_{S-1, 1-alpha/2} + t_{S-1, power}) sd / sqrt(S)``.

    NaN for fewer than 2 seeds or a NaN ``sd``.
    """
    from scipy.stats import t

    if n_seeds < 2 or not math.isfinite(sd):
        return math.nan
    df = n_seeds - 1
    return float((t.ppf(1.0 - alpha / 2.0, df) + t.ppf(power, df)) * sd / math.sqrt(n_seeds))


def seeds_for_mde(sd: float, target: float, *, alpha: float = 0.05, power: float = 0.8,
                  max_seeds: int = 10_000) -> int | None:
    """The fewest seeds (>= 2) whose :func:`seed_mde` is at most ``target``; None when ``sd`` is NaN
    or more than ``max_seeds`` would be needed."""
    if not math.isfinite(sd) or target <= 0:
        return None
    lo, hi = 2, 2
    while seed_mde(sd, hi, alpha=alpha, power=power) > target:  # the MDE falls with S: double, then bisect
        if hi >= max_seeds:
            return None
        lo, hi = hi, min(2 * hi, max_seeds)
    while lo < hi:
        mid = (lo + hi) // 2
        if seed_mde(sd, mid, alpha=alpha, power=power) <= target:
            hi = mid
        else:
            lo = mid + 1
    return hi


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


def paired_se(diffs: Sequence[np.ndarray]) -> float:
    """Standard error of the mean paired difference over problems (the normal-theory twin of
    :func:`paired_bootstrap`).

    For one benchmark with ``d`` of shape ``(S, n)``: ``dbar_i = mean_s d[s, i]`` and
    ``SE = sd(dbar, ddof=1) / sqrt(n)``. For several benchmarks (their unweighted mean):
    ``SE = sqrt(sum_b SE_b^2) / B``. NaN when a benchmark has fewer than 2 problems.
    """
    if not diffs:
        raise ValueError("paired_se: no benchmarks")
    ses = []
    for j, d in enumerate(diffs):
        d = np.asarray(d, dtype=np.float64)
        if d.ndim != 2 or d.shape[1] == 0:
            raise ValueError(f"paired_se: benchmark {j}: expected (n_seeds, n_problems>0), got {d.shape}")
        per_problem = d.mean(axis=0)
        n = per_problem.shape[0]
        ses.append(float(np.std(per_problem, ddof=1) / math.sqrt(n)) if n > 1 else math.nan)
    return float(math.sqrt(sum(s * s for s in ses)) / len(ses))


def mde(se: float, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable difference of a two-sided z test: ``(z_{1-alpha/2} + z_power) * se``."""
    return z_power(alpha, power) * float(se)


def per_seed_differences(d: np.ndarray) -> np.ndarray:
    """``(S,)`` mean difference of each seed over problems, from ``d`` of shape ``(S, n)``."""
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"per_seed_differences: expected (n_seeds, n_problems), got {d.shape}")
    return d.mean(axis=1)


def first_crossing(x: Sequence[float], y: Sequence[float], threshold: float) -> float:
    """The first ``x`` at which the piecewise-linear curve through ``(x, y)`` reaches ``threshold``.

    ``x`` must increase. If ``y[0] >= threshold`` the answer is ``x[0]``; otherwise, with ``j`` the
    first point where ``y[j] >= threshold``, linear interpolation between points ``j-1`` and ``j``:
    ``x[j-1] + (threshold - y[j-1]) / (y[j] - y[j-1]) * (x[j] - x[j-1])``. NaN when no point reaches
    it ("not reached"); NaN values of ``y`` (missing evaluations) are skipped.
    """
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"first_crossing: x and y must be 1-D of one length, got {xs.shape} and {ys.shape}")
    keep = ~np.isnan(ys) & ~np.isnan(xs)
    xs, ys = xs[keep], ys[keep]
    if np.any(np.diff(xs) < 0):
        raise ValueError("first_crossing: x must not decrease")
    hit = np.nonzero(ys >= threshold)[0]
    if hit.size == 0:
        return math.nan
    j = int(hit[0])
    if j == 0:
        return float(xs[0])
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return float(x0 + (threshold - y0) / (y1 - y0) * (x1 - x0))


def pass_at_k(correct_counts: Sequence[int], k: int) -> float:
    """Share of problems with at least one correct answer among their ``k`` samples (``correct_counts``:
    per problem, how many of its ``k`` samples were correct)."""
    c = np.asarray(correct_counts)
    if c.size == 0:
        return math.nan
    if np.any(c > k) or np.any(c < 0):
        raise ValueError(f"pass_at_k: counts must lie in [0, {k}]")
    return float(np.mean(c > 0))
