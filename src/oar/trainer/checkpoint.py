"""Writing a training checkpoint (:func:`save_checkpoint`) and naming a full disk in one line
(:func:`disk_full_named`, :func:`intact_sentence`): the file side of :mod:`oar.trainer.loop`'s checkpoint
phase. The folder layout, reading a checkpoint back and what may be resumed: :mod:`oar.trainer.runs`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from oar.trainer.runs import STATE_FILE, RunFolder, disk_full_error, is_disk_full, save_trainer_state, write_manifest
from oar.trainer.strategy import Strategy

__all__ = ["save_checkpoint", "intact_sentence", "disk_full_named"]


def save_checkpoint(strategy: Strategy, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any, state: dict,
                     identity: dict[str, str], folder: RunFolder, *, intact: int | None, keep: int) -> None:
    """Write model and optimizer (whole or sharded, per strategy), tokenizer, scheduler, RNG states,
    data position and run identity into a temporary folder, then ``checkpoint.json`` (every file's
    size), then rename it onto the checkpoint. A full disk raises :class:`oar.trainer.runs.DiskFullError`
    naming the checkpoint that is intact (the one of step ``intact``, None: none yet). With ``keep``
    > 1 (``train.keep_checkpoints``) the checkpoint it replaces is kept as ``checkpoints/step_<N>/``,
    and the oldest kept ones are pruned once the new one is complete, ``keep`` in all."""
    step = state["step"]
    if keep > 1 and strategy.is_main:
        folder.archive_checkpoint()
    with disk_full_named(folder.checkpoint, f"the step-{step} checkpoint", strategy.checkpoint_bytes(model, optimizer),
                          intact_sentence(folder, intact)):
        with strategy.shared_atomic_dir(folder.checkpoint, seal=lambda tmp: write_manifest(tmp, step=step)) as tmp:
            optimizer_state = strategy.save_training_state(model, optimizer, tmp, tokenizer)
            if strategy.is_main:
                save_trainer_state(tmp / STATE_FILE, optimizer_state=optimizer_state, scheduler=scheduler, state=state,
                                   identity=identity)
    if strategy.is_main and folder.archive.exists():
        folder.prune_archive(keep)


def intact_sentence(folder: RunFolder, intact: int | None) -> str:
    """Which checkpoint a failed write left intact, for :class:`oar.trainer.runs.DiskFullError`."""
    if intact is None:
        return "No checkpoint was written before: a rerun starts at step 0."
    return f"The step-{intact} checkpoint {folder.checkpoint} is intact: a rerun resumes from step {intact}."


@contextlib.contextmanager
def disk_full_named(path: Path, what: str, needed: int, intact: str) -> Any:
    """Turn an error of the block that means a full disk into one :class:`oar.trainer.runs.DiskFullError`
    line (the block's atomic write has already removed what it wrote); other errors pass."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - torch.distributed.checkpoint's errors are BaseExceptions
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not is_disk_full(e, path, needed):
            raise
        raise disk_full_error(path, what, needed, intact) from e
