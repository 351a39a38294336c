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
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from oar.config import ResolvedMethod, resolve_method
from oar.credit import CreditBatch, estimator_needs_continuations, estimator_needs_model, get_estimator
from oar.credit.metrics import ess_ratio, top_mass
from oar.identity import run_identity
from oar.io import atomic_write_json, read_jsonl
from oar.loss import aggregate, k3_kl, policy_loss
from oar.packing import MicroBatch, micro_batch_logprobs, plan_micro_batches
from oar.preemption import CheckpointSchedule, StopSignal
from oar.rollout import Rollout, generate_per_prompt, make_engine
from oar.strategy import Strategy
from oar.runs import (STATE_FILE, RunFolder, disk_full_error, is_disk_full, load_trainer_state, restore_rng,
                      save_trainer_state, write_manifest)

__all__ = [
    "TrainingError",
    "train",
    "check_train_inputs",
    "policy_forward",
    "load_training_records",
    "make_scheduler",
    "dynamic_sampling_keep",
    "step_metrics",
    "marked_timer",
    "PHASES",
]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. several non-finite losses in a row); the last checkpoint is intact."""


# ----------------------------------------------------------------------------------------------
# pieces of the loop (plain functions, tested on their own)


def policy_forward(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packing: str = "length_grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens under ``model``, all rows in one forward.

    Positions are ``cumsum(attention_mask) - 1`` as in ``generate`` with left padding, so the
    result matches the rollout's log-probs. ``packing`` is the layout of the forward
    (:mod:`oar.packing`): ``none`` runs the rows as given (``[left-padded prompt | right-padded
    response]``), ``length_grouped`` (default) each sequence contiguous with right padding only and
    the lm_head only on positions that predict a response token; the results agree up to rounding.

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` left-padded prompts.
        response_ids, response_mask: ``(B, T)`` right-padded responses (the mask a prefix).
    Returns:
        logp ``(B, T)`` and entropy ``(B, T)`` (or None), both 0 outside ``response_mask``.
    """
    B, T = response_ids.shape
    (mb,) = plan_micro_batches(prompt_ids, prompt_mask, response_ids, response_mask, torch.arange(B),
                               packing=packing, micro_batch_size=max(B, 1)) or [None]
    if mb is None:  # no rows
        z = torch.zeros(B, T)
        return z, (z.clone() if with_entropy else None)
    logp, ent = micro_batch_logprobs(model, mb, temperature=temperature, with_entropy=with_entropy)
    # back to the caller's row order and width
    out = logp.new_zeros(B, T)
    out[mb.rows, : mb.T] = logp
    ent_out = None
    if ent is not None:
        ent_out = ent.new_zeros(B, T)
        ent_out[mb.rows, : mb.T] = ent
    return out, ent_out


def make_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, schedule: str) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then ``constant``, ``linear`` decay or ``cosine`` decay to 0."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"train.schedule: unknown schedule {schedule!r}; valid: constant, linear, cosine")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Groups worth training on under DAPO's dynamic sampling: those whose rewards are not all equal.

    Args:
        rewards: ``(N,)``; group_ids: ``(N,)``.
    Returns:
        ``(N,)`` bool, True for responses of groups with mixed rewards.
    """
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    gmax = torch.full((len(uniq),), -math.inf, dtype=rewards.dtype).scatter_reduce(0, inv, rewards, "amax")
    gmin = torch.full((len(uniq),), math.inf, dtype=rewards.dtype).scatter_reduce(0, inv, rewards, "amin")
    return (gmax > gmin)[inv]


def load_training_records(config: dict) -> list[dict]:
    """The training prompts of the config's task: synthetic ``train`` split or a benchmark file."""
    task = config["task"]
    if task["kind"] == "synthetic":
        from oar.data.synthetic import generate

        return generate("train", task["train_size"], seed=task["seed"], **task["synthetic"])
    from oar.data.benchmarks import load_benchmark, require_records

    bench = task.get("benchmark") or {}
    if "name" not in bench or "source" not in bench:
        raise ValueError("task.benchmark: needs 'name' and 'source' when task.kind is 'benchmark'")
    filters = {"levels": bench["levels"]} if bench.get("levels") else {}
    records = load_benchmark(bench["name"], bench["source"], **filters)
    # an empty training set: a clear error here, not a ZeroDivisionError in _PromptStream
    return require_records(records, bench["name"], bench["source"], key="task.benchmark (training set)", **filters)


