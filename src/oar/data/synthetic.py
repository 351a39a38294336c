"""Synthetic multi-step arithmetic: the embedded default task (CPU, no download).

A problem is an integer expression over small non-negative operands, e.g. ``"Compute 47+18-25."``;
its reference solution reduces the expression one operation at a time and ends in a boxed answer::

    47+18=65, so 65-25=40. \\boxed{40}

Format of the solution (all choices here are ours, see docs/methods.md for the rest):

- Steps ``"<a><op><b>=<c>"`` are joined by ``", "``; the last step is followed by ``". "`` and
  ``"\\boxed{<answer>}"``. A k-operand problem has k-1 steps.
- Order of steps: ``*`` binds tighter than ``+``/``-``. All multiplications are reduced first, leftmost
  first, then the additions and subtractions left to right, so the boxed value is always the exact
  value of the question read with ordinary precedence (``answer_of``).
- Negative values are allowed and written with a leading minus (``"12-47=-35, -35+20=-15."``). Operands
  in the question are never negative; negatives only appear as results of ``-`` steps and as the
  left operand of the steps after them. ``*`` steps never see a negative (they come first).
- Filler words: each gap (between two steps, and between the last step and the box) gets one filler
  word followed by a space with probability ``filler_prob``. The filler is drawn uniformly from
  ``fillers`` by a random stream separate from the one that draws the questions, so fillers carry
  no information about the problem and changing ``filler_prob`` leaves the questions unchanged.

Spans (``[start, end)`` character offsets into ``solution``):

- ``result_spans``: the digits (sign excluded) of the right-hand side of every ``=`` step, in step
  order, including the last step's result; the copy inside ``\\boxed{}`` is NOT included (it can be
  located with :func:`oar.reward.answer.last_boxed_span`).
- ``filler_spans``: every filler word (without the space that follows it).

Splits: every question is assigned to a pool by a stable hash (``hashlib.sha256`` of the question
text): a share ``test_share`` of all questions forms the held-out pool. ``test`` (operand counts from
``operands``) and ``ood`` (``ood_operands``) draw only from the held-out pool, ``train`` only from the
rest, so no test or ood question ever appears in train, whatever ``n`` and ``seed``. ``test`` and
``ood`` hold distinct questions; ``train`` is sampled with replacement (a question may repeat).
Training mixes a share ``long_share`` of ``long_operands``-operand problems into the ``operands`` ones
so the ood split is reachable.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "SPLITS", "OPERATORS", "DEFAULT_FILLERS", "ERROR_OFFSETS", "task_fillers", "generate", "answer_of", "apply_op",
    "next_operation", "reduce_steps", "solve_steps", "corrupt_steps", "format_solution", "parse_question",
]

#: Split names accepted by :func:`generate`.
SPLITS: tuple[str, ...] = ("train", "test", "ood")
#: Operators the generator knows.
OPERATORS: tuple[str, ...] = ("+", "-", "*")
#: Default filler words: short, no digits, no operator characters.
DEFAULT_FILLERS: tuple[str, ...] = ("so", "then", "ok", "now", "well")


def task_fillers(synthetic: Mapping[str, Any] | None) -> list[str]:
    """The filler words of a ``task.synthetic`` section: the ones :func:`generate` writes.

    ``fillers`` when the section sets it (an empty list means none), else :data:`DEFAULT_FILLERS`. The
    oracle's locator, the attribution benchmark and the tests parse responses with these words, so they
    read the task as the generator wrote it.
    """
    given = (synthetic or {}).get("fillers")
    return list(DEFAULT_FILLERS if given is None else given)


_QUESTION_RE = re.compile(r"^Compute (.+)\.$")
_TOKEN_RE = re.compile(r"\d+|[+\-*]")


def _stable_unit(text: str, salt: str) -> float:
    """A number in [0, 1) from ``sha256(salt + text)``: identical across processes and machines."""
    h = hashlib.sha256(f"{salt}\x00{text}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def _derived_seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()[:8], "big")


def apply_op(a: int, op: str, b: int) -> int:
    """``a op b`` for ``op`` in :data:`OPERATORS`."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; valid: {OPERATORS}")


def next_operation(ops: Sequence[str]) -> int:
    """Index of the operation the reduction order takes next: the leftmost ``*``, else the first."""
    return list(ops).index("*") if "*" in ops else 0


