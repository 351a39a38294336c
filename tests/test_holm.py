"""Multiple comparisons: the seed-level t test's p value, Holm's step-down correction, and the
tables' bold (only a difference whose interval excludes 0 and that survives the correction for the
comparisons its table shows)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from oar.report.render import format_difference, wide
from oar.core.stats import holm_significant, seed_interval, seed_p_value


def test_seed_p_value_is_the_one_sample_t_test_the_interval_inverts():
    d = [-3.0, -2.5, -3.8]
    assert seed_p_value(d) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue)
    # the 95% interval excludes 0 exactly when p < 0.05
    for per_seed in ([1.0, 2.0, 0.5], [1.0, -2.0, 0.5], [0.1, 0.2, 0.15, 0.12]):
        _, lo, hi, _ = seed_interval(per_seed)
        assert (lo > 0 or hi < 0) == (seed_p_value(per_seed) < 0.05)
    assert math.isnan(seed_p_value([1.0])) and seed_p_value([2.0, 2.0]) == 0.0 and seed_p_value([0.0, 0.0]) == 1.0


def test_holm_by_hand():
    # m = 3: 0.01 <= 0.05/3, then 0.03 > 0.05/2 stops: only the first
    assert holm_significant([0.01, 0.04, 0.03]).tolist() == [True, False, False]
    assert holm_significant([0.01, 0.02, 0.03]).tolist() == [True, True, True]  # 0.0167, 0.025, 0.05
    # NaN does not count in m: with it m = 2, 0.024 <= 0.05/2
    assert holm_significant([0.024, float("nan"), 0.04]).tolist() == [True, False, True]
    assert holm_significant([0.024, 0.9, 0.04]).tolist() == [False, False, False]
    assert holm_significant([]).tolist() == []


def test_an_interval_excluding_zero_is_bold_only_when_it_survives_the_correction():
    assert format_difference(-3.1, -4.6, -1.7, significant=True) == "**-3.1 [-4.6, -1.7]**"
    assert format_difference(-3.1, -4.6, -1.7, significant=False) == "-3.1 [-4.6, -1.7]"
    assert format_difference(1.0, -1.0, 3.0, significant=True) == "+1.0 [-1.0, +3.0]"  # contains 0: never bold
    # a table of 12 comparisons where one seed-level test gives p ~ 0.015: bold alone, plain among 12
    per_seed = np.array([-3.0, -2.5, -3.8])
    p = seed_p_value(per_seed)
    assert 0.01 < p < 0.05
    _, lo, hi, _ = seed_interval(per_seed)
    rows = [{"row": "dapo", "label": "dapo", "benchmark": "b0", "diff": per_seed.mean(), "ci_low": lo, "ci_high": hi,
             "p": p}]
    alone = wide(pd.DataFrame(rows), "diff", alpha=0.05)
    assert alone.iloc[0, 0].startswith("**")
    rows += [{"row": f"m{i}", "label": f"m{i}", "benchmark": "b0", "diff": 0.1, "ci_low": -1.0, "ci_high": 1.2,
              "p": 0.8} for i in range(11)]
    among = wide(pd.DataFrame(rows), "diff", alpha=0.05)
    assert not among.iloc[0, 0].startswith("**") and among.iloc[0, 0] == "-3.1 [-4.7, -1.5]"


def test_fieller_interval_hand_computed_and_widens_with_an_uncertain_oracle():
    import math

    from scipy.stats import t

    from oar.core.stats import fieller_ratio_interval

    # N = 1, 2, 3 (mean 2, var of mean 1/3); D = 4, 4, 4 (no spread): the ratio's interval is the
    # t interval of mean(N) divided by 4
    r, lo, hi = fieller_ratio_interval([1.0, 2.0, 3.0], [4.0, 4.0, 4.0])
    half = t.ppf(0.975, 2) * math.sqrt(1.0 / 3.0)
    assert r == 0.5
    assert math.isclose(lo, (2.0 - half) / 4.0) and math.isclose(hi, (2.0 + half) / 4.0)
    # the same numerator over an oracle lead of the same mean, spread over seeds (uncorrelated with N):
    # wider on both sides
    _, lo2, hi2 = fieller_ratio_interval([1.0, 2.0, 3.0], [3.5, 5.0, 3.5])
    assert lo2 < lo and hi2 > hi
    # an oracle whose own interval contains 0: unbounded
    assert fieller_ratio_interval([1.0, 2.0, 3.0], [-1.0, 0.5, 1.0])[1:] == (-math.inf, math.inf)
    # the interval holds every ratio the paired test of mean(N - r D) = 0 does not reject
    from oar.core.stats import seed_p_value

    n, d = [0.5, 1.5, 1.0, 2.0], [2.5, 3.0, 2.0, 3.5]
    _, lo, hi = fieller_ratio_interval(n, d)
    for r_ in (lo, hi):
        assert math.isclose(seed_p_value([x - r_ * y for x, y in zip(n, d)]), 0.05, rel_tol=1e-6)


def test_welch_interval_hand_values():
    from oar.core.stats import welch_interval

    diff, low, high, se, p = welch_interval([1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 1.0])
    # means 2 and 0.5; var/n 1/3 and (1/3)/4 = 1/12; se = sqrt(5/12); Welch df = (5/12)^2 / ((1/3)^2/2 + (1/12)^2/3)
    assert diff == pytest.approx(1.5) and se == pytest.approx((5 / 12) ** 0.5)
    from scipy.stats import t as T

    df = (5 / 12) ** 2 / ((1 / 3) ** 2 / 2 + (1 / 12) ** 2 / 3)
    half = T.ppf(0.975, df) * (5 / 12) ** 0.5
    assert (low, high) == (pytest.approx(1.5 - half), pytest.approx(1.5 + half))
    assert p == pytest.approx(2 * T.sf(1.5 / (5 / 12) ** 0.5, df))
    assert all(map(math.isnan, welch_interval([1.0], [2.0, 3.0])[1:]))


def test_unpaired_fieller_covers_the_ratio_and_reduces_to_the_delta_method_when_the_oracle_is_far():
    """Simulated seeds: the interval holds the true efficiency about 95% of the time; with the oracle's
    lead far from 0 its half-width is t x the delta method's SE."""
    from oar.core.stats import fieller_ratio_interval_unpaired

    rng = np.random.default_rng(0)
    cover = 0
    for _ in range(2000):
        g, o, m = rng.normal(27, 3, 12), rng.normal(47, 3, 10), rng.normal(37, 3, 8)  # efficiency 0.5
        r, lo, hi = fieller_ratio_interval_unpaired(m, o, g)
        cover += lo <= 0.5 <= hi
    assert 0.93 < cover / 2000 < 0.97
    g, o, m = np.array([0.0, 1.0, 2.0]), np.array([1000.0, 1001.0, 1002.0]), np.array([500.0, 501.0, 502.0])
    r, lo, hi = fieller_ratio_interval_unpaired(m, o, g)
    assert r == pytest.approx(0.5) and lo < 0.5 < hi and hi - lo < 0.01
    # an oracle within noise of the reference: unbounded
    assert fieller_ratio_interval_unpaired([1.0, 2.0], [0.0, 1.0], [0.5, 0.4])[1:] == (-math.inf, math.inf)
