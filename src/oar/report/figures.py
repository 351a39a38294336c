"""Figures of the training metrics: training curves and credit concentration over steps (mean ± std over seeds)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from oar.core.io import atomic_path

__all__ = ["plot_training_curves", "plot_credit_concentration"]


def _curves(metrics, key: str):
    """Per method: (steps, mean over seeds, std over seeds) of ``key``; methods without it are skipped."""
    import pandas as pd

    out = {}
    for m, per_seed in metrics.items():
        cols = [df[key].rename(s) for s, df in per_seed.items() if key in df]
        if not cols:
            continue
        frame = pd.concat(cols, axis=1)
        out[m] = (frame.index.to_numpy(), frame.mean(axis=1).to_numpy(), frame.std(axis=1, ddof=0).to_numpy())
    return out


def _plot_panels(path: Path, metrics, panels: Sequence[tuple[str, str]], labels: Mapping[str, str], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.0 * len(panels) + 1.5, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, ylabel) in zip(axes, panels):
        for m, (x, mean, std) in _curves(metrics, key).items():
            (line,) = ax.plot(x, mean, label=labels.get(m, m), linewidth=1.4)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    fig.suptitle(title)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def plot_training_curves(path: str | Path, metrics, labels: Mapping[str, str] | None = None) -> None:
    """Reward and accuracy of the rollouts per step, one line per method (mean ± std over seeds)."""
    _plot_panels(Path(path), metrics, [("reward", "mean reward"), ("accuracy", "rollout accuracy")],
                 labels or {}, "Training curves (mean ± std over seeds)")


def plot_credit_concentration(path: str | Path, metrics, labels: Mapping[str, str] | None = None) -> None:
    """ESS ratio of the token weights and top-10% advantage mass per step, one line per method."""
    _plot_panels(Path(path), metrics, [("ess_ratio", "ESS ratio of token weights"),
                                       ("top10_mass", "top-10% |advantage| mass")],
                 labels or {}, "Credit concentration (mean ± std over seeds)")
