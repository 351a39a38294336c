"""Rank statistics of the attribution benchmark: average ranks, AUROC, Spearman, top-k hit, and
median / inter-quartile summaries. Plain numpy on 1-D arrays."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["average_ranks", "auroc", "spearman", "topk_hit", "summarize"]


def average_ranks(x: np.ndarray | Sequence[float]) -> np.ndarray:
    """1-based ranks of ``x`` with ties given their average rank (like ``scipy.stats.rankdata``).

    Args:
        x: ``(n,)`` finite values.

    Returns:
        ``(n,)`` float64 ranks.
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size and not np.isfinite(a).all():
        raise ValueError("oar.attribution.average_ranks: scores must be finite (got NaN or inf)")
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    # value group g covers ranks (cum[g] - counts[g], cum[g]]: its average is cum - (counts - 1)/2
    avg = np.cumsum(counts) - (counts - 1) / 2.0
    return avg[inverse.ravel()]


def auroc(scores: np.ndarray | Sequence[float], labels: np.ndarray | Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive), ties counted 1/2.

    The Mann-Whitney form ``(sum of positive ranks - n1 (n1 + 1) / 2) / (n1 n0)`` with average
    ranks, i.e. ``P(s_pos > s_neg) + P(s_pos == s_neg) / 2`` over all positive/negative pairs.

    Args:
        scores: ``(n,)`` finite scores (larger = more positive).
        labels: ``(n,)`` booleans.

    Returns:
        AUROC in ``[0, 1]``; NaN when either class is empty.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"oar.attribution.auroc: scores shape {s.shape} != labels shape {y.shape}")
    n1 = int(y.sum())
    n0 = int(y.size - n1)
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = average_ranks(s)
    u = r[y].sum() - n1 * (n1 + 1) / 2.0
    return float(u / (n1 * n0))


def spearman(x: np.ndarray | Sequence[float], y: np.ndarray | Sequence[float]) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks); NaN when fewer than two
    values or when either input is constant."""
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"oar.attribution.spearman: shapes {a.shape} and {b.shape} differ")
    if a.size < 2:
        return float("nan")
    ra = average_ranks(a) - (a.size + 1) / 2.0
    rb = average_ranks(b) - (b.size + 1) / 2.0
    den = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    if den == 0.0:
        return float("nan")
    return float((ra * rb).sum() / den)


def topk_hit(scores: np.ndarray | Sequence[float], positives: np.ndarray | Sequence[bool], k: int) -> float:
    """Probability that at least one of the ``k`` highest-scored items is a positive, ties broken
    uniformly at random.

    With ``s_k`` the k-th largest score, ``g`` items score above it and ``m`` tie at it (``p`` of
    them positive); ``k - g`` of the tied items are drawn without replacement. The hit is 1 when a
    positive scores above ``s_k``, else ``1 - C(m - p, k - g) / C(m, k - g)``. Without ties this is
    the plain 0/1 hit; a constant score gives the chance level ``1 - C(n - P, k) / C(n, k)``.

    Args:
        scores: ``(n,)`` finite scores over the candidate items (larger = ranked first).
        positives: ``(n,)`` booleans.
        k: ``>= 1``; ``k >= n`` gives 1 when there is any positive.

    Returns:
        the hit probability in ``[0, 1]``; NaN when there is no item or no positive.
    """
    if k < 1:
        raise ValueError(f"oar.attribution.topk_hit: k must be >= 1, got {k}")
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(positives).ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"oar.attribution.topk_hit: scores shape {s.shape} != positives shape {y.shape}")
    if s.size and not np.isfinite(s).all():
        raise ValueError("oar.attribution.topk_hit: scores must be finite (got NaN or inf)")
    if s.size == 0 or not y.any():
        return float("nan")
    k = min(k, s.size)
    sk = np.sort(s)[::-1][k - 1]
    above = s > sk
    if y[above].any():
        return 1.0
    tied = s == sk
    m, p, draw = int(tied.sum()), int((tied & y).sum()), k - int(above.sum())
    if p == 0:
        return 0.0
    return 1.0 - math.comb(m - p, draw) / math.comb(m, draw)


def summarize(values: np.ndarray | Sequence[float]) -> dict[str, float]:
    """``n`` (finite values), ``mean``, ``median``, ``q25``, ``q75`` and ``iqr`` of the finite values
    (NaN statistics when there are none)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        nan = float("nan")
        return {"n": 0, "mean": nan, "median": nan, "q25": nan, "q75": nan, "iqr": nan}
    q25, med, q75 = np.percentile(v, [25, 50, 75])
    return {"n": int(v.size), "mean": float(v.mean()), "median": float(med), "q25": float(q25),
            "q75": float(q75), "iqr": float(q75 - q25)}
