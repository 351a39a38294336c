"""How a training run ends (:mod:`oar.trainer.loop`'s last phase): the final model and ``train_summary.json``
(:func:`finish_run`), or, after a signal, the summary that says where to resume (:func:`interrupted_run`).
"""

from __future__ import annotations

import sys
from typing import Any

from oar.trainer.checkpoint import disk_full_named, intact_sentence
from oar.core.io import atomic_write_json, read_jsonl, read_recorded_json
from oar.trainer.preemption import StopSignal
from oar.trainer.setup import TrainingRun
from oar.trainer.runs import TIMED_PHASES, RunFolder
from oar.trainer.step import mean_of
from oar.trainer.strategy import Strategy

__all__ = ["finish_run", "interrupted_run"]


def finish_run(loop: TrainingRun, last_metrics: dict[str, float]) -> dict:
    """The final model (full, consolidated weights) and the run summary, with the provenance of the
    invocation that finished the run (:mod:`oar.core.provenance`); the MLflow run gets its provenance and
    ``train_summary.json`` as an artifact.

    A finished run started again with nothing left to train (the workflow reruns its job when a
    resumable setting such as ``train.save_every`` changed) keeps its recorded summary as it is:
    the evaluation's fingerprint checksums ``train_summary.json``, and a new timestamp (or the
    ``final`` row read back from ``metrics.jsonl``) alone must not make it evaluate the same model again."""
    from oar.core.provenance import provenance_tags, with_end_time

    strategy, folder = loop.strategy, loop.folder
    summary: dict[str, Any] = {}
    with disk_full_named(folder.final, "the final model", strategy.checkpoint_bytes(loop.model),
                          intact_sentence(folder, loop.intact)):
        with strategy.shared_atomic_dir(folder.final) as tmp:
            strategy.save_pretrained(loop.model, loop.tokenizer, tmp)
    if strategy.is_main:
        rows = read_jsonl(folder.metrics)
        summary = {
            "method": loop.method.name,
            "seed": loop.seed,
            "steps": loop.train.steps,
            "strategy": strategy.name,
            "world_size": strategy.world,
            "final": last_metrics or (rows[-1] if rows else {}),
            "mean_time": {k: mean_of([r.get(f"time_{k}") or 0.0 for r in rows if "time_step" in r])  # not held-out rows
                          for k in [*TIMED_PHASES, "step"]},
            "mlflow_run_id": loop.state.run_id,
            "provenance": with_end_time(loop.provenance),
        }
        recorded = read_recorded_json(folder.summary)
        if not last_metrics and recorded and all(recorded.get(k) == summary[k] for k in _SAME_RUN_KEYS):
            summary = recorded  # nothing trained since it was written: the same file, byte for byte
        atomic_write_json(folder.summary, summary)
        if loop.tracker is not None:
            prov = summary.get("provenance") or {}  # the run's tags: the provenance its summary records
            loop.tracker.set_tags({**provenance_tags(prov), **({"oar.git_commit": prov["git_commit"]}
                                                               if prov.get("git_commit") else {})})
            loop.tracker.log_artifact(folder.summary)
            loop.tracker.finish()
    strategy.barrier()
    return summary


#: What a recorded ``train_summary.json`` must share with the summary being written to be kept.
_SAME_RUN_KEYS: tuple[str, ...] = ("method", "seed", "steps", "mlflow_run_id")


def interrupted_run(stop: StopSignal, step: int, folder: RunFolder, tracker: Any, strategy: Strategy, *,
                 checkpointed: bool) -> dict:
    """End a run that a signal stopped after ``step`` steps (``checkpointed``: the checkpoint holds
    them): the MLflow run is marked KILLED with the step, and the summary says where to resume."""
    reason = stop.received or "a signal to another process"
    if tracker is not None:
        tracker.interrupted(step, reason)
    if strategy.is_main:
        where = (f"the checkpoint {folder.checkpoint} holds step {step}" if checkpointed
                 else "nothing was trained yet, so nothing was saved")
        print(f"oar train: {folder.path}: stopped by {reason} after step {step}; {where}: run the same command "
              f"again to resume", file=sys.stderr, flush=True)
    strategy.barrier()
    return {"interrupted_at": step, "signal": reason, "checkpoint": str(folder.checkpoint) if checkpointed else None}
