"""Where a training run stands (:class:`RunState`): the steps done, the prompt stream's place, the
MLflow run and the non-finite guard's count. Every checkpoint's trainer state saves it
(``state``, :func:`oar.trainer.runs.save_trainer_state`) and a resumed run starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["RunState"]


@dataclass
class RunState:
    """The loop's state between steps.

    Attributes:
        step: steps done (the next step's index).
        cursor: the main process's place in the prompt stream (:class:`oar.trainer.batch.PromptStream`).
        run_id: the run's MLflow run id (None until the tracker starts).
        nonfinite_streak: consecutive steps whose every update was skipped as non-finite.
        cursors: each process's place, saved with several processes (DAPO's extra sampling rounds
            differ between them); None with one.
    """

    step: int = 0
    cursor: int = 0
    run_id: str | None = None
    nonfinite_streak: int = 0
    cursors: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state`` entry (``cursors`` only where saved, as it always was)."""
        out: dict[str, Any] = {"step": self.step, "cursor": self.cursor, "run_id": self.run_id,
                               "nonfinite_streak": self.nonfinite_streak}
        if self.cursors is not None:
            out["cursors"] = list(self.cursors)
        return out

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "RunState":
        """The state a checkpoint saved (:meth:`to_dict`); a key it lacks keeps its start value."""
        start = cls()
        return cls(step=saved.get("step", start.step), cursor=saved.get("cursor", start.cursor),
                   run_id=saved.get("run_id", start.run_id),
                   nonfinite_streak=saved.get("nonfinite_streak", start.nonfinite_streak),
                   cursors=list(saved["cursors"]) if saved.get("cursors") else None)

    def resume_cursor(self, rank: int, world: int) -> int:
        """Where process ``rank``'s prompt stream resumes: its own cursor (``cursors``, one per
        process), else the main process's (a checkpoint of one process, of another number of
        processes, or of an older oar)."""
        return int(self.cursors[rank]) if self.cursors and len(self.cursors) == world else int(self.cursor)
