"""Error localisation ground truth on the synthetic task: the first arithmetic mistake of a
response, and exact counterfactual edits of correct responses.

The reference solution of a question (:mod:`oar.data.synthetic`) reduces the expression one
operation at a time: ``*`` first (leftmost first), then ``+``/``-`` left to right, each step
``a op b = c`` taking ``a`` and ``b`` from the current list of values (question operands and the
results written so far). :func:`check_steps` replays a response's steps against that order:

- a step whose operands or operator differ from the ones the order prescribes (given the values
  written before it) is an **operand inconsistency**: the response copied something wrong, and the
  grammar cannot say which token caused it, so such a response is *not locatable* when this
  happens before any arithmetic mistake;
- a step with consistent operands and ``c != a op b`` is an **arithmetic mistake**; the first one
  is the located mistake and its result tokens (sign included) are the cause of the wrong answer;
- the written result (right or wrong) replaces ``a`` and ``b`` in the list of values, so later
  steps are checked against what the response actually wrote.

A located mistake is **propagated** when nothing else goes wrong after it: every later step is
consistent and arithmetically right, the number of steps is complete and the boxed answer equals
the last result. Then the mistake is the only cause of the wrong answer.

:func:`counterfactual_edit` builds the exact counterfactual of a correct response: one step's
result is replaced, every later step is re-derived by the same order from the edited value, the
boxed answer is the new final value, and fillers stay in their gaps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from oar.data.synthetic import parse_question, apply_op, format_solution, next_operation, reduce_steps, solve_steps

__all__ = [
    "STEP_STATUSES",
    "StepCheck",
    "apply_op",
    "question_terms",
    "check_steps",
    "Counterfactual",
    "counterfactual_edit",
    "draw_counterfactual",
    "mistake_spans",
]

#: Outcomes of :func:`check_steps`.
STEP_STATUSES: tuple[str, ...] = (
    "consistent",  # every step consistent and right, complete, box = last result
    "mistake",  # a first arithmetic mistake is located
    "inconsistent_operands",  # operands/operator off the reduction order before any mistake
    "incomplete",  # too few steps (no mistake)
    "extra_steps",  # more steps than operations (no mistake)
    "box_mismatch",  # steps right, but the box is not the last result
)


def question_terms(question: str) -> tuple[list[int], list[str]]:
    """Operands and operators of a synthetic question (``"Compute 47+18-25."`` ->
    ``([47, 18, 25], ["+", "-"])``)."""
    return parse_question(question)


@dataclass(frozen=True)
class StepCheck:
    """Result of :func:`check_steps`.

    Attributes:
        status: one of :data:`STEP_STATUSES`.
        mistake_step: index of the first arithmetic mistake (``status == "mistake"``), else None.
        propagated: for a mistake, True when nothing else goes wrong after it (later steps
            consistent with the written values and right, complete, box = last result).
        expected: for each step checked, the ``(a, op, b)`` the reduction order prescribes given
            the values written before it.
    """

    status: str
    mistake_step: int | None
    propagated: bool
    expected: tuple[tuple[int, str, int], ...]

    @property
    def locatable(self) -> bool:
        return self.status == "mistake"


def check_steps(
    steps: Sequence[tuple[int, str, int, int]],
    operands: Sequence[int],
    ops: Sequence[str],
    answer: str | None = None,
) -> StepCheck:
    """Replay written steps against the reduction order of a question and find the first
    arithmetic mistake (see the module docstring).

    Args:
        steps: ``(a, op, b, c)`` as written (:attr:`ParsedResponse.steps`).
        operands, ops: the question's terms (:func:`question_terms`).
        answer: the boxed content; None skips the box check.

    Returns:
        a :class:`StepCheck`.
    """
    vals, rest = list(operands), list(ops)
    if len(vals) != len(rest) + 1:
        raise ValueError(f"oar.attribution.check_steps: {len(vals)} operands for {len(rest)} operators")
    mistake: int | None = None
    clean_after = True
    expected: list[tuple[int, str, int]] = []
    for i, (a, op, b, c) in enumerate(steps):
        if not rest:
            if mistake is None:
                return StepCheck("extra_steps", None, False, tuple(expected))
            clean_after = False
            break
        j = next_operation(rest)
        want = (vals[j], rest[j], vals[j + 1])
        expected.append(want)
        if (a, op, b) != want:
            if mistake is None:
                return StepCheck("inconsistent_operands", None, False, tuple(expected))
            clean_after = False
            break
        if c != apply_op(a, op, b):
            if mistake is None:
                mistake = i
            else:
                clean_after = False
        vals[j : j + 2] = [c]
        del rest[j]
    complete = not rest
    box_ok = answer is None or (bool(steps) and answer.strip() == str(steps[-1][3]))
    if mistake is None:
        if not complete:
            return StepCheck("incomplete", None, False, tuple(expected))
        if not box_ok:
            return StepCheck("box_mismatch", None, False, tuple(expected))
        return StepCheck("consistent", None, False, tuple(expected))
    return StepCheck("mistake", mistake, bool(clean_after and complete and box_ok), tuple(expected))


@dataclass(frozen=True)
class Counterfactual:
    """An edited solution (:func:`counterfactual_edit`).

    Attributes:
        text: the edited solution (reasoning and ``\\boxed{answer}``, nothing after the box).
        steps: its ``(a, op, b, c)`` steps.
        step: the index of the edited step.
        original_result, new_result: that step's result before and after the edit.
        answer: the boxed value (the last step's result) as a string.
    """

    text: str
    steps: tuple[tuple[int, str, int, int], ...]
    step: int
    original_result: int
    new_result: int
    answer: str


def counterfactual_edit(
    operands: Sequence[int],
    ops: Sequence[str],
    gap_fillers: Sequence[str | None],
    step: int,
    new_result: int,
) -> Counterfactual:
    """Solve a question by the reduction order, but write ``new_result`` as the result of step
    ``step`` and derive every later step from the values written (so later steps are right given
    the edit, and the box holds the new final value).

    Args:
        operands, ops: the question's terms.
        gap_fillers: the filler of each gap (``len(ops)`` entries, None for none), e.g. the
            :attr:`ParsedResponse.gap_fillers` of the response being edited.
        step: index of the step to edit, ``0 <= step < len(ops)``.
        new_result: the result written at that step; must differ from the right one.

    Returns:
        a :class:`Counterfactual`; :func:`check_steps` on its steps finds the mistake at ``step``,
        propagated.
    """
    n_steps = len(ops)
    if not 0 <= step < n_steps:
        raise ValueError(f"oar.attribution.counterfactual_edit: step {step} outside 0..{n_steps - 1}")
    if len(gap_fillers) != n_steps:
        raise ValueError(f"oar.attribution.counterfactual_edit: {len(gap_fillers)} fillers for {n_steps} gaps")
    original = 0

    def result(k: int, c: int) -> int:
        nonlocal original
        if k != step:
            return c
        original = c
        if new_result == c:
            raise ValueError(f"oar.attribution.counterfactual_edit: new_result {new_result} is the right result")
        return int(new_result)

    steps = reduce_steps(operands, ops, result)
    text, _, _ = format_solution(steps, list(gap_fillers))
    return Counterfactual(text, tuple(steps), step, original, int(new_result), str(steps[-1][3]))


def draw_counterfactual(
    operands: Sequence[int],
    ops: Sequence[str],
    gap_fillers: Sequence[str | None],
    gold: str,
    rng: random.Random,
    *,
    max_delta: int,
    max_tries: int = 20,
) -> Counterfactual | None:
    """A random :func:`counterfactual_edit`: a step drawn uniformly, its result moved by a
    non-zero ``delta`` drawn uniformly from ``[-max_delta, max_delta]`` that keeps its sign
    (a non-negative result stays non-negative, a negative one negative), redrawn while the new
    boxed answer equals ``gold`` (possible only through a ``* 0``).

    Returns:
        the edit, or None when ``max_tries`` draws all left the answer at ``gold``.
    """
    if max_delta < 1:
        raise ValueError(f"oar.attribution.draw_counterfactual: max_delta must be >= 1, got {max_delta}")
    for _ in range(max_tries):
        step = rng.randrange(len(ops))
        right = solve_steps(operands, ops)[step][3]  # steps before ``step`` are unedited
        deltas = [d for d in range(-max_delta, max_delta + 1) if d != 0 and ((right + d) >= 0) == (right >= 0)]
        if not deltas:
            continue
        cf = counterfactual_edit(operands, ops, gap_fillers, step, right + rng.choice(deltas))
        if cf.answer.strip() != str(gold).strip():
            return cf
    return None



def mistake_spans(parsed: Any, step: int) -> tuple[list[list[int]], list[list[int]]]:
    """Character spans of the error-localisation labels of a parsed response whose mistake is at
    ``step``: ``([result span of that step, sign included], [span of every other step])``.
    Separators, fillers and the operands of the mistaken step belong to neither.

    Args:
        parsed: a :class:`oar.task.parsing.ParsedResponse`.
        step: index of the mistaken step.
    """
    if not 0 <= step < len(parsed.steps):
        raise ValueError(f"oar.attribution.mistake_spans: step {step} outside 0..{len(parsed.steps) - 1}")
    return [list(parsed.result_spans[step])], [list(s) for j, s in enumerate(parsed.step_spans) if j != step]
