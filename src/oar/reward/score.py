"""Outcome reward: is the response's final answer equal to the gold answer (math-verify)?

Public API
----------
- :func:`score_batch` -- one reward per response (``correct`` or ``wrong``), scored in a
  module-level :class:`RewardPool` that is created on first use, reused and closed at exit.
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
(:mod:`oar.trainer.batch`, :func:`oar.trainer.loop.step_metrics`), an evaluation's ``summary.json`` a ``reward``
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

import atexit
import dataclasses
import functools
import logging
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from oar.reward.answer import extract_boxed

if TYPE_CHECKING:  # torch is imported lazily so that worker processes never load it
    import torch

__all__ = [
    "CALLS_PER_ITEM",
    "DEFAULT_MAX_WORKERS",
    "GUARD_MARGIN_S",
    "PoolStats",
    "RETRY_FACTOR",
    "RewardPool",
    "check_one",
    "default_inner_timeout",
    "extracted_answer",
    "gold_readable",
    "overlong_penalty",
    "score_batch",
    "score_one",
]

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

#: A check's outcome: True (correct), False (wrong) or None (ran out of math-verify's time limit).
Verdict = bool | None
#: What a worker (and the test hook) is called with: ``(response, gold, parsing_timeout=n) -> Verdict``,
#: ``n`` being math-verify's limit per parse/verify call in whole seconds.
WorkFn = Callable[..., Verdict]


# --------------------------------------------------------------------------------------------
# Scoring one item (runs inside a worker process)
# --------------------------------------------------------------------------------------------


def _extraction_config() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _threaded_error(e: Exception) -> bool:
    """Whether ``e`` is math-verify's "signal only works in the main thread" error (raised, not scored)."""
    return isinstance(e, ValueError) and str(e).startswith("Math-Verify")


def _parse(text: str, parsing_timeout: int, extraction_config: list[Any] | None = None) -> list[Any]:
    """math-verify's ``parse`` (``[]`` when it fails), except that its timeout raises ``TimeoutException``.

    ``parse(..., raise_on_error=False)`` turns a timeout into ``[]``, like any failure; with
    ``raise_on_error=True`` it raises instead, and the other failures are turned into ``[]`` here.
    """
    from math_verify import parse

    kw = {} if extraction_config is None else {"extraction_config": extraction_config}
    try:
        return parse(text, parsing_timeout=parsing_timeout, raise_on_error=True, **kw)
    except Exception as e:  # noqa: BLE001 - untrusted input: a failed parse (TimeoutException is a BaseException)
        if _threaded_error(e):
            raise
        return []


def _verify(gold: list[Any], pred: list[Any], timeout_seconds: int) -> Verdict:
    """math-verify's ``verify(gold, pred)``, with None where it is False and a comparison timed out.

    ``verify`` returns whether any (gold, pred) pair compares equal, a pair that fails or times
    out counting as unequal; it is called here pair by pair in its own order, with
    ``raise_on_error=True`` so that a timeout is seen, and a failure is unequal as there.
    """
    from itertools import product

    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for g, t in product(gold, pred):
        try:
            if verify(g, t, timeout_seconds=timeout_seconds, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
        except Exception as e:  # noqa: BLE001 - untrusted input: this pair is unequal
            if _threaded_error(e):
                raise
    return None if timed_out else False


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, parsing_timeout: int, *, warn: bool = True) -> list[Any]:
    """The gold answer as the reward reads it (the module docstring, *Gold*), cached; empty when it
    does not parse, which ``warn`` logs (every response to it scores wrong); a timeout raises
    ``TimeoutException`` and is not cached."""
    inner = extract_boxed(gold)
    text = inner if inner is not None else gold
    parsed = _parse("\\boxed{" + text + "}", parsing_timeout, _extraction_config())
    if not parsed and warn:
        logger.warning("oar.reward.score: gold answer %r could not be parsed; every response to it scores wrong", gold[:200])
    return parsed


