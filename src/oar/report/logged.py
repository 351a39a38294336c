"""The report's MLflow run (:func:`log_report_run`): the report layer's part of every stage's runs
(:mod:`oar.tracking.stage_runs` has the others)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from oar.tracking.stage_metrics import report_metrics_of
from oar.tracking.stage_runs import log_all_metrics, log_stage_files, stage_tags, stage_run, tracking_uri

__all__ = ["log_report_run"]


def log_report_run(config: Mapping[str, Any], paths: Mapping[str, str | os.PathLike], *,
                   provenance: Mapping[str, Any] | None = None, footer: str | None = None,
                   params: Mapping[str, Any] | None = None) -> str | None:
    """The report's run: ``oar.fingerprint`` the report rule's fingerprint, the provenance of the
    process that wrote it (``provenance``, default: this one's) and ``oar.report.provenance`` (the
    ``main.md`` footer naming the results' provenance, ``footer``; default: made from the results
    beside ``paths["main_csv"]``), the ``report`` section and
    ``params`` as params, :func:`report_metrics_of` ``main.csv``, and every table and figure of
    ``paths`` (:func:`oar.report.build_report`'s result; under ``tables/`` or ``figures/``).
    Returns the run id (None: tracking off)."""
    from oar.config.methods import resolve_methods
    from oar.config.identity import report_fingerprint
    from oar.core.provenance import provenance as current, with_end_time

    from oar.report.build import provenance_footer, result_provenances

    uri = tracking_uri(config)
    if uri is None:
        return None
    prov = dict(provenance) if provenance is not None else with_end_time(current(device="cpu"))
    if footer is None and "main_csv" in paths:
        footer = provenance_footer(result_provenances(config, Path(paths["main_csv"]).parent.parent))
    tags = stage_tags(config, "report", fingerprint=report_fingerprint(config, resolve_methods(dict(config))),
                      provenance=prov)
    if "main_csv" in paths:
        tags["oar.output"] = str(Path(paths["main_csv"]).parent.parent)
    if footer:
        tags["oar.report.provenance"] = footer
    with stage_run(config, uri, run_name="report", tags=tags, parent=None) as tracker:
        tracker.log_params({"report": config["report"], **dict(params or {})})
        if "main_csv" in paths:
            log_all_metrics(tracker, report_metrics_of(paths["main_csv"]))
        log_stage_files(tracker, {p: p.parent.name for p in map(Path, paths.values()) if p.is_file()}, config)
    return tracker.run_id
