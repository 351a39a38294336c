"""Checking one answer against its gold with math-verify (how answers are read: :mod:`oar.reward.score`'s
docstring); this runs inside the reward pool's worker processes (:mod:`oar.reward.pool`).
"""

from __future__ import annotations

import logging
import functools
import math
from collections.abc import Callable
from typing import Any

from oar.reward.answer import extract_boxed

__all__ = ["check_one", "default_inner_timeout", "gold_readable", "score_one"]

logger = logging.getLogger(__name__)


#: A check's outcome: True (correct), False (wrong) or None (ran out of math-verify's time limit).
Verdict = bool | None
#: What a worker (and the test hook) is called with: ``(response, gold, parsing_timeout=n) -> Verdict``,
#: ``n`` being math-verify's limit per parse/verify call in whole seconds.
WorkFn = Callable[..., Verdict]


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
def parse_gold(gold: str, parsing_timeout: int, *, warn: bool = True) -> list[Any]:
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
        gold_parsed = parse_gold(gold, parsing_timeout)
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
    """Whether the reward reads ``gold`` as math: :func:`parse_gold` (in this process, the main thread,
    with the per-call limit the reward's workers use under ``reward.timeout_s``:
    :func:`default_inner_timeout`; its warning left to the caller) gives a math expression. False when
    it gives nothing, or only the gold's text (``???``, ``-1./3``, ``30^\\circ.``): then a response scores
    right only by repeating that text exactly, so in effect every response to it scores wrong."""
    from math_verify.errors import TimeoutException

    try:
        parsed = parse_gold(str(gold), default_inner_timeout(timeout_s), warn=False)
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


def gold_text(g: object, i: int) -> str:
    if isinstance(g, bool) or not isinstance(g, (str, int, float)):
        raise TypeError(
            f"oar.reward.score: gold answer {i} is a {type(g).__name__} ({g!r:.80}); expected str (or int/float); "
            "join multi-part answers (e.g. olympiadbench's lists) yourself"
        )
    s = str(g).strip()
    if not s:
        raise ValueError(f"oar.reward.score: gold answer {i} is empty; drop that record or fix the data")
    return s