def check_one(response: str | None, gold: str, *, parsing_timeout: int = 2, require_boxed: bool = False) -> Verdict:
    """Like :func:`score_one`, but None where the check ran out of math-verify's time limit
    (``parsing_timeout`` per parse/verify call) before it found the answer correct."""
    if not response or response.isspace():
        return False
    from math_verify.errors import TimeoutException

    try:
        box = extract_boxed(response)
        if box is not None:
            pred = _parse("\\boxed{" + box + "}", parsing_timeout, _extraction_config())
        elif require_boxed:
            return False
        else:
            pred = _parse(response, parsing_timeout)
        if not pred:
            return False
        gold_parsed = _parse_gold(gold, parsing_timeout)
        if not gold_parsed:
            return False
        return _verify(gold_parsed, pred, parsing_timeout)
    except TimeoutException:
        return None


def default_inner_timeout(timeout_s: float) -> int:
    """math-verify's own per-call limit (whole seconds) under ``reward.timeout_s`` = ``timeout_s``
    (:class:`RewardPool`'s ``inner_timeout_s`` default): the configured limit itself, rounded up."""
    return max(1, math.ceil(timeout_s))


def gold_readable(gold: str, *, timeout_s: float) -> bool:
    """Whether the reward reads ``gold`` as math: :func:`_parse_gold` (in this process, the main thread,
    with the per-call limit the reward's workers use under ``reward.timeout_s``:
    :func:`default_inner_timeout`; its warning left to the caller) gives a math expression. False when
    it gives nothing, or only the gold's text (``???``, ``-1./3``, ``30^\\circ.``): then a response scores
    right only by repeating that text exactly, so in effect every response to it scores wrong."""
    from math_verify.errors import TimeoutException

    try:
        parsed = _parse_gold(str(gold), default_inner_timeout(timeout_s), warn=False)
    except TimeoutException:  # too slow to tell here: not reported as unreadable
        return True
    return any(not isinstance(item, str) for item in parsed)


def score_one(response: str | None, gold: str, *, parsing_timeout: int = 2, require_boxed: bool = False) -> bool:
    """Whether ``response``'s final answer equals ``gold``, in THIS process (no pool, no wall clock).

    The reading rules are in the module docstring. ``parsing_timeout`` is math-verify's own
    per-call limit (``signal.alarm``, whole seconds, main thread only); a check that runs out of
    it is not correct (:func:`check_one` tells it apart). Never raises on odd model output:
    anything that fails to parse is simply not correct. Use :func:`score_batch` for untrusted
    text; this function can still hang in C code that ignores signals.
    """
    return check_one(response, gold, parsing_timeout=parsing_timeout, require_boxed=require_boxed) is True


