"""One training step (:func:`train_step`): rollout and reward, credit, policy update, metrics.

The library's one step: :func:`oar.trainer.loop.train` runs it once per step before its logging,
held-out and checkpoint phases; the benchmarks call it through ``train`` with a :class:`StepObserver`
that times or probes its phases, and ``benchmarks/gpu_check.py`` calls :func:`train_step_on_batch` on
a batch it builds. A :class:`StepObserver` sees every phase start and end
(:data:`STEP_EVENTS`) and the update's micro-batch events (:data:`oar.trainer.update.UPDATE_EVENTS`),
and after each step may end the invocation (``after_step`` returns True: as a kill would, without
a checkpoint; :class:`EndAfter`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from oar.config.settings import RolloutSettings, TrainSettings
from oar.core.seeds import CONTINUATIONS_SALT, UPDATE_SALT, step_seed
from oar.credit import CreditBatch, CreditResult, estimator_spec
from oar.credit.metrics import credited_concentration, ess_ratio, top_mass
from oar.trainer.batch import PromptStream, StepBatch, collect_batch, continuation_context
from oar.trainer.runs import TIMED_PHASES
from oar.trainer.update import update_policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from oar.config.methods import ResolvedMethod
    from oar.reward.pool import RewardPool
    from oar.rollout.base import RolloutEngine
    from oar.trainer.strategy import Strategy

__all__ = ["STEP_EVENTS", "StepParts", "StepObserver", "EndAfter", "StepOutput", "train_step", "train_step_on_batch",
           "step_metrics", "marked_timer", "mean_of"]

#: What :func:`train_step` tells :meth:`StepObserver.event`, in order (the update's own events,
#: :data:`oar.trainer.update.UPDATE_EVENTS`, come between ``update start`` and ``update end``).
STEP_EVENTS: tuple[str, ...] = ("rollout start", "rollout end", "credit start", "credit end", "update start",
                                "update end")


@dataclass
class StepParts:
    """What :func:`train_step` reads: the settings, the policy and its optimizer, the engine, the
    training prompts and the estimator. :class:`oar.trainer.setup.TrainingRun` is one (set up from a
    config by ``setup_run``); ``benchmarks/gpu_check.py`` builds one around a model of the paper's
    shape."""

    train: TrainSettings
    rollout: RolloutSettings
    task: Mapping[str, Any]  # the task section, as the task layer and the estimators read it
    method: "ResolvedMethod"
    seed: int
    strategy: "Strategy"
    model: torch.nn.Module  # prepared by the strategy (wrapped or sharded)
    tokenizer: "PreTrainedTokenizerBase"
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: torch.nn.Module | None  # only with a KL term
    policy: torch.nn.Module  # what the rollout and the credit estimators call, in strategy.local_phase
    records: list[dict]  # the training records (question, answer), by index
    prompts_all: list[str]  # each record's rendered prompt
    stream: PromptStream
    engine: "RolloutEngine"
    reward_pool: "RewardPool"  # the run's own: every reward check of its steps (and held-out evaluations)
    credit_options: dict[str, Any]  # what the estimator is called with (oar.trainer.setup.estimator_options)

    @property
    def recipe(self) -> dict:
        return self.method.recipe

    @property
    def local_prompts(self) -> int:
        """This process's share of each step's prompts."""
        return len(range(self.strategy.rank, self.train.prompts_per_step, self.strategy.world))

    @property
    def agg_max_len(self) -> int | None:
        """Dr. GRPO's aggregation divides by the generation budget, not the batch's padded length."""
        return self.rollout.max_new_tokens if self.recipe["loss_agg"] == "seq-mean-token-sum-norm" else None


class StepObserver:
    """Hooks into the steps of a run; each does nothing unless a subclass says otherwise (a time or
    memory probe, a benchmark that runs a set number of steps)."""

    def event(self, name: str) -> None:
        """Called at each of :data:`STEP_EVENTS` and :data:`oar.trainer.update.UPDATE_EVENTS`."""

    def after_step(self, step: int, metrics: dict[str, float]) -> bool:
        """Called on every process after step ``step`` (0-based) is logged and checkpointed when due,
        with this process's metrics. Returns True to end this invocation now, as a kill would: no
        further checkpoint; the same command resumes from the last one."""
        return False


class EndAfter(StepObserver):
    """Ends the invocation after ``steps`` steps of it, as a kill would (``bench_methods.py`` times
    one step per invocation this way, and the resume tests kill a run at a known step)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done = steps, 0

    def after_step(self, step: int, metrics: dict[str, float]) -> bool:
        self.done += 1
        return self.done >= self.steps


@dataclass
class StepOutput:
    """What one :func:`train_step` produced (this process's share)."""

    batch: StepBatch
    credit: CreditResult  # the estimator's
    update: dict[str, list[float]]  # update_policy's statistics, one value per mini-batch
    nonfinite: int  # updates skipped as non-finite
    metrics: dict[str, float]  # step_metrics, before they are averaged over processes


def train_step(run: StepParts, step: int, observer: StepObserver | None = None) -> StepOutput:
    """Step ``step`` of ``run``: 1-2. sample and score this process's prompts, then
    :func:`train_step_on_batch` (3. the method's token advantages, 4. the policy update, 5. the step's
    metrics with each phase's seconds)."""
    observer = observer or StepObserver()
    started = time.perf_counter()
    timings = dict.fromkeys(TIMED_PHASES, 0.0)
    with _phase("rollout", observer):
        batch = _rollout(run, step, timings)
    return train_step_on_batch(run, batch, step, observer=observer, timings=timings, started=started)


