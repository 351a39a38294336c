"""The RL training loop shared by every method (``oar train``).

Read it top to bottom, like nanoGPT's ``train.py``: per step we

1. take the next ``prompts_per_step`` prompts and sample ``n`` responses each (rollout engine);
2. score them (``oar.reward``), with DAPO's overlong shaping and dynamic sampling when the recipe
   asks for them;
3. compute token advantages with the method's registered estimator (``oar.credit``);
4. update the policy: ``ppo_epochs`` passes over shuffled mini-batches, PPO clip with the recipe's
   ``eps_low``/``eps_high``, optional k3 KL to a frozen reference, gradient clipping, AdamW and a
   warmup + schedule;
5. log metrics (MLflow and ``metrics.jsonl``) and checkpoint every ``save_every`` steps (and every
   ``save_every_minutes``); a SIGTERM, SIGINT or SIGUSR1 stops the run after the step it is in,
   with a checkpoint (:mod:`oar.preemption`).

Methods differ only by their resolved recipe and estimator (``oar.config.resolve_method``).

Output folder layout, locking, crash recovery and what may be resumed: :mod:`oar.runs`
(``checkpoint/``, ``model/``, ``metrics.jsonl``, ``train_summary.json``).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from oar.batch import (CONTINUATIONS_SALT, UPDATE_SALT, PromptStream, StepBatch, collect_batch, continuation_context,
                       load_training_records, resume_cursor, step_seed)
from oar.checkpoint import disk_full_named, intact_sentence, save_checkpoint
from oar.config import ResolvedMethod, resolve_method
from oar.credit import CreditBatch, estimator_needs_continuations, estimator_needs_model, get_estimator
from oar.credit.metrics import ess_ratio, top_mass
from oar.identity import run_identity
from oar.io import atomic_write_json, read_jsonl
from oar.preemption import CheckpointSchedule, StopSignal
from oar.rollout import make_engine
from oar.runs import RunFolder, load_trainer_state, restore_rng
from oar.strategy import Strategy
from oar.update import make_scheduler, update_policy

__all__ = [
    "TrainingError",
    "train",
    "check_train_inputs",
    "step_metrics",
    "marked_timer",
    "PHASES",
]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. several non-finite losses in a row); the last checkpoint is intact."""


# ----------------------------------------------------------------------------------------------
# pieces of the loop (plain functions, tested on their own)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# the loop