class _PromptStream:
    """Deterministic, resumable stream of training record indices: one seeded permutation per epoch."""

    def __init__(self, n: int, seed: int, cursor: int = 0) -> None:
        self.n, self.seed, self.cursor = n, seed, cursor

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.cursor, self.n)
            if pos == 0 or not hasattr(self, "_perm") or self._epoch != epoch:
                g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch)
                self._perm, self._epoch = torch.randperm(self.n, generator=g).tolist(), epoch
            out.append(self._perm[pos])
            self.cursor += 1
        return out


@dataclass
class StepBatch:
    """One step's training data after rollout, scoring and dynamic sampling."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,) shaped rewards used for the advantage
    correct: torch.Tensor  # (N,) bool
    group_ids: torch.Tensor  # (N,)
    n_gen_batches: int
    kept_fraction: float
    record_index: torch.Tensor  # (N,) long: the training record (prompt, gold answer) of each row


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


#: Seed derivation: a run's seed, a step and a salt give each random draw of the step its own seed
#: (:func:`_step_seed`); the prompt order of an epoch is seeded ``seed * SEED_STRIDE + epoch``.
SEED_STRIDE = 1_000_003
STEP_STRIDE = 101
#: Salts of the step's draws besides the rollout's rounds (0, 1, ... for DAPO's extra rounds).
CONTINUATIONS_SALT = 104729  # mc_value's continuations
UPDATE_SALT = 7919  # the update's mini-batch shuffles


def _step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of a step's draw: ``round_`` is the rollout round or one of the salts above."""
    return (seed * SEED_STRIDE + step * STEP_STRIDE + round_) % (2**63 - 1)


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
    stream: "_PromptStream"
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
    stream = _PromptStream(len(records), seed, _resume_cursor(state, strategy.rank, strategy.world))
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
    """Steps 1-2: sample and score this process's share of the step's prompts (:func:`_collect_batch`),
    in the engine's phase (:func:`oar.rollout.engine_phase`: the gathered policy for the HF engine)."""
    from oar.rollout import engine_phase

    with engine_phase(loop.engine, loop.strategy, loop.model):
        return _collect_batch(loop.engine, loop.stream, loop.prompts_all, loop.records, config=loop.config,
                              recipe=loop.recipe, seed=loop.seed, step=step, rank=loop.strategy.rank,
                              world=loop.strategy.world, local_prompts=loop.local_prompts,
                              pad_id=loop.tokenizer.pad_token_id, timings=timings)


