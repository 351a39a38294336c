"""One MLflow run per stage of the pipeline: SFT, training, each evaluation, the attribution
benchmark and the report, in the config's experiment (``tracking.uri``, ``tracking.experiment``;
nothing is logged when ``tracking.enabled`` is false).

Every run is tagged so the UI groups and filters them (:func:`stage_tags`): ``oar.stage`` (one of
:data:`STAGES`), ``oar.method`` and ``oar.seed`` (``base`` for the start model), ``oar.config.load`` (the
config's name), ``oar.fingerprint`` (the key of the run's entry in the results store,
:func:`oar.pipeline.store.store_location`; for the attribution and the report, which live outside the
store, their rules' fingerprints), ``oar.git_commit`` and the provenance of the result
(``oar.core.provenance.<key>``, :mod:`oar.core.provenance`), ``oar.output`` (the folder given to the stage)
``oar.launched_by`` (``workflow`` for the workflow's jobs, ``command line`` for an ``oar`` command run
by hand: the method x seed grid of a config filters on ``workflow``), and ``oar.current``: a stage run again into the same output (a job rerun, a run started over)
leaves its earlier runs in the store, tagged ``oar.current = false`` and ``oar.superseded_by``
(:func:`supersede_older_runs`); filter ``tags.oar.current = 'true'`` for the results in force.

How the runs relate: the evaluation of a trained policy finds its training run (the id in
``train_summary.json``, else by the tags stage/method/seed/fingerprint) and

- logs its scores onto it too, as ``eval/<benchmark>/<score>`` and ``eval/average/<score>``, so the
  runs table shows one row per method and seed with every benchmark's scores side by side;
- is its nested child (the ``mlflow.parentRunId`` tag), as is an attribution run of a trained policy.

The evaluation of the start model (``oar.method = base``) is a top-level run with the same
``eval/...`` metric names, so it lines up with the training runs in the table.

The transfer evaluation (``eval.transfer``, ``oar evaluate --transfer``) logs the same way, into
runs of its own (stage ``evaluate``), told apart by the tag ``oar.eval_set`` (:data:`EVAL_SET_TAG`):
``transfer`` on them, ``main`` on the evaluations of ``eval.benchmarks``; its scores are named
``transfer/<benchmark>/<score>`` (on its run and on the training run, which it tags
``oar.transfer_run_id``), so they never mix with the ``eval/...`` ones.

Metric names are the summaries' keys with ``@`` (not allowed by MLflow) written ``_at_``
(:func:`metric_key`): ``pass@1`` -> ``pass_at_1``, ``avg@k`` -> ``avg_at_k``, ``pass@k`` ->
``pass_at_k`` (k is ``eval.samples``, among the run's params).

The stages call these after their results are written (``oar.cli``): MLflow holds a copy, the files
stay the record.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from oar.tracking.client import PARENT_RUN_TAG, Tracker, ensure_experiment, search_runs, with_retry
from oar.tracking.stage_metrics import EVAL_EXTRAS, EVAL_SCORES, as_number, attribution_metrics, eval_metrics, metric_key, sft_metrics

__all__ = ["stage_run", "log_all_metrics", "log_stage_files", "STAGES", "BASE_METHOD", "CURRENT_TAG", "LAUNCHED_BY_ENV", "IDENTITY_TAGS", "supersede_older_runs", "EVAL_SET_TAG", "tracking_uri", "stage_tags", "trained_run_summary", "find_training_run", "train_run_tags", "log_sft_run", "log_verifier_run", "log_evaluation_run", "log_attribution_run"]


#: The values of the ``oar.stage`` tag.
STAGES: tuple[str, ...] = ("sft", "verifier", "train", "evaluate", "attribution", "report")
#: The environment variable the workflow's jobs carry (:func:`oar.pipeline.launch.oar_env`); a run's tag
#: ``oar.launched_by`` is its value, ``command line`` for an ``oar`` command run by hand.
LAUNCHED_BY_ENV = "OAR_LAUNCHED_BY"
#: ``oar.method`` of the start model's runs (the report's base row).
BASE_METHOD = "base"
#: ``"true"`` on the newest run of each output (:data:`IDENTITY_TAGS`), ``"false"`` on the runs a
#: rerun of the stage replaced (tagged ``oar.superseded_by``): filter ``tags.oar.current = 'true'``.
CURRENT_TAG = "oar.current"
#: What makes two runs the same stage's result: the stage, the config and the output folder.
IDENTITY_TAGS: tuple[str, ...] = ("oar.stage", "oar.config", "oar.output")
#: The tag that tells an evaluation of ``eval.benchmarks`` (``main``) from the transfer evaluation
#: (``transfer``, ``eval.transfer.benchmarks``); the value is also the prefix of the transfer's metrics.
EVAL_SET_TAG = "oar.eval_set"
#: Files of an evaluation folder that are copied into its run (when no larger than tracking.max_artifact_mb).
_EVAL_FILES: tuple[str, ...] = ("summary.json", "*.json", "*.jsonl")
#: Files of an attribution folder copied into its run.
_ATTRIBUTION_FILES: tuple[str, ...] = ("summary.json", "attribution.md", "*.csv", "*.png")
_BYTES_PER_MB = 1024 * 1024


def tracking_uri(config: Mapping[str, Any]) -> str | None:
    """The config's MLflow URI, or None when ``tracking.enabled`` is false."""
    tr = config["tracking"]
    return tr["uri"] if tr["enabled"] else None


