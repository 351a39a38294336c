"""One training step's batch (steps 1-2 of :mod:`oar.trainer.loop`): the training prompts' resumable
order, sampling and scoring ``n`` responses per prompt, DAPO's dynamic sampling, and the seeds of a
step's random draws; plus what an estimator that samples continuations needs (``mc_value``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from oar.config.settings import RolloutSettings
from oar.reward.pool import PoolStats
from oar.rollout import Rollout, generate_per_prompt
from oar.core.seeds import step_seed, stream_seed

__all__ = [
    "PromptStream",
    "StepBatch",
    "dynamic_sampling_keep",
    "collect_batch",
    "continuation_context",
]


class PromptStream:
    """Deterministic, resumable stream of training record indices: one seeded permutation per epoch."""

    def __init__(self, n: int, seed: int, cursor: int = 0) -> None:
        self.n, self.seed, self.cursor = n, seed, cursor

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.cursor, self.n)
            if pos == 0 or not hasattr(self, "_perm") or self._epoch != epoch:
                g = torch.Generator().manual_seed(stream_seed(self.seed, epoch))
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
    #: the step's reward checks: timeouts, crashes, retried and marked items (oar.reward.pool.PoolStats), over
    #: every round of dynamic sampling and mc_value's continuations (continuation_context adds theirs)
    reward_stats: PoolStats = field(default_factory=PoolStats)


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


def collect_batch(engine: Any, stream: PromptStream, prompts_all: list[str], records: list[dict], *,
                   prompts_per_step: int, rollout: RolloutSettings, recipe: dict, seed: int, step: int, rank: int,
                   world: int, local_prompts: int, pad_id: int, timings: dict[str, float], pool: Any) -> StepBatch:
    """Steps 1-2 of the loop: sample ``rollout.n`` responses for this process's share of the next
    ``prompts_per_step`` prompts and score them in the run's reward ``pool``
    (:class:`oar.reward.pool.RewardPool`); with DAPO's dynamic sampling, regenerate until
    ``local_prompts`` groups have mixed rewards (at most ``max_num_gen_batches`` rounds). Adds to
    ``timings["rollout"]``/``["reward"]``; the batch's ``reward_stats`` count the reward pool's timeouts,
    crashes and retries over the rounds."""
    from oar.reward.score import overlong_penalty, score_batch

    kept: list[StepBatch] = []
    n_kept_groups, rounds, gen_total = 0, 0, 0
    reward_stats = PoolStats()
    max_rounds = recipe["max_num_gen_batches"] if recipe["dynamic_sampling"] else 1
    positions = torch.arange(prompts_per_step)[rank::world]  # this process's prompts' places in the step
    while True:
        idx = stream.take(prompts_per_step)[rank::world]
        t0 = time.perf_counter()
        prompts = [prompts_all[i] for i in idx]
        gen = rollout.sampling()
        if rollout.batch_invariant:  # seeded by the prompt's position in the step, not by the process
            seeds = [step_seed(step_seed(seed, step, rounds), pos) for pos in positions.tolist()]
            ro = generate_per_prompt(engine, prompts, seeds=seeds, pad_id=pad_id, **gen)
        else:
            ro = engine.generate(prompts, seed=step_seed(seed, step, rounds) + rank, **gen)
        timings["rollout"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        golds = [records[idx[i]]["answer"] for i in ro.prompt_index.tolist()]
        scores = torch.tensor(score_batch(ro.texts, golds, correct=recipe["correct"], wrong=recipe["wrong"],
                                          stats=reward_stats, pool=pool),
                              dtype=torch.float32)
        correct = scores == recipe["correct"]
        rewards = scores.clone()
        if recipe["overlong_buffer"] > 0:
            rewards = rewards + overlong_penalty(ro.response_mask.sum(1), max_length=rollout.max_new_tokens,
                                                 cache_length=recipe["overlong_buffer"],
                                                 penalty_factor=recipe["overlong_penalty"])
        timings["reward"] += time.perf_counter() - t0
        # the prompt's position in the step (over all processes) and round: unique across rounds and processes,
        # so what is keyed by group (OAR-G's per-response noise) does not depend on the number of processes
        group_ids = positions[ro.prompt_index] + (rounds * prompts_per_step)
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
    batch.reward_stats = reward_stats
    return batch


def continuation_context(engine: Any, batch: StepBatch, prompts_all: list[str], records: list[dict], *,
                         rollout: RolloutSettings, recipe: dict, seed: int, pool: Any) -> Any:
    """What an estimator that samples continuations of the responses needs (``mc_value``): the
    engine, each row's prompt and gold answer, the rollout's reward and sampling settings. Built
    by :func:`oar.trainer.step.train_step` only for estimators registered with ``needs_continuations``. The continuations'
    reward checks run in the run's reward ``pool`` and are counted in ``batch.reward_stats``, with the step's."""
    from functools import partial

    from oar.credit.mc_value import ContinuationContext
    from oar.reward.score import score_batch

    rows = batch.record_index.tolist()
    score = partial(score_batch, correct=recipe["correct"], wrong=recipe["wrong"],
                    stats=batch.reward_stats, pool=pool)
    return ContinuationContext(engine=engine, prompts=[prompts_all[i] for i in rows],
                               golds=[records[i]["answer"] for i in rows], score=score,
                               temperature=rollout.temperature, top_p=rollout.top_p,
                               max_new_tokens=rollout.max_new_tokens, seed=seed)


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
