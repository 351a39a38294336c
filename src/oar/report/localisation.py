"""Does localisation predict what training gains? Each method's credit efficiency against how often its
credit signal finds an earlier-step mistake.

``report.credit_signals`` maps a trained method to the attribution signal that scores tokens as its
credit does (``{oar_g: oar_g_joint, grpo: uniform, ...}``). For every mapped method that has a credit
efficiency (:func:`oar.report.capture.credit_efficiency_table`), this module joins it with the signal's
top-k hit rate by mistake position (:func:`oar.attribution.metrics.localisation_by_position`, over the
attribution benchmark's ``per_response.csv``) on the start model and on each trained policy of
``attribution.trained``, and draws efficiency (with its Fieller interval) against the earlier-step hit
rate. Written as ``tables/efficiency_vs_localisation.csv`` and
``figures/efficiency_vs_localisation.png``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from oar.core.io import atomic_path
from oar.report.base import ReportError

__all__ = ["START_POLICY", "attribution_per_response_files", "efficiency_vs_localisation",
           "plot_efficiency_vs_localisation"]

#: How the table names the attribution benchmark's start model (``attribution/`` itself).
START_POLICY = "start model"


def attribution_per_response_files(config: Mapping[str, Any], root: str | Path) -> dict[str, Path]:
    """``{policy: per_response.csv}`` of the attribution benchmark under the results folder ``root``:
    :data:`START_POLICY` -> ``attribution/per_response.csv``, and ``<method>_seed<seed>`` ->
    ``attribution/<method>_seed<seed>/per_response.csv`` for each entry of ``attribution.trained``."""
    att = Path(root) / "attribution"
    out = {START_POLICY: att / "per_response.csv"}
    for t in (config.get("attribution") or {}).get("trained") or []:
        name = f"{t['method']}_seed{t['seed']}"
        out[name] = att / name / "per_response.csv"
    return out


def efficiency_vs_localisation(eff: "pd.DataFrame", per_response: Mapping[str, "pd.DataFrame"],  # noqa: F821
                               signals: Mapping[str, str], labels: Mapping[str, str], *,
                               kind: str = "sampled", k: int = 3, benchmark: str = "Average",
                               oracle: str | None = None) -> "pd.DataFrame":  # noqa: F821
    """One row per (mapped method, attribution policy): the method's credit efficiency and difference
    from the reference on ``benchmark``, and its signal's top-``k`` hit rate of ``kind`` mistakes in the
    last step and in an earlier one. The ``oracle`` itself, when mapped, is a row of efficiency 1 (its
    difference: the oracle's lead), the top of the calibration curve.

    Args:
        eff: :func:`oar.report.capture.credit_efficiency_table`'s table.
        per_response: ``{policy: the attribution benchmark's per-response frame}``
            (:func:`attribution_per_response_files`, read).
        signals: method -> attribution signal name (``report.credit_signals``); methods without a
            credit efficiency (the reference, the oracle) are left out.
        labels: method -> label.

    Returns:
        Columns ``method``, ``label``, ``signal``, ``policy``, ``n_earlier``, ``earlier_top{k}``,
        ``n_last``, ``last_top{k}``, ``diff``, ``diff_low``, ``diff_high``, ``efficiency``, ``eff_low``,
        ``eff_high``.

    Raises:
        ReportError: a mapped method is not a row of ``labels``, or its signal is not a signal of an
            attribution table (naming the key).
    """
    import pandas as pd

    from oar.attribution.metrics import localisation_by_position

    unknown = [m for m in signals if m not in labels]
    if unknown:
        raise ReportError(f"report.credit_signals.{unknown[0]}: not a method of this config "
                          f"(rows: {', '.join(labels)})")
    rows = eff[eff["benchmark"] == benchmark].set_index("row")
    recs = []
    for policy, per in per_response.items():
        for method, signal in signals.items():
            if method not in rows.index and method != oracle:
                continue
            if f"top{k}_{signal}" not in per.columns:
                raise ReportError(f"report.credit_signals.{method}: {signal!r} is not a signal of the "
                                  f"attribution table of the {policy} (attribution.signals names them)")
            by_pos = localisation_by_position(per[per["kind"] == kind], [signal], top_k=(k,))
            at = {r["position"]: r for _, r in by_pos.iterrows()}
            rec = {"method": method, "label": labels.get(method, method), "signal": signal, "policy": policy}
            for pos in ("earlier", "last"):
                rec[f"n_{pos}"] = int(at[pos]["n_responses"]) if pos in at else 0
                rec[f"{pos}_top{k}"] = float(at[pos][f"top{k}_{signal}"]) if pos in at else math.nan
            if method in rows.index:
                r = rows.loc[method]
                recs.append({**rec, **{c: r[c] for c in ("diff", "diff_low", "diff_high", "efficiency", "eff_low", "eff_high")}})
            elif len(rows):  # the oracle: efficiency 1 by definition, its lead over the reference
                r = rows.iloc[0]
                recs.append({**rec, "diff": r["oracle_diff"], "diff_low": r["oracle_low"], "diff_high": r["oracle_high"],
                             "efficiency": 1.0, "eff_low": 1.0, "eff_high": 1.0})
    cols = ["method", "label", "signal", "policy", "n_earlier", f"earlier_top{k}", "n_last", f"last_top{k}",
            "diff", "diff_low", "diff_high", "efficiency", "eff_low", "eff_high"]
    return pd.DataFrame.from_records(recs, columns=cols)


def plot_efficiency_vs_localisation(path: str | Path, table: "pd.DataFrame", *, k: int = 3,  # noqa: F821
                                    oracle_label: str, reference_label: str,
                                    policies: Sequence[str] | None = None, calibration: Sequence[str] = (),
                                    unmatched: Mapping[str, float] | None = None) -> None:
    """Credit efficiency (Fieller interval; an unbounded end drawn to the axis edge) against the
    earlier-step top-``k`` hit rate of each method's signal: filled markers on the start model, hollow
    ones on each trained policy, joined per method. ``calibration``: the methods that are the oracle at a
    lower localisation (and the oracle), joined on the start model as the calibration curve a practical
    signal is read against; ``unmatched``: signals no trained method uses yet, ``{name: earlier-step
    top-k on the start model}``, drawn as vertical lines (where on the curve they would sit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(policies or dict.fromkeys(table["policy"]))
    finite = table[["eff_low", "eff_high"]].replace([math.inf, -math.inf], math.nan)
    lo = min(-0.5, float(finite.min().min()) if finite.notna().any().any() else -0.5)
    hi = max(1.5, float(finite.max().max()) if finite.notna().any().any() else 1.5)
    eff = table["efficiency"].replace([math.inf, -math.inf], math.nan).dropna()
    if len(eff):
        span = max(float(eff.max() - eff.min()), 1.0)
        lo, hi = min(lo, float(eff.min()) - 0.1 * span), max(hi, float(eff.max()) + 0.1 * span)
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for i, (method, grp) in enumerate(table.groupby("method", sort=False)):
        color = f"C{i % 10}"
        grp = grp.set_index("policy").reindex(policies).dropna(subset=["efficiency"])
        ax.plot(grp[f"earlier_top{k}"], grp["efficiency"], color=color, lw=0.8, alpha=0.6)
        for j, (policy, r) in enumerate(grp.iterrows()):
            low = lo if math.isinf(r["eff_low"]) or math.isnan(r["eff_low"]) else r["eff_low"]
            high = hi if math.isinf(r["eff_high"]) or math.isnan(r["eff_high"]) else r["eff_high"]
            if not low <= r["efficiency"] <= high:  # Fieller's set excludes the ratio (unbounded): the whole axis
                low, high = lo, hi
            ax.errorbar([r[f"earlier_top{k}"]], [r["efficiency"]],
                        yerr=[[r["efficiency"] - low], [high - r["efficiency"]]], fmt="o", color=color,
                        mfc=color if j == 0 else "white", capsize=3, label=r["label"] if j == 0 else None)
    start = table[table["policy"] == policies[0]] if len(table) else table
    curve = start[start["method"].isin(list(calibration))].sort_values(f"earlier_top{k}")
    if len(curve) > 1:
        ax.plot(curve[f"earlier_top{k}"], curve["efficiency"], color="0.3", lw=1.6, ls="-", zorder=0,
                label="calibration: the oracle at lower localisation")
    for j, (name, x) in enumerate(sorted((unmatched or {}).items(), key=lambda kv: kv[1])):
        ax.axvline(x, color="0.6", lw=0.9, ls="-.")
        ax.text(x, lo + (0.04 + 0.06 * j) * (hi - lo), f" {name} (no arm yet) ", fontsize=7, color="0.3",
                ha="right" if x > 0.5 else "left")
    ax.axhline(0.0, color="0.5", lw=0.8, ls="--")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_ylim(lo, hi)
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel(f"earlier-step top-{k} hit of the method's signal (filled: {policies[0]}"
                  + (f"; hollow: {', '.join(policies[1:])})" if len(policies) > 1 else ")"))
    ax.set_ylabel(f"credit efficiency vs {oracle_label}\n(method - {reference_label}) / ({oracle_label} - {reference_label})")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=130, format="png")
    plt.close(fig)