def _credit(loop: _Loop, batch: "StepBatch", step: int, timings: dict[str, float]) -> Any:
    """Step 3: the method's estimator (OAR-P / OAR-G / mc_value call the gathered policy)."""
    ro, name = batch.rollout, loop.method.estimator
    extras = {"old_logprobs": ro.logprobs, "step": step, "seed": loop.seed, "task": loop.config["task"]}
    if estimator_needs_continuations(name):  # registered with needs_continuations (mc_value)
        extras["continuations"] = _continuations(loop.engine, batch, loop.prompts_all, loop.records,
                                                 config=loop.config, recipe=loop.recipe,
                                                 seed=_step_seed(loop.seed, step, CONTINUATIONS_SALT))
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
    """Step 4: the policy update (:func:`_update_policy`), the scheduler, and the engine refreshed
    with the new weights (:func:`oar.rollout.refresh_engine`; the engine sleeps meanwhile)."""
    from oar.rollout import refresh_engine

    with marked_timer("update", timings):
        loop.engine.sleep()  # rollout.sleep_mode: the engine frees its KV cache and weights meanwhile
        out = _update_policy(loop.model, loop.optimizer, loop.strategy, batch.rollout,
                             credit.token_advantages.float(), loop.ref_model, recipe=loop.recipe, tcfg=loop.tcfg,
                             temperature=loop.rcfg["temperature"], agg_max_len=loop.agg_max_len,
                             generator=torch.Generator().manual_seed(_step_seed(loop.seed, step, UPDATE_SALT)))
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
    intact = _intact_sentence(folder, loop.intact)
    if loop.tracker is not None:  # a full disk here: one line, no half row (oar.io.append_jsonl)
        with _disk_full_named(folder.metrics, f"the metrics of step {step}", len(json.dumps(metrics)), intact):
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
    with _disk_full_named(folder.metrics, f"the held-out row of step {state['step']}", len(json.dumps(metrics)), intact):
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
        _save_checkpoint(strategy, loop.model, loop.tokenizer, loop.optimizer, loop.scheduler, state, loop.identity,
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
    with _disk_full_named(folder.final, "the final model", strategy.checkpoint_bytes(loop.model),
                          _intact_sentence(folder, loop.intact)):
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


def _collect_batch(engine: Any, stream: _PromptStream, prompts_all: list[str], records: list[dict], *,
                   config: dict, recipe: dict, seed: int, step: int, rank: int, world: int, local_prompts: int,
                   pad_id: int, timings: dict[str, float]) -> StepBatch:
    """Steps 1-2 of the loop: sample ``n`` responses for this process's share of the next prompts and
    score them; with DAPO's dynamic sampling, regenerate until ``local_prompts`` groups have mixed
    rewards (at most ``max_num_gen_batches`` rounds). Adds to ``timings["rollout"]``/``["reward"]``."""
    from oar.reward import overlong_penalty, score_batch

    tcfg, rcfg, n = config["train"], config["rollout"], config["rollout"]["n"]
    kept: list[StepBatch] = []
    n_kept_groups, rounds, gen_total = 0, 0, 0
    max_rounds = recipe["max_num_gen_batches"] if recipe["dynamic_sampling"] else 1
    positions = torch.arange(tcfg["prompts_per_step"])[rank::world]  # this process's prompts' places in the step
    while True:
        idx = stream.take(tcfg["prompts_per_step"])[rank::world]
        t0 = time.perf_counter()
        prompts = [prompts_all[i] for i in idx]
        gen = dict(n=n, temperature=rcfg["temperature"], top_p=rcfg["top_p"], max_new_tokens=rcfg["max_new_tokens"])
        if rcfg["batch_invariant"]:  # seeded by the prompt's position in the step, not by the process
            seeds = [_step_seed(_step_seed(seed, step, rounds), pos) for pos in positions.tolist()]
            ro = generate_per_prompt(engine, prompts, seeds=seeds, pad_id=pad_id, **gen)
        else:
            ro = engine.generate(prompts, seed=_step_seed(seed, step, rounds) + rank, **gen)
        timings["rollout"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        golds = [records[idx[i]]["answer"] for i in ro.prompt_index.tolist()]
        scores = torch.tensor(score_batch(ro.texts, golds, correct=recipe["correct"], wrong=recipe["wrong"],
                                          timeout_s=config["reward"]["timeout_s"],
                                          workers=config["reward"]["workers"]), dtype=torch.float32)
        correct = scores == recipe["correct"]
        rewards = scores.clone()
        if recipe["overlong_buffer"] > 0:
            rewards = rewards + overlong_penalty(ro.response_mask.sum(1), max_length=rcfg["max_new_tokens"],
                                                 cache_length=recipe["overlong_buffer"],
                                                 penalty_factor=recipe["overlong_penalty"])
        timings["reward"] += time.perf_counter() - t0
        # the prompt's position in the step (over all processes) and round: unique across rounds and processes,
        # so what is keyed by group (OAR-G's per-response noise) does not depend on the number of processes
        group_ids = positions[ro.prompt_index] + (rounds * tcfg["prompts_per_step"])
        gen_total += len(idx)
        rounds += 1
        rec = torch.tensor(idx, dtype=torch.long)[ro.prompt_index]
        sb = StepBatch(ro, rewards, correct, group_ids, rounds, 1.0, rec)
        if not recipe["dynamic_sampling"]:
            kept.append(sb)
            break
        keep = dynamic_sampling_keep(rewards, group_ids)
        if keep.any():
            rows = torch.nonzero(keep).squeeze(1)
            kept.append(StepBatch(ro.select(rows), rewards[rows], correct[rows], group_ids[rows], rounds, 1.0, rec[rows]))
            n_kept_groups += int(torch.unique(group_ids[rows]).numel())
        if n_kept_groups >= local_prompts or rounds >= max_rounds:
            if not kept:  # nothing mixed at all: train on the last batch (its advantages are zero)
                kept.append(sb)
            break
    batch = _merge(kept, pad_id)
    if recipe["dynamic_sampling"]:  # truncate to the batch size (first groups kept)
        first = torch.unique(batch.group_ids)[:local_prompts]
        rows = torch.nonzero(torch.isin(batch.group_ids, first)).squeeze(1)
        batch = StepBatch(batch.rollout.select(rows), batch.rewards[rows], batch.correct[rows],
                          batch.group_ids[rows], rounds, n_kept_groups / max(1, gen_total), batch.record_index[rows])
    return batch


def _continuations(engine: Any, batch: StepBatch, prompts_all: list[str], records: list[dict], *, config: dict,
                   recipe: dict, seed: int) -> Any:
    """What an estimator that samples continuations of the responses needs (``mc_value``): the
    engine, each row's prompt and gold answer, the rollout's reward and sampling settings. Built
    by :func:`_credit` only for estimators registered with ``needs_continuations``."""
    from functools import partial

    from oar.credit.mc_value import ContinuationContext
    from oar.reward import score_batch

    rcfg, rows = config["rollout"], batch.record_index.tolist()
    score = partial(score_batch, correct=recipe["correct"], wrong=recipe["wrong"],
                    timeout_s=config["reward"]["timeout_s"], workers=config["reward"]["workers"])
    return ContinuationContext(engine=engine, prompts=[prompts_all[i] for i in rows],
                               golds=[records[i]["answer"] for i in rows], score=score,
                               temperature=rcfg["temperature"], top_p=rcfg["top_p"],
                               max_new_tokens=rcfg["max_new_tokens"], seed=seed)


def _update_policy(model: Any, optimizer: Any, strategy: Strategy, ro: Rollout, token_adv: torch.Tensor,
                   ref_model: Any, *, recipe: dict, tcfg: dict, temperature: float, agg_max_len: int | None,
                   generator: torch.Generator) -> tuple[dict[str, list[float]], int]:
    """Step 4 of the loop: ``ppo_epochs`` passes over shuffled mini-batches of ``ro``, each split
    into micro-batches laid out by ``train.packing`` (:mod:`oar.packing`; default ``shared_prompt``:
    one copy of each prompt followed by its responses, no padding inside a row, rows of similar
    length, at most ``train.micro_batch_tokens`` positions and ``micro_batch_size`` sequences per
    forward, the lm_head only where a response token is predicted), PPO clip loss with the recipe's range
    and aggregation, optional k3 KL to ``ref_model``, gradient clipping, one optimizer step per
    mini-batch (skipped when the loss or gradient is not finite on any process).

    Each micro-batch's loss is weighted so that the micro-batches add up to the mini-batch's
    aggregate whatever their sizes (:func:`_micro_weight`): the loss and gradient do not depend on
    the layout. Gradients are reduced once per mini-batch (``strategy.sync_context``), not per
    micro-batch. Every process runs the same number of mini-batches and, in each, of micro-batches
    (the maximum over processes; a process short of them runs zero-weight ones), so their
    collectives stay in step.

    Args:
        ro: the step's rollout, ``(N, T)`` responses; token_adv: ``(N, T)`` token advantages.
    Returns:
        statistics, one value per mini-batch, each the mini-batch's own aggregate (loss, pg_loss,
        kl_ref: its loss aggregation; clipfrac, approx_kl, entropy: token means; grad_norm), and
        ``tokens_real`` / ``tokens_computed`` (token positions of the forwards: real, and computed
        with padding); and the number of skipped (non-finite) updates.
    """
    model.train()
    N = ro.response_ids.shape[0]
    mb = min(tcfg["mini_batch_size"], N)
    micro = min(tcfg["micro_batch_size"], tcfg["mini_batch_size"], max(N, 1))
    layout = dict(packing=tcfg["packing"], micro_batch_size=micro, micro_batch_tokens=tcfg["micro_batch_tokens"],
                  pack_length=tcfg["pack_length"])

    def plan(rows: torch.Tensor) -> list[MicroBatch]:
        return plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, rows, **layout)

    n_mini = strategy.max_over_ranks([math.ceil(N / max(mb, 1))])[0]
    perms = [torch.randperm(N, generator=generator) for _ in range(tcfg["ppo_epochs"])]
    minis = [perm[b * mb : (b + 1) * mb] for perm in perms for b in range(n_mini)]
    plans = [plan(rows) for rows in minis]
    n_micro = strategy.max_over_ranks([len(p) for p in plans])  # per mini-batch, over processes
    dummy = plan(torch.arange(min(N, 1)))  # a zero-weight micro-batch for a process short of them
    upd: dict[str, list[float]] = {"loss": [], "pg_loss": [], "kl_ref": [], "clipfrac": [], "approx_kl": [],
                                   "grad_norm": [], "entropy": [], "tokens_real": [], "tokens_computed": []}
    nonfinite = 0
    for rows, micro_batches, count in zip(minis, plans, n_micro):
        optimizer.zero_grad(set_to_none=True)
        total, n_seq = _mini_batch_backward(model, strategy, ro, token_adv, ref_model, rows, micro_batches,
                                            dummy, count, upd, recipe=recipe, temperature=temperature,
                                            agg_max_len=agg_max_len)
        grad_norm = strategy.clip_grad_norm_(model, tcfg["grad_clip"])
        bad = strategy.max_over_ranks([int(not (math.isfinite(total) and math.isfinite(grad_norm)))])[0]
        if bad:
            optimizer.zero_grad(set_to_none=True)  # skip this update (on every process)
            nonfinite += 1
            continue
        optimizer.step()
        if n_seq:
            upd["loss"].append(total)
        upd["grad_norm"].append(grad_norm)
    return upd, nonfinite


def _mini_batch_backward(model: Any, strategy: Strategy, ro: Rollout, token_adv: torch.Tensor, ref_model: Any,
                         rows: torch.Tensor, micro_batches: list[MicroBatch], dummy: list[MicroBatch], count: int,
                         upd: dict[str, list[float]], *, recipe: dict, temperature: float,
                         agg_max_len: int | None) -> tuple[float, int]:
    """The forwards and backwards of one mini-batch (``rows`` of ``ro``): ``count`` micro-batches,
    those past ``micro_batches`` zero-weight runs of ``dummy[0]``, gradients reduced on the last one.
    Appends the mini-batch's statistics to ``upd`` (all but ``loss`` and ``grad_norm``, which depend
    on the optimizer step). Returns the mini-batch's weighted loss and its number of sequences."""
    agg = recipe["loss_agg"]
    resp_mask = ro.response_mask[rows]
    n_tok, n_seq = float(resp_mask.sum()), len(rows)
    n_has = int((resp_mask.sum(1) > 0).sum())
    total, pg_total, kl_total, clip_sum, akl_sum, ent_sum = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for u in range(count):
        real = u < len(micro_batches)
        mbatch = micro_batches[u] if real else dummy[0]
        r, T = mbatch.rows, mbatch.T
        with strategy.sync_context(model, sync=u == count - 1):
            with strategy.forward_context():
                logp, ent = micro_batch_logprobs(model, mbatch, temperature=temperature, with_entropy=True)
                dev = logp.device
                adv = token_adv[r, :T].to(dev)
                old = ro.logprobs[r, :T].to(dev)
                m = ro.response_mask[r, :T].to(dev)
                pg, stats = policy_loss(logp, old, adv, m, eps_low=recipe["eps_low"], eps_high=recipe["eps_high"],
                                        clip_ratio_c=recipe["clip_ratio_c"], agg=agg, max_len=agg_max_len)
                loss = pg
                kl_val = 0.0
                if ref_model is not None:
                    with torch.no_grad():
                        ref_lp, _ = micro_batch_logprobs(ref_model, mbatch, temperature=temperature)
                    kl = aggregate(k3_kl(logp, ref_lp), m, agg, max_len=agg_max_len)
                    loss = loss + recipe["kl_coef"] * kl
                    kl_val = float(kl.detach())
            # weight so that the micro-batches add up to the mini-batch aggregate
            w = _micro_weight(agg, m, n_tok=n_tok, n_seq=n_seq, n_has=n_has) if real else 0.0
            strategy.backward(loss * w)
        if not real:
            continue
        tokens = float(m.sum())
        total += float(loss.detach()) * w
        pg_total += float(pg.detach()) * w
        kl_total += kl_val * w
        clip_sum += stats["clipfrac"] * tokens
        akl_sum += stats["approx_kl"] * tokens
        ent_sum += float(ent.sum())
        upd["tokens_real"].append(float(mbatch.real_tokens))
        upd["tokens_computed"].append(float(mbatch.computed_tokens))
    if n_seq:
        upd["pg_loss"].append(pg_total)
        upd["kl_ref"].append(kl_total)
        upd["clipfrac"].append(clip_sum / max(n_tok, 1.0))
        upd["approx_kl"].append(akl_sum / max(n_tok, 1.0))
        upd["entropy"].append(ent_sum / max(n_tok, 1.0))
    return total, n_seq


def _micro_weight(agg: str, mask: torch.Tensor, *, n_tok: float, n_seq: int, n_has: int) -> float:
    """Weight of a micro-batch's aggregated loss so that the weighted micro-batches of a mini-batch
    add up to the mini-batch's aggregate (:func:`oar.loss.aggregate`), whatever their sizes.

    Args:
        agg: the loss aggregation mode.
        mask: ``(b, T)`` the micro-batch's response mask.
        n_tok, n_seq, n_has: the mini-batch's response tokens, sequences, and sequences with at
            least one response token.
    Returns:
        ``token-mean``: its share of the tokens; ``seq-mean-token-sum-norm`` (divides by all
        sequences): its share of the sequences; the other ``seq-mean`` modes (mean over sequences
        with tokens): its share of those.
    """
    if agg == "token-mean":
        return float(mask.sum()) / max(n_tok, 1.0)
    if agg == "seq-mean-token-sum-norm":
        return mask.shape[0] / max(n_seq, 1)
    return float((mask.sum(1) > 0).sum()) / max(n_has, 1)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else 0.0


def _merge(parts: list[StepBatch], pad_id: int) -> StepBatch:
    if len(parts) == 1:
        return parts[0]
    return StepBatch(
        rollout=Rollout.concat([p.rollout for p in parts], pad_id),
        rewards=torch.cat([p.rewards for p in parts]),
        correct=torch.cat([p.correct for p in parts]),
        group_ids=torch.cat([p.group_ids for p in parts]),
        n_gen_batches=parts[-1].n_gen_batches,
        kept_fraction=1.0,
        record_index=torch.cat([p.record_index for p in parts]),
    )


def _save_checkpoint(strategy: Strategy, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any, state: dict,
                     identity: dict[str, str], folder: RunFolder, *, intact: int | None, keep: int) -> None:
    """Write model and optimizer (whole or sharded, per strategy), tokenizer, scheduler, RNG states,
    data position and run identity into a temporary folder, then ``checkpoint.json`` (every file's
    size), then rename it onto the checkpoint. A full disk raises :class:`oar.runs.DiskFullError`
    naming the checkpoint that is intact (the one of step ``intact``, None: none yet). With ``keep``
    > 1 (``train.keep_checkpoints``) the checkpoint it replaces is kept as ``checkpoints/step_<N>/``,
    and the oldest kept ones are pruned once the new one is complete, ``keep`` in all."""
    step = state["step"]
    if keep > 1 and strategy.is_main:
        folder.archive_checkpoint()
    with _disk_full_named(folder.checkpoint, f"the step-{step} checkpoint", strategy.checkpoint_bytes(model, optimizer),
                          _intact_sentence(folder, intact)):
        with strategy.shared_atomic_dir(folder.checkpoint, seal=lambda tmp: write_manifest(tmp, step=step)) as tmp:
            optimizer_state = strategy.save_training_state(model, optimizer, tmp, tokenizer)
            if strategy.is_main:
                save_trainer_state(tmp / STATE_FILE, optimizer_state=optimizer_state, scheduler=scheduler, state=state,
                                   identity=identity)
    if strategy.is_main and folder.archive.exists():
        folder.prune_archive(keep)


def _resume_cursor(state: dict, rank: int, world: int) -> int:
    """Where this process's prompt stream resumes: its own cursor (``state["cursors"]``, one per
    process, saved since the processes' streams can differ), else the main process's (a checkpoint
    of one process, of another number of processes, or of an older oar)."""
    cursors = state.get("cursors")
    return int(cursors[rank]) if cursors and len(cursors) == world else int(state["cursor"])


def _intact_sentence(folder: RunFolder, intact: int | None) -> str:
    """Which checkpoint a failed write left intact, for :class:`oar.runs.DiskFullError`."""
    if intact is None:
        return "No checkpoint was written before: a rerun starts at step 0."
    return f"The step-{intact} checkpoint {folder.checkpoint} is intact: a rerun resumes from step {intact}."


@contextlib.contextmanager
def _disk_full_named(path: Path, what: str, needed: int, intact: str) -> Any:
    """Turn an error of the block that means a full disk into one :class:`oar.runs.DiskFullError`
    line (the block's atomic write has already removed what it wrote); other errors pass."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - torch.distributed.checkpoint's errors are BaseExceptions
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not is_disk_full(e, path, needed):
            raise
        raise disk_full_error(path, what, needed, intact) from e


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