def stage_tags(config: Mapping[str, Any], stage: str, *, method: str | None = None, seed: int | None = None,
               fingerprint: str | None = None, provenance: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The tags of a stage's run (see the module docstring); None values are left out.

    Raises:
        ValueError: ``stage`` is not one of :data:`STAGES`.
    """
    from oar.core.provenance import provenance_tags

    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {', '.join(STAGES)}")
    prov = dict(provenance or {})
    tags = {"oar.stage": stage, "oar.config": str(config["name"]), "oar.method": method,
            "oar.seed": None if seed is None else str(int(seed)), "oar.fingerprint": fingerprint,
            "oar.git_commit": prov.get("git_commit"),
            "oar.launched_by": os.environ.get(LAUNCHED_BY_ENV) or "command line"}
    out = {k: str(v) for k, v in tags.items() if v is not None}
    out.update(provenance_tags(prov))
    return out


def _store_key(path: str | os.PathLike | None) -> str | None:
    from oar.config.tree import store_location

    loc = store_location(path) if path is not None else None
    return loc.key if loc is not None else None


def trained_run_summary(model_dir: str | os.PathLike | None) -> dict | None:
    """The ``train_summary.json`` of the training run whose final model is ``model_dir``
    (``<run>/model``), or None (the start model, a model not trained by ``oar train``)."""
    from oar.config.tree import SUMMARY_FILE

    if model_dir is None:
        return None
    path = Path(model_dir).parent / SUMMARY_FILE
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and "method" in summary and "seed" in summary else None


def _live_run(uri: str, run_id: str, experiment_id: str) -> bool:
    """Whether ``run_id`` is a (not deleted) run of the experiment in the store ``uri``."""
    from mlflow.tracking import MlflowClient

    client = with_retry(lambda: MlflowClient(tracking_uri=uri))
    try:
        run = with_retry(lambda: client.get_run(run_id))
    except Exception as e:  # noqa: BLE001 - mlflow raises MlflowException for a missing run
        if "not found" in str(e).lower() or "RESOURCE_DOES_NOT_EXIST" in str(e):
            return False
        raise
    return run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"


def find_training_run(config: Mapping[str, Any], model_dir: str | os.PathLike,
                      trained: Mapping[str, Any] | None = None) -> str | None:
    """The MLflow run id of the training run that made ``model_dir``, in the config's experiment:
    the ``mlflow_run_id`` of its ``train_summary.json`` when that run is there, else the newest
    finished run tagged ``oar.stage = train`` with its method, seed and (when the run folder is in
    the results store) fingerprint; None when there is none or tracking is off."""
    uri = tracking_uri(config)
    trained = trained if trained is not None else trained_run_summary(model_dir)
    if uri is None or trained is None:
        return None
    experiment = config["tracking"]["experiment"]
    exp_id = ensure_experiment(uri, experiment)
    run_id = trained.get("mlflow_run_id")
    if run_id and _live_run(uri, str(run_id), exp_id):
        return str(run_id)
    tags = {"oar.stage": "train", "oar.method": str(trained["method"]), "oar.seed": str(int(trained["seed"]))}
    key = _store_key(Path(model_dir).parent)
    if key is not None:
        tags["oar.fingerprint"] = key
    runs = search_runs(uri, experiment, tags, status="FINISHED")
    return runs[0].info.run_id if runs else None


def train_run_tags(config: Mapping[str, Any], method: str, seed: int, output: str | os.PathLike,
                   provenance: Mapping[str, Any] | None) -> dict[str, str]:
    """The tags of the training run of ``method`` and ``seed`` in the run folder ``output``
    (:func:`stage_tags` with the folder's store key, ``oar.output`` and ``oar.current``)."""
    tags = stage_tags(config, "train", method=method, seed=seed, fingerprint=_store_key(output),
                      provenance=provenance)
    tags.update({"oar.output": str(output), CURRENT_TAG: "true"})
    return tags


def _files(folder: Path, patterns: Sequence[str]) -> list[Path]:
    seen: dict[Path, None] = {}
    for pattern in patterns:
        for p in sorted(folder.glob(pattern)):
            if p.is_file():
                seen.setdefault(p, None)
    return list(seen)


def log_stage_files(tracker: Tracker, files: Iterable[Path] | Mapping[Path, str | None], config: Mapping[str, Any]) -> list[str]:
    """Copy ``files`` (or ``{file: artifact folder}``) no larger than ``tracking.max_artifact_mb``
    into the run; returns the names of those left out (also set as the tag ``oar.artifacts_skipped``)."""
    limit = float(config["tracking"]["max_artifact_mb"]) * _BYTES_PER_MB
    where = files if isinstance(files, Mapping) else dict.fromkeys(files)
    skipped = []
    for p, folder in where.items():
        if p.stat().st_size > limit:
            skipped.append(p.name)
        else:
            tracker.log_artifact(p, folder)
    if skipped:
        tracker.set_tags({"oar.artifacts_skipped": ", ".join(skipped)})
    return skipped


def supersede_older_runs(uri: str, experiment: str, tags: Mapping[str, str], run_id: str) -> list[str]:
    """Mark the runs with the same :data:`IDENTITY_TAGS` as ``tags`` (the same stage's earlier result
    in the same output folder: a job run again, a run started over) but ``run_id`` as no longer
    current (``oar.current = false``, ``oar.superseded_by = run_id``); returns their ids. Nothing
    when ``tags`` lack one of the identity tags."""
    if any(k not in tags for k in IDENTITY_TAGS):
        return []
    identity = {k: tags[k] for k in IDENTITY_TAGS}
    older = [r.info.run_id for r in search_runs(uri, experiment, {**identity, CURRENT_TAG: "true"})
             if r.info.run_id != run_id]
    for old in older:
        Tracker(None, uri=uri, experiment=experiment, run_id=old, reopen=False).set_tags(
            {CURRENT_TAG: "false", "oar.superseded_by": run_id})
    return older


@contextlib.contextmanager
def stage_run(config: Mapping[str, Any], uri: str, *, run_name: str, tags: Mapping[str, str],
              parent: str | None) -> Iterator[Tracker]:
    """A new run of a stage, the current one of its output (:func:`supersede_older_runs`), for the
    block: finished when the block ends, marked ``FAILED`` (and the error re-raised) when it raises."""
    tags = {**tags, CURRENT_TAG: "true", **({PARENT_RUN_TAG: parent} if parent else {})}
    experiment = config["tracking"]["experiment"]
    tracker = Tracker(None, uri=uri, experiment=experiment, run_name=run_name, tags=tags)
    supersede_older_runs(uri, experiment, tags, tracker.run_id)
    try:
        yield tracker
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()


def log_all_metrics(tracker: Tracker, metrics: Mapping[str, float], step: int = 0) -> None:
    tracker.log_history((k, v, step) for k, v in metrics.items())


def evaluated_model(config: Mapping[str, Any], model_dir: str | os.PathLike | None, *,
                    default_seed: int | None) -> tuple[dict | None, str, int | None, Any]:
    """What an evaluation or attribution run measures: (the trained run's summary or None, its method
    or ``base`` for the start model, its seed or ``default_seed``, its MLflow training run or None)."""
    trained = trained_run_summary(model_dir)
    if not trained:
        return None, BASE_METHOD, default_seed, None
    return trained, str(trained["method"]), int(trained["seed"]), find_training_run(config, model_dir, trained)


def log_sft_run(config: Mapping[str, Any], output_dir: str | os.PathLike, summary: Mapping[str, Any]) -> str | None:
    """The SFT's run: tags (its store key, the provenance of the model: a copy from ``sft.cache_dir``
    keeps the one it was trained with, and is tagged ``oar.trainer.sft.cached_from``), the model, task and
    sft sections as params, :func:`sft_metrics`, the loss (``sft/loss``) and held-out accuracy
    (``sft/eval_accuracy``) per step, and ``sft_summary.json``. Returns the run id (None: tracking off)."""
    uri = tracking_uri(config)
    if uri is None:
        return None
    out = Path(output_dir)
    tags = stage_tags(config, "sft", fingerprint=_store_key(out), provenance=summary.get("provenance"))
    tags["oar.output"] = str(out)
    if summary.get("cached_from"):
        tags["oar.sft.cached_from"] = str(summary["cached_from"])
    with stage_run(config, uri, run_name="sft", tags=tags, parent=None) as tracker:
        tracker.log_params({k: config[k] for k in ("model", "task", "sft")})
        log_all_metrics(tracker, sft_metrics(summary), step=int((summary.get("sft") or {}).get("steps") or 0))
        result = summary.get("sft") or {}
        curve = [("sft/loss", v, s) for s, v in result.get("loss_curve") or []]
        curve += [("sft/eval_accuracy", v, s) for s, v in result.get("eval_curve") or []]
        tracker.log_history(curve)
        log_stage_files(tracker, _files(out, ["sft_summary.json"]), config)
    return tracker.run_id


def log_verifier_run(config: Mapping[str, Any], output_dir: str | os.PathLike, summary: Mapping[str, Any]) -> str | None:
    """The step verifier's run (``oar verifier``): tags (its store key, the provenance), the
    ``verifier`` and ``task`` sections and the start model as params, its numbers
    (``verifier/eval_accuracy``, ``verifier/eval_recall_wrong``, ...), the loss per step
    (``verifier/loss``) and ``verifier_summary.json``. Returns the run id (None: tracking off)."""
    uri = tracking_uri(config)
    if uri is None:
        return None
    out = Path(output_dir)
    tags = stage_tags(config, "verifier", fingerprint=_store_key(out), provenance=summary.get("provenance"))
    tags["oar.output"] = str(out)
    with stage_run(config, uri, run_name="verifier", tags=tags, parent=None) as tracker:
        tracker.log_params({"verifier": config["verifier"], "task": config["task"],
                            "start_model": str(summary.get("start_model"))})
        log_all_metrics(tracker, {metric_key("verifier", k): float(v) for k, v in summary.items()
                                  if k != "loss_curve" and as_number(v) is not None},
                        step=int(config["verifier"]["steps"]))
        tracker.log_history([("verifier/loss", v, s) for s, v in summary.get("loss_curve") or []])
        log_stage_files(tracker, _files(out, ["verifier_summary.json"]), config)
    return tracker.run_id


def log_evaluation_run(config: Mapping[str, Any], model_dir: str | os.PathLike | None, output_dir: str | os.PathLike,
                       summary: Mapping[str, Any], *, seed: int, transfer: bool = False) -> str | None:
    """The evaluation's run, and its scores on the training run it evaluates (module docstring).

    ``oar.method``/``oar.seed``: the training run's (its ``train_summary.json`` beside ``model_dir``),
    else ``base`` and the sampling ``seed``; ``oar.eval_seed``: the sampling seed; :data:`EVAL_SET_TAG`:
    ``transfer`` for the transfer evaluation (``transfer``), else ``main``. Params: the ``eval``
    section, the model, the seed. Metrics: :func:`eval_metrics` with :data:`EVAL_SCORES` and
    :data:`EVAL_EXTRAS`, prefixed ``eval`` (``transfer`` for the transfer evaluation). Artifacts:
    ``summary.json``, each ``<bench>.json`` and each ``<bench>.jsonl`` no larger than
    ``tracking.max_artifact_mb``.

    Returns:
        The evaluation run's id (None: tracking off).
    """
    uri = tracking_uri(config)
    if uri is None:
        return None
    out = Path(output_dir)
    prefix, eval_set = ("transfer", "transfer") if transfer else ("eval", "main")
    trained, method, run_seed, parent = evaluated_model(config, model_dir, default_seed=int(seed))
    tags = stage_tags(config, "evaluate", method=method, seed=run_seed, fingerprint=_store_key(out),
                      provenance=summary.get("provenance"))
    tags.update({"oar.eval_seed": str(int(seed)), "oar.model": str(summary.get("model")), "oar.output": str(out),
                 EVAL_SET_TAG: eval_set})
    name = f"{method}-seed{run_seed}/{prefix}" if trained else f"{BASE_METHOD}/{prefix}"
    with stage_run(config, uri, run_name=name, tags=tags, parent=parent) as tracker:
        tracker.log_params({"eval": config["eval"], "model": summary.get("model"), "seed": seed,
                            "model_identity": summary.get("model_identity")})
        log_all_metrics(tracker, eval_metrics(summary, EVAL_SCORES + EVAL_EXTRAS, prefix=prefix))
        log_stage_files(tracker, _files(out, _EVAL_FILES), config)
    if parent:
        train_run = Tracker(None, uri=uri, experiment=config["tracking"]["experiment"], run_id=parent, reopen=False)
        log_all_metrics(train_run, eval_metrics(summary, EVAL_SCORES, prefix=prefix))
        train_run.set_tags({f"oar.{prefix}_run_id": tracker.run_id})
    return tracker.run_id


def log_attribution_run(config: Mapping[str, Any], model_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        summary: Mapping[str, Any]) -> str | None:
    """The attribution benchmark's run: ``oar.method``/``oar.seed`` of the trained policy it scores
    (a nested child of its training run), else ``base``; ``oar.fingerprint`` the attribution rules'
    fingerprint; the ``attribution`` section as params; :func:`attribution_metrics`; the tables,
    ``attribution.md``, the figures and ``summary.json`` as artifacts. Returns the run id (None: tracking off)."""
    from oar.config.identity import attribution_fingerprint

    uri = tracking_uri(config)
    if uri is None:
        return None
    out = Path(output_dir)
    trained, method, run_seed, parent = evaluated_model(config, model_dir, default_seed=None)
    tags = stage_tags(config, "attribution", method=method, seed=run_seed, fingerprint=attribution_fingerprint(config),
                      provenance=summary.get("provenance"))
    tags.update({"oar.model": str(model_dir), "oar.output": str(out)})
    name = f"{method}-seed{run_seed}/attribution" if trained else "attribution"
    with stage_run(config, uri, run_name=name, tags=tags, parent=parent) as tracker:
        tracker.log_params({"attribution": config["attribution"], "model": str(model_dir)})
        log_all_metrics(tracker, attribution_metrics(out))
        log_stage_files(tracker, _files(out, _ATTRIBUTION_FILES), config)
    return tracker.run_id
