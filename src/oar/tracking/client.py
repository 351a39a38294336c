"""Experiment tracking: MLflow (SQLite store by default) plus a plain ``metrics.jsonl``.

Several training jobs may log into one SQLite store at once. Two processes that create a NEW
store at the same moment fail ("table tags already exists"), so :func:`ensure_experiment` creates
the store and experiment under an exclusive file lock (``<db>.lock``) and every client call retries
when the database is locked: first use is safe without ``oar init-tracking`` (the workflow still
calls it in ``onstart``). Results never depend on MLflow alone: :class:`Tracker` also appends every
metrics row to ``metrics.jsonl`` beside the checkpoint.

Every stage of the pipeline logs a run through :class:`Tracker` (training here, the others through
:mod:`oar.tracking.stage_runs`); :func:`search_runs` finds runs by their tags (the evaluation of a training run
finds that run so).
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from oar.core.flatten import flatten
from oar.core.io import append_jsonl

__all__ = ["ensure_experiment", "end_orphan_run", "Tracker", "with_retry", "sqlite_path", "search_runs",
           "PARENT_RUN_TAG", "MAX_TAG_LENGTH", "BATCH_SIZE", "ARTIFACTS_DIR", "artifact_location",
           "TrackingStoreError", "check_store"]

T = TypeVar("T")

#: The tag that makes a run the nested child of another in the MLflow UI.
PARENT_RUN_TAG = "mlflow.parentRunId"
#: Characters of a tag value kept (MLflow refuses longer values; a long command line is cut).
MAX_TAG_LENGTH = 5000
#: MLflow's limit on a parameter value's length (characters): longer values are cut when logged.
MAX_PARAM_LENGTH = 6000
#: Metrics, params or tags per ``log_batch`` call (MLflow's limits: 1000 metrics, 100 params and tags).
BATCH_SIZE = 90

#: The folder beside a SQLite store that holds its experiments' artifacts (:func:`artifact_location`).
ARTIFACTS_DIR = "mlartifacts"

#: Substrings of errors worth retrying (SQLite contention).
_RETRYABLE = ("database is locked", "database table is locked", "already exists", "unable to open database")


def with_retry(fn: Callable[[], T], *, attempts: int = 8, base_delay_s: float = 0.2) -> T:
    """Call ``fn``; on a retryable SQLite error wait (exponential backoff with jitter) and retry."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # mlflow wraps sqlalchemy errors in MlflowException
            if i == attempts - 1 or not any(s in str(e).lower() for s in _RETRYABLE):
                raise
            time.sleep(base_delay_s * (2**i) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def sqlite_path(uri: str) -> Path | None:
    """File path of a ``sqlite:///`` URI (None for other stores)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


class TrackingStoreError(ValueError):
    """The MLflow store of ``tracking.uri`` cannot be read (a file that is not an SQLite database, a
    corrupt one); the message names the file and what to do (:func:`check_store`)."""


#: Seconds :func:`check_store` waits for a store another process is writing.
_STORE_BUSY_TIMEOUT_S = 30.0


def check_store(uri: str) -> None:
    """Check, before any work, that the SQLite store of ``uri`` is a database MLflow can open.

    A store that does not exist yet (or is empty) is fine: MLflow creates it. Other stores (not
    ``sqlite:///``) are not checked. The file is opened read-only and only its schema is read; a
    store another process has locked is left to the retries of the calls that use it.

    Raises:
        TrackingStoreError: the file is not an SQLite database, or a corrupt one; naming it and what
            to do (move it away, or set ``tracking.uri`` to another store).
    """
    import sqlite3

    db = sqlite_path(uri)
    if db is None or not db.is_file() or db.stat().st_size == 0:
        return
    try:
        con = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, timeout=_STORE_BUSY_TIMEOUT_S)
        try:
            con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        if any(s in str(e).lower() for s in _RETRYABLE):
            return
        raise TrackingStoreError(
            f"{db}: the MLflow store (tracking.uri {uri}) cannot be read: {e}; move the file away (a new store "
            f"is made on the next run) or set tracking.uri to another store (tracking.enabled: false for none)"
        ) from None


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of the store ``uri`` keeps its runs' files: beside a SQLite store,
    ``<db folder>/`` :data:`ARTIFACTS_DIR` ``/<experiment>`` (absolute); None for other stores (the
    server's default). MLflow's own default, ``./mlruns`` of the working directory, would scatter
    them over every folder a job runs in."""
    db = sqlite_path(uri)
    if db is None:
        return None
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment) or "default"
    return str((db.parent / ARTIFACTS_DIR / name).resolve())


def ensure_experiment(uri: str, experiment: str) -> str:
    """Create the tracking store (and its folder) and the experiment if missing; return its id.
    A new experiment keeps its artifacts at :func:`artifact_location`.

    Call this once before starting parallel jobs that log into the same new SQLite store.

    Raises:
        TrackingStoreError: the SQLite store exists and cannot be read (:func:`check_store`).
    """
    from mlflow.tracking import MlflowClient

    check_store(uri)
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)

    def create() -> str:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return client.create_experiment(experiment, artifact_location=artifact_location(uri, experiment))
        except Exception:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise
            return exp.experiment_id

    if db is None:
        return with_retry(create)
    import fcntl

    # one process at a time creates the store's tables (a blocking lock, held for a moment)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return with_retry(create)


