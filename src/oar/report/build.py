"""``oar report``: :func:`build_report` writes every table and figure of a finished results tree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from oar.config.tree import ResultsTree
from oar.core.io import atomic_write_text
from oar.report.base import (BASE_ROW, TRANSFER_FOLDER, ReportError, eval_dirs, report_option, results_root, rows_of,
                             transfer_rows)
from oar.report.efficiency import all_metrics, efficiency_table
from oar.report.figures import plot_credit_concentration, plot_training_curves
from oar.report.tables import main_table, start_model_table, transfer_table

__all__ = ["report_metrics", "build_report", "result_provenances", "provenance_footer"]


def report_metrics(config: Mapping[str, Any]) -> list[str]:
    """The metrics the main tables show: ``avg@k`` when ``eval.samples`` > 0, ``pass@1`` when
    ``eval.greedy`` (at least one of them)."""
    ev = config["eval"]
    out = (["avg@k"] if ev.get("samples") else []) + (["pass@1"] if ev["greedy"] else [])
    return out or ["pass@1"]


def result_provenances(config: Mapping[str, Any], root: str | Path) -> dict[str, list[dict | None]]:
    """The recorded provenance (:mod:`oar.core.provenance`) of every result the report summarises:
    ``{"training runs": [...], "evaluations": [...]}``, one entry per ``train_summary.json`` of each
    method and seed and per evaluation ``summary.json`` (the base row first), and with
    ``eval.transfer.benchmarks`` ``"transfer evaluations"``, one per transfer ``summary.json``; None for
    a file without one (written before provenance was recorded) or that cannot be read."""
    import json

    root = Path(root)
    seeds = list(config.get("seeds") or [0])
    methods = [name for name, _ in rows_of(config) if name != BASE_ROW]

    def read(path: Path) -> dict | None:
        try:
            prov = json.loads(path.read_text(encoding="utf-8")).get("provenance")
        except (OSError, ValueError, AttributeError):
            return None
        return prov if isinstance(prov, dict) else None

    tree = ResultsTree.at(root)
    runs = [(m, s) for m in methods for s in seeds]
    out = {"training runs": [read(Path(tree.run_summary(m, s))) for m, s in runs],
           "evaluations": [read(Path(tree.eval_summary(BASE_ROW)))] + [read(Path(tree.eval_summary(m, s))) for m, s in runs]}
    if config["eval"]["transfer"]["benchmarks"]:
        out["transfer evaluations"] = [read(d / "summary.json") for row, _ in transfer_rows(config)
                                       for d in eval_dirs(root, row, seeds, folder=TRANSFER_FOLDER).values()]
    return out


def provenance_footer(provenances: Mapping[str, list[dict | None]]) -> str | None:
    """The last line of ``main.md``: :func:`oar.core.provenance.describe` over ``provenances``
    (:func:`result_provenances`), or None when none of them has a provenance (then ``main.md`` has
    no footer, as before provenance was recorded)."""
    from oar.core.provenance import describe

    every = [p for group in provenances.values() for p in group]
    counts = ", ".join(f"{len(group)} {name}" for name, group in provenances.items())
    return describe(every, what=f"the {len(every)} results summarised ({counts})")


def _all_heldout(config: Mapping[str, Any], root: Path) -> dict[str, dict[int, "pd.DataFrame"]]:  # noqa: F821
    from oar.report.learning_curves import load_heldout

    seeds = list(config.get("seeds") or [0])
    methods = [name for name, _ in rows_of(config) if name != BASE_ROW]
    tree = ResultsTree.at(root)
    return {m: {s: load_heldout(Path(tree.run_metrics(m, s))) for s in seeds} for m in methods}


def build_report(
    config: Mapping[str, Any],
    results: str | Path | None = None,
    *,
    reference: str | None = None,
    seed: int = 0,
    n_boot: int | None = None,
    confidence: float | None = None,
    metric: str | None = None,
    skip_steps: int = 1,
) -> dict[str, Path]:
    """Write the tables and figures of a finished results tree (see the module docstring).

    Args:
        config: a validated config (:func:`oar.config.load.load_config`).
        results: the results folder ``R`` (default ``<results_dir>/<name>``).
        reference: the method differences and overheads are relative to (default ``report.reference``).
        seed: bootstrap seed.
        n_boot: bootstrap resamples (default ``eval.bootstrap``).
        confidence: interval coverage (default ``report.confidence``).
        metric: only this metric's tables (default: :func:`report_metrics`).
        skip_steps: warm-up steps left out of the efficiency means (see :func:`efficiency_table`).

    Returns:
        ``{"main_csv", "main_md", "main_tex", "steps_to_threshold_csv", "learning_speed_csv", "efficiency_csv",
        "learning_curves", "training_curves", "credit_concentration"}`` -> the paths written, and
        ``"credit_efficiency_csv"`` with ``report.efficiency_oracle`` (and ``"efficiency_vs_localisation"``,
        ``"efficiency_vs_localisation_csv"`` with ``report.credit_signals`` too), ``"versus_<method>_csv"`` per
        ``report.also_against``, ``"transfer_csv"`` with ``eval.transfer.benchmarks``.

    Raises:
        ReportError: a result file is missing (every missing file is named).
    """
    import pandas as pd

    from oar.report.learning_curves import learning_speed_table, plot_learning_curves, steps_to_threshold

    root = results_root(config, results)
    labels = dict(rows_of(config))
    reference = report_option(config, "reference", reference)
    confidence = float(report_option(config, "confidence", confidence))
    power = float(report_option(config, "power", None))
    n_boot = int(config["eval"]["bootstrap"]) if n_boot is None else int(n_boot)
    metrics_shown = [metric] if metric else report_metrics(config)
    tables = {m: main_table(config, root, reference=reference, n_boot=n_boot, seed=seed, confidence=confidence,
                            metric=m, power=power) for m in metrics_shown}
    start = start_model_table(config, root)
    metrics = all_metrics(config, root)
    eff = efficiency_table(config, root, reference=reference, metrics=metrics, skip_steps=skip_steps)
    heldout = _all_heldout(config, root)
    ref_label = labels.get(reference, reference)
    threshold, how = _report_threshold(config, heldout, reference, ref_label)
    steps = steps_to_threshold(heldout, threshold, labels) if not math.isnan(threshold) else steps_to_threshold({}, 0.0)
    speed = learning_speed_table(heldout, threshold, reference, labels=labels, confidence=confidence)
    out = _report_paths(root)
    ev = config["eval"]
    k = int(ev.get("samples") or 0) or None
    temperature = float(ev["temperature"])
    rollout_t = (config.get("rollout") or {}).get("temperature")
    atomic_write_text(out["main_csv"], pd.concat(list(tables.values()), ignore_index=True)
                      .to_csv(index=False, float_format="%.6g"))
    versus = _write_versus(config, root, out, labels, n_boot=n_boot, seed=seed, confidence=confidence,
                           metric=metrics_shown[0], power=power)
    versus = _write_credit_efficiency(config, root, out, tables[metrics_shown[0]], labels, ref_label=ref_label,
                                      confidence=confidence) + versus
    transfer = _write_transfer(config, root, out, metrics_shown, confidence=confidence, k=k, temperature=temperature)
    _write_main_markdown(config, root, out, tables, start, steps, speed, extra=versus, threshold=threshold, how=how,
                         reference=reference, ref_label=ref_label, confidence=confidence, power=power, n_boot=n_boot,
                         seed=seed, k=k, temperature=temperature, rollout_t=rollout_t, transfer=transfer)
    atomic_write_text(out["steps_to_threshold_csv"], steps.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["learning_speed_csv"], speed.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(out["efficiency_csv"], eff.to_csv(index=False, float_format="%.6g"))
    plot_learning_curves(out["learning_curves"], heldout, labels, band=report_option(config, "band", None),
                         threshold=threshold)
    plot_training_curves(out["training_curves"], metrics, labels)
    plot_credit_concentration(out["credit_concentration"], metrics, labels)
    return out


def _write_main_markdown(
    config: Mapping[str, Any],
    root: Path,
    out: Mapping[str, Path],
    tables: Mapping[str, "pd.DataFrame"],  # noqa: F821
    start: "pd.DataFrame",  # noqa: F821
    steps: "pd.DataFrame",  # noqa: F821
    speed: "pd.DataFrame",  # noqa: F821
    *,
    extra: str,
    threshold: float,
    how: str,
    reference: str,
    ref_label: str,
    confidence: float,
    power: float,
    n_boot: int,
    seed: int,
    k: int | None,
    temperature: float,
    rollout_t: float | None,
    transfer: str = "",
) -> None:
    """Write ``tables/main.md`` (the main tables, ``extra`` (the sections of ``report.also_against``
    and ``report.efficiency_oracle``), the steps to ``threshold`` and the learning speed, ``transfer``
    (the transfer section, apart from the comparison), and the provenance footer) and ``tables/main.tex``."""
    from oar.report.learning_curves import learning_speed_markdown, threshold_markdown
    from oar.report.render import main_latex, main_markdown

    md = main_markdown(
        tables, start=start, reference=reference, reference_label=ref_label, confidence=confidence, power=power,
        n_boot=n_boot, seed=seed, k=k, temperature=temperature, rollout_temperature=rollout_t,
        seeds=list(config.get("seeds") or [0]),
        extra=extra + threshold_markdown(steps, threshold=threshold, how=how) + "\n" + learning_speed_markdown(
            speed, threshold=threshold, reference_label=ref_label, confidence=confidence)
        + (f"\n{transfer}" if transfer else ""))
    footer = provenance_footer(result_provenances(config, root))
    atomic_write_text(out["main_md"], md + (f"\n{footer}\n" if footer else ""))
    atomic_write_text(out["main_tex"], main_latex(tables, reference=reference, reference_label=ref_label,
                                                  confidence=confidence, k=k, temperature=temperature))


def _write_transfer(config: Mapping[str, Any], root: Path, out: dict[str, Path], metrics: list[str], *,
                    confidence: float, k: int | None, temperature: float) -> str:
    """``eval.transfer``: the transfer table of each of ``metrics`` (:func:`oar.report.tables.transfer_table`),
    written together to ``tables/transfer.csv`` (added to ``out``); returns the "Transfer (no claim)"
    section of ``main.md`` ("" without transfer benchmarks)."""
    if not config["eval"]["transfer"]["benchmarks"]:
        return ""
    import pandas as pd

    from oar.report.render import transfer_markdown

    tables = {m: transfer_table(config, root, metric=m, confidence=confidence) for m in metrics}
    out["transfer_csv"] = Path(ResultsTree.at(root).table("transfer.csv"))
    atomic_write_text(out["transfer_csv"], pd.concat(list(tables.values()), ignore_index=True)
                      .to_csv(index=False, float_format="%.6g"))
    return transfer_markdown(tables, confidence=confidence, k=k, temperature=temperature)


def _report_threshold(config: Mapping[str, Any], heldout: Mapping[str, Mapping[int, Any]], reference: str,
                      ref_label: str) -> tuple[float, str]:
    """The held-out accuracy the steps to threshold are counted to (``report.threshold``, else
    :func:`oar.report.learning_curves.auto_threshold`; NaN when there is none) and how it was chosen."""
    from oar.report.learning_curves import auto_threshold

    threshold = report_option(config, "threshold", None)
    if threshold is None:
        threshold = auto_threshold(heldout, reference)
        how = f"halfway between the start model's held-out accuracy and {ref_label}'s last one"
    else:
        how = "report.threshold"
    if not any(len(df) for per_seed in heldout.values() for df in per_seed.values()):
        threshold, how = math.nan, "no held-out evaluation during training (train.heldout.every is 0)"
    elif math.isnan(threshold):
        how = (f"{ref_label}'s last held-out accuracy is not above the start model's, so no accuracy lies "
               "between them; set report.threshold")
    return threshold, how


def _report_paths(root: Path) -> dict[str, Path]:
    """The files :func:`build_report` always writes under the results folder ``root``."""
    tree = ResultsTree.at(root)
    tables = {"main_csv": "main.csv", "main_md": "main.md", "main_tex": "main.tex",
              "steps_to_threshold_csv": "steps_to_threshold.csv", "learning_speed_csv": "learning_speed.csv",
              "efficiency_csv": "efficiency.csv"}
    figures = {"learning_curves": "learning_curves.png", "training_curves": "training_curves.png",
               "credit_concentration": "credit_concentration.png"}
    return {**{k: Path(tree.table(f)) for k, f in tables.items()}, **{k: Path(tree.figure(f)) for k, f in figures.items()}}


def _write_versus(config: Mapping[str, Any], root: Path, out: dict[str, Path], labels: Mapping[str, str], *,
                  n_boot: int, seed: int, confidence: float, metric: str, power: float) -> str:
    """``report.also_against``: the same paired, seed-level differences against each other method
    listed, written to ``tables/versus_<method>.csv`` (added to ``out``); returns their markdown.

    Raises:
        ReportError: a listed name is not a method of the config.
    """
    from oar.report.render import versus_markdown

    versus = ""
    for other in report_option(config, "also_against", None):
        if other not in labels:
            raise ReportError(f"report.also_against: {other!r} is not a method of this config")
        vs = main_table(config, root, reference=other, n_boot=n_boot, seed=seed, confidence=confidence,
                        metric=metric, power=power)
        out[f"versus_{other}_csv"] = Path(ResultsTree.at(root).table(f"versus_{other}.csv"))
        atomic_write_text(out[f"versus_{other}_csv"], vs.to_csv(index=False, float_format="%.6g"))
        versus += "\n" + versus_markdown(vs, reference_label=labels.get(other, other), confidence=confidence) + "\n"
    return versus


def _write_credit_efficiency(config: Mapping[str, Any], root: Path, out: dict[str, Path], table: "pd.DataFrame",  # noqa: F821
                             labels: Mapping[str, str], *, ref_label: str, confidence: float) -> str:
    """``report.efficiency_oracle``: how much of the oracle's lead each method captures, from the
    main ``table``, written to ``tables/credit_efficiency.csv`` (added to ``out``); returns its
    markdown ("" without an oracle)."""
    oracle = report_option(config, "efficiency_oracle", None)
    if oracle is None:
        return ""
    from oar.report.capture import credit_efficiency_markdown, credit_efficiency_table

    pairing = report_option(config, "pairing", None)
    eff_credit = credit_efficiency_table(table, oracle=oracle, confidence=confidence, pairing=pairing,
                                         reference=report_option(config, "reference", None))
    out["credit_efficiency_csv"] = Path(ResultsTree.at(root).table("credit_efficiency.csv"))
    atomic_write_text(out["credit_efficiency_csv"], eff_credit.to_csv(index=False, float_format="%.6g"))
    _write_efficiency_vs_localisation(config, root, out, eff_credit, labels, oracle_label=labels.get(oracle, oracle),
                                      ref_label=ref_label)
    return "\n" + credit_efficiency_markdown(eff_credit, oracle_label=labels.get(oracle, oracle),
                                              reference_label=ref_label, confidence=confidence, pairing=pairing)


def _write_efficiency_vs_localisation(config: Mapping[str, Any], root: Path, out: dict[str, Path],
                                      eff_credit: "pd.DataFrame", labels: Mapping[str, str], *,  # noqa: F821
                                      oracle_label: str, ref_label: str) -> None:
    """``report.credit_signals``: each method's credit efficiency against its signal's earlier-step
    top-3 (:mod:`oar.report.localisation`), to ``tables/efficiency_vs_localisation.csv`` and
    ``figures/efficiency_vs_localisation.png`` (added to ``out``)."""
    signals = report_option(config, "credit_signals", None)
    if not signals:
        return
    import pandas as pd

    from oar.report.localisation import (attribution_per_response_files, efficiency_vs_localisation,
                                         plot_efficiency_vs_localisation)

    files = attribution_per_response_files(config, root)
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ReportError(f"report.credit_signals needs the attribution benchmark's results; missing: "
                          f"{', '.join(missing)} (run the attribution rules, or set report.credit_signals: {{}})")
    from oar.attribution.metrics import localisation_by_position
    from oar.attribution.specs import CHANCE_KINDS
    from oar.config.methods import resolve_methods

    per_response = {k: pd.read_csv(p) for k, p in files.items()}
    oracle = report_option(config, "efficiency_oracle", None)
    table = efficiency_vs_localisation(eff_credit, per_response, signals, labels, oracle=oracle)
    methods = resolve_methods(dict(config))
    # the calibration curve: the oracle and its degraded copies (the oracle's estimator at a lower localisation)
    calibration = [m for m in signals if oracle in methods and methods[m].estimator == methods[oracle].estimator]
    start = per_response[next(iter(per_response))]
    named = [c[len("top3_"):] for c in start.columns if c.startswith("top3_")]
    by_pos = localisation_by_position(start[start["kind"] == "sampled"], named, top_k=(3,))
    earlier = by_pos[by_pos["position"] == "earlier"]
    kinds = {sig["name"]: sig["kind"] for sig in (config.get("attribution") or {}).get("signals") or ()}
    mapped = set(signals.values())
    unmatched = {s: float(earlier[f"top3_{s}"].iloc[0]) for s in named
                 if s not in mapped and kinds.get(s) not in CHANCE_KINDS} if len(earlier) else {}
    tree = ResultsTree.at(root)
    out["efficiency_vs_localisation_csv"] = Path(tree.table("efficiency_vs_localisation.csv"))
    out["efficiency_vs_localisation"] = Path(tree.figure("efficiency_vs_localisation.png"))
    atomic_write_text(out["efficiency_vs_localisation_csv"], table.to_csv(index=False, float_format="%.6g"))
    plot_efficiency_vs_localisation(out["efficiency_vs_localisation"], table, oracle_label=oracle_label,
                                    reference_label=ref_label, policies=list(files), calibration=calibration,
                                    unmatched=unmatched)
