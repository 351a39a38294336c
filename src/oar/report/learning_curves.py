"""Learning curves from the in-training held-out evaluation (:mod:`oar.evaluate.heldout`): one figure, and the
steps and seconds each method needs to reach a held-out accuracy.

Input: per method and seed, the held-out rows of ``metrics.jsonl`` (``step``, ``heldout_acc``,
``train_seconds``), read by :func:`load_heldout`.

- :func:`plot_learning_curves`: two panels, held-out accuracy against the training step and against
  the training seconds; per method the mean over seeds at each evaluation step (x on the seconds panel:
  the mean over seeds of ``train_seconds`` there), with a band over seeds (``report.band``: min-max,
  or the mean's 95% t interval).
- :func:`steps_to_threshold`: per seed, the first step (and second) at which the held-out accuracy
  reaches ``threshold``, interpolated linearly between evaluation points
  (:func:`oar.core.stats.first_crossing`); per method the mean over seeds, or "not reached" when a seed
  never reaches it.
- :func:`learning_speed_table`: learning-speed endpoints with seed-level intervals: the area under
  each seed's held-out curve (its mean accuracy over the run) and the steps to the threshold, each as
  a difference from the reference method paired by seed, with the t interval over seeds
  (:func:`oar.core.stats.seed_interval`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from oar.core.io import atomic_path, read_jsonl
from oar.core.markdown import markdown_table
from oar.core.stats import first_crossing, seed_interval, seed_p_value

__all__ = [
    "load_heldout",
    "heldout_frame",
    "auto_threshold",
    "steps_to_threshold",
    "threshold_markdown",
    "heldout_auc",
    "learning_speed_table",
    "learning_speed_markdown",
    "plot_learning_curves",
]


def load_heldout(path: str | Path) -> "pd.DataFrame":  # noqa: F821
    """The held-out rows of one run's ``metrics.jsonl``: columns ``heldout_acc``, ``train_seconds``
    (and the other :data:`oar.evaluate.heldout.HELDOUT_KEYS` present), indexed by ``step``, sorted; the last row
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
    interpolated linearly between its evaluation points (:func:`oar.core.stats.first_crossing`), against
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
    rows = []
    for r in df.itertuples(index=False):
        if r.reached == r.n_seeds:
            steps, secs = f"{r.steps:.1f}", f"{r.seconds:.0f}"
        else:
            steps = secs = "not reached"
        per = " / ".join("—" if v == "nan" else f"{float(v):.1f}" for v in str(r.steps_per_seed).split(";"))
        rows.append([r.label, steps, secs, f"{r.reached}/{r.n_seeds}", per])
    lines = [f"### Steps to {threshold:.1%} held-out accuracy ({how})", "",
             *markdown_table(["Method", "steps", "seconds", "seeds reaching it", "per seed (steps)"], rows, "lrrrl")]
    lines += ["", "Mean over seeds of the first step (and training second: summed step time, held-out "
              "evaluations excluded) at which the held-out sampled accuracy reaches the threshold, "
              "interpolated linearly between evaluation points; \"not reached\" when a seed never reaches "
              "it within the run (— in the per-seed column).", ""]
    return "\n".join(lines)


def heldout_auc(df: "pd.DataFrame") -> float:  # noqa: F821
    """Area under one run's held-out curve, normalised by its length: the trapezoid integral of
    ``heldout_acc`` over the steps divided by (last step - first step), i.e. the run's mean held-out
    accuracy (a fraction). NaN with fewer than 2 evaluation points."""
    y = df["heldout_acc"].to_numpy(dtype=float) if len(df) else np.array([])
    x = df.index.to_numpy(dtype=float) if len(df) else np.array([])
    keep = ~np.isnan(y)
    x, y = x[keep], y[keep]
    if len(x) < 2 or x[-1] <= x[0]:
        return math.nan
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0 / (x[-1] - x[0]))


def _per_seed_endpoints(per_seed: Mapping[int, Any], threshold: float) -> dict[int, tuple[float, float]]:
    """Seed -> (AUC, steps to ``threshold``) of one method's runs with held-out rows."""
    out = {}
    for s, df in per_seed.items():
        if len(df):
            steps = (first_crossing(df.index.to_numpy(dtype=float), df["heldout_acc"].to_numpy(dtype=float), threshold)
                     if not math.isnan(threshold) else math.nan)
            out[s] = (heldout_auc(df), steps)
    return out