def _worker_main(conn: Connection, work_fn: WorkFn) -> None:
    """Worker loop: receive a chunk ``(limit, [(key, response, gold), ...])``, answer ``(key, verdict)``
    per item, ``verdict`` being ``work_fn(response, gold, parsing_timeout=limit)``: True, False, or
    None when the check ran out of math-verify's limit (also when ``work_fn`` lets math-verify's
    ``TimeoutException`` through). Any other exception is a wrong answer (untrusted input).

    ``None`` (or a closed pipe) ends the loop. The first message is ``("ready", pid)`` after a
    warm-up item, so imports do not count against the first item's timeout.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it logs whole inputs on timeouts
    from math_verify.errors import TimeoutException

    try:
        work_fn("\\boxed{1}", "1", parsing_timeout=1)
    except (Exception, TimeoutException):  # noqa: BLE001 - a failing warm-up shows up on real items
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        limit, chunk = msg
        for key, response, gold in chunk:
            try:
                out = work_fn(response, gold, parsing_timeout=limit)
                ok: Verdict = None if out is None else bool(out)
            except TimeoutException:
                ok = None
            except Exception:  # noqa: BLE001 - untrusted input: any failure is "not correct"
                ok = False
            conn.send((key, ok))


#: What a "subprocess" worker runs: ``python -c _SUBPROCESS_BOOT <fd>``.
_SUBPROCESS_BOOT = "import sys; from oar.reward.score import _subprocess_main; _subprocess_main(int(sys.argv[1]))"


def _subprocess_main(fd: int) -> None:
    """Entry point of a ``"subprocess"`` worker: the first message on the socket is ``work_fn``."""
    conn = Connection(fd)
    try:
        work_fn = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    _worker_main(conn, work_fn)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (slow with sympy's caches); nothing to flush


class _PopenProcess:
    """The part of the ``multiprocessing.Process`` interface the pool uses, for a ``Popen``."""

    sentinel = None  # the pool sees the death of a worker as EOF on its socket

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


# --------------------------------------------------------------------------------------------
# The pool (parent side)
# --------------------------------------------------------------------------------------------


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


def _default_workers() -> int:
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
            workers = _default_workers()
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"oar.reward.score.RewardPool: workers must be an int >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"oar.reward.score.RewardPool: timeout_s must be > 0, got {timeout_s!r}")
        if inner_timeout_s is None:
            inner_timeout_s = default_inner_timeout(timeout_s)
        if not isinstance(inner_timeout_s, int) or inner_timeout_s < 1:
            raise ValueError(f"oar.reward.score.RewardPool: inner_timeout_s must be an int >= 1, got {inner_timeout_s!r}")
        if guard_s is None:
            guard_s = CALLS_PER_ITEM * inner_timeout_s + GUARD_MARGIN_S
        if not guard_s > 0:
            raise ValueError(f"oar.reward.score.RewardPool: guard_s must be > 0, got {guard_s!r}")
        if chunk_size < 1:
            raise ValueError(f"oar.reward.score.RewardPool: chunk_size must be >= 1, got {chunk_size!r}")
        if start_method not in _START_METHODS:
            raise ValueError(f"oar.reward.score.RewardPool: start_method must be one of {_START_METHODS}, got {start_method!r}")
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
            raise RuntimeError("oar.reward.score.RewardPool: the pool is closed")
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
                [sys.executable, "-c", _SUBPROCESS_BOOT, str(fd)],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                env=env,
            )
            child_conn.close()
            parent_conn.send(self.work_fn)
            proc: Any = _PopenProcess(popen)
        else:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main, args=(child_conn, self.work_fn), name="oar-reward-worker", daemon=True
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
        gold_strs = [_gold_str(g, i) for i, g in enumerate(golds)]
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


def _gold_str(g: object, i: int) -> str:
    if isinstance(g, bool) or not isinstance(g, (str, int, float)):
        raise TypeError(
            f"oar.reward.score: gold answer {i} is a {type(g).__name__} ({g!r:.80}); expected str (or int/float); "
            "join multi-part answers (e.g. olympiadbench's lists) yourself"
        )
    s = str(g).strip()
    if not s:
        raise ValueError(f"oar.reward.score: gold answer {i} is empty; drop that record or fix the data")
    return s


# --------------------------------------------------------------------------------------------
# Module-level pool and the public functions
# --------------------------------------------------------------------------------------------

_default_pool: RewardPool | None = None
_default_lock = threading.Lock()


def _close_default_pool() -> None:
    global _default_pool
    if _default_pool is not None:
        _default_pool.close()
        _default_pool = None


atexit.register(_close_default_pool)


def score_batch(
    responses: Sequence[str | None],
    golds: Sequence[str | int | float],
    *,
    correct: float = 1.0,
    wrong: float = 0.0,
    timeout_s: float = 5.0,
    workers: int | None = None,
    stats: PoolStats | None = None,
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

    Uses a module-level :class:`RewardPool`, created on the first call and reused; a call with a
    different ``timeout_s`` or ``workers`` replaces it. Closed at interpreter exit.
    """
    global _default_pool
    with _default_lock:
        want = workers if workers is not None else _default_workers()
        pool = _default_pool
        if pool is None or pool.workers != want or pool.timeout_s != float(timeout_s):
            if pool is not None:
                pool.close()
            pool = _default_pool = RewardPool(workers=want, timeout_s=timeout_s)
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
