"""How a training run stops early without losing work: signals, time-based checkpoints, exit code.

A cluster ends a job with a signal. SLURM sends SIGTERM at the time limit, on preemption and on
``scancel``, then SIGKILL after ``KillWait`` (30 s by default); ``sbatch --signal=TERM@N`` sends
it N seconds before the limit (the workflow asks for it, see ``train.preemption``); a terminal
sends SIGINT on Ctrl-C; torchrun forwards the signals it handles to its workers. Inside
:func:`oar.trainer.loop.train`, :class:`StopSignal` turns SIGTERM, SIGINT and SIGUSR1 into a request: the
loop finishes the step it is in, every process agrees to stop after that same step
(:meth:`CheckpointSchedule.after_step`, a maximum over the processes), writes a checkpoint (all
processes, sharded under FSDP), marks the MLflow run KILLED with the step, and ``oar train``
exits with :data:`EXIT_INTERRUPTED`. A rerun of the same command resumes from that checkpoint.

A second signal ends the process at once (the signal's default action): nothing is written, the
previous checkpoint stays intact, and the next start removes a half-written one. One signal
often arrives twice, though: SLURM signals every process of a job step and torchrun forwards the
one it got a few milliseconds later; a terminal's Ctrl-C reaches torchrun and its workers alike.
A repeat within ``train.preemption.repeat_seconds`` of the first signal is that same signal and
is ignored.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

__all__ = ["EXIT_INTERRUPTED", "STOP_SIGNALS", "StopSignal", "CheckpointSchedule", "StepDecision",
           "restore_ignored_signals"]

#: Exit status of ``oar train`` stopped by a signal after writing its checkpoint: "interrupted,
#: resumable; run the same command again". ``EX_TEMPFAIL`` of BSD's sysexits.h (a temporary
#: failure, the user is invited to retry), distinct from 1 (an error), 2 (a usage or config error)
#: and 128 + N (killed by signal N, what a second signal or SIGKILL gives).
EXIT_INTERRUPTED = 75

#: The signals that ask the loop to stop after its step: SLURM's time limit, preemption and
#: ``scancel`` (TERM), Ctrl-C (INT), and USR1, which batch scripts commonly ask for early
#: (``sbatch --signal=B:USR1@N``) and forward.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def restore_ignored_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> list[str]:
    """Give :data:`STOP_SIGNALS` that this process inherited as ignored their default action back
    (a rule's shell ignores SIGTERM so that it outlives its job on SLURM: ``oar.pipeline.launch.SHELL_PREFIX``;
    a command that is not the trainer must still end on SLURM's SIGTERM and on scancel). Returns
    the names restored. Only from the main thread (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    restored = []
    for sig in signals:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
            restored.append(sig.name)
    return restored


class _Agrees(Protocol):
    """What :class:`CheckpointSchedule` needs of the strategy: a maximum over the processes."""

    def max_over_ranks(self, values: list[int]) -> list[int]: ...


class StopSignal:
    """While active (a context manager), :data:`STOP_SIGNALS` ask the loop to stop after its step.

    The first signal is recorded (:attr:`received`); a repeat within ``repeat_seconds`` is taken
    for the same signal delivered twice and ignored; a later one restores the signal's default
    action and re-raises it, so the process ends at once. The handlers only set a flag (no I/O),
    ask the kernel to restart interrupted system calls (``siginterrupt(sig, False)``, so a read
    in a collective or a file write is not cut short), and are put back as they were on exit.
    A process forked while they are installed (a reward worker) takes the default action.
    Installed only from the main thread (Python's rule); elsewhere the object does nothing.

    Args:
        repeat_seconds: ``train.preemption.repeat_seconds``.
        signals: the signals to catch.
    """

    def __init__(self, *, repeat_seconds: float, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.repeat_seconds = float(repeat_seconds)
        self.signals = tuple(signals)
        self.received: str | None = None  #: name of the first signal (``"SIGTERM"``), None before one
        self.received_at: float | None = None  #: ``time.monotonic()`` of the first signal
        self._previous: dict[signal.Signals, Any] = {}
        self._pid: int | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for (a signal arrived, or :meth:`request`)."""
        return self.received is not None

    def request(self, reason: str) -> None:
        """Ask for a stop as a first signal would (for callers that are not signals)."""
        if self.received is None:
            self.received, self.received_at = reason, time.monotonic()

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                signal.siginterrupt(sig, False)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is what is left
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def reinstall(self) -> list[str]:
        """Put the handlers back where a library replaced them while the run started (an engine
        that installs its own); returns the names of the signals it took back."""
        taken = []
        if self._previous and os.getpid() == self._pid:
            for sig in self.signals:
                if signal.getsignal(sig) != self._handle:
                    signal.signal(sig, self._handle)
                    signal.siginterrupt(sig, False)
                    taken.append(sig.name)
        return taken

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child inherited the handler: behave as without it
            _die_by(signum)
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, now
            return
        if self.received_at is not None and now - self.received_at < self.repeat_seconds:
            return  # the first signal, delivered twice (to the process group, and forwarded)
        _die_by(signum)


def _die_by(signum: int) -> None:
    """End this process with ``signum``'s default action (as if no handler had been installed)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action does not end the process


@dataclass(frozen=True)
class StepDecision:
    """What the loop does after a step: write a checkpoint, and stop after writing it."""

    save: bool
    stop: bool


@dataclass
class CheckpointSchedule:
    """When the training loop writes a checkpoint and whether it stops after it (its one seam for
    ``train.save_every``, ``train.save_every_minutes`` and :class:`StopSignal`).

    A checkpoint is written every ``save_every`` steps, after the last step, once
    ``save_every_minutes`` have passed since the last one (or since the start), and when a stop is
    requested (after the last step too: the rerun then only writes the final model, which may not
    fit in what is left of the job's time). Processes decide together (one maximum over them per step), so a signal that
    reached one process stops all of them after the same step, and the minutes counted by one
    make all of them save.

    Args:
        save_every: ``train.save_every``.
        total_steps: ``train.steps``.
        save_every_minutes: ``train.save_every_minutes`` (None: by steps only).
        stop: the run's :class:`StopSignal`.
        strategy: gives the maximum over the processes (:class:`oar.trainer.strategy.Strategy`).
        clock: seconds (``time.monotonic``), replaceable in tests.
    """

    save_every: int
    total_steps: int
    save_every_minutes: float | None
    stop: StopSignal
    strategy: _Agrees
    clock: Any = time.monotonic
    _last_save: float = field(init=False)

    def __post_init__(self) -> None:
        self._last_save = self.clock()

    def before_first_step(self) -> bool:
        """Whether a signal that came while the run was starting asks every process to stop now
        (nothing trained yet in this invocation, so nothing to save)."""
        return bool(self.strategy.max_over_ranks([int(self.stop.requested)])[0])

    def after_step(self, step: int) -> StepDecision:
        """The decision after ``step`` steps are done (``step`` counts from 1)."""
        minutes = self.save_every_minutes
        due = minutes is not None and self.clock() - self._last_save >= 60.0 * minutes
        stop, due = self.strategy.max_over_ranks([int(self.stop.requested), int(due)])
        save = bool(stop or due or step % self.save_every == 0 or step == self.total_steps)
        return StepDecision(save=save, stop=bool(stop))

    def saved(self) -> None:
        """A checkpoint was written: the minutes count from now."""
        self._last_save = self.clock()