def check_train_inputs(config: dict, start_spec: dict, output: Path) -> None:
    """The user's files a run needs, checked before it touches anything: ``output`` can be a folder
    this process writes (:func:`oar.io.check_output_folder`), the MLflow store reads
    (:func:`oar.tracking.check_store`, when tracking is on) and the start model's files are whole
    (:func:`oar.models.check_model_files`). A failed check leaves an existing run folder as it was.

    Raises:
        oar.io.OutputPathError, oar.tracking.TrackingStoreError, oar.models.ModelLoadError: naming
            the file and what to do.
        FileNotFoundError: the start model is neither an existing path nor a hub id.
    """
    from oar.io import check_output_folder
    from oar.models import check_model_files
    from oar.tracking import check_store

    check_output_folder(output, what="the run folder (--output)")
    if config["tracking"]["enabled"]:
        check_store(config["tracking"]["uri"])
    check_model_files(start_spec)


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
    belongs to the same run and every file of it reads (:mod:`oar.runs`). SIGTERM, SIGINT and
    SIGUSR1 stop it after the step it is in, with a checkpoint (:mod:`oar.preemption`).

    Args:
        config: validated config (``oar.config.load_config``).
        method_name: a key of ``config["methods"]``.
        seed: run seed (same seed, same run).
        output: run folder.
        init: starting checkpoint (defaults to ``train.init``, else the config's ``model``).
        restart: discard the folder's checkpoint, model and metrics and start over.
        progress: show a progress bar.
        stop_after: stop (as if killed: no checkpoint) after this many steps of this invocation; for tests.
        stop: the :class:`oar.preemption.StopSignal` already catching signals (``oar train`` installs
            one before the slow imports); by default one is installed here for the run.
    Returns:
        The run summary (also written to ``<output>/train_summary.json``); after a signal,
        ``{"interrupted_at": <steps done>, "signal": "SIGTERM", "checkpoint": <path>}`` instead.
    Raises:
        oar.io.FolderLockedError: another process trains into ``output``.
        oar.runs.RunMismatchError: the checkpoint belongs to a run with other settings.
        oar.runs.CheckpointError: a file of the checkpoint cannot be read.
        oar.runs.DiskFullError: the disk filled up while writing a checkpoint or the model.
        oar.io.OutputPathError, oar.models.ModelLoadError, oar.tracking.TrackingStoreError: from
            :func:`check_train_inputs`, before anything of ``output`` is touched.
    """
    from oar.io import exclusive_lock
    from oar.models import model_identity
    from oar.strategy import make_strategy

    method: ResolvedMethod = resolve_method(config, method_name)
    folder = RunFolder(Path(output))
    start = init if init is not None else config["train"].get("init")
    start_spec = dict(config["model"], source=start, gguf_file=None) if start else dict(config["model"])
    check_train_inputs(config, start_spec, folder.path)  # before the folder is locked, repaired or reset
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


#: The timed phases of a step (``time_<phase>`` in the metrics, ``mean_time`` in the summary).
PHASES: tuple[str, ...] = ("rollout", "reward", "importance", "update")


@contextlib.contextmanager
def marked_timer(name: str, timings: dict[str, float]) -> Any:
    """Add the wall time of the block to ``timings[name]`` (verl's ``marked_timer``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class _Loop:
    """What the phases of one training run share (built by :func:`_setup`)."""

    config: dict
    method: ResolvedMethod
    seed: int
    folder: RunFolder
    identity: dict[str, str]
    strategy: Strategy
    stop: StopSignal
    model: Any
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    ref_model: Any
    policy: Any  # what the rollout and the credit estimators call, in strategy.local_phase
    records: list[dict]
    prompts_all: list[str]
    stream: "PromptStream"
    engine: Any
    tracker: Any
    heldout: Any
    schedule: CheckpointSchedule
    state: dict[str, Any]
    resumed: bool  # started from a checkpoint
    intact: int | None  # the step of the checkpoint on disk
    provenance: dict[str, Any]  # of this invocation (oar.provenance), without its end time

    @property
    def tcfg(self) -> dict:
        return self.config["train"]

    @property
    def rcfg(self) -> dict:
        return self.config["rollout"]

    @property
    def recipe(self) -> dict:
        return self.method.recipe

    @property
    def local_prompts(self) -> int:
        """This process's share of each step's prompts."""
        return len(range(self.strategy.rank, self.tcfg["prompts_per_step"], self.strategy.world))

    @property
    def agg_max_len(self) -> int | None:
        """Dr. GRPO's aggregation divides by the generation budget, not the batch's padded length."""
        return self.rcfg["max_new_tokens"] if self.recipe["loss_agg"] == "seq-mean-token-sum-norm" else None


def _train(config: dict, method: ResolvedMethod, seed: int, folder: RunFolder, start_spec: dict,
           identity: dict[str, str], strategy: Strategy, *, progress: bool, stop_after: int | None,
           stop: StopSignal) -> dict:
    """The loop of :func:`train`, run while the folder is locked and repaired: set-up, then per step
    rollout -> credit -> update -> metrics -> log -> checkpoint, then the final model."""
    from tqdm.auto import tqdm

    loop = _setup(config, method, seed, folder, start_spec, identity, strategy, stop)
    steps = loop.tcfg["steps"]
    if loop.state["step"] < steps and loop.schedule.before_first_step():  # a signal while starting: nothing to save
        return _interrupted(stop, loop.state["step"], folder, loop.tracker, strategy, checkpointed=loop.resumed)
    bar = tqdm(total=steps, initial=loop.state["step"], desc=f"{method.name} seed{seed}",
               disable=not (progress and strategy.is_main), dynamic_ncols=True)
    last_metrics: dict[str, float] = {}
    steps_this_call = 0
    while loop.state["step"] < steps:
        step, t_step = loop.state["step"], time.perf_counter()
        timings = dict.fromkeys(PHASES, 0.0)
        batch = _rollout(loop, step, timings)                      # 1-2. rollout + reward (+ dynamic sampling)
        credit = _credit(loop, batch, step, timings)               # 3. token advantages
        upd, nonfinite = _update(loop, batch, credit, step, timings)   # 4. policy update
        metrics = step_metrics(batch, credit, upd, nonfinite, lr=float(loop.scheduler.get_last_lr()[0]),
                               timings=timings, step_seconds=time.perf_counter() - t_step)   # 5. metrics
        last_metrics = _log(loop, step, metrics, nonfinite=nonfinite, losses=upd["loss"])  # 6. log, held-out
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.3f}")
        steps_this_call += 1
        if _checkpoint(loop):                                      # 7. checkpoint; stop on a signal
            bar.close()
            return _interrupted(stop, loop.state["step"], folder, loop.tracker, strategy, checkpointed=True)
        if stop_after is not None and steps_this_call >= stop_after and loop.state["step"] < steps:
            bar.close()
            return {"interrupted_at": loop.state["step"]}
    bar.close()
    return _finish(loop, last_metrics)


def _setup(config: dict, method: ResolvedMethod, seed: int, folder: RunFolder, start_spec: dict,
           identity: dict[str, str], strategy: Strategy, stop: StopSignal) -> _Loop:
    """Model, reference and optimizer (restored from the checkpoint when resuming), then data,
    engine, tracking, the held-out evaluation and the checkpoint schedule."""
    from datetime import datetime, timezone

    from oar.data.prompts import render_prompt
    from oar.heldout import HeldoutEval
    from oar.models import load_policy
    from oar.provenance import provenance
    from oar.rollout import refresh_engine

    started = datetime.now(timezone.utc)
    tcfg, rcfg = config["train"], config["rollout"]
    _seed_everything(seed)
    saved = None
    if folder.state_file.exists():
        folder.check_checkpoint()  # every file whole (checkpoint.json's sizes, safetensors headers)
        saved = load_trainer_state(folder.state_file)
        folder.check_identity(saved.get("identity"), identity)
    try:
        model, tokenizer = load_policy(strategy.resume_source(folder.checkpoint, start_spec) if saved else start_spec)
    except Exception as e:
        if saved is None:
            raise
        raise folder.unreadable_checkpoint(e) from e
    ref_model = None
    if method.recipe["kl_coef"] > 0:  # the reference only exists when the KL term is used, placed like the policy
        ref_model = strategy.prepare_frozen(load_policy(start_spec)[0])
    # float32 master weights (train.master_dtype), sharded or wrapped per train.strategy
    model, optimizer = strategy.prepare(model, lr=tcfg["lr"], betas=tuple(tcfg["betas"]), weight_decay=tcfg["weight_decay"])
    scheduler = make_scheduler(optimizer, warmup_steps=tcfg["warmup_steps"], total_steps=tcfg["steps"], schedule=tcfg["schedule"])
    state: dict[str, Any] = {"step": 0, "cursor": 0, "run_id": None, "nonfinite_streak": 0}
    if saved is not None:
        try:
            strategy.load_training_state(model, optimizer, folder.checkpoint, saved)
            scheduler.load_state_dict(saved["scheduler"])
            restore_rng(saved)
        except BaseException as e:  # noqa: BLE001 - torch.distributed.checkpoint's errors are BaseExceptions
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise folder.unreadable_checkpoint(e) from e
        state.update(saved["state"])
    if strategy.is_main:  # rows of steps after the checkpoint (or of a run killed before one) go
        folder.keep_metrics_before(state["step"])
    policy = strategy.policy(model)

    records = load_training_records(config)
    prompts_all = [render_prompt(config["task"]["template"], r["question"], tokenizer) for r in records]
    stream = PromptStream(len(records), seed, resume_cursor(state, strategy.rank, strategy.world))
    engine = make_engine(rcfg["engine"], policy, tokenizer, batch_size=rcfg["batch_size"], seed=seed, sampler=rcfg["sampler"],
                         model_path=str(start_spec["source"]), vllm_kwargs=rcfg["vllm"], sleep_mode=rcfg["sleep_mode"])
    if saved is not None:  # the engine starts from the start model's weights
        refresh_engine(engine, strategy, model)
    prov = provenance(device=strategy.device.type, started=started)
    tracker = _tracker(config, method, seed, folder, strategy, state, prov)
    # held-out accuracy of the start model (or of the resume point), then every train.heldout.every steps
    heldout = HeldoutEval(config, engine=engine, tokenizer=tokenizer, strategy=strategy, model=model, tracker=tracker,
                          seed=seed, metrics_path=folder.metrics, total_steps=tcfg["steps"])
    heldout.after_step(state["step"], 0.0)
    schedule = CheckpointSchedule(save_every=tcfg["save_every"], total_steps=tcfg["steps"],
                                  save_every_minutes=tcfg["save_every_minutes"], stop=stop, strategy=strategy)
    for name in stop.reinstall():  # a library (the rollout engine) may have put its own handlers in place
        print(f"oar train: the {name} handler that stops after a step was replaced while starting; put back",
              file=sys.stderr)
    return _Loop(config=config, method=method, seed=seed, folder=folder, identity=identity, strategy=strategy,
                 stop=stop, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                 ref_model=ref_model, policy=policy, records=records, prompts_all=prompts_all, stream=stream,
                 engine=engine, tracker=tracker, heldout=heldout, schedule=schedule, state=state,
                 resumed=saved is not None, intact=state["step"] if saved is not None else None, provenance=prov)


def _tracker(config: dict, method: ResolvedMethod, seed: int, folder: RunFolder, strategy: Strategy,
             state: dict[str, Any], prov: dict[str, Any]) -> Any:
    """The MLflow + metrics.jsonl tracker of the main process (None on the others): the run of the
    checkpoint when resuming; a start killed before its first checkpoint left an orphan run, ended here.
    Tagged as every stage's run (:func:`oar.stage_runs.train_run_tags`, the provenance ``prov`` of
    this invocation: a resumed run carries its latest), plus the plain method, seed, config, output."""
    from oar.stage_runs import supersede_older_runs, train_run_tags
    from oar.tracking import Tracker, end_orphan_run

    if not strategy.is_main:
        return None
    tr = config["tracking"]
    uri = tr["uri"] if tr["enabled"] else None
    tags = {"method": method.name, "seed": str(seed), "config": config["name"], "output": str(folder.path),
            **train_run_tags(config, method.name, seed, folder.path, prov)}
    tracker = Tracker(folder.metrics, uri=uri, experiment=tr["experiment"], run_name=f"{method.name}-seed{seed}",
                      tags=tags, run_id=state["run_id"])
    orphan = folder.recorded_mlflow_run()
    if uri and orphan and orphan != tracker.run_id:
        end_orphan_run(uri, orphan, replaced_by=tracker.run_id)
    if uri and state["run_id"] is None:  # a new run: the folder's earlier runs are no longer current
        supersede_older_runs(uri, tr["experiment"], tags, tracker.run_id)
    folder.record_mlflow_run(tracker.run_id)
    state["run_id"] = tracker.run_id
    tracker.log_params({"config": config, **method.as_params(), "seed": seed})
    return tracker


def _rollout(loop: _Loop, step: int, timings: dict[str, float]) -> "StepBatch":
    """Steps 1-2: sample and score this process's share of the step's prompts (:func:`collect_batch`),
    in the engine's phase (:func:`oar.rollout.engine_phase`: the gathered policy for the HF engine)."""
    from oar.rollout import engine_phase

    with engine_phase(loop.engine, loop.strategy, loop.model):
        return collect_batch(loop.engine, loop.stream, loop.prompts_all, loop.records, config=loop.config,
                              recipe=loop.recipe, seed=loop.seed, step=step, rank=loop.strategy.rank,
                              world=loop.strategy.world, local_prompts=loop.local_prompts,
                              pad_id=loop.tokenizer.pad_token_id, timings=timings)


def _credit(loop: _Loop, batch: "StepBatch", step: int, timings: dict[str, float]) -> Any:
    """Step 3: the method's estimator (OAR-P / OAR-G / mc_value call the gathered policy)."""
    ro, name = batch.rollout, loop.method.estimator
    extras = {"old_logprobs": ro.logprobs, "step": step, "seed": loop.seed, "task": loop.config["task"]}
    if estimator_needs_continuations(name):  # registered with needs_continuations (mc_value)
        extras["continuations"] = continuation_context(loop.engine, batch, loop.prompts_all, loop.records,
                                                 config=loop.config, recipe=loop.recipe,
                                                 seed=step_seed(loop.seed, step, CONTINUATIONS_SALT))
    with loop.strategy.local_phase(loop.model) if estimator_needs_model(name) else contextlib.nullcontext():
        with marked_timer("importance", timings):
            return get_estimator(name)(
                CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask, rewards=batch.rewards,
                            group_ids=batch.group_ids, prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
                            model=loop.policy, tokenizer=loop.tokenizer, extras=extras),
                **loop.method.estimator_options(),
            )


