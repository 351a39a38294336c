"""The RL training loop shared by every method (``oar train``).

Read it top to bottom, like nanoGPT's ``train.py``: :func:`train` locks and repairs the run
folder, :func:`oar.trainer.setup.setup_run` turns the validated config into typed settings and the
run's parts (:class:`oar.trainer.setup.TrainingRun`), then per step the library's one step
(:func:`oar.trainer.step.train_step`) does

1. take the next ``prompts_per_step`` prompts and sample ``n`` responses each (rollout engine);
2. score them (``oar.reward.score``), with DAPO's overlong shaping and dynamic sampling when the recipe
   asks for them;
3. compute token advantages with the method's registered estimator (``oar.credit``);
4. update the policy: ``ppo_epochs`` passes over shuffled mini-batches, PPO clip with the recipe's
   ``eps_low``/``eps_high``, optional k3 KL to a frozen reference, gradient clipping, AdamW and a
   warmup + schedule;
5. the step's metrics; and this loop goes on with

6. log them (MLflow and ``metrics.jsonl``), averaged over processes;
7. the held-out evaluation when due;
8. checkpoint every ``save_every`` steps (and every ``save_every_minutes``); a SIGTERM, SIGINT or
   SIGUSR1 stops the run after the step it is in, with a checkpoint (:mod:`oar.trainer.preemption`).

Methods differ only by their resolved recipe and estimator (``oar.config.methods.resolve_method``).

Output folder layout, locking, crash recovery and what may be resumed: :mod:`oar.trainer.runs`
(``checkpoint/``, ``model/``, ``metrics.jsonl``, ``train_summary.json``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from oar.config.identity import run_identity
from oar.config.methods import ResolvedMethod, resolve_method
from oar.config.settings import TrainSettings
from oar.trainer.checkpoint import disk_full_named, intact_sentence, save_checkpoint
from oar.trainer.end import finish_run, interrupted_run
from oar.trainer.preemption import StopSignal
from oar.trainer.runs import RunFolder
from oar.trainer.setup import TrainingRun, check_train_inputs, setup_run
from oar.trainer.step import StepObserver, train_step
from oar.trainer.strategy import Strategy

__all__ = ["TrainingError", "train"]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. several non-finite losses in a row); the last checkpoint is intact."""


#: Step metrics that are counts: summed over the processes (the others are averaged).
SUMMED_METRICS: tuple[str, ...] = ("reward_timeouts", "reward_crashes", "reward_marked")


