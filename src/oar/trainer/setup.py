"""Setting up a training run (:mod:`oar.trainer.loop`'s first phase): the user's files checked, the policy,
reference, optimizer and schedule built or restored from the checkpoint, the prompts, the rollout
engine, the tracker, the held-out evaluation and the checkpoint schedule, gathered in one
:class:`TrainingRun` that every phase of the loop reads.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
import yaml

from oar.config.methods import ResolvedMethod
from oar.config.settings import EvalSettings, RewardSettings, RolloutSettings, TrainSettings
from oar.config.validate import changed_settings
from oar.data.records import training_records
from oar.evaluate.heldout import HeldoutEval
from oar.reward.pool import RewardPool
from oar.rollout import make_engine
from oar.trainer.batch import PromptStream
from oar.trainer.optim import make_scheduler
from oar.trainer.preemption import CheckpointSchedule, StopSignal
from oar.trainer.runs import RunFolder, load_trainer_state, restore_rng
from oar.trainer.state import RunState
from oar.trainer.step import StepParts
from oar.trainer.strategy import Strategy

if TYPE_CHECKING:
    from oar.tracking.client import Tracker

__all__ = ["check_train_inputs", "estimator_options", "TrainingRun", "setup_run"]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def estimator_options(config: dict, method: ResolvedMethod) -> dict[str, Any]:
    """``method.estimator_options()`` as the trainer passes them: the option ``verifier: trained`` (credit
    ``step_verifier``) becomes the config's verifier folder (:attr:`oar.config.tree.ResultsTree.verifier_model`).

    Raises:
        FileNotFoundError: that verifier is not trained yet, naming the folder and how to train it.
    """
    from oar.config.identity import uses_trained_verifier
    from oar.config.tree import ResultsTree

    options = method.estimator_options()
    if uses_trained_verifier(method):
        tree = ResultsTree.of(config)
        if not Path(tree.verifier_summary).is_file():
            raise FileNotFoundError(
                f"methods.{method.name}: credit step_verifier reads the verifier this config trains, and "
                f"{tree.verifier_summary} is missing; train it first (the workflow's rule verifier: "
                f"snakemake {tree.verifier_summary}, or oar verifier --config <config> --model <start model> "
                f"--output {tree.verifier_model})")
        options["verifier"] = tree.verifier_model
    return options


def check_train_inputs(config: dict, start_spec: dict, output: Path, *, start_key: str = "model.source",
                       method: ResolvedMethod | None = None) -> None:
    """The user's files a run needs, checked before it touches anything: ``output`` can be a folder
    this process writes (:func:`oar.core.io.check_output_folder`), the MLflow store reads
    (:func:`oar.tracking.client.check_store`, when tracking is on) and the start model's files are whole
    (:func:`oar.models.checks.check_model_files`; ``start_key`` names where the start model came from:
    ``model.source``, ``train.init`` or ``--init``), and the files ``method``'s estimator reads are there
    (:func:`estimator_options`). A failed check leaves an existing run folder as it was.

    Raises:
        oar.core.io.OutputPathError, oar.tracking.client.TrackingStoreError, oar.models.checks.ModelLoadError: naming
            the file and what to do.
        FileNotFoundError: the start model is neither an existing path nor a hub id; the verifier a
            method reads is not trained.
    """

    from oar.core.io import check_output_folder
    from oar.models.checks import check_model_files
    from oar.tracking.client import check_store

    check_output_folder(output, what="the run folder (--output)")
    if config["tracking"]["enabled"]:
        check_store(config["tracking"]["uri"])
    check_model_files(start_spec, key=start_key)
    if method is not None:
        estimator_options(config, method)


@dataclass
class TrainingRun(StepParts):
    """What the phases of one training run share (built by :func:`setup_run`): the parts of a step
    (:class:`oar.trainer.step.StepParts`: typed settings, model, engine, data), plus the run's folder,
    tracking, held-out evaluation, checkpoint schedule and where it stands; no phase reads the config."""

    reward: RewardSettings
    folder: RunFolder
    identity: dict[str, str]
    stop: StopSignal
    tracker: Tracker | None  # on the main process
    heldout: HeldoutEval
    schedule: CheckpointSchedule
    state: RunState
    resumed: bool  # started from a checkpoint
    intact: int | None  # the step of the checkpoint on disk
    provenance: dict[str, Any]  # of this invocation (oar.core.provenance), without its end time


@contextlib.contextmanager
def setup_run(config: dict, train: TrainSettings, method: ResolvedMethod, seed: int, folder: RunFolder,
              start_spec: dict, identity: dict[str, str], strategy: Strategy, stop: StopSignal
              ) -> Iterator[TrainingRun]:
    """The run's typed settings (``train``, as :func:`oar.trainer.loop.train` built them; the others
    read from ``config`` here, once), model, reference and optimizer
    (restored from the checkpoint when resuming), then data, engine, tracking, the held-out
    evaluation and the checkpoint schedule. A context manager: on leaving it (or when the set-up
    itself fails) the engine and the run's reward pool are closed."""
    with contextlib.ExitStack() as stack:
        reward = RewardSettings.from_config(config)
        pool = reward.pool()
        stack.callback(pool.close)
        run = _build_run(config, train, method, seed, folder, start_spec, identity, strategy, stop, reward, pool,
                         stack)
        yield run


