"""A training run's output folder: what it holds, who may write it, and what it may resume.

Layout::

    <run>/.lock               held (flock) by the one process that trains into the folder
    <run>/checkpoint/         latest checkpoint (save_pretrained + trainer_state.pt), atomically replaced
    <run>/model/              final policy (save_pretrained), written when training ends
    <run>/metrics.jsonl       one row per step
    <run>/run.json            the MLflow run this folder logs to (so a restart can close an orphan)
    <run>/train_summary.json

A checkpoint stores the run's *identity* (:func:`run_identity`): the resolved method, the seed, the
train/rollout/reward/task configuration and the start model's content hash. Resuming with anything
that changes these is refused (:class:`RunMismatchError`) instead of silently continuing another
run; ``restart=True`` (``oar train --restart``) discards the folder's state and starts over.

The trainer state is read with ``torch.load(weights_only=True)``: it holds only tensors and plain
Python values (RNG states are converted), so a tampered file cannot run code.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from oar.io import atomic_write_json, atomic_write_jsonl, read_jsonl, recover_atomic_dir
from oar.tracking import flatten

__all__ = [
    "RunFolder",
    "RunMismatchError",
    "run_identity",
    "identity_diff",
    "save_trainer_state",
    "load_trainer_state",
    "RESUMABLE_TRAIN_KEYS",
]

CHECKPOINT_DIR = "checkpoint"
FINAL_DIR = "model"
STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train_summary.json"
RUN_FILE = "run.json"

#: ``train`` keys a resumed run may change: how long it runs, how often it saves, when it gives up,
#: and where the start model came from (its content is part of the identity instead). A longer
#: ``steps`` continues the run; the schedule is then computed for the new total.
RESUMABLE_TRAIN_KEYS: tuple[str, ...] = ("steps", "save_every", "max_nonfinite", "init")
#: ``model`` keys that only say where the start model is; its content hash stands for them.
_MODEL_LOCATION_KEYS = ("source", "gguf_file")


class RunMismatchError(ValueError):
    """The folder's checkpoint belongs to a run with other settings; the message names the keys."""


def run_identity(config: Mapping[str, Any], method: Any, seed: int, start_model: str) -> dict[str, str]:
    """What defines a training run, flattened to ``{"train.lr": "1e-05", ...}`` (:func:`oar.tracking.flatten`).

    Args:
        config: validated config.
        method: the :class:`oar.config.ResolvedMethod` being trained.
        seed: run seed.
        start_model: :func:`oar.models.model_identity` of the model training starts from.
    """
    train = {k: v for k, v in config["train"].items() if k not in RESUMABLE_TRAIN_KEYS}
    model = {k: v for k, v in config["model"].items() if k not in _MODEL_LOCATION_KEYS}
    return flatten({
        "method": method.as_params(),
        "seed": seed,
        "start_model": start_model,
        "model": model,
        "task": config["task"],
        "train": train,
        "rollout": config["rollout"],
        "reward": config["reward"],
    })


def identity_diff(saved: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Lines ``key: <saved> -> <current>`` for every key whose value differs (or exists on one side)."""
    lines = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k, "<absent>"), current.get(k, "<absent>")
        if a != b:
            lines.append(f"{k}: {a} -> {b}")
    return lines


# ----------------------------------------------------------------------------------- trainer state


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, gauss_np = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np))
    torch.set_rng_state(rng["torch"])


def save_trainer_state(path: str | Path, *, optimizer_state: Mapping[str, Any] | None, scheduler: Any,
                       state: Mapping[str, Any], identity: Mapping[str, str]) -> None:
    """Write the optimizer state (None when the strategy stores it sharded beside), scheduler, RNG
    states, loop state and run identity to ``path`` (``torch.save``)."""
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": _rng_state(),
                "state": dict(state), "identity": dict(identity)}, path)


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """Read a file of :func:`save_trainer_state` with ``weights_only=True`` (no code runs).

    Raises:
        ValueError: naming the file when it is not a trainer state (tampered, truncated, or written
            by an older oar that pickled arbitrary objects).
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for forbidden globals, RuntimeError for a broken zip
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a loadable trainer state ({first}); it was not executed. "
                         f"Delete the checkpoint or pass --restart to start over.") from None
    if not isinstance(saved, dict) or not {"optimizer", "scheduler", "rng", "state"} <= set(saved):
        raise ValueError(f"{path}: not a trainer state (keys {sorted(saved) if isinstance(saved, dict) else type(saved).__name__})")
    return saved


def restore_rng(saved: Mapping[str, Any]) -> None:
    """Put the RNG states of a loaded trainer state back (python, numpy, torch)."""
    _set_rng_state(saved["rng"])


# ------------------------------------------------------------------------------------------ folder


@dataclass(frozen=True)
class RunFolder:
    """Paths of one run's folder and the operations that keep it consistent across interruptions.

    Every method that writes assumes the caller holds the folder's lock
    (:func:`oar.io.exclusive_lock`).
    """

    path: Path

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def state_file(self) -> Path:
        return self.checkpoint / STATE_FILE

    @property
    def final(self) -> Path:
        return self.path / FINAL_DIR

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    def recover(self) -> list[str]:
        """Repair what a kill during a checkpoint or final-model write left (see
        :func:`oar.io.recover_atomic_dir`); returns what was done."""
        return recover_atomic_dir(self.checkpoint) + recover_atomic_dir(self.final)

    def start_over(self) -> list[str]:
        """Remove the checkpoint, final model, metrics and summary (``--restart``); returns what went."""
        gone = []
        for p in (self.checkpoint, self.final, self.metrics, self.summary):
            if p.exists():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                gone.append(p.name)
        return gone

    def check_identity(self, saved: Mapping[str, str] | None, current: Mapping[str, str]) -> None:
        """Refuse to resume a checkpoint of another run.

        Raises:
            RunMismatchError: naming every differing key and the flag that starts over.
        """
        if saved is None:
            diff = ["(the checkpoint stores no run identity: it was written by an older oar)"]
        else:
            diff = identity_diff(saved, current)
        if diff:
            shown = "; ".join(diff[:12]) + (f"; and {len(diff) - 12} more" if len(diff) > 12 else "")
            raise RunMismatchError(
                f"{self.checkpoint} belongs to a run with other settings, so it cannot be resumed: {shown}. "
                f"Pass --restart to discard it and start over, or choose another --output."
            )

    def keep_metrics_before(self, step: int) -> None:
        """Drop ``metrics.jsonl`` rows of steps >= ``step`` (they will run again)."""
        if self.metrics.exists():
            rows = read_jsonl(self.metrics)
            if any(r.get("step", -1) >= step for r in rows):
                atomic_write_jsonl(self.metrics, [r for r in rows if r.get("step", -1) < step])

    def recorded_mlflow_run(self) -> str | None:
        """The MLflow run id the folder last logged to (``run.json``), or None."""
        p = self.path / RUN_FILE
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text(encoding="utf-8")).get("mlflow_run_id")
        except (ValueError, AttributeError):
            return None

    def record_mlflow_run(self, run_id: str | None) -> None:
        atomic_write_json(self.path / RUN_FILE, {"mlflow_run_id": run_id})