def _update(loop: _Loop, batch: "StepBatch", credit: Any, step: int,
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
    losses and statistics, the credit's concentration and its own stats (``credit_*``), the phases'
    seconds (``time_*``) and the whole step's (``time_step``)."""
    ro = batch.rollout
    mask_f = ro.response_mask.float()
    token_adv = credit.token_advantages.float()
    weights = credit.weights if credit.weights is not None else torch.ones_like(mask_f)
    return {
        "reward": float(batch.rewards.mean()),
        "accuracy": float(batch.correct.float().mean()),
        "response_length": float(mask_f.sum(1).mean()),
        "truncated": float(ro.truncated.float().mean()),
        "entropy": _mean(upd["entropy"]),
        "kl_ref": _mean(upd["kl_ref"]),
        "approx_kl": _mean(upd["approx_kl"]),
        "clipfrac": _mean(upd["clipfrac"]),
        "loss": _mean(upd["loss"]),
        "pg_loss": _mean(upd["pg_loss"]),
        "grad_norm": _mean(upd["grad_norm"]),
        # share of the update's computed token positions that are padding (train.packing)
        "update_padding": 1.0 - sum(upd["tokens_real"]) / max(sum(upd["tokens_computed"]), 1.0),
        "ess_ratio": float(ess_ratio(weights, ro.response_mask).mean()),
        "top10_mass": float(top_mass(token_adv, ro.response_mask, frac=0.1).mean()),
        "nonfinite_updates": float(nonfinite),
        "gen_batches": float(batch.n_gen_batches),
        "kept_groups": float(batch.kept_fraction),
        "lr": lr,
        **{f"time_{k}": v for k, v in timings.items()},
        "time_step": step_seconds,
        **{f"credit_{k}": float(v) for k, v in credit.stats.items()},
    }


def _log(loop: _Loop, step: int, metrics: dict[str, float], *, nonfinite: int, losses: list[float]) -> dict[str, float]:
    """Step 6: the metrics averaged over processes and logged; the non-finite guard; the step
    counted; the held-out evaluation when due. Returns the logged metrics."""
    strategy, state, folder = loop.strategy, loop.state, loop.folder
    state["nonfinite_streak"] = state["nonfinite_streak"] + 1 if nonfinite and not losses else 0
    if strategy.world > 1:
        metrics = dict(zip(metrics, strategy.mean_over_ranks(list(metrics.values()))))
    intact = intact_sentence(folder, loop.intact)
    if loop.tracker is not None:  # a full disk here: one line, no half row (oar.io.append_jsonl)
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


def _checkpoint(loop: _Loop) -> bool:
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


def _finish(loop: _Loop, last_metrics: dict[str, float]) -> dict:
    """The final model (full, consolidated weights) and the run summary, with the provenance of the
    invocation that finished the run (:mod:`oar.provenance`); the MLflow run gets its provenance and
    ``train_summary.json`` as an artifact.

    A finished run started again with nothing left to train (the workflow reruns its job when a
    resumable setting such as ``train.save_every`` changed) keeps its recorded summary as it is:
    the evaluation's fingerprint checksums ``train_summary.json``, and a new timestamp (or the
    ``final`` row read back from ``metrics.jsonl``) alone must not make it evaluate the same model again."""
    from oar.provenance import provenance_tags, with_end_time

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
            "steps": loop.tcfg["steps"],
            "strategy": strategy.name,
            "world_size": strategy.world,
            "final": last_metrics or (rows[-1] if rows else {}),
            "mean_time": {k: _mean([r.get(f"time_{k}") or 0.0 for r in rows if "time_step" in r])  # not held-out rows
                          for k in [*PHASES, "step"]},
            "mlflow_run_id": loop.state["run_id"],
            "provenance": with_end_time(loop.provenance),
        }
        recorded = _recorded_summary(folder.summary)
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


def _recorded_summary(path: Path) -> dict | None:
    """The run's recorded ``train_summary.json`` (None: none, unreadable, or not a mapping)."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else 0.0


def _interrupted(stop: StopSignal, step: int, folder: RunFolder, tracker: Any, strategy: Strategy, *,
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