def end_orphan_run(uri: str, run_id: str, *, replaced_by: str | None = None) -> bool:
    """Mark ``run_id`` KILLED if it is still RUNNING (a run whose process died before it could
    finish, and which is not being continued); returns whether it did. A missing run is ignored."""
    from mlflow.tracking import MlflowClient

    client = with_retry(lambda: MlflowClient(tracking_uri=uri))
    try:
        run = with_retry(lambda: client.get_run(run_id))
    except Exception as e:
        if "not found" in str(e).lower() or "RESOURCE_DOES_NOT_EXIST" in str(e):
            return False
        raise
    if run.info.status != "RUNNING":
        return False
    if replaced_by:
        with_retry(lambda: client.set_tag(run_id, "oar.replaced_by", replaced_by))
    with_retry(lambda: client.set_terminated(run_id, status="KILLED"))
    return True


def _tag_text(value: Any) -> str:
    return str(value)[:MAX_TAG_LENGTH]


def search_runs(uri: str, experiment: str, tags: Mapping[str, str], *, status: str | None = None) -> list[Any]:
    """The runs of ``experiment`` whose tags equal ``tags`` (and whose status is ``status``, e.g.
    ``"FINISHED"``; None: any), newest first; ``[]`` when the experiment does not exist.

    Raises:
        ValueError: a tag key or value holds a quote (it cannot be written in MLflow's filter).
    """
    from mlflow.tracking import MlflowClient

    clauses = []
    for key, value in tags.items():
        if any(q in f"{key}{value}" for q in "'\"`"):
            raise ValueError(f"search_runs: the tag {key}={value!r} holds a quote")
        clauses.append(f"tags.`{key}` = '{value}'")
    if status is not None:
        clauses.append(f"attributes.status = '{status}'")
    client = with_retry(lambda: MlflowClient(tracking_uri=uri))
    exp = with_retry(lambda: client.get_experiment_by_name(experiment))
    if exp is None:
        return []
    return list(with_retry(lambda: client.search_runs([exp.experiment_id], " AND ".join(clauses),
                                                      order_by=["attributes.start_time DESC"], max_results=1000)))