def train(
    config: dict,
    method_name: str,
    seed: int,
    output: str | Path,
    *,
    init: str | None = None,
    restart: bool = False,
    progress: bool = True,
    stop: StopSignal | None = None,
    observer: StepObserver | None = None,
) -> dict:
    """Train ``method_name`` with ``seed``; resume from ``<output>/checkpoint`` if it exists.

    The folder is locked for the whole run (a second trainer into it fails at once, naming this
    one), repaired if a kill interrupted a checkpoint write, and resumed only if its checkpoint
    belongs to the same run and every file of it reads (:mod:`oar.trainer.runs`). SIGTERM, SIGINT and
    SIGUSR1 stop it after the step it is in, with a checkpoint (:mod:`oar.trainer.preemption`).

    Args:
        config: validated config (``oar.config.load.load_config``).
        method_name: a key of ``config["methods"]``.
        seed: run seed (same seed, same run).
        output: run folder.
        init: starting checkpoint (defaults to ``train.init``, else the config's ``model``).
        restart: discard the folder's checkpoint, model and metrics and start over.
        progress: show a progress bar.
        stop: the :class:`oar.trainer.preemption.StopSignal` already catching signals (``oar train`` installs
            one before the slow imports); by default one is installed here for the run.
        observer: sees every step's phases and metrics (:class:`oar.trainer.step.StepObserver`: a
            timing or memory probe) and may end the invocation after a step, as a kill would
            (:class:`oar.trainer.step.EndAfter`); then the summary is ``{"interrupted_at": <steps done>}``.
    Returns:
        The run summary (also written to ``<output>/train_summary.json``); after a signal,
        ``{"interrupted_at": <steps done>, "signal": "SIGTERM", "checkpoint": <path>}`` instead.
    Raises:
        oar.core.io.FolderLockedError: another process trains into ``output``.
        oar.trainer.runs.RunMismatchError: the checkpoint belongs to a run with other settings.
        oar.trainer.runs.CheckpointError: a file of the checkpoint cannot be read.
        oar.trainer.runs.DiskFullError: the disk filled up while writing a checkpoint or the model.
        oar.core.io.OutputPathError, oar.models.checks.ModelLoadError, oar.tracking.client.TrackingStoreError: from
            :func:`check_train_inputs`, before anything of ``output`` is touched.
    """
    from oar.core.io import exclusive_lock
    from oar.models.loading import model_identity
    from oar.trainer.strategy import make_strategy

    method: ResolvedMethod = resolve_method(config, method_name)
    folder = RunFolder(Path(output))
    train_settings = TrainSettings.from_config(config)
    start = init if init is not None else train_settings.init
    start_spec = dict(config["model"], source=start, gguf_file=None) if start else dict(config["model"])
    start_key = "--init" if init is not None else "train.init" if start else "model.source"
    # before the folder is locked, repaired or reset
    check_train_inputs(config, start_spec, folder.path, start_key=start_key, method=method)
    signals = (contextlib.nullcontext(stop) if stop is not None
               else StopSignal(repeat_seconds=train_settings.preemption.repeat_seconds))
    with signals as stop:
        strategy = make_strategy(train_settings, config["device"], source=f"config {config['name']!r}")
        lock = (exclusive_lock(folder.path, purpose=f"oar train {method.name} seed {seed}")
                if strategy.is_main else contextlib.nullcontext())
        with lock:
            identity = run_identity(config, method, seed, model_identity(start_spec))
            if strategy.is_main:
                for line in folder.recover() + ([f"removed {n}" for n in folder.start_over()] if restart else []):
                    print(f"oar train: {folder.path}: {line}", file=sys.stderr)
            strategy.barrier()
            return _train(config, train_settings, method, seed, folder, start_spec, identity, strategy,
                          progress=progress, stop=stop, observer=observer or StepObserver())


def _train(config: dict, train: TrainSettings, method: ResolvedMethod, seed: int, folder: RunFolder,
           start_spec: dict, identity: dict[str, str], strategy: Strategy, *, progress: bool, stop: StopSignal,
           observer: StepObserver) -> dict:
    """The loop of :func:`train`, run while the folder is locked and repaired: set-up, then per step
    rollout -> credit -> update -> metrics -> log -> checkpoint, then the final model."""
    with setup_run(config, train, method, seed, folder, start_spec, identity, strategy, stop) as run:
        return _steps(run, progress=progress, stop=stop, observer=observer)


def _steps(run: TrainingRun, *, progress: bool, stop: StopSignal, observer: StepObserver) -> dict:
    """The steps of :func:`_train` from where the run stands, then the final model."""
    from tqdm.auto import tqdm

    steps = run.train.steps
    if run.state.step < steps and run.schedule.before_first_step():  # a signal while starting: nothing to save
        return interrupted_run(stop, run.state.step, run.folder, run.tracker, run.strategy, checkpointed=run.resumed)
    bar = tqdm(total=steps, initial=run.state.step, desc=f"{run.method.name} seed{run.seed}",
               disable=not (progress and run.strategy.is_main), dynamic_ncols=True)
    last_metrics: dict[str, float] = {}
    while run.state.step < steps:
        step = run.state.step
        out = train_step(run, step, observer)                     # 1-5. rollout, reward, credit, update, metrics
        last_metrics = _log(run, step, out.metrics, nonfinite=out.nonfinite, losses=out.update["loss"])  # 6. log
        _heldout(run, last_metrics)                                # 7. held-out evaluation when due
        bar.update(1)
        bar.set_postfix(reward=f"{out.metrics['reward']:.3f}", acc=f"{out.metrics['accuracy']:.3f}")
        if not progress and run.strategy.is_main:
            _progress_line(run, out.metrics, steps)  # a log's per-step account, where no bar is drawn
        if _checkpoint(run):                                       # 8. checkpoint; stop on a signal
            bar.close()
            return interrupted_run(stop, run.state.step, run.folder, run.tracker, run.strategy, checkpointed=True)
        if observer.after_step(step, out.metrics) and run.state.step < steps:  # ended as by a kill
            bar.close()
            return {"interrupted_at": run.state.step}
    bar.close()
    return finish_run(run, last_metrics)