def learning_speed_table(heldout: Mapping[str, Mapping[int, Any]], threshold: float, reference: str, *,
                         labels: Mapping[str, str] | None = None, confidence: float = 0.95) -> "pd.DataFrame":  # noqa: F821
    """Learning-speed endpoints of every method with seed-level intervals against ``reference``.

    Columns: ``method``, ``label``, ``n_seeds``, ``auc`` (mean over seeds of :func:`heldout_auc`, in
    percent), ``auc_diff``, ``auc_low``, ``auc_high`` (difference from the reference in points, paired by
    seed, t interval over the seeds both have), ``steps`` (mean steps to ``threshold``; NaN unless every
    seed reaches it), ``steps_diff``, ``steps_low``, ``steps_high`` (likewise, NaN when a seed of either
    side does not reach it), ``auc_p`` and ``steps_p`` (the t tests' p values, :func:`oar.core.stats.seed_p_value`),
    ``auc_per_seed`` and ``steps_per_seed`` (";"-joined).
    """
    import pandas as pd

    labels = labels or {}
    ends = {m: _per_seed_endpoints(per_seed, threshold) for m, per_seed in heldout.items()}
    ref = ends.get(reference, {})
    recs = []
    for m, per in ends.items():
        if not per:
            continue
        auc = np.array([v[0] for v in per.values()]) * 100.0
        steps = np.array([v[1] for v in per.values()])
        rec = {"method": m, "label": labels.get(m, m), "n_seeds": len(per), "auc": float(np.nanmean(auc)),
               "steps": float(steps.mean()) if not np.isnan(steps).any() else math.nan,
               "auc_per_seed": ";".join(f"{v:.4g}" for v in auc), "steps_per_seed": ";".join(f"{v:.4g}" for v in steps)}
        common = [s for s in per if s in ref]
        for j, key in enumerate(("auc", "steps")):
            scale = 100.0 if key == "auc" else 1.0
            d = np.array([(per[s][j] - ref[s][j]) * scale for s in common])
            if m == reference or not len(d) or np.isnan(d).any():
                est = lo = hi = p = math.nan
            else:
                est, lo, hi, _ = seed_interval(d, confidence=confidence)
                p = seed_p_value(d)
            rec.update({f"{key}_diff": est, f"{key}_low": lo, f"{key}_high": hi, f"{key}_p": p})
        recs.append(rec)
    cols = ["method", "label", "n_seeds", "auc", "auc_diff", "auc_low", "auc_high", "auc_p", "steps", "steps_diff",
            "steps_low", "steps_high", "steps_p", "auc_per_seed", "steps_per_seed"]
    return pd.DataFrame.from_records(recs, columns=cols)


def learning_speed_markdown(df: "pd.DataFrame", *, threshold: float, reference_label: str,  # noqa: F821
                            confidence: float = 0.95) -> str:
    """The learning-speed endpoints as markdown (see :func:`learning_speed_table`)."""
    from oar.report.render import family_significance, format_difference, holm_note

    if not len(df):
        return ""
    # one family: every difference the table shows (both columns)
    sig, family = family_significance([*df["auc_p"], *df["steps_p"]], alpha=1.0 - confidence)
    auc_sig, steps_sig = sig[:len(df)], sig[len(df):]
    thr = "—" if math.isnan(threshold) else f"{threshold:.1%}"
    lines = [f"### Learning speed: differences from {reference_label}, {confidence:.0%} interval over training seeds", "",
             *markdown_table(["Method", "held-out AUC (%)", "AUC difference (points)", f"steps to {thr}", "steps difference"],
                             [[r.label, f"{r.auc:.1f}", format_difference(r.auc_diff, r.auc_low, r.auc_high, significant=a_sig),
                               "not reached" if math.isnan(r.steps) else f"{r.steps:.1f}",
                               format_difference(r.steps_diff, r.steps_low, r.steps_high, significant=s_sig)]
                              for r, a_sig, s_sig in zip(df.itertuples(index=False), auc_sig, steps_sig)], "lrrrr")]
    lines += ["", "Held-out AUC: the area under a run's held-out curve divided by its length (the mean held-out "
              "sampled accuracy over the run, trapezoid rule over the evaluation steps). Differences are paired by "
              "seed; the interval is the t interval over the per-seed differences (— when a seed of either side "
              "never reaches the threshold, or for one seed). A negative steps difference is faster learning. "
              + holm_note(family, 1.0 - confidence), ""]
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
