"""Rendering of the main comparison (``main.md``, ``main.tex``) from :func:`oar.report.tables.main_table`'s
long tables: per metric the scores, the differences from the reference with their paired intervals,
the per-seed differences, the minimum detectable difference, and the differences from the start model;
and the start model's own accuracy; and the transfer section (:func:`transfer_markdown`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from oar.core.markdown import markdown_table
from oar.report.base import BASE_ROW

__all__ = ["main_markdown", "main_latex", "wide", "metric_title", "format_difference", "holm_note", "transfer_markdown"]

def holm_note(m: int, alpha: float) -> str:
    """What the bold of a difference table means (one sentence, said once per table note), for a table
    of ``m`` comparisons with an interval at familywise ``alpha``; with none (one seed: no interval)
    it says that nothing is bold."""
    if m == 0:
        return "Bold: none (no interval to test: one seed, or no comparison)."
    return (f"Bold: the interval excludes 0 and the difference survives Holm's correction for the {m} comparisons "
            f"of its table (familywise alpha {alpha:.2g}, oar.core.stats.holm_significant).")


def metric_title(metric: str, k: int | None, temperature: float | None) -> str:
    """``avg@8 (sampled, T = 1.0)``, ``pass@1 (greedy)``, ..."""
    if metric == "pass@1":
        return "pass@1 (greedy)"
    name = metric.replace("@k", f"@{k}") if k else metric
    return f"{name} (sampled, T = {temperature:g})" if temperature is not None else name


def _fmt_cell(mean: float, std: float, digits: int = 1) -> str:
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def format_difference(diff: float, lo: float, hi: float, *, significant: bool, digits: int = 1) -> str:
    """``+2.1 [-2.4, +6.5]``; bold only when the (seed-level) interval excludes 0 and ``significant``
    (the caller's multiple-comparison decision, :func:`oar.core.stats.holm_significant` over its table)."""
    if math.isnan(diff):
        return "—"
    if math.isnan(lo):
        return f"{diff:+.{digits}f}"
    text = f"{diff:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    return f"**{text}**" if significant and (lo > 0 or hi < 0) else text


def family_significance(p_values: Sequence[float], *, alpha: float) -> tuple[list[bool], int]:
    """Holm's decision for the comparisons of one table: (significant per p value, the family size m)."""
    import numpy as np

    from oar.core.stats import holm_significant

    p = np.asarray(p_values, dtype=np.float64)
    return list(holm_significant(p, alpha=alpha)), int(np.isfinite(p).sum())


def _fmt_seeds(joined: str, digits: int = 1) -> str:
    if not isinstance(joined, str) or not joined:
        return "—"
    return " / ".join(f"{float(v):+.{digits}f}" for v in joined.split(";"))


def wide(df, column: str, *, rows: Sequence[str] | None = None, alpha: float = 0.05) -> "pd.DataFrame":  # noqa: F821
    """One formatted cell per (row label, benchmark): ``cell`` (mean ± std), ``diff`` (difference from
    the reference [interval]), ``seeds`` (per-seed differences) or ``start`` (difference from the start).
    A ``diff`` / ``start`` cell is bold when it survives Holm's correction at ``alpha`` over the cells
    of this table (columns ``p`` / ``start_p``)."""
    import pandas as pd

    order = list(dict.fromkeys(df["benchmark"]))
    sel = df if rows is None else df[df["row"].isin(rows)]
    labels = list(dict.fromkeys(sel["label"]))
    p_col = {"diff": "p", "start": "start_p"}.get(column)
    sig = family_significance(sel[p_col], alpha=alpha)[0] if p_col else [False] * len(sel)
    cells = {}
    for r, significant in zip(sel.itertuples(index=False), sig):
        if column == "cell":
            v = _fmt_cell(r.mean, r.std)
        elif column == "diff":
            v = format_difference(r.diff, r.ci_low, r.ci_high, significant=significant)
        elif column == "seeds":
            v = _fmt_seeds(r.diff_per_seed)
        elif column == "start":
            v = format_difference(r.start_diff, r.start_ci_low, r.start_ci_high, significant=significant)
        else:
            raise ValueError(f"wide: unknown column {column!r}")
        cells[(r.label, r.benchmark)] = v
    return pd.DataFrame([[cells[(lab, b)] for b in order] for lab in labels], index=pd.Index(labels, name="Method"),
                        columns=order)


def _md_table(w) -> str:
    """A wide table (:func:`wide`) as markdown: its index (the method) left, its columns right."""
    rows = [[i, *r] for i, r in zip(w.index, w.values)]
    return "\n".join(markdown_table([w.index.name, *w.columns], rows, "l" + "r" * len(w.columns)))


def interval_heading(confidence: float, n_seeds: int) -> str:
    """What a difference table's cells hold, for its heading: the seed-level interval with two or more
    seeds; with one, that there is none (main.csv keeps the problem-level bootstrap interval)."""
    if n_seeds >= 2:
        return f"{confidence:.0%} interval over training seeds"
    return "one training seed: no interval over seeds (main.csv has a problem-level bootstrap interval, problem_ci_*)"


def _interval_note(*, reference_label: str, confidence: float, n_boot: int, seed: int, n_seeds: int,
                   family: int, start: bool = False) -> str:
    other = "the start model" if start else reference_label
    pairing = ("seed s of the method minus the start model (one evaluation, paired with every seed)" if start
               else f"seed s of the method minus seed s of {reference_label} (the start model, evaluated once, "
                    "is paired with every seed)")
    return (
        f"Difference from {other} in points: the mean over seeds and problems of d[s, i] = score on problem i of "
        f"{pairing}. Interval: {confidence:.0%} t interval over the {n_seeds} training seed(s), each seed one "
        f"replicate: D_s = mean_i d[s, i] (the Average column: the mean over benchmarks), mean(D) -+ "
        f"t_(S-1) sd(D) / sqrt(S) with S - 1 = {max(n_seeds - 1, 0)} degrees of freedom (oar.core.stats.seed_interval; "
        "no interval with one seed). " + holm_note(family, 1.0 - confidence)
        + " The problems are the same for every seed, "
        f"so which problems were drawn is not resampled; main.csv holds that problem-level interval "
        f"(problem_ci_*, a {n_boot}-resample bootstrap, seed {seed}) for comparison."
    )


def _mde_line(df, *, confidence: float, power: float, reference_label: str, short: bool = False) -> str:
    mdes = df.drop_duplicates("benchmark")
    if mdes["mde"].isna().all():  # one seed: no seed-level sd to compute it from
        return ("**Minimum detectable difference**: not defined; a seed-level sd needs a paired comparison over 2 or "
                "more seeds.")
    vals = ", ".join(f"{r.benchmark} {r.mde:.1f}" if not math.isnan(r.mde) else f"{r.benchmark} —"
                     for r in mdes.itertuples(index=False))
    target = float(mdes["target_mde"].iloc[0])
    need = ", ".join(f"{r.benchmark} {int(r.seeds_for_target)}" if r.seeds_for_target == r.seeds_for_target
                     and r.seeds_for_target is not None else f"{r.benchmark} —" for r in mdes.itertuples(index=False))
    alpha = 1.0 - confidence
    seeds_line = f" Seeds for a seed-level MDE of {target:g} points (same sd): {need}."
    if short:
        return (f"**Minimum detectable difference** (seed level, power {power:.0%}, two-sided alpha {alpha:.2g}, "
                f"as above), in points: {vals}.{seeds_line}")
    source = str(mdes["mde_source"].iloc[0]).replace("the reference", reference_label)
    pse = df["problem_se"].dropna()
    ratio = (f" For comparison, the problem-sampling SE of a difference (median over methods) is "
             f"{float(pse.median()):.2f} points." if len(pse) else "")
    return (
        f"**Minimum detectable difference** (seed level, power {power:.0%}, two-sided alpha {alpha:.2g}) of this "
        f"design, in points: {vals}. MDE = (t_(S-1, {1 - alpha / 2:.3g}) + t_(S-1, {power:.2g})) x sd / sqrt(S), "
        f"sd here the {source}.{ratio}{seeds_line}"
    )


def main_markdown(tables: Mapping[str, Any], *, start: Any | None, reference: str, reference_label: str,
                  confidence: float, power: float, n_boot: int, seed: int, k: int | None,
                  temperature: float | None, rollout_temperature: float | None, seeds: Sequence[int] = (),
                  extra: str = "") -> str:
    """``main.md``: the start model's accuracy, then per metric (``tables``: metric -> long table) the
    scores, the differences from the reference with intervals, per-seed differences, the MDE line
    and the differences from the start model; ``extra`` (e.g. the steps-to-threshold table) last."""
    parts: list[str] = []
    if start is not None and len(start):
        parts += ["## Start model (the base row)", ""]
        heads = [("pass@1", "pass@1 greedy")]
        if k:
            heads += [("avg@k", f"pass@1 at T = {temperature:g} (avg@{k})"), ("pass@k", f"pass@{k} at T = {temperature:g}")]
        heads += [("answered", "answers with a final answer the reward reads")]
        rows = [[name, *("—" if math.isnan(v) else f"{v:.1f}" for v in start[key])]
                for key, name in heads if key in start and start[key].notna().any()]
        parts += markdown_table(["", *start["benchmark"]], rows, "l" + "r" * len(start)) + [""]
        if k and rollout_temperature is not None and temperature is not None and rollout_temperature != temperature:
            parts += [f"(The rollout temperature is {rollout_temperature:g}; these samples use eval.temperature "
                      f"{temperature:g}.)", ""]
        if k:
            parts += [f"pass@{k}: share of problems with at least one correct answer among its {k} samples.", ""]
    seed_names = " / ".join(str(s) for s in seeds) if seeds else "in config order"
    for j, (metric, df) in enumerate(tables.items()):
        title = metric_title(metric, k, temperature)
        non_base = df.loc[df["row"] != "base", "n_seeds"]
        n_seeds = int(non_base.max()) if len(non_base) else 1
        again = "" if j == 0 else "Interval as defined above. "  # the notes are spelled out once
        parts += [f"## {title}", "", f"### Mean ± std over {n_seeds} seed(s) (%)", "", _md_table(wide(df, "cell")), ""]
        if df["diff"].notna().any():
            others = [r for r in dict.fromkeys(df["row"]) if r != reference]
            family = int(df.loc[df["row"].isin(others), "p"].notna().sum())
            note = (again + holm_note(family, 1.0 - confidence) if again else
                    _interval_note(reference_label=reference_label, confidence=confidence, n_boot=n_boot,
                                   seed=seed, n_seeds=n_seeds, family=family))
            parts += [f"### Difference from {reference_label} (points), {interval_heading(confidence, n_seeds)}", "",
                      _md_table(wide(df, "diff", rows=others, alpha=1.0 - confidence)), "", note.strip(), "",
                      _mde_line(df, confidence=confidence, power=power, reference_label=reference_label,
                                short=bool(again)), "",
                      f"#### Per-seed differences from {reference_label} (points; seeds {seed_names})", "",
                      _md_table(wide(df, "seeds", rows=others)), ""]
        if df["start_diff"].notna().any():
            methods = [r for r in dict.fromkeys(df["row"]) if r != "base"]
            family = int(df.loc[df["row"].isin(methods), "start_p"].notna().sum())
            note = (again + holm_note(family, 1.0 - confidence) if again else
                    _interval_note(reference_label=reference_label, confidence=confidence, n_boot=n_boot,
                                   seed=seed, n_seeds=n_seeds, family=family, start=True))
            parts += [f"### Difference from the start model (points), {interval_heading(confidence, n_seeds)}", "",
                      _md_table(wide(df, "start", rows=methods, alpha=1.0 - confidence)), "", note.strip(), ""]
    if extra:
        parts += [extra]
    return "\n".join(parts).rstrip() + "\n"


def _esc(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#"),
                 ("±", r"$\pm$"), ("—", "--")):
        s = s.replace(a, b)
    return s


def _cell_tex(v: str) -> str:
    """A markdown cell as LaTeX: ``**x**`` (significant, :func:`wide`) becomes ``\\textbf{x}``."""
    if len(v) > 4 and v.startswith("**") and v.endswith("**"):
        return r"\textbf{" + _esc(v[2:-2]) + "}"
    return _esc(v)


def _tabular(w, caption: str) -> str:
    cols = "l" + "r" * len(w.columns)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{_esc(caption)}}}", rf"\begin{{tabular}}{{{cols}}}",
             r"\toprule", " & ".join([_esc(w.index.name)] + [_esc(c) for c in w.columns]) + r" \\", r"\midrule"]
    for i, r in zip(w.index, w.values):
        lines.append(" & ".join([_esc(str(i))] + [_cell_tex(str(v)) for v in r]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines)


def main_latex(tables: Mapping[str, Any], *, reference: str, reference_label: str, confidence: float,
               k: int | None, temperature: float | None) -> str:
    """``main.tex``: per metric the scores and the differences from the reference (booktabs tabulars)."""
    out = []
    for metric, df in tables.items():
        title = metric_title(metric, k, temperature)
        out.append(_tabular(wide(df, "cell"), f"{title} (%), mean ± std over seeds"))
        if df["diff"].notna().any():
            others = [r for r in dict.fromkeys(df["row"]) if r != reference]
            mdes = df.drop_duplicates("benchmark")
            mde_txt = "; ".join(f"{b} {v:.1f}" for b, v in zip(mdes["benchmark"], mdes["mde"]) if not math.isnan(v))
            family = int(df.loc[df["row"].isin(others), "p"].notna().sum())
            caption = (f"{title}: difference from {reference_label} (points), "
                       + (f"{confidence:.0%} t interval over training seeds; seed-level minimum detectable difference: "
                          f"{mde_txt}; bold: significant after Holm's correction for {family} comparisons" if family
                          else "one training seed: no interval, nothing bold"))
            out.append(_tabular(wide(df, "diff", rows=others, alpha=1.0 - confidence), caption))
    return "% generated by oar.report (needs \\usepackage{booktabs})\n" + "\n\n".join(out) + "\n"


def versus_markdown(table: Any, *, reference_label: str, confidence: float) -> str:
    """A difference table against another reference (``report.also_against``): one row per method,
    one column per benchmark, ``diff [low, high]`` with the seed-level interval (bold when it survives
    Holm's correction over the cells of this table)."""
    df = table[table["row"] != "base"]
    df = df[~df.groupby("row")["diff"].transform(lambda d: d.isna().all())]
    sig, family = family_significance(df["p"], alpha=1.0 - confidence)
    significant = dict(zip(zip(df["row"], df["benchmark"]), sig))
    benches = list(dict.fromkeys(df["benchmark"]))
    metric = df["metric"].iloc[0] if len(df) else ""
    rows = []
    for row, sub in df.groupby("row", sort=False):
        by = sub.set_index("benchmark")
        rows.append([by["label"].iloc[0], *(format_difference(by.loc[b, "diff"], by.loc[b, "ci_low"], by.loc[b, "ci_high"],
                                                              significant=significant[(row, b)]) for b in benches)])
    n_seeds = int(df["n_seeds"].max()) if "n_seeds" in df and len(df) else 1
    lines = [f"### Difference from {reference_label} ({metric}, points), {interval_heading(confidence, n_seeds)}",
             "", *markdown_table(["Method", *benches], rows, "l" + "r" * len(benches))]
    lines += ["", holm_note(family, 1.0 - confidence)]
    return "\n".join(lines) + "\n"


def _level_cell(mean: float, low: float, high: float, digits: int = 1) -> str:
    """``41.2 [38.0, 44.4]`` (a score and its interval; the score alone without one)."""
    if math.isnan(low):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def transfer_markdown(tables: Mapping[str, Any], *, confidence: float, k: int | None,
                      temperature: float | None) -> str:
    """The "Transfer (no claim)" section of ``main.md``: per metric (``tables``: metric ->
    :func:`oar.report.tables.transfer_table`) one row per start model / listed method, one column per
    transfer benchmark (its number of problems in the header), each cell the mean over seeds with its
    t interval over seeds. No difference is taken and nothing is bold: these rows are not compared."""
    first = next(iter(tables.values()))
    methods = [lab for row, lab in dict.fromkeys(zip(first["row"], first["label"])) if row != BASE_ROW]
    n_seeds = int(first.loc[first["row"] != BASE_ROW, "n_seeds"].max()) if methods else 1
    parts = ["## Transfer (no claim)", "",
             f"The transfer benchmarks (eval.transfer), evaluated with the settings above on the start model and on "
             f"{', '.join(methods) or 'no method'} only. Not a comparison: no differences, no test, nothing bold. "
             f"Cells: the score (%), for a method the mean over its {n_seeds} training seed(s) with the {confidence:.0%} "
             "t interval over seeds (oar.core.stats.seed_interval; none with one seed; the problems are fixed, so only "
             "the training seed varies); tables/transfer.csv holds the seed-level sd and the per-seed scores.", ""]
    for metric, df in tables.items():
        benches = list(dict.fromkeys(df["benchmark"]))
        n = df.drop_duplicates("benchmark").set_index("benchmark")["n_problems"]
        rows = [[sub["label"].iloc[0], *(_level_cell(r.mean, r.ci_low, r.ci_high) for r in sub.itertuples(index=False))]
                for _, sub in df.groupby("row", sort=False)]
        parts += [f"### {metric_title(metric, k, temperature)}", "",
                  *markdown_table(["Method", *(f"{b} (n = {n[b]})" for b in benches)], rows, "l" + "r" * len(benches)),
                  ""]
    return "\n".join(parts)