def _restore(folder: RunFolder, identity: dict[str, str], strategy: Strategy, start_spec: dict,
             train: TrainSettings, kl_coef: float) -> tuple[Any, ...]:
    """The policy and its optimizer and schedule, new or restored from the folder's checkpoint, the
    reference (None without a KL term) and the run's state; also whether a checkpoint was read."""
    from oar.models.loading import load_policy

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
    if kl_coef > 0:  # the reference only exists when the KL term is used, placed like the policy
        ref_model = strategy.prepare_frozen(load_policy(start_spec)[0])
    # float32 master weights (train.master_dtype), sharded or wrapped per train.strategy
    model, optimizer = strategy.prepare(model, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=train.warmup_steps, floor_step=train.steps,
                               schedule=train.schedule)
    state = RunState()
    if saved is not None:
        try:
            strategy.load_training_state(model, optimizer, folder.checkpoint, saved)
            scheduler.load_state_dict(saved["scheduler"])
            restore_rng(saved)
        except BaseException as e:  # noqa: BLE001 - torch.distributed.checkpoint's errors are BaseExceptions
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise folder.unreadable_checkpoint(e) from e
        state = RunState.from_dict(saved["state"])
    return model, tokenizer, optimizer, scheduler, ref_model, state, saved is not None


def _build_run(config: dict, train: TrainSettings, method: ResolvedMethod, seed: int, folder: RunFolder,
               start_spec: dict, identity: dict[str, str], strategy: Strategy, stop: StopSignal,
               reward: RewardSettings, reward_pool: RewardPool, stack: contextlib.ExitStack) -> TrainingRun:
    """:func:`setup_run`'s parts, in order; the engine's close joins ``stack`` once it exists."""
    from datetime import datetime, timezone

    from oar.data.prompts import render_prompt
    from oar.evaluate.heldout import heldout_records
    from oar.core.provenance import provenance
    from oar.rollout import refresh_engine

    started = datetime.now(timezone.utc)
    rollout = RolloutSettings.from_config(config)
    _seed_everything(seed)
    model, tokenizer, optimizer, scheduler, ref_model, state, resumed = _restore(
        folder, identity, strategy, start_spec, train, method.recipe["kl_coef"])
    if strategy.is_main:  # rows of steps after the checkpoint (or of a run killed before one) go
        folder.keep_metrics_before(state.step)
    policy = strategy.policy(model)

    records = training_records(config["task"])
    prompts_all = [render_prompt(config["task"]["template"], r["question"], tokenizer) for r in records]
    stream = PromptStream(len(records), seed, state.resume_cursor(strategy.rank, strategy.world))
    engine = make_engine(rollout.engine, policy, tokenizer, batch_size=rollout.batch_size, seed=seed,
                         sampler=rollout.sampler, model_path=str(start_spec["source"]), vllm_kwargs=dict(rollout.vllm),
                         sleep_mode=rollout.sleep_mode, colocated=True)
    stack.callback(engine.close)  # closed before the pool: while the process group exists (vLLM's teardown ends it)
    if resumed:  # the engine starts from the start model's weights
        refresh_engine(engine, strategy, model)
    prov = provenance(device=strategy.device.type, started=started, credit_source=method.credit_source)
    tracker = _tracker(config, method, seed, folder, strategy, state, prov)
    # held-out accuracy of the start model (or of the resume point), then every train.heldout.every steps
    ev = EvalSettings.from_config(config)
    held = heldout_records(train.heldout, config["task"], ev.benchmarks) if train.heldout.every > 0 else []
    heldout = HeldoutEval(train.heldout, held, template=config["task"]["template"], sampling=ev,
                          reward=reward, engine=engine, tokenizer=tokenizer, strategy=strategy, model=model,
                          tracker=tracker, seed=seed, metrics_path=folder.metrics, total_steps=train.steps,
                          pool=reward_pool)
    heldout.after_step(state.step, 0.0)
    schedule = CheckpointSchedule(save_every=train.save_every, total_steps=train.steps,
                                  save_every_minutes=train.save_every_minutes, stop=stop, strategy=strategy)
    for name in stop.reinstall():  # a library (the rollout engine) may have put its own handlers in place
        print(f"oar train: the {name} handler that stops after a step was replaced while starting; put back",
              file=sys.stderr)
    return TrainingRun(train=train, rollout=rollout, reward=reward, task=config["task"], method=method, seed=seed,
                       folder=folder, identity=identity, strategy=strategy, stop=stop, model=model,
                       tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, ref_model=ref_model,
                       policy=policy, records=records, prompts_all=prompts_all, stream=stream, engine=engine,
                       reward_pool=reward_pool, tracker=tracker, heldout=heldout, schedule=schedule, state=state,
                       resumed=resumed, intact=state.step if resumed else None, provenance=prov,
                       credit_options=estimator_options(config, method))


