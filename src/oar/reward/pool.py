"""The reward pool: persistent worker processes that run math-verify on untrusted model outputs, each
item under a guard (the safety model: :mod:`oar.reward.score`'s docstring), with what it counted
(:class:`PoolStats`).
"""

from __future__ import annotations

import logging
import dataclasses
import functools
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from oar.reward.verify import WorkFn, check_one, default_inner_timeout, gold_text
from oar.reward.worker import PopenProcess, SUBPROCESS_BOOT, worker_main

__all__ = ["CALLS_PER_ITEM", "DEFAULT_MAX_WORKERS", "GUARD_MARGIN_S", "PoolStats", "RETRY_FACTOR", "RewardPool"]

logger = logging.getLogger(__name__)


#: ``workers=None`` means: the number of usable CPUs, but at most this many.
DEFAULT_MAX_WORKERS: int = 4
#: math-verify calls of one item that can take long, each under its own limit: the response's
#: parse, the gold's parse (cached per worker after the first) and the symbolic comparison (the
#: string comparisons math-verify also makes are instant). The parent's guard per item allows them all.
CALLS_PER_ITEM: int = 3
#: Seconds the parent's guard per item allows beyond math-verify's limits: reading the box,
#: sending the item and its answer, a worker's scheduling on a busy machine.
GUARD_MARGIN_S: float = 1.0
#: A timed-out item's one retry runs under this many times the limit (and the guard).
RETRY_FACTOR: int = 2
#: A chunk of work: the keys of its items and math-verify's limit for them (whole seconds).
_Chunk = tuple[list[int], int]


@dataclasses.dataclass
class _Worker:
    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    started: float
    ready: bool = False
    chunk: list[int] | None = None  # keys in flight, in the order the worker handles them
    pos: int = 0  # how many of ``chunk`` have been answered
    limit: int = 0  # math-verify's limit for the items of ``chunk``
    deadline: float = math.inf
    pending: _Chunk | None = None  # a retry kept for this (new) worker: sent first when it is ready


