"""The RL training loop shared by every method (``oar train``).

Read it top to bottom, like nanoGPT's ``train.py``: per step we

1. take the next ``prompts_per_step`` prompts and sample ``n`` responses each (rollout engine);
2. score them (``oar.reward.score``), with DAPO's overlong shaping and dynamic sampling when the recipe
   asks for them;
3. compute token advantages with the method's registered estimator (``oar.credit``);
4. update the policy: ``ppo_epochs`` passes over shuffled mini-batches, PPO clip with the recipe's
   ``eps_low``/``eps_high``, optional k3 KL to a frozen reference, gradient clipping, AdamW and a
   warmup + schedule;
5. log metrics (MLflow and ``metrics.jsonl``) and checkpoint every ``save_every`` steps (and every
   ``save_every_minutes``); a SIGTERM, SIGINT or SIGUSR1 stops the run after the step it is in,
   with a checkpoint (:mod:`oar.trainer.preemption`).

Methods differ only by their resolved recipe and estimator (``oar.config.methods.resolve_method``).

Output folder layout, locking, crash recovery and what may be resumed: :mod:`oar.trainer.runs`
(``checkpoint/``, ``model/``, ``metrics.jsonl``, ``train_summary.json``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from oar.trainer.batch import StepBatch, collect_batch, continuation_context
from oar.core.seeds import CONTINUATIONS_SALT, UPDATE_SALT, step_seed
from oar.trainer.checkpoint import disk_full_named, intact_sentence, save_checkpoint
from oar.config.methods import ResolvedMethod, resolve_method
from oar.credit import CreditBatch, estimator_spec
from oar.credit.metrics import credited_concentration, ess_ratio, top_mass
from oar.config.identity import run_identity
from oar.trainer.preemption import StopSignal
from oar.trainer.end import finish_run, interrupted_run, mean_of
from oar.trainer.setup import TrainingRun, check_train_inputs, setup_run
from oar.trainer.runs import TIMED_PHASES, RunFolder
from oar.trainer.strategy import Strategy
from oar.trainer.update import update_policy

__all__ = [
    "TrainingError",
    "train",
    "step_metrics",
    "marked_timer",
]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. several non-finite losses in a row); the last checkpoint is intact."""


#: Step metrics that are counts: summed over the processes (the others are averaged).
SUMMED_METRICS: tuple[str, ...] = ("reward_timeouts", "reward_crashes", "reward_marked")


# ----------------------------------------------------------------------------------------------
# pieces of the loop (plain functions, tested on their own)


# ----------------------------------------------------------------------------------------------
# the loop


