"""The regime map: where token credit could pay, measured cell by cell (``config/regimes.yaml``).

A cell is the config it belongs to with a set of changes (``regimes.cells[k].set``: response length
through ``task.synthetic.filler_words``, group size through ``rollout.n``, a harder task ...). Each
cell is an ordinary run of the workflow into ``results/<name>_<cell>/`` (:func:`write_cell_configs`
writes a config per cell that ``extends`` the regime config; ``scripts/regimes.sh`` runs them one
after the other, each resumable). :func:`regime_table` then reads every finished cell's
``tables/main.csv`` (its seed-level differences from the reference, :mod:`oar.report`) into one
table; :func:`plot_regime_map` draws oracle - GRPO and credit - GRPO against response length.

Credit efficiency of a method in a cell is ``(method - GRPO) / (oracle - GRPO)``, reported only where
the oracle separates from GRPO (its seed-level interval excludes 0).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from oar.core.io import atomic_path, atomic_write_text
from oar.core.markdown import markdown_table
from oar.report.base import per_seed_values
from oar.core.stats import seed_p_value

__all__ = ["cell_names", "selected_cells", "write_cell_configs", "regime_table", "regime_markdown", "plot_regime_map",
           "write_regime_report"]


def _regimes(config: Mapping[str, Any]) -> dict:
    reg = config.get("regimes") or {}
    if not reg.get("cells"):
        raise ValueError(f"config {config.get('name')!r}: key regimes.cells is empty; nothing to map")
    return reg


def _results_dir(config: Mapping[str, Any], results: str | Path | None) -> Path:
    """The folder holding every cell's run folder: ``results``, else the config's ``results_dir``."""
    return Path(results) if results is not None else Path(config["results_dir"])


def cell_names(config: Mapping[str, Any]) -> list[str]:
    """``<config name>_<cell name>`` of every cell: its run's ``name`` (results under ``results/<name>``)."""
    return [f"{config['name']}_{c['name']}" for c in _regimes(config)["cells"]]


def selected_cells(config: Mapping[str, Any], wanted: Sequence[str] = ()) -> list[str]:
    """The cells to run: those named in ``wanted`` (a cell's name, or its run name ``<config
    name>_<cell>``), in the config's order; with none named, every cell not marked ``optional``.

    Raises:
        ValueError: a name in ``wanted`` that is no cell of the config (lists the cells).
    """
    cells = _regimes(config)["cells"]
    if not wanted:
        return [c["name"] for c in cells if not c["optional"]]
    names = {c["name"] for c in cells}
    runs = dict(zip(cell_names(config), (c["name"] for c in cells)))
    unknown = [w for w in wanted if w not in names and w not in runs]
    if unknown:
        raise ValueError(f"config {config.get('name')!r}: no cell {', '.join(map(repr, unknown))} in regimes.cells "
                         f"(cells: {', '.join(c['name'] for c in cells)})")
    chosen = {runs.get(w, w) for w in wanted}
    return [c["name"] for c in cells if c["name"] in chosen]


def write_cell_configs(config: Mapping[str, Any], config_path: str | Path, out_dir: str | Path,
                       wanted: Sequence[str] = (), *, overrides: Mapping[str, Any] | None = None) -> list[Path]:
    """Write one config per cell of :func:`selected_cells` (``wanted``) to ``out_dir/<name>.yaml``:
    ``extends`` the regime config (absolute path), ``name`` the cell's run name, plus ``overrides``
    (the command line's ``--set`` values, which the regime config file does not hold) and the cell's
    ``set`` on top of them (a cell's own axis wins). Returns the paths, in cell order."""
    import yaml

    from oar.config.source import deep_merge

    out_dir = Path(out_dir)
    chosen = set(selected_cells(config, wanted))
    paths = []
    for name, cell in zip(cell_names(config), _regimes(config)["cells"]):
        if cell["name"] not in chosen:
            continue
        # the run's name is the cell's (a --set name is already in it: cell_names)
        changes = deep_merge({k: v for k, v in (overrides or {}).items() if k != "name"}, cell.get("set") or {})
        body = {"extends": str(Path(config_path).resolve()), "name": name, **changes}
        path = out_dir / f"{name}.yaml"
        atomic_write_text(path, "# written by oar regimes cells: one cell of the regime map\n"
                          + yaml.safe_dump(body, sort_keys=False))
        paths.append(path)
    return paths


def regime_table(config: Mapping[str, Any], results: str | Path | None = None, *,
                 metric: str = "avg@k") -> "pd.DataFrame":  # noqa: F821
    """Every finished cell's differences from the reference on the first benchmark.

    Columns: ``cell``, ``label``, ``length`` (the cell's nominal response length in tokens),
    ``group_size``, ``method``, ``n_seeds``, ``diff``, ``ci_low``, ``ci_high`` (seed-level, points),
    ``mde`` (the cell's seed-level MDE), ``separates`` (the oracle's interval excludes 0 in this cell),
    ``efficiency`` ((method - reference) / (oracle - reference) where the oracle separates, else NaN),
    ``headroom`` (the reference's own gain over the start model, points: a cell where RL does not move
    the reference cannot show credit paying), ``highlight`` (the cell's ``highlight``), ``series`` (its
    ``series``: "length" for the length x group-size grid), ``done`` (False for a cell whose main.csv
    does not exist yet: its other columns are NaN).
    """
    import pandas as pd

    reg = _regimes(config)
    root = _results_dir(config, results)
    bench = config["eval"]["benchmarks"][0]["name"]
    oracle = reg["oracle"]
    recs = []
    for name, cell in zip(cell_names(config), reg["cells"]):
        base = {"cell": cell["name"], "label": cell.get("label", cell["name"]), "length": cell.get("length", math.nan),
                "group_size": cell.get("group_size", math.nan), "highlight": bool(cell.get("highlight", False)),
                "series": cell.get("series", "length")}
        path = root / name / "tables" / "main.csv"
        if not path.exists():
            recs.append({**base, "method": None, "done": False})
            continue
        df = pd.read_csv(path)
        df = df[(df["metric"] == metric) & (df["benchmark"] == bench) & df["diff"].notna()]
        start = df[df["row"] == "base"]
        headroom = -float(start["diff"].iloc[0]) if len(start) else math.nan
        by = df[df["row"] != "base"].set_index("row")
        sep = oracle in by.index and (by.loc[oracle, "ci_low"] > 0 or by.loc[oracle, "ci_high"] < 0)
        for row, r in by.iterrows():
            eff = (r["diff"] / by.loc[oracle, "diff"]) if sep and row != oracle else math.nan
            recs.append({**base, "method": row, "n_seeds": int(r["n_seeds"]), "diff": r["diff"], "ci_low": r["ci_low"],
                         "ci_high": r["ci_high"], "p": seed_p_value(per_seed_values(r.get("diff_per_seed"))),
                         "mde": r["mde"], "separates": bool(sep), "efficiency": eff,
                         "headroom": headroom, "done": True})
    return pd.DataFrame.from_records(recs)