def _tracker(config: dict, method: ResolvedMethod, seed: int, folder: RunFolder, strategy: Strategy,
             state: RunState, prov: dict[str, Any]) -> Tracker | None:
    """The MLflow + metrics.jsonl tracker of the main process (None on the others): the run of the
    checkpoint when resuming; a start killed before its first checkpoint left an orphan run, ended here.
    Tagged as every stage's run (:func:`oar.tracking.stage_runs.train_run_tags`, the provenance ``prov`` of
    this invocation: a resumed run carries its latest), plus the plain method, seed, config, output."""
    from oar.tracking.stage_runs import supersede_older_runs, train_run_tags
    from oar.tracking.client import Tracker, end_orphan_run

    if not strategy.is_main:
        return None
    tr = config["tracking"]
    uri = tr["uri"] if tr["enabled"] else None
    tags = {"method": method.name, "seed": str(seed), "config": config["name"], "output": str(folder.path),
            **train_run_tags(config, method.name, seed, folder.path, prov)}
    tracker = Tracker(folder.metrics, uri=uri, experiment=tr["experiment"], run_name=f"{method.name}-seed{seed}",
                      tags=tags, run_id=state.run_id)
    orphan = folder.recorded_mlflow_run()
    if uri and orphan and orphan != tracker.run_id:
        end_orphan_run(uri, orphan, replaced_by=tracker.run_id)
    if uri and state.run_id is None:  # a new run: the folder's earlier runs are no longer current
        supersede_older_runs(uri, tr["experiment"], tags, tracker.run_id)
    folder.record_mlflow_run(tracker.run_id)
    state.run_id = tracker.run_id
    # the settings that differ from the schema's defaults, this method's and the seed (the whole
    # resolved config is the artifact config.yaml)
    tracker.log_params({**{f"config.{k}": v for k, v in changed_settings(config).items()}, "config.name": config["name"],
                        **method.as_params(), "seed": seed})
    tracker.log_text(yaml.safe_dump(config, sort_keys=False), "config.yaml")
    if method.credit_source is not None:  # a user estimator's source files, as they were for this run
        root = Path(method.credit_source["root"])
        for rel in method.credit_source["files"]:
            folder = Path(rel).parent.as_posix()
            tracker.log_artifact(root / rel, "credit_source" if folder == "." else f"credit_source/{folder}")
    return tracker
