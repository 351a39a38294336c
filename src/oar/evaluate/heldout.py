"""Held-out evaluation during training: the learning curves of the report (``train.heldout``).

Every ``train.heldout.every`` policy updates (and at update 0, the start model, and after the last
update) the trainer samples ``train.heldout.samples`` answers for each of the first
``train.heldout.size`` problems of the benchmark ``train.heldout.benchmark`` (an entry of
``eval.benchmarks``, or a synthetic split; for the synthetic task ``synthetic-test``, whose problems
never occur in training), with the final evaluation's generation settings (``eval.temperature``,
``eval.top_p``, ``eval.max_new_tokens``), through the training's own rollout engine and
:func:`oar.evaluate.evaluation.evaluate_records`. It logs one row ``{step, heldout_acc, heldout_pass_at_k,
heldout_seconds, train_seconds}`` to ``metrics.jsonl`` and MLflow, where ``step`` is the number of
updates done (the row of the model that training step ``step`` starts from) and ``train_seconds`` is the
sum of ``time_step`` over the steps done (rollout, reward, credit and update; not the held-out
evaluations, checkpoints or logging).

The evaluation leaves training as it was: it runs under :func:`torch.random.fork_rng` (the RNG state
is restored afterwards), in the policy's eval mode (restored), without gradients, so a run with and
without it ends with the same weights. On resume the rows of steps at or after the checkpoint are
dropped with the training rows (:meth:`oar.trainer.runs.RunFolder.keep_metrics_before`) and the evaluation
at the resume point runs again (same seed, same answers), so no step has two rows.
With several processes each evaluates its share of the problems (``rank::world``) and the counts
are summed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from oar.config.settings import EvalSettings, HeldoutSettings, RewardSettings

__all__ = ["HELDOUT_KEYS", "heldout_records", "HeldoutEval"]

#: Keys of a held-out row in metrics.jsonl (besides ``step``).
HELDOUT_KEYS = ("heldout_acc", "heldout_pass_at_k", "heldout_seconds", "train_seconds")


def heldout_records(settings: HeldoutSettings, task: Mapping[str, Any], benchmarks: Sequence[Mapping[str, Any]]
                    ) -> list[dict]:
    """``settings.size`` problems spread evenly over ``settings.benchmark`` (``train.heldout``), as
    evaluated; ``task`` is the config's ``task`` section, ``benchmarks`` its ``eval.benchmarks``.

    Evenly spaced rather than the first ones: a synthetic split exhausts its small pool of
    two-operand questions first (the one-digit test split starts with a third of them against a
    tenth overall), so its head is easier than the whole.

    The benchmark is looked up in ``benchmarks`` (its ``source`` and ``filters`` are used); a
    synthetic split (``synthetic-test``, ``synthetic-ood``) may also be named without an entry.

    Raises:
        ValueError: the benchmark is neither an ``eval.benchmarks`` entry nor a synthetic split, or
            ``synthetic-train`` (the training problems) is named.
    """
    from oar.evaluate.evaluation import load_benchmark_entry

    name, size = settings.benchmark, settings.size
    if name == "synthetic-train":
        raise ValueError("train.heldout.benchmark: synthetic-train holds the training problems; use synthetic-test")
    entries = {b["name"]: b for b in benchmarks}
    if name in entries:
        entry = dict(entries[name])
    elif name.startswith("synthetic-"):
        entry = {"name": name, "n": size}
    else:
        raise ValueError(f"train.heldout.benchmark: {name!r} is not in eval.benchmarks "
                         f"({sorted(entries)}) and not a synthetic split")
    records = load_benchmark_entry(task, entry, key="train.heldout")
    if len(records) <= size:
        return records
    return [records[(i * len(records)) // size] for i in range(size)]


class HeldoutEval:
    """The held-out evaluation hook of the training loop (see the module docstring).

    Args:
        settings: ``train.heldout`` (every, samples).
        records: the held-out problems (:func:`heldout_records`; empty when ``every`` is 0).
        template: the task's prompt template (``task.template``).
        sampling: how the evaluation samples (``eval.temperature``, ``top_p``, ``max_new_tokens``, ``chunk_size``).
        reward: the answer checks' time limit and workers (``reward:``).
        engine: the training's rollout engine (samples from the current policy).
        tokenizer: the policy's tokenizer.
        strategy: the training strategy (rank, world, ``local_phase``, ``mean_over_ranks``).
        model: the prepared policy module (for ``strategy.local_phase``).
        tracker: :class:`oar.tracking.client.Tracker` on the main process, else None.
        seed: the run seed; every evaluation of the run samples with it (common random numbers).
        metrics_path: the run's ``metrics.jsonl``: the ``time_step`` of the steps already done (a
            resumed run) start the ``train_seconds`` clock.
        total_steps: ``train.steps`` (the last update is always evaluated).
        pool: the run's :class:`oar.reward.pool.RewardPool` (None: each evaluation starts its own).
    """

    def __init__(self, settings: HeldoutSettings, records: list[dict], *, template: str,
                 sampling: EvalSettings, reward: RewardSettings, engine: Any, tokenizer: Any, strategy: Any,
                 model: Any, tracker: Any, seed: int, metrics_path: str | Path, total_steps: int,
                 pool: Any = None) -> None:
        self.every, self.samples = settings.every, settings.samples
        self.template, self.sampling, self.reward = template, sampling, reward
        self.engine, self.tokenizer = engine, tokenizer
        self.strategy, self.model, self.tracker = strategy, model, tracker
        self.seed, self.total_steps = seed, total_steps
        self.pool = pool
        self.records: list[dict] = []
        self.n_problems = 0
        self.train_seconds = 0.0
        if not self.enabled:
            return
        self.n_problems = len(records)
        self.records = records[strategy.rank :: strategy.world]
        path = Path(metrics_path)
        if path.exists():
            from oar.core.io import read_jsonl

            self.train_seconds = float(sum(r.get("time_step") or 0.0 for r in read_jsonl(path)))

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, updates_done: int) -> bool:
        """Whether the model after ``updates_done`` updates is evaluated."""
        return self.enabled and (updates_done % self.every == 0 or updates_done == self.total_steps)

    def after_step(self, updates_done: int, step_seconds: float) -> dict[str, float] | None:
        """Count ``step_seconds`` of training; evaluate and log when ``updates_done`` is due.

        Call once before the loop (``step_seconds`` 0: the start model, or the resume point) and once
        at the end of every step. Every process must call it (collectives with several).

        Returns:
            the logged row (without ``step``), or None when nothing was due.
        """
        self.train_seconds += float(step_seconds)
        if not self.due(updates_done):
            return None
        t0 = time.perf_counter()
        correct, answers, solved = self._evaluate()
        if self.strategy.world > 1:
            correct, answers, solved = (v * self.strategy.world for v in
                                        self.strategy.mean_over_ranks([correct, answers, solved]))
        row = {
            "heldout_acc": correct / max(1.0, answers),
            "heldout_pass_at_k": solved / max(1, self.n_problems),
            "heldout_seconds": time.perf_counter() - t0,
            "train_seconds": self.train_seconds,
        }
        if self.tracker is not None:
            self.tracker.log_metrics(row, updates_done)
        return row

    def _evaluate(self) -> tuple[float, float, float]:
        """(correct answers, answers, problems with a correct answer) of this process's share."""
        from oar.evaluate.evaluation import evaluate_records

        ev = self.sampling
        # every process enters the phase (gathering a sharded policy is collective), even with no problems
        from oar.rollout import engine_phase

        phase = engine_phase(self.engine, self.strategy, self.model)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), phase, torch.no_grad():
            if not self.records:
                return 0.0, 0.0, 0.0
            _, rows = evaluate_records(
                self.engine, self.tokenizer, self.records, template=self.template, greedy=False,
                samples=self.samples, temperature=ev.temperature, top_p=ev.top_p,
                max_new_tokens=ev.max_new_tokens, seed=self.seed, timeout_s=self.reward.timeout_s,
                workers=self.reward.workers, chunk_size=ev.chunk_size, keep_text=False, pool=self.pool,
            )
        correct = float(sum(r["correct"] for r in rows))
        solved = float(len({r["id"] for r in rows if r["correct"]}))
        return correct, float(len(rows)), solved