def regime_markdown(df: "pd.DataFrame", *, reference_label: str = "GRPO",  # noqa: F821
                    confidence: float = 0.95) -> str:
    """The regime table as markdown: one row per (cell, method), with the reference's gain over the
    start model (the cell's room for RL). A highlighted cell's label is marked with a star."""
    from oar.report.render import family_significance, format_difference, holm_note

    done = df[df["done"]] if "done" in df else df
    sig, family = family_significance(done["p"] if "p" in done else [], alpha=1.0 - confidence)
    significant = dict(zip(done.index, sig))
    rows = []
    for i, r in zip(df.index, df.itertuples(index=False)):
        label = f"{r.label} ★" if r.highlight else r.label
        if not r.done:
            rows.append([label, f"{r.length:g}", f"{r.group_size:g}", "", "(not run)", "", "", "", ""])
            continue
        eff = "—" if math.isnan(r.efficiency) else f"{r.efficiency:.2f}"
        gain = "" if math.isnan(r.headroom) else f"{r.headroom:+.1f}"
        rows.append([label, f"{r.length:g}", f"{r.group_size:g}", gain, r.method, int(r.n_seeds),
                     format_difference(r.diff, r.ci_low, r.ci_high, significant=significant[i]), f"{r.mde:.1f}", eff])
    lines = markdown_table(["cell", "length", "group", f"{reference_label} - start", "method", "seeds",
                            f"difference from {reference_label} [{confidence:.0%} CI over seeds]", "seed-level MDE",
                            "credit efficiency"], rows, "lrrrlrrrr")
    lines.append("\n" + holm_note(family, 1.0 - confidence))
    if df["highlight"].any():
        lines.append("\n★ highlighted in the map: the cells given more seeds for a seed-level MDE of about 2 points "
                     "(the MDE column says what they reached)")
    return "\n".join(lines) + "\n"


def plot_regime_map(path: str | Path, df: "pd.DataFrame", methods: list[str], *,  # noqa: F821
                    reference_label: str = "GRPO") -> None:
    """Difference from the reference against response length, one panel per group size, one line per
    method over the "length" series, error bars = the seed-level intervals. Cells of another series (a
    harder task) are separate open markers; a highlighted cell gets a shaded band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = df[df["done"]]
    sizes = sorted(done["group_size"].dropna().unique()) or [math.nan]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in every panel
    lengths = sorted(done["length"].dropna().unique())
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False, sharey=True)
    for ax, g in zip(axes[0], sizes):
        sub = done[done["group_size"] == g] if not math.isnan(g) else done
        for length in sorted(sub[sub["highlight"]]["length"].unique()):
            ax.axvspan(length / 1.12, length * 1.12, color="gold", alpha=0.25, lw=0)
        for i, m in enumerate(methods):
            for series, rows in sub[sub["method"] == m].groupby("series", sort=False):
                rows = rows.sort_values("length")
                err = [rows["diff"] - rows["ci_low"], rows["ci_high"] - rows["diff"]]
                x = rows["length"] * 1.04 ** (i - (len(methods) - 1) / 2)  # side by side at each length
                grid = series == "length"
                ax.errorbar(x, rows["diff"], yerr=err, marker="o" if grid else "s", capsize=3, color=colors[m],
                            ls="-" if grid else "none", mfc=None if grid else "white",
                            label=m if grid else f"{m} ({series})")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        if lengths:
            ax.set_xticks(lengths, [f"{v:g}" for v in lengths])
            ax.minorticks_off()
            ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)
        ax.set_xlabel("response length (tokens)")
        ax.set_title(f"group size {g:g}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"avg@k difference from {reference_label} (points)")
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def write_regime_report(config: Mapping[str, Any], results: str | Path | None = None) -> dict[str, Path]:
    """``results/<name>/regime_map.{csv,md,png}`` from every finished cell."""
    reg = _regimes(config)
    root = _results_dir(config, results)
    out_dir = root / config["name"]
    df = regime_table(config, root)
    methods = list(reg.get("plot") or [m for m in dict.fromkeys(df["method"].dropna())])
    out = {"csv": out_dir / "regime_map.csv", "md": out_dir / "regime_map.md", "png": out_dir / "regime_map.png"}
    atomic_write_text(out["csv"], df.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["md"], regime_markdown(df, confidence=float(config["report"]["confidence"])))
    plot_regime_map(out["png"], df, methods)
    return out
