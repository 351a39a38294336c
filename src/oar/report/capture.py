"""Credit efficiency: how much of the credit an oracle captures over the reference a method captures.

``(method - reference) / (oracle - reference)`` per benchmark column of :func:`oar.report.tables.main_table`,
with the Fieller interval over training seeds (:func:`oar.core.stats.fieller_ratio_interval`): numerator and
denominator are the same seed's differences from the reference, so the pairing by seed is kept and
the interval widens as the oracle's own lead becomes uncertain (it is unbounded when the oracle's
interval contains 0). Written as ``tables/credit_efficiency.csv`` and a section of ``main.md`` when
``report.efficiency_oracle`` names a method.
"""

from __future__ import annotations

import math

import numpy as np

from oar.core.markdown import markdown_table
from oar.report.base import BASE_ROW, ReportError, per_seed_values

__all__ = ["EFFICIENCY_COLUMNS", "credit_efficiency_table", "credit_efficiency_markdown"]

#: The columns of :func:`credit_efficiency_table` (also of its empty table: no method but the reference
#: and the oracle).
EFFICIENCY_COLUMNS = ["row", "label", "metric", "benchmark", "n_seeds", "diff", "diff_low", "diff_high", "p",
                      "oracle_diff", "oracle_low", "oracle_high", "oracle_p", "efficiency", "eff_low", "eff_high"]


def credit_efficiency_table(table: "pd.DataFrame", *, oracle: str, confidence: float = 0.95,  # noqa: F821
                            pairing: str = "seed", reference: str | None = None) -> "pd.DataFrame":  # noqa: F821
    """The credit efficiency of every method of one metric's main table against ``oracle``.

    Args:
        table: :func:`oar.report.tables.main_table`'s long table (its ``diff_per_seed`` column holds
            each seed's difference from the reference, same seed order on every row).
        oracle: the method whose lead over the reference is the denominator.
        confidence: coverage of the Fieller interval.
        pairing: ``seed`` (``report.pairing``'s default): each seed's differences from the
            reference's same seed (:func:`oar.core.stats.fieller_ratio_interval`); ``none``: the method's,
            the oracle's and the reference's per-seed scores as three independent samples
            (:func:`oar.core.stats.fieller_ratio_interval_unpaired`; the differences and their p values
            Welch's, :func:`oar.core.stats.welch_interval`), for a design whose seeds share nothing
            across methods (docs/methods.md, 7.1).
        reference: the reference's row (needed with ``pairing: none``).

    Returns:
        One row per (method, benchmark) except the start model, the reference and the oracle (none
        when the config runs no other method), columns :data:`EFFICIENCY_COLUMNS`: ``row``,
        ``label``, ``metric``, ``benchmark``, ``n_seeds``, ``diff`` (method - reference, points),
        ``diff_low``, ``diff_high`` (its seed-level interval), ``p`` (its seed-level p value),
        ``oracle_diff`` (oracle - reference), ``oracle_low``, ``oracle_high`` (its interval),
        ``efficiency``, ``eff_low``, ``eff_high`` (Fieller; -inf/+inf when unbounded).

    Raises:
        ReportError: ``oracle`` is not a method of the table or has no differences (it is the reference).
    """
    import pandas as pd

    orc = table[table["row"] == oracle]
    if orc.empty:
        raise ReportError(f"report.efficiency_oracle: {oracle!r} is not a method of this config")
    orc = orc.set_index("benchmark")
    if orc["diff_per_seed"].map(lambda j: len(per_seed_values(j))).eq(0).all():
        raise ReportError(f"report.efficiency_oracle: {oracle!r} is the reference; name another method")
    if pairing == "none":
        ref = table[table["row"] == reference].set_index("benchmark") if reference is not None else None
        if ref is None or ref.empty:
            raise ReportError(f"report.pairing none: the reference {reference!r} has no row in this table")
    recs = []
    for _, r in table.iterrows():
        if r["row"] in (BASE_ROW, oracle) or not isinstance(r["diff_per_seed"], str) or not r["diff_per_seed"]:
            continue
        o = orc.loc[r["benchmark"]]
        if pairing == "none":
            rec = _unpaired(r, o, ref.loc[r["benchmark"]], confidence)
        else:
            ratio, low, high = _fieller(r["diff_per_seed"], o["diff_per_seed"], confidence)
            rec = {"diff": r["diff"], "diff_low": r["ci_low"], "diff_high": r["ci_high"], "p": r["p"],
                   "oracle_diff": o["diff"], "oracle_low": o["ci_low"], "oracle_high": o["ci_high"], "oracle_p": o["p"],
                   "efficiency": ratio, "eff_low": low, "eff_high": high}
        recs.append({"row": r["row"], "label": r["label"], "metric": r["metric"], "benchmark": r["benchmark"],
                     "n_seeds": int(r["n_seeds"]), **rec})
    return pd.DataFrame.from_records(recs, columns=EFFICIENCY_COLUMNS)