#: Lines a run without a progress bar (``--no-progress``, every workflow job) logs over its steps.
PROGRESS_LINES = 50


def _progress_line(run: TrainingRun, metrics: dict[str, float], steps: int) -> None:
    """One line to stderr every ``steps / PROGRESS_LINES`` steps and at the last: the step, reward,
    accuracy, response length and seconds of the step (a job's log shows how its run goes)."""
    done = run.state.step
    if done % max(1, steps // PROGRESS_LINES) and done != steps:
        return
    print(f"oar train: {run.method.name} seed {run.seed}: step {done}/{steps} reward {metrics['reward']:.3f} "
          f"accuracy {metrics['accuracy']:.3f} length {metrics['response_length']:.1f} "
          f"{metrics['time_step']:.2f} s/step", file=sys.stderr, flush=True)


def _log(run: TrainingRun, step: int, metrics: dict[str, float], *, nonfinite: int, losses: list[float]) -> dict[str, float]:
    """Step 6: the metrics averaged over processes (the counts of :data:`SUMMED_METRICS` summed) and
    logged; the non-finite guard; the step counted. Returns the logged metrics."""
    strategy, state, folder = run.strategy, run.state, run.folder
    state.nonfinite_streak = state.nonfinite_streak + 1 if nonfinite and not losses else 0
    if strategy.world > 1:
        metrics = dict(zip(metrics, strategy.mean_over_ranks(list(metrics.values()))))
        metrics.update({k: metrics[k] * strategy.world for k in SUMMED_METRICS if k in metrics})
    if run.tracker is not None:  # a full disk here: one line, no half row (oar.core.io.append_jsonl)
        with disk_full_named(folder.metrics, f"the metrics of step {step}", len(json.dumps(metrics)),
                             intact_sentence(folder, run.intact)):
            run.tracker.log_metrics(metrics, step)
    if state.nonfinite_streak >= run.train.max_nonfinite:
        if run.tracker is not None:
            run.tracker.finish("FAILED")
        raise TrainingError(
            f"{state.nonfinite_streak} consecutive steps with non-finite loss or gradient (step {step}, "
            f"method {run.method.name}, seed {run.seed}); stopping. The last good checkpoint in {folder.checkpoint} "
            f"is intact; try a lower train.lr or a smaller train.grad_clip."
        )
    state.step = step + 1
    state.cursor = run.stream.cursor
    return metrics


def _heldout(run: TrainingRun, logged: dict[str, float]) -> None:
    """Step 7: the held-out evaluation of the model after ``run.state.step`` updates, when due
    (``train.heldout.every``; :class:`oar.evaluate.heldout.HeldoutEval`); its time is counted in no step's.
    ``logged``: the step's logged metrics (averaged over processes), whose ``time_step`` the training
    clock adds, the same on every process."""
    folder = run.folder
    with disk_full_named(folder.metrics, f"the held-out row of step {run.state.step}", len(json.dumps(logged)),
                         intact_sentence(folder, run.intact)):
        run.heldout.after_step(run.state.step, logged["time_step"])


def _checkpoint(run: TrainingRun) -> bool:
    """Step 8: a checkpoint when the schedule says so (every ``save_every`` steps or minutes, the last
    step, a signal; the same decision on every process). Returns whether to stop (a signal)."""
    strategy, state = run.strategy, run.state
    decision = run.schedule.after_step(state.step)
    if decision.save:
        if strategy.world > 1:  # DAPO's extra sampling rounds differ between processes: each resumes at its own place
            state.cursors = strategy.max_over_ranks(
                [run.stream.cursor if r == strategy.rank else 0 for r in range(strategy.world)])
        save_checkpoint(strategy, run.model, run.tokenizer, run.optimizer, run.scheduler, state.to_dict(),
                        run.identity, run.folder, intact=run.intact, keep=run.train.keep_checkpoints)
        run.intact = state.step
        run.schedule.saved()
    return decision.stop