def train_step_on_batch(run: StepParts, batch: StepBatch, step: int, *, observer: StepObserver | None = None,
                        timings: dict[str, float] | None = None, started: float | None = None) -> StepOutput:
    """Steps 3-5 of a step whose scored batch is given: the method's token advantages, the policy
    update and the step's metrics. :func:`train_step` calls it after its rollout; ``gpu_check.py``
    calls it on a batch whose answers and rewards it sets itself (a model of the paper's shape with
    random weights answers nothing right).

    Args:
        timings: the step's phase seconds so far (:data:`oar.trainer.runs.TIMED_PHASES`; None: zeros).
        started: ``time.perf_counter()`` at the step's start (None: now), for ``time_step``.
    """
    observer = observer or StepObserver()
    started = time.perf_counter() if started is None else started
    timings = dict.fromkeys(TIMED_PHASES, 0.0) if timings is None else timings
    with _phase("credit", observer):
        credit = _credit(run, batch, step, timings)
    with _phase("update", observer):
        upd, nonfinite = _update(run, batch, credit, step, timings, observer)
    metrics = step_metrics(batch, credit, upd, nonfinite, lr=float(run.scheduler.get_last_lr()[0]),
                           timings=timings, step_seconds=time.perf_counter() - started)
    return StepOutput(batch=batch, credit=credit, update=upd, nonfinite=nonfinite, metrics=metrics)


@contextlib.contextmanager
def _phase(name: str, observer: StepObserver) -> Iterator[None]:
    observer.event(f"{name} start")
    yield
    observer.event(f"{name} end")


@contextlib.contextmanager
def marked_timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timings[name]`` (verl's ``marked_timer``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


def _rollout(run: StepParts, step: int, timings: dict[str, float]) -> StepBatch:
    """Steps 1-2: sample and score this process's share of the step's prompts (:func:`collect_batch`),
    in the engine's phase (:func:`oar.rollout.engine_phase`: the gathered policy for the HF engine)."""
    from oar.rollout import engine_phase

    with engine_phase(run.engine, run.strategy, run.model):
        return collect_batch(run.engine, run.stream, run.prompts_all, run.records,
                             prompts_per_step=run.train.prompts_per_step, rollout=run.rollout, recipe=run.recipe,
                             seed=run.seed, step=step, rank=run.strategy.rank, world=run.strategy.world,
                             local_prompts=run.local_prompts, pad_id=run.tokenizer.pad_token_id, timings=timings,
                             pool=run.reward_pool)


def _credit(run: StepParts, batch: StepBatch, step: int, timings: dict[str, float]) -> CreditResult:
    """Step 3: the method's estimator (OAR-P / OAR-G / mc_value call the gathered policy). The engine
    sleeps from here on (rollout.sleep_mode: its memory is free for the estimator's passes, as
    ``oar plan``'s credit phase counts it), unless the estimator samples continuations through it."""
    ro, spec = batch.rollout, estimator_spec(run.method.estimator)
    continuations = None
    if spec.needs_continuations:  # mc_value
        continuations = continuation_context(run.engine, batch, run.prompts_all, run.records,
                                             rollout=run.rollout, recipe=run.recipe,
                                             seed=step_seed(run.seed, step, CONTINUATIONS_SALT), pool=run.reward_pool)
    else:
        run.engine.sleep()
    with run.strategy.local_phase(run.model) if spec.needs_model else contextlib.nullcontext():
        with marked_timer("importance", timings):
            return spec.fn(
                CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask, rewards=batch.rewards,
                            group_ids=batch.group_ids, prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
                            model=run.policy, tokenizer=run.tokenizer, old_logprobs=ro.logprobs, step=step,
                            seed=run.seed, task=run.task, continuations=continuations),
                **run.credit_options,
            )


def _update(run: StepParts, batch: StepBatch, credit: CreditResult, step: int, timings: dict[str, float],
            observer: StepObserver) -> tuple[dict[str, list[float]], int]:
    """Step 4: the policy update (:func:`update_policy`), the scheduler, and the engine refreshed
    with the new weights (:func:`oar.rollout.refresh_engine`; the engine sleeps meanwhile)."""
    from oar.rollout import refresh_engine

    with marked_timer("update", timings):
        run.engine.sleep()  # rollout.sleep_mode: the engine frees its KV cache and weights meanwhile
        out = update_policy(run.model, run.optimizer, run.strategy, batch.rollout,
                            credit.token_advantages.float(), run.ref_model, recipe=run.recipe, train=run.train,
                            temperature=run.rollout.temperature, agg_max_len=run.agg_max_len,
                            generator=torch.Generator().manual_seed(step_seed(run.seed, step, UPDATE_SALT)),
                            observe=observer.event)
        run.scheduler.step()
        refresh_engine(run.engine, run.strategy, run.model)
    return out


def step_metrics(batch: StepBatch, credit: CreditResult, upd: dict[str, list[float]], nonfinite: int, *, lr: float,
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


def mean_of(xs: list[float]) -> float:
    """The mean of the values that are not None (0.0 for none)."""
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else 0.0