def _unpaired(row: "pd.Series", oracle: "pd.Series", reference: "pd.Series", confidence: float) -> dict:  # noqa: F821
    """The efficiency record of ``row`` with the three rows' per-seed scores as independent samples."""
    from oar.core.stats import fieller_ratio_interval_unpaired, welch_interval

    m, o, g = (per_seed_values(x["per_seed"]) for x in (row, oracle, reference))
    diff, low, high, _, p = welch_interval(m, g, confidence=confidence)
    odiff, olow, ohigh, _, op = welch_interval(o, g, confidence=confidence)
    ratio, elow, ehigh = fieller_ratio_interval_unpaired(m, o, g, confidence=confidence)
    return {"diff": diff, "diff_low": low, "diff_high": high, "p": p, "oracle_diff": odiff, "oracle_low": olow,
            "oracle_high": ohigh, "oracle_p": op, "efficiency": ratio, "eff_low": elow, "eff_high": ehigh}


def _fieller(method_joined: str, oracle_joined: str, confidence: float) -> tuple[float, float, float]:
    from oar.core.stats import fieller_ratio_interval

    n, d = np.asarray(per_seed_values(method_joined)), np.asarray(per_seed_values(oracle_joined))
    if n.size != d.size:
        raise ReportError(f"credit efficiency: {n.size} per-seed differences against the oracle's {d.size}")
    return fieller_ratio_interval(n, d, confidence=confidence)


def _fmt_ratio(ratio: float, low: float, high: float, *, significant: bool) -> str:
    if math.isnan(ratio):
        return "—"
    if math.isnan(low):
        return f"{ratio:+.2f}"
    if math.isinf(low) or math.isinf(high):
        return f"{ratio:+.2f} (unbounded)"
    text = f"{ratio:+.2f} [{low:+.2f}, {high:+.2f}]"
    return f"**{text}**" if significant and (low > 0 or high < 0) else text


def credit_efficiency_markdown(eff: "pd.DataFrame", *, oracle_label: str, reference_label: str,  # noqa: F821
                               confidence: float, benchmark: str = "Average", pairing: str = "seed") -> str:
    """A ``main.md`` section: per method its difference from the reference and its credit efficiency on
    one benchmark column (bold: the interval excludes 0 and the method's difference survives Holm's
    correction over the methods shown; the Fieller interval excludes 0 exactly when the paired t test
    of the difference rejects)."""
    import pandas as pd

    from oar.report.render import family_significance, format_difference, holm_note

    df = eff[eff["benchmark"] == benchmark]
    if df.empty:
        return ""
    # the family: each method's test against the reference, and (unpaired) the oracle's own lead, once
    tests = list(df["p"]) + ([df["oracle_p"].iloc[0]] if pairing == "none" else [])
    sig, family = family_significance(pd.Series(tests), alpha=1.0 - confidence)
    o = df.iloc[0]
    how = "paired by seed" if pairing == "seed" else "unpaired (the three rows' seeds as independent samples; Welch's differences)"
    oracle_bold = bool(pairing == "none" and sig[-1])
    lines = [f"### Credit efficiency against {oracle_label} ({df['metric'].iloc[0]}, {benchmark})", "",
             f"(method - {reference_label}) / ({oracle_label} - {reference_label}), with {oracle_label} - {reference_label} = "
             f"{format_difference(o['oracle_diff'], o['oracle_low'], o['oracle_high'], significant=oracle_bold)} points. {confidence:.0%} Fieller interval over training seeds, {how}.", "",
             *markdown_table(["Method", f"vs {reference_label} (points)", "Credit efficiency"],
                             [[r["label"], format_difference(r["diff"], r["diff_low"], r["diff_high"], significant=bool(s)),
                               _fmt_ratio(r["efficiency"], r["eff_low"], r["eff_high"], significant=bool(s))]
                              for (_, r), s in zip(df.iterrows(), sig)], "lrr")]
    lines += ["", holm_note(family, 1.0 - confidence)]
    return "\n".join(lines) + "\n"