@dataclasses.dataclass
class PoolStats:
    """Counters since the pool was created (for logging); the limits and retries are in the module docstring."""

    items: int = 0  #: items passed to :meth:`RewardPool.score` (before deduplication)
    scored: int = 0  #: items sent to a worker (unique, non-empty)
    timeouts: int = 0  #: tries that ran out of time: math-verify's own limit, or the parent's guard (worker killed)
    crashes: int = 0  #: tries whose worker died while scoring them (killed, crashed)
    retried: int = 0  #: items tried a second time after a timeout or a crash
    marked: int = 0  #: items scored wrong because their second try also timed out or crashed (no verdict)
    stopped: int = 0  #: workers stopped by a signal from outside (SIGTERM, SIGINT, SIGHUP): their items rescored
    restarts: int = 0  #: workers started to replace a killed or dead one

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for a metrics logger)."""
        return dataclasses.asdict(self)

    def add(self, after: PoolStats, before: PoolStats | None = None) -> None:
        """Add ``after``'s counters (minus ``before``'s: what happened in between) to these."""
        for f in dataclasses.fields(self):
            delta = getattr(after, f.name) - (getattr(before, f.name) if before is not None else 0)
            setattr(self, f.name, getattr(self, f.name) + delta)


_START_METHODS = ("subprocess", "forkserver", "spawn")
#: Exit codes of a worker stopped from outside (SLURM's --signal and scancel reach every process of a
#: job): no verdict on its item, which is scored again by a new worker.
_STOP_EXIT_CODES = frozenset(-int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
#: Workers stopped from outside in a row (none got ready or answered in between) before the pool gives up.
_MAX_STOPS_IN_A_ROW = 10


def default_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, DEFAULT_MAX_WORKERS))


class RewardPool:
    """A persistent pool of worker processes that score (response, gold) pairs with math-verify.

    Args:
        workers: number of worker processes; None = usable CPUs, at most ``DEFAULT_MAX_WORKERS``.
        timeout_s: the reward's limit (config ``reward.timeout_s``): math-verify's own limit per
            parse/verify call inside the worker, rounded up to whole seconds.
        inner_timeout_s: that limit in whole seconds >= 1, if not ``ceil(timeout_s)``.
        guard_s: the parent's wall-clock limit per item on its first try (past it the worker is
            killed and replaced); None = ``CALLS_PER_ITEM * inner_timeout_s + GUARD_MARGIN_S``, so
            that math-verify gives up by itself first. A retry gets ``RETRY_FACTOR`` times both.
        require_boxed: responses without a complete ``\\boxed{}`` score wrong.
        chunk_size: most items sent to a worker in one message (fewer when a batch is small, so
            that all workers get work).
        start_method: ``"subprocess"`` (default), ``"forkserver"`` or ``"spawn"`` (see the
            module docstring); ``"fork"`` is refused because the parent may hold threads (torch).
        start_timeout_s: how long a new worker may take to import math-verify and report ready.
        work_fn: a picklable module-level ``(response, gold, parsing_timeout=n) -> bool | None``
            run instead of :func:`check_one` (None: ran out of math-verify's limit ``n``; the test hook).

    Workers are started on first use (or by :meth:`start` / ``with``) and stay until
    :meth:`close`. Not thread-safe: use one pool per thread.

    >>> with RewardPool(workers=1) as pool:  # doctest: +SKIP
    ...     pool.score(["so \\\\boxed{0.5}", "I give up"], ["\\\\frac{1}{2}", "3"])
    [1.0, 0.0]
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        *,
        inner_timeout_s: int | None = None,
        guard_s: float | None = None,
        require_boxed: bool = False,
        chunk_size: int = 16,
        start_method: str = "subprocess",
        start_timeout_s: float = 120.0,
        work_fn: WorkFn | None = None,
    ) -> None:
        if workers is None:
            workers = default_workers()
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"oar.reward.pool.RewardPool: workers must be an int >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"oar.reward.pool.RewardPool: timeout_s must be > 0, got {timeout_s!r}")
        if inner_timeout_s is None:
            inner_timeout_s = default_inner_timeout(timeout_s)
        if not isinstance(inner_timeout_s, int) or inner_timeout_s < 1:
            raise ValueError(f"oar.reward.pool.RewardPool: inner_timeout_s must be an int >= 1, got {inner_timeout_s!r}")
        if guard_s is None:
            guard_s = CALLS_PER_ITEM * inner_timeout_s + GUARD_MARGIN_S
        if not guard_s > 0:
            raise ValueError(f"oar.reward.pool.RewardPool: guard_s must be > 0, got {guard_s!r}")
        if chunk_size < 1:
            raise ValueError(f"oar.reward.pool.RewardPool: chunk_size must be >= 1, got {chunk_size!r}")
        if start_method not in _START_METHODS:
            raise ValueError(f"oar.reward.pool.RewardPool: start_method must be one of {_START_METHODS}, got {start_method!r}")
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.inner_timeout_s = inner_timeout_s
        self.guard_s = float(guard_s)
        self.require_boxed = require_boxed
        self.chunk_size = chunk_size
        self.start_method = start_method
        self.start_timeout_s = float(start_timeout_s)
        self.work_fn: WorkFn = (
            work_fn
            if work_fn is not None
            else functools.partial(check_one, require_boxed=require_boxed)
        )
        self.stats = PoolStats()
        self._ctx: Any = None
        self._workers: list[_Worker] = []
        self._closed = False
        self._stops_in_a_row = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> RewardPool:
        """Start the worker processes (no-op when running). Returns ``self``."""
        if self._closed:
            raise RuntimeError("oar.reward.pool.RewardPool: the pool is closed")
        if self._ctx is None and self.start_method != "subprocess":
            self._ctx = mp.get_context(self.start_method)
            if self.start_method == "forkserver":
                # Takes effect only if this process's fork server is not running yet.
                self._ctx.set_forkserver_preload(["math_verify", "oar.reward.score"])
        while len(self._workers) < self.workers:
            self._workers.append(self._spawn())
        return self

    def _spawn(self) -> _Worker:
        if self.start_method == "subprocess":
            parent_conn, child_conn = mp.Pipe(duplex=True)
            fd = child_conn.fileno()
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
            popen = subprocess.Popen(
                [sys.executable, "-c", SUBPROCESS_BOOT, str(fd)],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                env=env,
            )
            child_conn.close()
            parent_conn.send(self.work_fn)
            proc: Any = PopenProcess(popen)
        else:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=worker_main, args=(child_conn, self.work_fn), name="oar-reward-worker", daemon=True
            )
            proc.start()
            child_conn.close()
        now = time.monotonic()
        return _Worker(proc=proc, conn=parent_conn, started=now, deadline=now + self.start_timeout_s)

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=10)
        w.conn.close()

    def close(self) -> None:
        """Stop all workers (politely, then by SIGKILL). Safe to call twice."""
        self._closed = True
        workers, self._workers = self._workers, []
        for w in workers:
            if not w.ready:  # still importing: no need to wait for it
                w.proc.kill()
                continue
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 2.0
        for w in workers:
            w.proc.join(timeout=max(0.0, end - time.monotonic()))
            self._kill(w)

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring -----------------------------------------------------------------------------

    def score(
        self,
        responses: Sequence[str | None],
        golds: Sequence[str | int | float],
        correct: float = 1.0,
        wrong: float = 0.0,
    ) -> list[float]:
        """``correct`` or ``wrong`` for each response (see :func:`score_batch`)."""
        return [correct if ok else wrong for ok in self.verdicts(responses, golds)]

    def verdicts(self, responses: Sequence[str | None], golds: Sequence[str | int | float]) -> list[bool]:
        """True/False for each (response, gold) pair; identical pairs are scored once."""
        if len(responses) != len(golds):
            raise ValueError(
                f"oar.reward.score: got {len(responses)} responses but {len(golds)} gold answers; they must pair up"
            )
        gold_strs = [gold_text(g, i) for i, g in enumerate(golds)]
        self.stats.items += len(responses)
        key_of: dict[tuple[str, str], int] = {}
        unique: list[tuple[str, str]] = []
        keys: list[int | None] = []
        for i, (r, g) in enumerate(zip(responses, gold_strs)):
            if r is None:
                keys.append(None)
                continue
            if not isinstance(r, str):
                raise TypeError(f"oar.reward.score: response {i} is a {type(r).__name__}, expected str or None")
            if not r or r.isspace():
                keys.append(None)
                continue
            k = key_of.get((r, g))
            if k is None:
                k = key_of[(r, g)] = len(unique)
                unique.append((r, g))
            keys.append(k)
        results = self._run(unique) if unique else []
        return [False if k is None else results[k] for k in keys]

    def _guard(self, limit: int) -> float:
        """The parent's wall-clock limit per item for items under math-verify's limit ``limit``."""
        return self.guard_s * limit / self.inner_timeout_s

    def _run(self, items: list[tuple[str, str]]) -> list[bool]:
        """Score unique items in the workers; the limits and retries are in the module docstring."""
        self.start()
        self.stats.scored += len(items)
        n = len(items)
        verdict = [False] * n
        retried: set[int] = set()  # the items that had their one retry
        size = max(1, min(self.chunk_size, math.ceil(n / (4 * self.workers))))
        queue: deque[_Chunk] = deque(
            (list(range(s, min(s + size, n))), self.inner_timeout_s) for s in range(0, n, size)
        )
        try:
            while queue or any(w.chunk is not None or w.pending is not None for w in self._workers):
                now = time.monotonic()
                for w in self._workers:
                    if not w.ready or w.chunk is not None or (w.pending is None and not queue):
                        continue
                    job = w.pending if w.pending is not None else queue.popleft()
                    w.pending = None
                    keys, limit = job
                    try:
                        w.conn.send((limit, [(k, items[k][0], items[k][1]) for k in keys]))
                    except OSError:  # died while idle: nothing was in flight
                        queue.appendleft(job)
                        w.deadline = -math.inf  # replaced below
                        continue
                    w.chunk, w.pos, w.limit, w.deadline = keys, 0, limit, now + self._guard(limit)
                next_deadline = min(w.deadline for w in self._workers)
                wait(
                    [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers if w.proc.sentinel is not None],
                    timeout=None if next_deadline == math.inf else max(0.0, next_deadline - time.monotonic()),
                )
                for idx, w in enumerate(self._workers):
                    self._workers[idx] = self._service(w, verdict, queue, retried)
        except BaseException:
            # Interrupted (Ctrl-C) or broken: items may be in flight, so start over next time.
            self.close()
            self._closed = False
            raise
        return verdict

    def _retry_or_mark(self, key: int, verdict: list[bool], retried: set[int], why: str) -> _Chunk | None:
        """After item ``key``'s try failed (``why``: timed out or its worker died): the chunk of its one
        retry (under ``RETRY_FACTOR`` times the limit), or None when that was the retry (marked: wrong)."""
        if key in retried:
            verdict[key] = False
            self.stats.marked += 1
            logger.warning("oar.reward.score: an item %s on its retry too; scored wrong without a verdict (marked)", why)
            return None
        retried.add(key)
        self.stats.retried += 1
        return [key], RETRY_FACTOR * self.inner_timeout_s

    def _stopped_from_outside(self, w: _Worker) -> bool:
        """Whether dead worker ``w`` was stopped by a signal from outside (not by its item); raises
        after :data:`_MAX_STOPS_IN_A_ROW` such stops with no progress in between."""
        w.proc.join(timeout=1.0)  # EOF on the socket can come before the exit status
        if w.proc.exitcode not in _STOP_EXIT_CODES:
            return False
        self._stops_in_a_row += 1
        if self._stops_in_a_row > _MAX_STOPS_IN_A_ROW:
            raise RuntimeError(f"oar.reward.score: {self._stops_in_a_row} workers in a row were stopped by signals from "
                               "outside (SIGTERM / SIGINT / SIGHUP) before answering; giving up")
        return True

    def _service(self, w: _Worker, verdict: list[bool], queue: deque[_Chunk], retried: set[int]) -> _Worker:
        """Read what worker ``w`` sent; retry what timed out; replace ``w`` if it died or ran past its guard."""
        dead = False
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                self._stops_in_a_row = 0
                if msg[0] == "ready":
                    w.ready, w.deadline = True, math.inf
                    continue
                key, ok = msg
                if w.chunk is None or w.pos >= len(w.chunk) or w.chunk[w.pos] != key:
                    raise RuntimeError(f"oar.reward.score: worker answered item {key} out of order (bug)")
                w.pos += 1
                if ok is None:  # ran out of math-verify's own limit; the worker is intact
                    self.stats.timeouts += 1
                    retry = self._retry_or_mark(key, verdict, retried, f"ran out of math-verify's {w.limit} s limit")
                    if retry is not None:
                        queue.appendleft(retry)
                else:
                    verdict[key] = ok
                if w.pos == len(w.chunk):
                    w.chunk, w.deadline = None, math.inf
                else:
                    w.deadline = time.monotonic() + self._guard(w.limit)
        except (EOFError, OSError):
            dead = True
        dead = dead or not w.proc.is_alive()
        late = time.monotonic() > w.deadline
        if not (dead or late):
            return w
        if w.pending is not None:  # a retry it never got: the next free worker takes it
            queue.appendleft(w.pending)
            w.pending = None
        if dead and not late and self._stopped_from_outside(w):
            # preempted, not broken: what it had not answered goes back to the queue, unscored
            if w.chunk is not None and w.pos < len(w.chunk):
                queue.appendleft((w.chunk[w.pos:], w.limit))
            self.stats.stopped += 1
            logger.warning("oar.reward.score: a worker was stopped by signal %d from outside; its items are scored again",
                           -w.proc.exitcode)
            self._kill(w)
            self.stats.restarts += 1
            return self._spawn()
        if not w.ready:
            self._kill(w)
            why = f"exit code {w.proc.exitcode}" if dead else f"not ready after {self.start_timeout_s:g} s"
            raise RuntimeError(
                f"oar.reward.score: a worker process failed to start ({why}; its traceback, if any, is on stderr). "
                "math-verify and oar must be importable by a fresh interpreter; with start_method "
                "forkserver/spawn the main script also needs an `if __name__ == '__main__':` guard."
            )
        retry = None
        if w.chunk is not None:
            lost, rest = w.chunk[w.pos], w.chunk[w.pos + 1 :]
            if rest:
                queue.appendleft((rest, w.limit))
            if dead:
                self.stats.crashes += 1
                why = f"killed its worker (exit code {w.proc.exitcode})"
            else:
                self.stats.timeouts += 1
                why = f"ran past the parent's {self._guard(w.limit):.3g} s guard (worker killed)"
            retry = self._retry_or_mark(lost, verdict, retried, why)
            if retry is not None:
                logger.warning("oar.reward.score: an item %s; retried on a new worker", why)
        self._kill(w)
        self.stats.restarts += 1
        new = self._spawn()
        new.pending = retry  # the retry goes to the new worker
        return new
