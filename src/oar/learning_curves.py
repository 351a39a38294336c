"""Learning curves from the in-training held-out evaluation (:mod:`oar.heldout`): one figure, and the
steps and seconds each method needs to reach a held-out accuracy.

Input: per method and seed, the held-out rows of ``metrics.jsonl`` (``step``, ``heldout_acc``,
``train_seconds``), read by :func:`load_heldout`.

- :func:`plot_learning_curves`: two panels, held-out accuracy against the training step and against
  the training seconds; per method the mean over seeds at each evaluation step (x on the seconds panel:
  the mean over seeds of ``train_seconds`` there), with a band over seeds (``report.band``: min-max,
  or the mean's 95% t interval).
- :func:`steps_to_threshold`: per seed, the first step (and second) at which the held-out accuracy
  reaches ``threshold``, interpolated linearly between evaluation points
  (:func:`oar.stats.first_crossing`); per method the mean over seeds, or "not reached" when a seed
  never reaches it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from oar.io import atomic_path, read_jsonl
from oar.stats import first_crossing

__all__ = [
    "load_heldout",
    "heldout_frame",
    "auto_threshold",
    "steps_to_threshold",
    "threshold_markdown",
    "plot_learning_curves",
]


def load_heldout(path: str | Path) -> "pd.DataFrame":  # noqa: F821
    """The held-out rows of one run's ``metrics.jsonl``: columns ``heldout_acc``, ``train_seconds``
    (and the other :data:`oar.heldout.HELDOUT_KEYS` present), indexed by ``step``, sorted; the last row
    of a repeated step wins. Empty when the run has none (``train.heldout.every`` 0)."""
    import pandas as pd

    rows = [r for r in read_jsonl(path) if r.get("heldout_acc") is not None and "step" in r]
    if not rows:
        return pd.DataFrame(columns=["heldout_acc", "train_seconds"], index=pd.Index([], name="step"), dtype=float)
    df = pd.DataFrame.from_records(rows).drop_duplicates("step", keep="last").set_index("step").sort_index()
    return df.apply(pd.to_numeric, errors="coerce")


def heldout_frame(per_seed: Mapping[int, "pd.DataFrame"], key: str = "heldout_acc") -> "pd.DataFrame":  # noqa: F821
    """``(steps, seeds)`` table of ``key`` (NaN where a seed has no row at a step)."""
    import pandas as pd

    cols = [df[key].rename(s) for s, df in per_seed.items() if key in df and len(df)]
    return pd.concat(cols, axis=1).sort_index() if cols else pd.DataFrame()


def auto_threshold(heldout: Mapping[str, Mapping[int, Any]], reference: str) -> float:
    """Halfway between the start model's held-out accuracy (mean over every run's step-0 row) and the
    ``reference`` method's last held-out accuracy (mean over its seeds); NaN when either is missing or
    the reference ends no higher than the start."""
    starts = [float(df["heldout_acc"].loc[0]) for per_seed in heldout.values() for df in per_seed.values()
              if len(df) and 0 in df.index]
    ends = [float(df["heldout_acc"].iloc[-1]) for df in (heldout.get(reference) or {}).values() if len(df)]
    if not starts or not ends or np.mean(ends) <= np.mean(starts):  # no accuracy lies between them
        return math.nan
    return 0.5 * (float(np.mean(starts)) + float(np.mean(ends)))


def steps_to_threshold(heldout: Mapping[str, Mapping[int, Any]], threshold: float,
                       labels: Mapping[str, str] | None = None) -> "pd.DataFrame":  # noqa: F821
    """Steps and training seconds each method needs to reach ``threshold`` held-out accuracy.

    Columns: ``method``, ``label``, ``threshold``, ``n_seeds``, ``reached`` (seeds that reach it),
    ``steps``, ``seconds`` (means over seeds; NaN unless every seed reaches it), ``steps_per_seed``,
    ``seconds_per_seed`` (";"-joined, ``nan`` for a seed that does not). The crossing of each seed is
    interpolated linearly between its evaluation points (:func:`oar.stats.first_crossing`), against
    the step and against ``train_seconds``.
    """
    import pandas as pd

    labels = labels or {}
    recs = []
    for m, per_seed in heldout.items():
        steps, secs = [], []
        for _s, df in per_seed.items():
            if not len(df):
                continue
            y = df["heldout_acc"].to_numpy(dtype=float)
            steps.append(first_crossing(df.index.to_numpy(dtype=float), y, threshold))
            secs.append(first_crossing(df["train_seconds"].to_numpy(dtype=float), y, threshold)
                        if "train_seconds" in df else math.nan)
        if not steps:
            continue
        reached = int(sum(not math.isnan(v) for v in steps))
        every = reached == len(steps)
        recs.append({
            "method": m, "label": labels.get(m, m), "threshold": threshold, "n_seeds": len(steps), "reached": reached,
            "steps": float(np.mean(steps)) if every else math.nan,
            "seconds": float(np.mean(secs)) if every else math.nan,
            "steps_per_seed": ";".join(f"{v:.4g}" for v in steps),
            "seconds_per_seed": ";".join(f"{v:.4g}" for v in secs),
        })
    return pd.DataFrame.from_records(recs, columns=["method", "label", "threshold", "n_seeds", "reached", "steps",
                                                    "seconds", "steps_per_seed", "seconds_per_seed"])


def threshold_markdown(df: "pd.DataFrame", *, threshold: float, how: str) -> str:  # noqa: F821
    """The steps-to-threshold table as markdown, with a note on what it measures (``how``: where the
    threshold comes from)."""
    if not len(df) or math.isnan(threshold):
        return f"### Steps to a held-out accuracy\n\nNo steps-to-threshold table: {how}.\n"
    lines = [f"### Steps to {threshold:.1%} held-out accuracy ({how})", "",
             "| Method | steps | seconds | seeds reaching it | per seed (steps) |", "|---|---:|---:|---:|---|"]
    for r in df.itertuples(index=False):
        if r.reached == r.n_seeds:
            steps, secs = f"{r.steps:.1f}", f"{r.seconds:.0f}"
        else:
            steps = secs = "not reached"
        per = " / ".join("—" if v == "nan" else f"{float(v):.1f}" for v in str(r.steps_per_seed).split(";"))
        lines.append(f"| {r.label} | {steps} | {secs} | {r.reached}/{r.n_seeds} | {per} |")
    lines += ["", "Mean over seeds of the first step (and training second: summed step time, held-out "
              "evaluations excluded) at which the held-out sampled accuracy reaches the threshold, "
              "interpolated linearly between evaluation points; \"not reached\" when a seed never reaches "
              "it within the run (— in the per-seed column).", ""]
    return "\n".join(lines)


def _band(frame: "pd.DataFrame", band: str) -> tuple[np.ndarray, np.ndarray]:  # noqa: F821
    if band == "minmax":
        return frame.min(axis=1).to_numpy(), frame.max(axis=1).to_numpy()
    if band == "ci95":
        from scipy.stats import t

        n = frame.count(axis=1).to_numpy()
        half = np.where(n > 1, t.ppf(0.975, np.maximum(n - 1, 1)) * frame.std(axis=1, ddof=1).to_numpy()
                        / np.sqrt(np.maximum(n, 1)), 0.0)
        mean = frame.mean(axis=1).to_numpy()
        return mean - half, mean + half
    raise ValueError(f"report.band: unknown band {band!r}; valid: minmax, ci95")


def plot_learning_curves(path: str | Path, heldout: Mapping[str, Mapping[int, Any]],
                         labels: Mapping[str, str] | None = None, *, band: str = "minmax",
                         threshold: float | None = None) -> None:
    """Held-out accuracy (%) against step and against training seconds; mean over seeds and a band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = labels or {}
    fig = Figure(figsize=(11.5, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax_step, ax_sec = fig.subplots(1, 2)
    drawn = False
    for m, per_seed in heldout.items():
        acc = heldout_frame(per_seed, "heldout_acc") * 100.0
        if acc.empty:
            continue
        secs = heldout_frame(per_seed, "train_seconds")
        mean = acc.mean(axis=1).to_numpy()
        low, high = _band(acc, band)
        (line,) = ax_step.plot(acc.index.to_numpy(), mean, marker="o", markersize=2.5, linewidth=1.3,
                               label=labels.get(m, m))
        ax_step.fill_between(acc.index.to_numpy(), low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        x = secs.reindex(acc.index).mean(axis=1).to_numpy() if not secs.empty else acc.index.to_numpy()
        ax_sec.plot(x, mean, marker="o", markersize=2.5, linewidth=1.3, color=line.get_color())
        ax_sec.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        drawn = True
    for ax, xlabel in ((ax_step, "training step"), (ax_sec, "training seconds (step time, evaluations excluded)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out sampled accuracy (%)")
        ax.grid(alpha=0.3)
        if threshold is not None and not math.isnan(threshold) and drawn:
            ax.axhline(threshold * 100.0, color="grey", linestyle="--", linewidth=0.8)
    if not drawn:
        ax_step.text(0.5, 0.5, "no held-out evaluation\n(train.heldout.every = 0)", ha="center", va="center",
                     transform=ax_step.transAxes)
    handles, names = ax_step.get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    what = {"minmax": "min-max", "ci95": "95% t interval"}[band]
    fig.suptitle(f"Held-out accuracy during training (mean over seeds, band: {what} over seeds)")
    with atomic_path(Path(path), suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
