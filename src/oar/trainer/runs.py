"""A training run's output folder: what it holds, who may write it, and what it may resume.

Layout::

    <run>/.lock               held (flock) by the one process that trains into the folder
    <run>/checkpoint/         latest checkpoint (save_pretrained + trainer_state.pt), atomically replaced
    <run>/model/              final policy (save_pretrained), written when training ends
    <run>/metrics.jsonl       one row per step
    <run>/run.json            the MLflow run this folder logs to (so a restart can close an orphan)
    <run>/train_summary.json

A checkpoint stores the run's *identity* (:func:`oar.config.identity.run_identity`): the resolved method,
the seed, the train/rollout/reward/task configuration and the start model's content hash, without
the keys a run may change and continue (:data:`oar.config.identity.RESUMABLE_TRAIN_KEYS`). Resuming with
anything that changes these is refused (:class:`RunMismatchError`) instead of silently continuing another
run; ``restart=True`` (``oar train --restart``) discards the folder's state and starts over.

The trainer state is read with ``torch.load(weights_only=True)``: it holds only tensors and plain
Python values (RNG states are converted), so a tampered file cannot run code.

What an interruption costs (see also :mod:`oar.trainer.preemption`): a checkpoint is written into a
temporary folder and renamed into place, and its last file, ``checkpoint.json``, lists every file
with its size, so a kill at any point leaves the previous checkpoint whole (:meth:`RunFolder.recover`
removes the partial one). A checkpoint file that cannot be read (truncated, corrupt, missing) is
refused before anything is loaded from it, naming the file (:class:`CheckpointError`); a write that
fills the disk leaves no partial file and names the path, the space it needed and the checkpoint
that is intact (:class:`DiskFullError`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from oar.config.tree import (ARCHIVE_DIR, CHECKPOINT_DIR, FINAL_DIR, MANIFEST_FILE, METRICS_FILE, RUN_FILE, STATE_FILE,
                             SUMMARY_FILE)
from oar.core.io import (DISK_FULL_ERRNOS, DiskFullError, atomic_path, atomic_write_json, atomic_write_jsonl, format_bytes,
                         free_bytes, read_jsonl, recover_atomic_dir, safetensors_problem)

__all__ = [
    "RunFolder",
    "TIMED_PHASES",
    "RunMismatchError",
    "CheckpointError",
    "DiskFullError",
    "write_manifest",
    "check_checkpoint_files",
    "is_disk_full",
    "identity_diff",
    "save_trainer_state",
    "load_trainer_state",
]

#: The timed phases of a training step: ``time_<phase>`` in each row of :data:`METRICS_FILE` (beside
#: ``time_step``, the whole step) and ``mean_time`` in :data:`SUMMARY_FILE`.
TIMED_PHASES: tuple[str, ...] = ("rollout", "reward", "importance", "update")


class RunMismatchError(ValueError):
    """The folder's checkpoint belongs to a run with other settings; the message names the keys."""


class CheckpointError(ValueError):
    """A file of the checkpoint cannot be read (truncated, corrupt, missing, tampered); the message
    names the file and what to do."""


#: What to do about a checkpoint that cannot be resumed.
_RESTART_HINT = ("Put back a good copy of the file, or pass --restart to start over at step 0 (it discards the "
                 "run's checkpoint, model and metrics).")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unreadable(folder: str | Path, path: str | Path, reason: str) -> CheckpointError:
    """The error for ``path`` of the checkpoint ``folder`` that cannot be read for ``reason``."""
    return CheckpointError(f"{path}: unreadable ({reason}), so the checkpoint {folder} cannot be resumed. "
                           f"{_RESTART_HINT}")


def write_manifest(folder: str | Path, **fields: Any) -> None:
    """Write ``checkpoint.json`` into a complete checkpoint ``folder``: ``fields`` (the step) and the
    size of every file in it, so a later start can tell a whole checkpoint from a damaged one."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): p.stat().st_size
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    atomic_write_json(folder / MANIFEST_FILE, {**fields, "files": files})


def _check_safetensors(folder: Path, path: Path) -> None:
    """A ``.safetensors`` file whose header reads and whose size is what the header describes."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise unreadable(folder, path, problem)


def check_checkpoint_files(folder: str | Path) -> dict[str, Any] | None:
    """Check that every file of the checkpoint ``folder`` can be read, before anything is loaded.

    Every file ``checkpoint.json`` lists must exist with the size it was written with, and every
    ``.safetensors`` file must have a whole header and the size it describes. A checkpoint written
    before ``checkpoint.json`` existed gets the second check only.

    Returns:
        The manifest (None when the checkpoint has none).
    Raises:
        CheckpointError: naming the first file that cannot be read, and what to do.
    """
    folder = Path(folder)
    manifest = None
    mpath = folder / MANIFEST_FILE
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
            files = {str(k): int(v) for k, v in manifest["files"].items()}
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            raise unreadable(folder, mpath, "not a checkpoint manifest") from None
        for rel, size in files.items():
            path = folder / rel
            if not path.is_file():
                raise unreadable(folder, path, "missing")
            actual = path.stat().st_size
            if actual != size:
                what = "truncated" if actual < size else "not the file that was written"
                raise unreadable(folder, path, f"{actual} bytes where {size} were written: {what}")
    for path in sorted(folder.glob("*.safetensors")):
        _check_safetensors(folder, path)
    return manifest