def reduce_steps(
    operands: Sequence[int], ops: Sequence[str], result: Callable[[int, int], int] | None = None
) -> list[tuple[int, str, int, int]]:
    """Reduce ``operands[0] ops[0] operands[1] ...`` step by step: list of ``(a, op, b, c)``.

    ``*`` first (leftmost first), then ``+``/``-`` left to right (:func:`next_operation`). Step
    ``k`` writes ``c = result(k, a op b)`` (default: ``a op b``), and every later step continues
    from the values written, so a changed result is carried forward consistently.
    """
    if len(operands) != len(ops) + 1 or len(operands) < 2:
        raise ValueError(f"need len(operands) == len(ops) + 1 >= 2, got {len(operands)} operands, {len(ops)} ops")
    vals, rest = list(operands), list(ops)
    steps: list[tuple[int, str, int, int]] = []
    while rest:
        i = next_operation(rest)
        a, op, b = vals[i], rest[i], vals[i + 1]
        c = apply_op(a, op, b)
        if result is not None:
            c = result(len(steps), c)
        steps.append((a, op, b, c))
        vals[i : i + 2] = [c]
        del rest[i]
    return steps


def solve_steps(operands: Sequence[int], ops: Sequence[str]) -> list[tuple[int, str, int, int]]:
    """Reduce ``operands[0] ops[0] operands[1] ...`` step by step: list of ``(a, op, b, a op b)``.

    ``*`` first (leftmost first), then ``+``/``-`` left to right; the last step's result is the
    value of the expression.

    >>> solve_steps([2, 3, 4], ["+", "*"])
    [(3, '*', 4, 12), (2, '+', 12, 14)]
    """
    return reduce_steps(operands, ops)


#: Offsets a wrong demonstration step adds to the correct result (:func:`corrupt_steps`).
ERROR_OFFSETS: tuple[int, ...] = (-2, -1, 1, 2)


def corrupt_steps(
    operands: Sequence[int], ops: Sequence[str], rate: float, rng: random.Random
) -> tuple[list[tuple[int, str, int, int]], list[int]]:
    """Steps of a demonstration with wrong results, each step wrong with probability ``rate``.

    The reduction order is :func:`solve_steps`'; a wrong step's result is the true ``a op b`` plus an
    offset drawn from :data:`ERROR_OFFSETS`, and every later step continues consistently from the
    values written so far (its operands are the previous, possibly wrong, results), so the boxed
    answer is the value this wrong arithmetic leads to.

    >>> corrupt_steps([2, 3, 4], ["+", "+"], 0.0, random.Random(0))
    ([(2, '+', 3, 5), (5, '+', 4, 9)], [])

    Returns:
        ``(steps, wrong)``: steps as ``(a, op, b, c)`` and the indices of the wrong steps.
    """
    wrong: list[int] = []

    def result(k: int, c: int) -> int:
        if rate > 0 and rng.random() < rate:
            wrong.append(k)
            return c + rng.choice(ERROR_OFFSETS)
        return c

    return reduce_steps(operands, ops, result), wrong


def parse_question(question: str) -> tuple[list[int], list[str]]:
    m = _QUESTION_RE.match(question.strip())
    if not m:
        raise ValueError(f"not a synthetic question (expected 'Compute <expr>.'): {question!r}")
    expr = m.group(1)
    toks = _TOKEN_RE.findall(expr)
    if "".join(toks) != expr or len(toks) < 3 or len(toks) % 2 == 0:
        raise ValueError(f"cannot parse expression {expr!r} in {question!r}")
    nums, ops = toks[0::2], toks[1::2]
    if not all(t.isdigit() for t in nums) or not all(t in OPERATORS for t in ops):
        raise ValueError(f"cannot parse expression {expr!r} in {question!r}")
    return [int(t) for t in nums], list(ops)


def answer_of(question: str) -> str:
    """Exact value of a synthetic question (``"Compute 47+18-25."`` -> ``"40"``)."""
    nums, ops = parse_question(question)
    return str(solve_steps(nums, ops)[-1][3])


def format_solution(
    steps: Sequence[tuple[int, str, int, int]], fillers: Sequence[str | None]
) -> tuple[str, list[list[int]], list[list[int]]]:
    """Render ``steps`` as a solution; ``fillers[g]`` is the filler of gap g (None for none).

    There are ``len(steps)`` gaps: before each step after the first, and before the box.
    Returns ``(solution, result_spans, filler_spans)`` (see the module docstring).

    >>> format_solution([(47, "+", 18, 65), (65, "-", 25, 40)], ["so", None])
    ('47+18=65, so 65-25=40. \\\\boxed{40}', [[6, 8], [19, 21]], [[10, 12]])
    """
    if len(fillers) != len(steps):
        raise ValueError(f"need one filler slot per gap: {len(steps)} gaps, got {len(fillers)}")
    parts: list[str] = []
    pos = 0
    result_spans: list[list[int]] = []
    filler_spans: list[list[int]] = []

    def emit(s: str) -> None:
        nonlocal pos
        parts.append(s)
        pos += len(s)

    def emit_filler(f: str | None) -> None:
        if f:
            filler_spans.append([pos, pos + len(f)])
            emit(f + " ")

    for k, (a, op, b, c) in enumerate(steps):
        if k > 0:
            emit(", ")
            emit_filler(fillers[k - 1])
        emit(f"{a}{op}{b}=")
        if c < 0:
            emit("-")
        digits = str(abs(c))
        result_spans.append([pos, pos + len(digits)])
        emit(digits)
    emit(". ")
    emit_filler(fillers[-1])
    emit(f"\\boxed{{{steps[-1][3]}}}")
    return "".join(parts), result_spans, filler_spans