class Tracker:
    """Log one run's params and per-step metrics to MLflow and to ``metrics.jsonl``.

    Args:
        jsonl_path: where every metrics row is appended (None: MLflow only).
        uri: MLflow tracking URI, or None to disable MLflow.
        experiment: experiment name (one per config).
        run_name: e.g. ``"oar_g-seed0"``.
        tags: tags of the run (method, seed, config); set on an existing run too.
        run_id: an existing run to continue (when resuming), or None to create one.
        reopen: mark the existing run ``run_id`` RUNNING again (a resumed training run); False adds
            to a run without touching its status (the evaluation adds its scores to a finished
            training run).
    """

    def __init__(
        self,
        jsonl_path: str | os.PathLike | None,
        *,
        uri: str | None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        reopen: bool = True,
    ) -> None:
        self.jsonl_path = Path(jsonl_path) if jsonl_path is not None else None
        self.client = None
        self.run_id = run_id
        self.experiment_id: str | None = None
        if uri:
            from mlflow.tracking import MlflowClient

            exp_id = ensure_experiment(uri, experiment or "default")  # creates a new store safely
            self.experiment_id = exp_id
            self.client = with_retry(lambda: MlflowClient(tracking_uri=uri))
            tags = {k: _tag_text(v) for k, v in (tags or {}).items()}
            if self.run_id is None:
                run = with_retry(
                    lambda: self.client.create_run(exp_id, run_name=run_name, tags=tags)
                )
                self.run_id = run.info.run_id
            else:
                if reopen:
                    with_retry(lambda: self.client.update_run(self.run_id, status="RUNNING"))
                self.set_tags(tags)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) tags of the run."""
        if self.client is None or not tags:
            return
        from mlflow.entities import RunTag

        items = [RunTag(k, _tag_text(v)) for k, v in tags.items()]
        for i in range(0, len(items), BATCH_SIZE):
            chunk = items[i : i + BATCH_SIZE]
            with_retry(lambda: self.client.log_batch(self.run_id, tags=chunk))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (flattened) params once; re-logging the same values on resume is harmless."""
        if self.client is None:
            return
        from mlflow.entities import Param

        flat = {k: v[:MAX_PARAM_LENGTH] for k, v in flatten(params).items()}  # MLflow's limit, here only
        items = [Param(k, v) for k, v in flat.items()]
        existing = with_retry(lambda: self.client.get_run(self.run_id)).data.params
        items = [p for p in items if p.key not in existing]
        for i in range(0, len(items), BATCH_SIZE):
            chunk = items[i : i + BATCH_SIZE]
            with_retry(lambda: self.client.log_batch(self.run_id, params=chunk))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and log the finite values to MLflow."""
        # strict JSON: non-finite values are written as null
        if self.jsonl_path is not None:
            row = {"step": step, **{k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}}
            append_jsonl(self.jsonl_path, row)
        self.log_history((k, v, step) for k, v in metrics.items())

    def log_history(self, points: Iterable[tuple[str, float, int]]) -> None:
        """Log ``(metric, value, step)`` points to MLflow only (a whole curve at once, e.g. SFT's loss
        per step from its summary), in batches; non-finite values are left out."""
        if self.client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, int(step)) for k, v, step in points
                 if v is not None and math.isfinite(float(v))]
        for i in range(0, len(items), 10 * BATCH_SIZE):
            chunk = items[i : i + 10 * BATCH_SIZE]
            with_retry(lambda: self.client.log_batch(self.run_id, metrics=chunk))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write ``text`` as the run's artifact ``artifact_file`` (e.g. ``config.yaml``)."""
        if self.client is not None:
            with_retry(lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy the file ``path`` into the run's artifacts (under ``artifact_path``)."""
        if self.client is not None:
            with_retry(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def finish(self, status: str = "FINISHED") -> None:
        if self.client is not None:
            with_retry(lambda: self.client.set_terminated(self.run_id, status=status))

    def interrupted(self, step: int, reason: str) -> None:
        """End the run as ``KILLED`` after ``step`` steps, stopped by ``reason`` (``"SIGTERM"``):
        tags ``oar.interrupted_at_step`` and ``oar.interrupted_by``. Resuming it sets it RUNNING."""
        if self.client is not None:
            with_retry(lambda: self.client.set_tag(self.run_id, "oar.interrupted_at_step", str(step)))
            with_retry(lambda: self.client.set_tag(self.run_id, "oar.interrupted_by", reason))
        self.finish("KILLED")