# ---------------------------------------------------------------------------------------- disk full

#: How writers say it when they do not raise an OSError (safetensors: "IoError(Os { code: 28, kind:
#: StorageFull, message: \"No space left on device\" })").
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "storagefull")
#: What torch's zip writer (``torch.save``) says when a write failed, the errno lost: a full disk
#: when the file system has less room than the write needed.
_WRITE_FAILED_TEXT = ("unexpected pos", "file write failed")


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-process failures of a
    ``torch.distributed.checkpoint`` ``CheckpointException``."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, Mapping):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def is_disk_full(exc: BaseException, path: str | Path, needed: int) -> bool:
    """Whether ``exc``, raised while writing ``needed`` bytes under ``path``, means the disk is full."""
    for e in _exception_chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        text = str(e).lower()
        if any(t in text for t in _DISK_FULL_TEXT):
            return True
        if any(t in text for t in _WRITE_FAILED_TEXT) and free_bytes(path) < needed:
            return True
    return False


def disk_full_error(path: str | Path, what: str, needed: int, intact: str) -> DiskFullError:
    """The one-line error of a write of ``what`` under ``path`` that filled the disk.

    Args:
        path: where it was written (the checkpoint or model folder).
        what: ``"the step-12 checkpoint"``.
        needed: bytes the write needed (an estimate: the tensors it held).
        intact: the sentence that says which checkpoint is intact.
    """
    e = DiskFullError(f"{path}: no space left on device writing {what}: it needs about {format_bytes(needed)} "
                      f"and {format_bytes(free_bytes(path))} are free there; nothing of it was left. {intact} "
                      f"Free space (or move the run folder and pass the new --output) and run the same command again.")
    e.errno = errno.ENOSPC
    return e


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
        CheckpointError: (a ValueError) naming the file when it is not a trainer state (tampered,
            truncated, or written by an older oar that pickled arbitrary objects).
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for forbidden globals, RuntimeError for a broken zip
        raise CheckpointError(f"{path}: not a loadable trainer state ({_first_line(e)}); it was not executed. "
                              f"Delete the checkpoint or pass --restart to start over.") from None
    if not isinstance(saved, dict) or not {"optimizer", "scheduler", "rng", "state"} <= set(saved):
        raise CheckpointError(f"{path}: not a trainer state (keys "
                              f"{sorted(saved) if isinstance(saved, dict) else type(saved).__name__}); "
                              f"delete the checkpoint or pass --restart to start over.")
    return saved


def restore_rng(saved: Mapping[str, Any]) -> None:
    """Put the RNG states of a loaded trainer state back (python, numpy, torch)."""
    _set_rng_state(saved["rng"])


# ------------------------------------------------------------------------------------------ folder


@dataclass(frozen=True)
class RunFolder:
    """Paths of one run's folder and the operations that keep it consistent across interruptions.

    Every method that writes assumes the caller holds the folder's lock
    (:func:`oar.core.io.exclusive_lock`).
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
    def manifest(self) -> Path:
        return self.checkpoint / MANIFEST_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def archive(self) -> Path:
        return self.path / ARCHIVE_DIR

    def archive_checkpoint(self) -> Path | None:
        """Keep the current checkpoint as ``checkpoints/step_<N>/`` before a newer one replaces it
        (hard links: no copy of the bytes; the new checkpoint writes new files). None when there is no
        complete checkpoint (its manifest names the step) or that step is already kept."""
        info = check_checkpoint_files(self.checkpoint) if self.manifest.exists() else None
        if not info or "step" not in info:
            return None
        dest = self.archive / f"step_{int(info['step'])}"
        if dest.exists():
            return None
        with atomic_path(dest) as tmp:
            shutil.copytree(self.checkpoint, tmp, copy_function=os.link)
        return dest

    def prune_archive(self, keep: int) -> list[str]:
        """Remove the oldest kept checkpoints so that ``keep`` remain in all (the latest ``checkpoint/``
        and ``keep - 1`` earlier ones). Call it only after the latest checkpoint is complete.
        Returns the names removed."""
        kept = sorted((p for p in self.archive.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        gone = kept[:max(len(kept) - (keep - 1), 0)]
        for p in gone:
            shutil.rmtree(p)
        return [p.name for p in gone]

    def recover(self) -> list[str]:
        """Repair what a kill during a checkpoint or final-model write left (see
        :func:`oar.core.io.recover_atomic_dir`); returns what was done."""
        return recover_atomic_dir(self.checkpoint) + recover_atomic_dir(self.final)

    def check_checkpoint(self) -> dict[str, Any] | None:
        """:func:`check_checkpoint_files` of the checkpoint (raises :class:`CheckpointError`)."""
        return check_checkpoint_files(self.checkpoint)

    def unreadable_checkpoint(self, exc: BaseException) -> CheckpointError:
        """The error for a checkpoint that passed :meth:`check_checkpoint` but failed to load."""
        return CheckpointError(f"{self.checkpoint}: cannot be resumed: {_first_line(exc)}. "
                               f"{_RESTART_HINT}")

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