def _check_options(
    split: str,
    n: int,
    operands: Sequence[int],
    long_operands: int,
    long_share: float,
    ood_operands: int,
    digits: int,
    operators: Sequence[str],
    filler_prob: float,
    fillers: Sequence[str],
    test_share: float,
    demo_error_rate: float = 0.0,
    filler_words: int = 1,
) -> None:
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; valid: {list(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: must be a non-negative int, got {n!r}")
    if not operands:
        raise ValueError("operands: must list at least one operand count")
    for key, counts in (("operands", list(operands)), ("long_operands", [long_operands]), ("ood_operands", [ood_operands])):
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, int) or c < 2:
                raise ValueError(f"{key}: operand counts must be ints >= 2, got {c!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits: must be an int >= 1, got {digits!r}")
    if isinstance(operators, str) or not operators:
        raise ValueError(f"operators: must be a non-empty list of operators from {list(OPERATORS)}, got {operators!r}")
    for op in operators:
        if op not in OPERATORS:
            raise ValueError(f"operators: unknown operator {op!r}; valid: {list(OPERATORS)}")
    for key, p in (("long_share", long_share), ("filler_prob", filler_prob), ("demo_error_rate", demo_error_rate)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{key}: must be in [0, 1], got {p!r}")
    if not 0.0 < test_share < 1.0:
        raise ValueError(f"test_share: must be in (0, 1), got {test_share!r}")
    if isinstance(filler_words, bool) or not isinstance(filler_words, int) or filler_words < 1:
        raise ValueError(f"filler_words: must be an int >= 1, got {filler_words!r}")
    if isinstance(fillers, str):
        raise ValueError(f"fillers: must be a list of words, got the string {fillers!r}")
    if filler_prob > 0 and not fillers:
        raise ValueError("fillers: empty while filler_prob > 0")
    for f in fillers:
        if not isinstance(f, str) or not re.fullmatch(r"[A-Za-z]+", f):
            raise ValueError(f"fillers: each filler must be a non-empty word of letters, got {f!r}")


def generate(
    split: str,
    n: int,
    *,
    seed: int,
    operands: Sequence[int] = (2, 3),
    long_operands: int = 4,
    long_share: float = 0.1,
    ood_operands: int = 4,
    digits: int = 2,
    operators: Sequence[str] = ("+", "-"),
    filler_prob: float = 0.3,
    fillers: Sequence[str] = DEFAULT_FILLERS,
    test_share: float = 0.2,
    demo_error_rate: float = 0.0,
    filler_words: int = 1,
    max_tries_per_record: int = 1000,
) -> list[dict]:
    """Generate ``n`` synthetic problems of ``split`` ("train", "test" or "ood").

    Args:
        split: "train" (operand counts from ``operands``, with a share ``long_share`` of
            ``long_operands``), "test" (in-distribution: counts from ``operands``) or "ood"
            (``ood_operands`` operands).
        n: number of records.
        seed: random seed; the same seed gives identical records, different seeds different ones.
        operands: operand counts (drawn uniformly) of the in-distribution problems.
        long_operands, long_share: operand count and share of the longer training problems.
        ood_operands: operand count of the ood split.
        digits: operands are drawn uniformly from ``[0, 10**digits)``.
        operators: operators drawn uniformly for each position; from ``OPERATORS``.
        filler_prob: probability that a gap in the solution gets filler words.
        fillers: the filler words.
        filler_words: words of a gap's filler (each drawn from ``fillers``, joined by spaces): the
            knob of the response length (1 draws exactly what earlier versions drew).
        test_share: share of all questions held out (by stable hash) for test/ood.
        demo_error_rate: ``train`` only: probability that a step of the reference solution (the SFT
            demonstration) is wrong, continued consistently (:func:`corrupt_steps`); ``answer``
            stays the true value, so rewards are unaffected. Drawn from a stream of its own: the
            questions and fillers do not change with it. ``demo_errors`` lists the wrong steps.
        max_tries_per_record: give up (ValueError) when the question space is too small for ``n``
            distinct held-out questions.

    Returns:
        Records ``{id, question, answer, solution, source, n_operands, result_spans, filler_spans}``
        (see the module docstring for the solution format and the spans). ``id`` is
        ``"synthetic-<split>-<i>"``; ``source`` is ``"synthetic-<split>"``; ``answer`` is a str.

    Raises:
        ValueError naming the key for bad option values; TypeError for an unknown option.
    """
    operands = [operands] if isinstance(operands, int) else list(operands)  # type: ignore[list-item]
    _check_options(split, n, operands, long_operands, long_share, ood_operands, digits, operators,
                   filler_prob, fillers, test_share, demo_error_rate, filler_words)
    operators = list(operators)
    fillers = list(fillers)
    q_rng = random.Random(_derived_seed("oar-synthetic-questions", split, seed))
    f_rng = random.Random(_derived_seed("oar-synthetic-fillers", split, seed))
    e_rng = random.Random(_derived_seed("oar-synthetic-demo-errors", split, seed))
    error_rate = demo_error_rate if split == "train" else 0.0
    held_out_wanted = split != "train"
    seen: set[str] = set()
    records: list[dict] = []
    tries = 0
    while len(records) < n:
        tries += 1
        if tries > max_tries_per_record * max(n, 1):
            raise ValueError(
                f"n: could not draw {n} distinct {split} questions (got {len(records)}) in {tries - 1} tries; "
                f"the question space is too small (digits={digits}, operators={operators})"
            )
        question, nums, ops = _draw_question(q_rng, split, operands=operands, long_operands=long_operands,
                                             long_share=long_share, ood_operands=ood_operands, digits=digits,
                                             operators=operators)
        if not _in_split(question, test_share=test_share, held_out_wanted=held_out_wanted, seen=seen):
            continue
        records.append(_make_record(split, len(records), question, nums, ops, error_rate=error_rate, e_rng=e_rng,
                                    f_rng=f_rng, fillers=fillers, filler_prob=filler_prob, filler_words=filler_words))
    return records


def _draw_question(q_rng: random.Random, split: str, *, operands: Sequence[int], long_operands: int,
                   long_share: float, ood_operands: int, digits: int,
                   operators: Sequence[str]) -> tuple[str, list[int], list[str]]:
    """One question of :func:`generate` (``"Compute <expr>."``) with its operands and operators, drawn
    from ``q_rng``: the operand count (``ood_operands`` for ood; for train ``long_operands`` with
    probability ``long_share``; else uniform over ``operands``), the operands (uniform in
    ``[0, 10**digits)``) and the operators (uniform over ``operators``)."""
    if split == "ood":
        k = ood_operands
    elif split == "train" and q_rng.random() < long_share:
        k = long_operands
    else:
        k = q_rng.choice(operands)
    nums = [q_rng.randrange(10**digits) for _ in range(k)]
    ops = [q_rng.choice(operators) for _ in range(k - 1)]
    expr = str(nums[0]) + "".join(f"{o}{x}" for o, x in zip(ops, nums[1:]))
    return f"Compute {expr}.", nums, ops


def _in_split(question: str, *, test_share: float, held_out_wanted: bool, seen: set[str]) -> bool:
    """Whether ``question`` belongs to the split being drawn: its stable hash puts it in the held-out
    pool (share ``test_share``) exactly when a held-out split is wanted, and a held-out question is
    new (added to ``seen``; held-out splits hold distinct questions)."""
    if (_stable_unit(question, "oar-synthetic-pool") < test_share) != held_out_wanted:
        return False
    if held_out_wanted:
        if question in seen:
            return False
        seen.add(question)
    return True


def _make_record(split: str, i: int, question: str, nums: list[int], ops: list[str], *, error_rate: float,
                 e_rng: random.Random, f_rng: random.Random, fillers: Sequence[str], filler_prob: float,
                 filler_words: int) -> dict:
    """Record ``i`` of :func:`generate`: the solution of ``nums`` and ``ops`` (its steps corrupted
    with ``error_rate`` from ``e_rng``, :func:`corrupt_steps`), each gap's filler words drawn from
    ``f_rng`` with probability ``filler_prob``."""
    steps = solve_steps(nums, ops)
    demo_steps, demo_errors = corrupt_steps(nums, ops, error_rate, e_rng) if error_rate > 0 else (steps, [])
    gap_fillers = [" ".join(f_rng.choice(fillers) for _ in range(filler_words)) if f_rng.random() < filler_prob
                   else None for _ in steps]
    solution, result_spans, filler_spans = format_solution(demo_steps, gap_fillers)
    return {
        "id": f"synthetic-{split}-{i}",
        "question": question,
        "answer": str(steps[-1][3]),
        "solution": solution,
        "source": f"synthetic-{split}",
        "n_operands": len(nums),
        "result_spans": result_spans,
        "filler_spans": filler_spans,
        "demo_errors": demo_errors,
    }
