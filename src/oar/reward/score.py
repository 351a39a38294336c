"""Outcome reward: is the response's final answer equal to the gold answer (math-verify)?

Public API
----------
- :func:`score_batch` -- one reward per response (``correct`` or ``wrong``), scored in the caller's
  :class:`RewardPool` (a training run, an evaluation and the attribution benchmark each own one for
  their lifetime), or in one started for the call.
- :class:`RewardPool` -- the persistent pool of worker processes; also a context manager.
- :class:`PoolStats` -- what a pool counted: timeouts, crashes, retries, items scored wrong for them.
- :func:`overlong_penalty` -- DAPO overlong reward shaping (docs/methods.md, 2 DAPO).
- :func:`extracted_answer` -- the answer that was read from a response, for logging.
- :func:`gold_readable` -- whether a gold answer reads as math (``oar data`` warns about those that do not).

How answers are read (our choices; math-verify 0.9 API)
-------------------------------------------------------
*Gold.* A gold answer is a final-answer string such as ``"40"``, ``"\\frac{1}{2}"`` or
``"(3, 4)"``; ints and floats (amc23 stores ``27.0``) are converted with ``str``. If it already
contains a ``\\boxed{}``, only the content of the last one is used. It is wrapped as
``"\\boxed{<gold>}"`` and parsed with ``[LatexExtractionConfig(boxed_match_priority=0),
ExprExtractionConfig()]``: math-verify's LaTeX extraction needs a delimiter (``$..$`` or
``\\boxed``) and the bare string fails for some MATH answers (``\\sqrt{51}``, ``6 - 5i``,
``\\pi``, ...), while the boxed wrapping parses them, each verified against itself (counts:
benchmarks/README.md, "Measured numbers"). Parsed golds are cached in every worker. A gold that
math-verify reads only as its text (``???``, ``-1./3``, ``30^\\circ.``) matches only a response that
repeats that text; ``oar data`` counts such golds and warns (:func:`gold_readable`).

*Response.* If the response has a complete ``\\boxed{...}`` (:func:`oar.reward.answer.extract_boxed`),
only the content of the LAST box is scored: it is wrapped and parsed exactly like the gold.
A box whose content does not parse scores ``wrong``; the text around it is not searched.
Otherwise (no box, or a box cut off before its closing brace) the whole response goes through
math-verify's default extraction (``parse(response)``: "final answer is" anchors first, then the
last LaTeX expression or number) -- unless ``require_boxed=True``, in which case it scores
``wrong``. ``None``, empty or whitespace-only responses score ``wrong`` without reaching a worker.
Then ``verify(gold, pred)`` (math-verify defaults: ``float_rounding=6``, ``strict=True``), so
``\\frac12`` = ``0.5`` = ``1/2``, ``27`` = ``27.0``, ``10\\%`` = ``10``, ``x=5`` = ``5``.

Safety model
------------
Model outputs are untrusted and sympy can run for a very long time (huge powers, deep nesting),
also inside C code where no Python signal handler runs. So parsing happens in separate worker
PROCESSES. Each worker scores its items in its own main thread, so math-verify's own
``signal.alarm`` timeouts work.

Limits and what is counted (:class:`PoolStats`)
-----------------------------------------------
*The limit.* ``timeout_s`` (config ``reward.timeout_s``) is math-verify's own limit per
parse/verify call inside the worker (``inner_timeout_s``: ``timeout_s`` rounded up to whole
seconds, as ``signal.alarm`` counts). An item makes at most :data:`CALLS_PER_ITEM` such calls
that can take long (the response's parse, the gold's parse, the symbolic comparison), so the
parent's wall-clock guard per item is ``guard_s = CALLS_PER_ITEM * inner_timeout_s +
GUARD_MARGIN_S``: math-verify gives up by itself first, and the parent kills (SIGKILL) and
replaces a worker only when an item is stuck where no signal handler runs.

*Timeouts.* math-verify reports its own timeout by raising ``TimeoutException`` (a
``BaseException``) inside ``parse``/``verify``, which return a failed parse (``[]``) or
``False`` unless called with ``raise_on_error=True``; the worker calls them so and reports the
item as timed out (``None``, not ``False``). Both that and the parent's kill count in
``timeouts``. An answer is not scored wrong because the machine was busy: a timed-out item is
retried once with :data:`RETRY_FACTOR` times the limit (and the guard for it); only when the
retry runs out of time too is it *marked*: scored ``wrong`` and counted in ``marked``.

*Crashes.* A worker that dies while scoring an item (killed, crashed) counts in ``crashes``, is
replaced, and the item is retried once on the replacement (marked when it dies again); the rest
of its chunk goes back to the queue. A retry after the parent's kill also goes to the
replacement worker; a retry after math-verify's own timeout to the next free worker (its worker
is intact). ``retried`` counts the items tried a second time.

*Preemption.* A worker stopped by a signal from outside (SIGTERM, SIGINT or SIGHUP: SLURM's
``--signal`` and ``scancel`` reach every process of a job, the workers too) is replaced as well,
but its unanswered items are scored again by the new worker without counting as a retry: the
item did not fail, and a preempted training step must not record it as wrong.

:func:`score_batch` adds a call's counts to a caller's :class:`PoolStats` (``stats=``): a
training step's metrics carry ``reward_timeouts``, ``reward_crashes`` and ``reward_marked``
(:mod:`oar.trainer.batch`, :func:`oar.trainer.step.step_metrics`), an evaluation's ``summary.json`` a ``reward``
entry (:mod:`oar.evaluate.evaluation`).

How workers start (``start_method``). ``fork`` is never used: the parent has torch (threads)
loaded. The default ``"subprocess"`` runs ``python -c "...oar.reward._subprocess_main..."`` with
a socket to the parent (the parent's ``sys.path`` goes along in ``PYTHONPATH``); the worker
imports only math-verify and this module. ``"forkserver"`` and ``"spawn"`` (multiprocessing)
also work but, like every multiprocessing child, re-import the parent's main module in each
worker (Python 3.11's fork server does not preload it), so with a main script that imports torch
they become ready more slowly than ``"subprocess"`` workers (benchmarks/bench_reward.py with
OAR_BENCH_IMPORT_TORCH=1; the numbers: benchmarks/README.md, "Measured numbers"), and such a
script needs an ``if __name__ == "__main__":`` guard. A killed worker is replaced the same way.

Speed: benchmarks/bench_reward.py (its numbers in benchmarks/README.md, "Measured numbers").

Only marked items (a timeout or crash on both tries) can score differently from one run to the
next with the machine's load; :attr:`RewardPool.stats` counts them so they can be logged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from oar.reward.answer import extract_boxed
from oar.reward.pool import PoolStats, RewardPool, default_workers

__all__ = ["extracted_answer", "overlong_penalty", "score_batch"]


if TYPE_CHECKING:  # torch is imported lazily so that worker processes never load it
    import torch


def score_batch(
    responses: Sequence[str | None],
    golds: Sequence[str | int | float],
    *,
    correct: float = 1.0,
    wrong: float = 0.0,
    timeout_s: float = 5.0,
    workers: int | None = None,
    stats: PoolStats | None = None,
    pool: RewardPool | None = None,
) -> list[float]:
    """Outcome reward per response: ``correct`` if its final answer equals the gold, else ``wrong``.

    Args:
        responses: (B,) model outputs; None or empty -> ``wrong``.
        golds: (B,) gold final answers (str; ints/floats are converted with ``str``).
        correct, wrong: reward values (GRPO: 1/0, DAPO: +1/-1; config ``reward.correct/wrong``).
        timeout_s: the reward's limit: math-verify's per parse/verify call (the parent's guard per
            item above it; see the module docstring). An item that runs out of time twice (its retry
            has ``RETRY_FACTOR`` times the limit) scores ``wrong`` and is counted (``marked``).
        workers: worker processes (None: usable CPUs, at most ``DEFAULT_MAX_WORKERS``).
        stats: a :class:`PoolStats` that this call's counts (timeouts, crashes, retries, marked
            items, ...) are added to, e.g. over a training step; None: not kept.

    Returns:
        (B,) list of floats, in the order of ``responses``.

    Raises:
        ValueError: ``len(responses) != len(golds)`` or an empty gold answer.
        TypeError: a response that is not str/None, or a gold that is not str/int/float.

    ``pool``: the caller's :class:`RewardPool` (a training run, an evaluation or the attribution
    benchmark owns one for its lifetime; ``timeout_s`` and ``workers`` are then the pool's). None: a
    pool of ``workers`` and ``timeout_s`` is started for this call and closed after it.
    """
    if pool is None:
        with RewardPool(workers=workers if workers is not None else default_workers(), timeout_s=timeout_s) as own:
            return score_batch(responses, golds, correct=correct, wrong=wrong, stats=stats, pool=own)
    before = dataclasses.replace(pool.stats)
    out = pool.score(responses, golds, correct=correct, wrong=wrong)
    if stats is not None:
        stats.add(pool.stats, before)
    return out


def extracted_answer(response: str | None) -> str | None:
    """The answer read from ``response`` for logging: the last ``\\boxed{}`` content, else None."""
    return extract_boxed(response)


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_length: int,
    cache_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO overlong reward shaping (docs/methods.md, 2 DAPO; verl recipe/dapo), added to the score.

    ``penalty_i = min(-(len_i - (max_length - cache_length)) / cache_length * penalty_factor, 0)``:
    0 up to ``max_length - cache_length`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length`` (and further below for longer responses, which truncation normally prevents).

    Args:
        lengths: (B,) response lengths in tokens (integer or float tensor; not modified).
        max_length: the maximum response length ``L_max`` (> 0).
        cache_length: the buffer ``L_cache``; ``<= 0`` disables the shaping and returns zeros.
            Must not exceed ``max_length``.
        penalty_factor: the penalty at ``max_length`` (>= 0).

    Returns:
        (B,) tensor of penalties ``<= 0``, dtype float32 (or ``lengths``' dtype if floating).
    """
    import torch

    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"oar.reward.score.overlong_penalty: lengths must be a 1-D (B,) tensor, got {lengths!r:.80}")
    if max_length <= 0:
        raise ValueError(f"oar.reward.score.overlong_penalty: max_length must be > 0, got {max_length}")
    if cache_length > max_length:
        raise ValueError(
            f"oar.reward.score.overlong_penalty: cache_length ({cache_length}) must not exceed max_length ({max_length})"
        )
    if penalty_factor < 0:
        raise ValueError(f"oar.reward.score.overlong_penalty: penalty_factor must be >= 0, got {penalty_factor}")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.float32
    if cache_length <= 0:
        return torch.zeros(lengths.shape, dtype=dtype, device=lengths.device)
    expected = max_length - cache_length
    exceed = lengths.to(dtype) - expected
    return torch.clamp(-exceed / cache_length * penalty_factor, max=0.0)
