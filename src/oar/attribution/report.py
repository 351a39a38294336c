"""Outputs of the attribution benchmark: printed and markdown tables, figures, files."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from oar.core.markdown import markdown_table

__all__ = ["frame_markdown", "localisation_wide", "format_tables", "plot_localisation", "plot_fidelity", "write_outputs"]


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(float(v)):
            return "nan"
        a = abs(float(v))
        if a != 0 and (a < 1e-3 or a >= 1e5):
            return f"{float(v):.2e}"
        return f"{float(v):.{digits}f}"
    return str(v)


def frame_markdown(df: Any, digits: int = 3) -> str:
    """A DataFrame as a markdown table (:func:`oar.core.markdown.markdown_table`; numbers right-aligned,
    floats to ``digits``)."""
    align = "".join("r" if df[c].dtype.kind in "fiu" else "l" for c in df.columns)
    rows = [[_fmt(row[c], digits) for c in df.columns] for _, row in df.iterrows()]
    return "\n".join(markdown_table([str(c) for c in df.columns], rows, align))


def localisation_wide(loc: Any) -> Any:
    """The localisation table with one row per signal and ``<kind> <metric>`` columns (metrics:
    the ``top{k}`` columns, ``AUROC`` = mean per response, ``AUROC pooled``), kinds and signals in
    their order in ``loc``."""
    import pandas as pd

    metrics = [c for c in loc.columns if c.startswith("top")] + ["auroc_mean", "auroc_pooled"]
    label = {"auroc_mean": "AUROC", "auroc_pooled": "AUROC pooled"}
    kinds = list(dict.fromkeys(loc["kind"]))
    rows = []
    for sig in dict.fromkeys(loc["signal"]):
        row: dict[str, Any] = {"signal": sig}
        for kind in kinds:
            r = loc[(loc["signal"] == sig) & (loc["kind"] == kind)]
            for m in metrics:
                row[f"{kind} {label.get(m, m)}"] = float(r[m].iloc[0]) if len(r) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def _n_by_kind(loc: Any) -> str:
    first = loc.drop_duplicates("kind")
    return ", ".join(f"{k}: n = {int(v)}" for k, v in zip(first["kind"], first["n_responses"]))


def format_tables(result: Any) -> str:
    """The three tables as text: error localisation (signal x kind x top-k / AUROC, with n),
    stability (signal x median / IQR, all responses) and cost (seconds per response, ratio)."""
    loc, stab, cost = result.localisation, result.stability, result.cost
    parts = [f"Error localisation ({_n_by_kind(loc)}):", localisation_wide(loc).to_string(index=False, float_format=_fmt)]
    by_pos = _by_position(result)
    if by_pos is not None:
        parts += ["", "Top-3 hit by where the mistake sits (last step / an earlier step, restated by the next):",
                  by_pos.to_string(index=False, float_format=_fmt)]
    if len(stab):
        s = stab[stab["kind"] == "all"][["signal", "comparison", "n", "median", "q25", "q75", "iqr"]]
        parts += ["", "Stability (per-response Spearman between two computations, all responses):",
                  s.to_string(index=False, float_format=_fmt)]
    else:
        parts += ["", "Stability: not computed"]
    c = cost[["signal", "seconds_per_response", "ratio_to_reference", "n_scored", "note"]]
    ref = cost["reference"].iloc[0] if len(cost) else ""
    parts += ["", f"Cost (seconds per response, one process; ratio to {ref}):", c.to_string(index=False, float_format=_fmt)]
    return "\n".join(parts)


def _by_position(result: Any) -> Any:
    """Top-3 hit per signal by mistake position (:func:`localisation_by_position`), signals as rows."""
    from oar.attribution.metrics import localisation_by_position

    per, loc = result.per_response, result.localisation
    if per is None or not len(per) or "mistake_step" not in per or "top3" not in loc:
        return None
    signals = list(dict.fromkeys(loc["signal"]))
    tab = localisation_by_position(per, signals, top_k=(3,))
    if not len(tab):
        return None
    out = tab.set_index(["kind", "position"])[[f"top3_{s}" for s in signals]].T
    out.index = signals
    out.columns = [f"{k} {p} (n={n})" for (k, p), n in zip(out.columns, tab["n_responses"])]
    return out.reset_index(names="signal")


def _markdown(result: Any) -> str:
    loc, stab, cost = result.localisation, result.stability, result.cost
    by_pos = _by_position(result)
    out = ["# Attribution benchmark", "", f"## Error localisation ({_n_by_kind(loc)})", "",
           frame_markdown(localisation_wide(loc)), "",
           *(["Top-3 hit by where the mistake sits (the last step, or an earlier step whose wrong value the "
              "next step restates):", "", frame_markdown(by_pos), ""] if by_pos is not None else []),
           "Long form (with n per kind):", "", frame_markdown(loc), "",
           "## Stability (per-response Spearman between two computations)", "",
           frame_markdown(stab) if len(stab) else "not computed", "",
           "## Cost (seconds per response, one process)", "", frame_markdown(cost), "",
           "## Fidelity (pivotal result digits vs filler words)", "", frame_markdown(result.fidelity), ""]
    return "\n".join(out)


def plot_localisation(result: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Four panels: top-k hit rates per signal and kind (the ``uniform`` signal, if present, is the
    chance level), AUROC per response (mean) per kind with a chance line, stability (median with
    inter-quartile bars, all responses), seconds per response (log scale). Written atomically (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oar.core.io import atomic_path

    loc, stab, cost = result.localisation, result.stability, result.cost
    names = list(dict.fromkeys(loc["signal"]))
    kinds = list(dict.fromkeys(loc["kind"]))
    topc = [c for c in loc.columns if c.startswith("top")]
    x = np.arange(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0, 0]
    bars = [(k, c) for k in kinds for c in topc]
    w = 0.8 / max(len(bars), 1)
    for j, (k, c) in enumerate(bars):
        v = [float(loc[(loc["signal"] == s) & (loc["kind"] == k)][c].iloc[0]) for s in names]
        ax.bar(x - 0.4 + w * (j + 0.5), v, w, label=f"{k} {c}")
    ax.set_xticks(x, names, rotation=35, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("hit rate (mistake among top-k reasoning tokens)")
    ax.legend(fontsize=7, ncol=2, frameon=False)
    ax = axes[0, 1]
    w = 0.8 / max(len(kinds), 1)
    for j, k in enumerate(kinds):
        v = [float(loc[(loc["signal"] == s) & (loc["kind"] == k)]["auroc_mean"].iloc[0]) for s in names]
        ax.bar(x - 0.4 + w * (j + 0.5), v, w, label=k)
    ax.axhline(0.5, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(x, names, rotation=35, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("AUROC, mistake vs correct-step tokens")
    ax.legend(fontsize=7, frameon=False)
    ax = axes[1, 0]
    s = stab[stab["kind"] == "all"] if len(stab) else stab
    if len(s):
        xs = np.arange(len(s))
        med = s["median"].to_numpy(dtype=float)
        err = np.vstack([med - s["q25"].to_numpy(dtype=float), s["q75"].to_numpy(dtype=float) - med])
        ax.bar(xs, med, yerr=err, capsize=3)
        ax.set_xticks(xs, [f"{a}\n({b})" for a, b in zip(s["signal"], s["comparison"])], rotation=35, ha="right", fontsize=7)
    ax.set_ylim(-0.2, 1.05)
    ax.set_ylabel("Spearman between two computations\n(median, IQR)")
    ax = axes[1, 1]
    secs = cost["seconds_per_response"].to_numpy(dtype=float)
    xc = np.arange(len(cost))
    ax.bar(xc, np.where(np.isfinite(secs) & (secs > 0), secs, np.nan))
    ax.set_yscale("log")
    ax.set_xticks(xc, list(cost["signal"]), rotation=35, ha="right")
    ax.set_ylabel("seconds per response")
    fig.suptitle(title or f"Error localisation and stability ({_n_by_kind(loc)})")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def plot_fidelity(fidelity: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Bar chart of AUROC per signal (pooled and mean per response, chance line at 0.5) and a
    panel of seconds per response (log scale); written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oar.core.io import atomic_path

    names = list(fidelity["signal"])
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.38
    ax1.bar(x - w / 2, fidelity["auroc_pooled"].to_numpy(dtype=float), w, label="pooled")
    ax1.bar(x + w / 2, fidelity["auroc_mean_per_response"].to_numpy(dtype=float), w, label="mean per response")
    ax1.axhline(0.5, color="k", linestyle="--", linewidth=1, label="chance")
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylim(0, 1.15)
    ax1.set_yticks(np.linspace(0, 1, 6))
    ax1.set_ylabel("AUROC, pivotal vs filler tokens")
    ax1.legend(loc="upper center", ncol=3, fontsize=8, frameon=False)
    secs = fidelity["seconds_per_response"].to_numpy(dtype=float)
    ax2.bar(x, np.where(np.isfinite(secs) & (secs > 0), secs, np.nan))
    ax2.set_yscale("log")
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax2.set_ylabel("seconds per response")
    n = int(fidelity["n_responses"].iloc[0]) if len(fidelity) else 0
    fig.suptitle(title or f"Attribution fidelity ({n} responses)")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def _write_csv(df: Any, path: Path) -> None:
    from oar.core.io import atomic_path

    with atomic_path(path, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)


def plot_cost_curve(result: Any, path: str | os.PathLike, *, title: str | None = None,
                    min_seconds: float = 1e-4) -> bool:
    """Localisation against cost: the top-3 hit of each signal (one panel per kind, one marker style
    per mistake position: last step / earlier step) against its seconds per response (log scale),
    each point labelled with the signal's name; signals named ``<x>_k<K>`` are joined into a curve
    (the K curve of ``mc_value``); signals under ``min_seconds`` per response (the baselines) are left out.
    Written atomically (PNG); returns False (and writes nothing) when the position split is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oar.core.io import atomic_path

    by_pos = _by_position(result)
    if by_pos is None:
        return False
    secs = dict(zip(result.cost["signal"], result.cost["seconds_per_response"].astype(float)))
    cols = [c for c in by_pos.columns if c != "signal"]
    kinds = list(dict.fromkeys(c.split(" ")[0] for c in cols))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), squeeze=False, sharey=True)
    # signals without a cost of their own (uniform, random, one KTAE pass over the batch) are left out
    keep = [i for i, name in enumerate(by_pos["signal"]) if secs.get(name, 0.0) >= min_seconds]
    names = [by_pos["signal"].iloc[i] for i in keep]
    for ax, kind in zip(axes[0], kinds):
        for col, marker in zip([c for c in cols if c.startswith(kind + " ")], ("o", "s")):
            xs = np.array([secs[n] for n in names], dtype=float)
            ys = by_pos[col].to_numpy(dtype=float)[keep]
            line = ax.scatter(xs, ys, marker=marker, label=col.split(" ", 1)[1])
            for x_, y_, name in zip(xs, ys, names):
                if np.isfinite(y_):
                    ax.annotate(name, (x_, y_), fontsize=6, xytext=(3, 2), textcoords="offset points")
            for prefix in sorted({n.rsplit("_", 1)[0] for n in names if n.rsplit("_", 1)[-1][:1] == "k"}):
                fam = sorted((x_, y_) for x_, y_, n in zip(xs, ys, names)
                             if n.rsplit("_", 1)[0] == prefix and n.rsplit("_", 1)[-1][1:].isdigit())
                if len(fam) > 1:  # a K curve (name_k1, name_k2, ...): joined in order of cost
                    ax.plot(*zip(*fam), color=line.get_facecolor()[0], lw=0.8, alpha=0.6)
        ax.set_xscale("log")
        ax.set_xlabel("seconds per response (one process)")
        ax.set_title(kind)
        ax.set_ylim(-0.02, 1.05)
        ax.legend(fontsize=7, frameon=False)
    axes[0][0].set_ylabel("top-3 hit (mistake among the top 3 reasoning tokens)")
    fig.suptitle(title or "Localisation against cost, by where the mistake sits")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return True


def write_outputs(result: Any, out: str | os.PathLike) -> None:
    """Write ``localisation.csv``, ``stability.csv``, ``cost.csv``, ``fidelity.csv``,
    ``per_response.csv``, ``attribution.md``, ``localisation.png``, ``fidelity.png``,
    ``cost_curve.png`` (:func:`plot_cost_curve`) and ``summary.json`` into ``out`` (created), each
    atomically."""
    from oar.core.io import atomic_write_json, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("localisation", "stability", "cost", "fidelity", "per_response"):
        _write_csv(getattr(result, name), out / f"{name}.csv")
    atomic_write_text(out / "attribution.md", _markdown(result))
    plot_localisation(result, out / "localisation.png")
    plot_fidelity(result.fidelity, out / "fidelity.png")
    plot_cost_curve(result, out / "cost_curve.png")
    atomic_write_json(out / "summary.json", result.summary)