def train(
    config: dict,
    method_name: str,
    seed: int,
    output: str | Path,
    *,
    init: str | None = None,
    restart: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    stop: StopSignal | None = None,
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
        stop_after: stop (as if killed: no checkpoint) after this many steps of this invocation; for tests.
        stop: the :class:`oar.trainer.preemption.StopSignal` already catching signals (``oar train`` installs
            one before the slow imports); by default one is installed here for the run.
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
    start = init if init is not None else config["train"].get("init")
    start_spec = dict(config["model"], source=start, gguf_file=None) if start else dict(config["model"])
    start_key = "--init" if init is not None else "train.init" if start else "model.source"
    # before the folder is locked, repaired or reset
    check_train_inputs(config, start_spec, folder.path, start_key=start_key, method=method)
    signals = (contextlib.nullcontext(stop) if stop is not None
               else StopSignal(repeat_seconds=config["train"]["preemption"]["repeat_seconds"]))
    with signals as stop:
        strategy = make_strategy(config)
        lock = (exclusive_lock(folder.path, purpose=f"oar train {method.name} seed {seed}")
                if strategy.is_main else contextlib.nullcontext())
        with lock:
            identity = run_identity(config, method, seed, model_identity(start_spec))
            if strategy.is_main:
                for line in folder.recover() + ([f"removed {n}" for n in folder.start_over()] if restart else []):
                    print(f"oar train: {folder.path}: {line}", file=sys.stderr)
            strategy.barrier()
            return _train(config, method, seed, folder, start_spec, identity, strategy,
                          progress=progress, stop_after=stop_after, stop=stop)


@contextlib.contextmanager
def marked_timer(name: str, timings: dict[str, float]) -> Any:
    """Add the wall time of the block to ``timings[name]`` (verl's ``marked_timer``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


def _train(config: dict, method: ResolvedMethod, seed: int, folder: RunFolder, start_spec: dict,
           identity: dict[str, str], strategy: Strategy, *, progress: bool, stop_after: int | None,
           stop: StopSignal) -> dict:
    """The loop of :func:`train`, run while the folder is locked and repaired: set-up, then per step
    rollout -> credit -> update -> metrics -> log -> checkpoint, then the final model."""
    loop = setup_run(config, method, seed, folder, start_spec, identity, strategy, stop)
    try:
        return _steps(loop, progress=progress, stop_after=stop_after, stop=stop)
    finally:
        loop.engine.close()  # while the process group exists (vLLM's teardown ends it)
        loop.reward_pool.close()


def _steps(loop: TrainingRun, *, progress: bool, stop_after: int | None, stop: StopSignal) -> dict:
    """The steps of :func:`_train` from where the run stands, then the final model."""
    from tqdm.auto import tqdm

    method, seed, folder, strategy = loop.method, loop.seed, loop.folder, loop.strategy
    steps = loop.tcfg["steps"]
    if loop.state["step"] < steps and loop.schedule.before_first_step():  # a signal while starting: nothing to save
        return interrupted_run(stop, loop.state["step"], folder, loop.tracker, strategy, checkpointed=loop.resumed)
    bar = tqdm(total=steps, initial=loop.state["step"], desc=f"{method.name} seed{seed}",
               disable=not (progress and strategy.is_main), dynamic_ncols=True)
    last_metrics: dict[str, float] = {}
    steps_this_call = 0
    while loop.state["step"] < steps:
        step, t_step = loop.state["step"], time.perf_counter()
        timings = dict.fromkeys(TIMED_PHASES, 0.0)
        batch = _rollout(loop, step, timings)                      # 1-2. rollout + reward (+ dynamic sampling)
        credit = _credit(loop, batch, step, timings)               # 3. token advantages
        upd, nonfinite = _update(loop, batch, credit, step, timings)   # 4. policy update
        metrics = step_metrics(batch, credit, upd, nonfinite, lr=float(loop.scheduler.get_last_lr()[0]),
                               timings=timings, step_seconds=time.perf_counter() - t_step)   # 5. metrics
        last_metrics = _log(loop, step, metrics, nonfinite=nonfinite, losses=upd["loss"])  # 6. log, held-out
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.3f}")
        if not progress and strategy.is_main:
            _progress_line(loop, metrics, steps)  # a log's per-step account, where no bar is drawn
        steps_this_call += 1
        if _checkpoint(loop):                                      # 7. checkpoint; stop on a signal
            bar.close()
            return interrupted_run(stop, loop.state["step"], folder, loop.tracker, strategy, checkpointed=True)
        if stop_after is not None and steps_this_call >= stop_after and loop.state["step"] < steps:
            bar.close()
            return {"interrupted_at": loop.state["step"]}
    bar.close()
    return finish_run(loop, last_metrics)


#: Lines a run without a progress bar (``--no-progress``, every workflow job) logs over its steps.
PROGRESS_LINES = 50


def _progress_line(loop: TrainingRun, metrics: dict[str, float], steps: int) -> None:
    """One line to stderr every ``steps / PROGRESS_LINES`` steps and at the last: the step, reward,
    accuracy, response length and seconds of the step (a job's log shows how its run goes)."""
    done = loop.state["step"]
    if done % max(1, steps // PROGRESS_LINES) and done != steps:
        return
    print(f"oar train: {loop.method.name} seed {loop.seed}: step {done}/{steps} reward {metrics['reward']:.3f} "
          f"accuracy {metrics['accuracy']:.3f} length {metrics['response_length']:.1f} "
          f"{metrics['time_step']:.2f} s/step", file=sys.stderr, flush=True)


def _rollout(loop: TrainingRun, step: int, timings: dict[str, float]) -> "StepBatch":
    """Steps 1-2: sample and score this process's share of the step's prompts (:func:`collect_batch`),
    in the engine's phase (:func:`oar.rollout.engine_phase`: the gathered policy for the HF engine)."""
    from oar.rollout import engine_phase

    with engine_phase(loop.engine, loop.strategy, loop.model):
        return collect_batch(loop.engine, loop.stream, loop.prompts_all, loop.records, config=loop.config,
                              recipe=loop.recipe, seed=loop.seed, step=step, rank=loop.strategy.rank,
                              world=loop.strategy.world, local_prompts=loop.local_prompts,
                              pad_id=loop.tokenizer.pad_token_id, timings=timings, pool=loop.reward_pool)


def _credit(loop: TrainingRun, batch: "StepBatch", step: int, timings: dict[str, float]) -> Any:
    """Step 3: the method's estimator (OAR-P / OAR-G / mc_value call the gathered policy). The engine
    sleeps from here on (rollout.sleep_mode: its memory is free for the estimator's passes, as
    ``oar plan``'s credit phase counts it), unless the estimator samples continuations through it."""
    ro, spec = batch.rollout, estimator_spec(loop.method.estimator)
    extras = {"old_logprobs": ro.logprobs, "step": step, "seed": loop.seed, "task": loop.config["task"]}
    if spec.needs_continuations:  # mc_value
        extras["continuations"] = continuation_context(loop.engine, batch, loop.prompts_all, loop.records,
                                                 config=loop.config, recipe=loop.recipe,
                                                 seed=step_seed(loop.seed, step, CONTINUATIONS_SALT),
                                                 pool=loop.reward_pool)
    else:
        loop.engine.sleep()
    with loop.strategy.local_phase(loop.model) if spec.needs_model else contextlib.nullcontext():
        with marked_timer("importance", timings):
            return spec.fn(
                CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask, rewards=batch.rewards,
                            group_ids=batch.group_ids, prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
                            model=loop.policy, tokenizer=loop.tokenizer, extras=extras),
                **loop.credit_options,
            )


def _update(loop: TrainingRun, batch: "StepBatch", credit: Any, step: int,
            timings: dict[str, float]) -> tuple[dict[str, list[float]], int]:
    """Step 4: the policy update (:func:`update_policy`), the scheduler, and the engine refreshed
    with the new weights (:func:`oar.rollout.refresh_engine`; the engine sleeps meanwhile)."""
    from oar.rollout import refresh_engine

    with marked_timer("update", timings):
        loop.engine.sleep()  # rollout.sleep_mode: the engine frees its KV cache and weights meanwhile
        out = update_policy(loop.model, loop.optimizer, loop.strategy, batch.rollout,
                             credit.token_advantages.float(), loop.ref_model, recipe=loop.recipe, tcfg=loop.tcfg,
                             temperature=loop.rcfg["temperature"], agg_max_len=loop.agg_max_len,
                             generator=torch.Generator().manual_seed(step_seed(loop.seed, step, UPDATE_SALT)))
        loop.scheduler.step()
        refresh_engine(loop.engine, loop.strategy, loop.model)
    return out


def step_metrics(batch: "StepBatch", credit: Any, upd: dict[str, list[float]], nonfinite: int, *, lr: float,
                 timings: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Step 5: the metrics of a step (this process's): rewards and lengths of the batch, the update's
    losses and statistics, the credit's concentration, the share of responses with credit and its
    concentration against uniform credit, the estimator's own stats (``credit_*``), the phases' seconds
    (``time_*``) and the whole step's (``time_step``), and the step's reward checks that timed out, whose
    worker died, and that were scored wrong for it after their retry (``reward_timeouts``,
    ``reward_crashes``, ``reward_marked``: ``batch.reward_stats``, oar.reward.score's module docstring)."""
    ro = batch.rollout
    mask_f = ro.response_mask.float()
    token_adv = credit.token_advantages.float()
    weights = credit.weights if credit.weights is not None else torch.ones_like(mask_f)
    credited, top_credited, top_uniform = credited_concentration(token_adv, ro.response_mask, frac=0.1)
    return {
        "reward": float(batch.rewards.mean()),
        "accuracy": float(batch.correct.float().mean()),
        "response_length": float(mask_f.sum(1).mean()),
        "truncated": float(ro.truncated.float().mean()),
        "entropy": mean_of(upd["entropy"]),
        "kl_ref": mean_of(upd["kl_ref"]),
        "approx_kl": mean_of(upd["approx_kl"]),
        "clipfrac": mean_of(upd["clipfrac"]),
        "loss": mean_of(upd["loss"]),
        "pg_loss": mean_of(upd["pg_loss"]),
        "grad_norm": mean_of(upd["grad_norm"]),
        # share of the update's computed token positions that are padding (train.packing)
        "update_padding": 1.0 - sum(upd["tokens_real"]) / max(sum(upd["tokens_computed"]), 1.0),
        "ess_ratio": float(ess_ratio(weights, ro.response_mask).mean()),
        "top10_mass": float(top_mass(token_adv, ro.response_mask, frac=0.1).mean()),
        # responses with a non-zero advantage, and the concentration of their credit against uniform
        "credited_share": credited,
        "top10_mass_credited": top_credited,
        "top10_mass_uniform": top_uniform,
        "nonfinite_updates": float(nonfinite),
        "gen_batches": float(batch.n_gen_batches),
        "kept_groups": float(batch.kept_fraction),
        "reward_timeouts": float(batch.reward_stats.timeouts),
        "reward_crashes": float(batch.reward_stats.crashes),
        "reward_marked": float(batch.reward_stats.marked),
        "lr": lr,
        **{f"time_{k}": v for k, v in timings.items()},
        "time_step": step_seconds,
        **{f"credit_{k}": float(v) for k, v in credit.stats.items()},
    }


def _log(loop: TrainingRun, step: int, metrics: dict[str, float], *, nonfinite: int, losses: list[float]) -> dict[str, float]:
    """Step 6: the metrics averaged over processes (the counts of :data:`SUMMED_METRICS` summed) and
    logged; the non-finite guard; the step counted; the held-out evaluation when due. Returns the
    logged metrics."""
    strategy, state, folder = loop.strategy, loop.state, loop.folder
    state["nonfinite_streak"] = state["nonfinite_streak"] + 1 if nonfinite and not losses else 0
    if strategy.world > 1:
        metrics = dict(zip(metrics, strategy.mean_over_ranks(list(metrics.values()))))
        metrics.update({k: metrics[k] * strategy.world for k in SUMMED_METRICS if k in metrics})
    intact = intact_sentence(folder, loop.intact)
    if loop.tracker is not None:  # a full disk here: one line, no half row (oar.core.io.append_jsonl)
        with disk_full_named(folder.metrics, f"the metrics of step {step}", len(json.dumps(metrics)), intact):
            loop.tracker.log_metrics(metrics, step)
    if state["nonfinite_streak"] >= loop.tcfg["max_nonfinite"]:
        if loop.tracker is not None:
            loop.tracker.finish("FAILED")
        raise TrainingError(
            f"{state['nonfinite_streak']} consecutive steps with non-finite loss or gradient (step {step}, "
            f"method {loop.method.name}, seed {loop.seed}); stopping. The last good checkpoint in {folder.checkpoint} "
            f"is intact; try a lower train.lr or a smaller train.grad_clip."
        )
    state["step"] = step + 1
    state["cursor"] = loop.stream.cursor
    with disk_full_named(folder.metrics, f"the held-out row of step {state['step']}", len(json.dumps(metrics)), intact):
        loop.heldout.after_step(state["step"], metrics["time_step"])  # not counted in any step's time
    return metrics


def _checkpoint(loop: TrainingRun) -> bool:
    """Step 7: a checkpoint when the schedule says so (every ``save_every`` steps or minutes, the last
    step, a signal; the same decision on every process). Returns whether to stop (a signal)."""
    strategy, state = loop.strategy, loop.state
    decision = loop.schedule.after_step(state["step"])
    if decision.save:
        if strategy.world > 1:  # DAPO's extra sampling rounds differ between processes: each resumes at its own place
            state["cursors"] = strategy.max_over_ranks(
                [loop.stream.cursor if r == strategy.rank else 0 for r in range(strategy.world)])
        save_checkpoint(strategy, loop.model, loop.tokenizer, loop.optimizer, loop.scheduler, state, loop.identity,
                         loop.folder, intact=loop.intact, keep=int(loop.tcfg["keep_checkpoints"]))
        loop.intact = state["step"]
        loop.schedule.saved()
    return decision.stop


