"""Controls for token credit: oracle importance from the synthetic task's ground truth, and nulls.

They answer "could token credit win here at all?". Every control but ``oracle_progress`` goes
through the same Bi-Level reshaping and loss as OAR (:func:`oar.credit.reshape.reshaped_credit`),
so only the importance scores differ from OAR-P / OAR-G:

- ``oracle_first_mistake`` (synthetic task only): in a wrong response whose first arithmetic
  mistake the task grammar locates (:func:`oar.task.grammar.check_steps`, the locator of
  ``oar attribution``), importance 1 on the result tokens of that step (sign included), 0 on every
  other reasoning token, including the later restatements of the wrong value. Correct responses,
  and wrong ones without a located mistake, keep GRPO's uniform credit.
  With ``localisation`` ``p`` < 1 it is a degraded oracle: in each scored response, with probability
  ``1 - p`` the importance lands on the result tokens of another step of the same response, drawn
  uniformly (a response with one step keeps it on the mistake): how fast the oracle's gain falls
  with the accuracy of the localisation.
- ``oracle_suffix`` (synthetic task only; VPPO-style, arXiv 2601.18984, not reshaped): in a wrong
  response (``A_i < 0``) with a located first mistake the tokens before the mistake's result (the
  correct prefix) get advantage 0, and the response's penalty is spread uniformly over its tokens
  from the mistake's result on (``A_i x L / L_suffix`` each with ``preserve_mass``, else ``A_i``).
  Against ``oracle_first_mistake`` it tells whether the gain comes from sparing the correct prefix
  or from pinpointing the mistake.
- ``oracle_decisive`` (synthetic task only): importance 1 on the result tokens of every step of
  every parsed response, without knowing which one is wrong: what an ideal OAR would find.
- ``oracle_progress`` (synthetic task only; PAV's form, arXiv 2410.08146, not reshaped):
  ``A_{i,t} = A_i + alpha * (P_k - P_{k-1})`` on the tokens of step ``k`` with
  ``P_k = 1[the results of steps 1..k equal the reference solution's]`` and ``P_0 = 1``: ``-alpha``
  on the first step whose result departs from the reference, 0 elsewhere.
- ``shuffled``: OAR-G's scores permuted at random among each response's reasoning tokens (same
  options as ``oar_g``): the reweighting without the signal.
- ``inverted``: OAR-G's scores reflected within each response (``max + min - s``): the least
  important tokens get the boost.

Shapes as :mod:`oar.credit`: ``B`` responses, ``T`` response tokens (right-padded).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import SEQ_OPTIONS, broadcast_seq, check_options, sequence_advantages
from oar.credit.reshape import RESHAPE_OPTIONS, reshaped_credit

__all__ = [
    "SyntheticTaskRequired",
    "OracleLabels",
    "oracle_labels",
    "shuffle_scores",
    "invert_scores",
    "oracle_first_mistake_estimator",
    "oracle_decisive_estimator",
    "oracle_progress_estimator",
    "oracle_suffix_estimator",
    "relocate_mistakes",
    "shuffled_estimator",
    "inverted_estimator",
]

_QUESTION_IN_PROMPT = re.compile(r"Compute ([0-9+\-*]+)\.")

#: Options of the reshaped oracles: the sequence advantage's and the Bi-Level reshaping's.
_ORACLE_OPTIONS = SEQ_OPTIONS + RESHAPE_OPTIONS
#: ``oracle_first_mistake``'s own: the accuracy of its localisation (1: the oracle itself).
_LOCALISATION = "localisation"
#: Salts of the controls' random draws (with the run seed and the step: :func:`_generator`).
_SHUFFLE_SALT, _RELOCATE_SALT = 0x5EED, 0x10CA


class SyntheticTaskRequired(ValueError):
    """An oracle control was asked to score responses that are not of the synthetic task."""


@dataclass
class OracleLabels:
    """Ground truth of a batch of synthetic-task responses, in response coordinates.

    Attributes:
        first_mistake: ``(B, T)`` float, 1 on the result tokens of the located first mistake.
        results: ``(B, T)`` float, 1 on the result tokens of every step.
        result_step: ``(B, T)`` long, ``k + 1`` on the result tokens of step ``k``, 0 elsewhere.
        mistake_step: ``(B,)`` long, the located first mistake's step, -1 where none is located.
        progress: ``(B, T)`` float, ``P_k - P_{k-1}`` on the tokens of step ``k`` (0 or -1).
        reasoning: ``(B, T)`` float, 1 on the tokens before the answer marker of parsed rows.
        parsed: ``(B,)`` bool, the response follows the task grammar.
        located: ``(B,)`` bool, a first arithmetic mistake was located.
    """

    first_mistake: torch.Tensor
    results: torch.Tensor
    progress: torch.Tensor
    reasoning: torch.Tensor
    parsed: torch.Tensor
    located: torch.Tensor
    result_step: torch.Tensor
    mistake_step: torch.Tensor


def _questions(batch: CreditBatch, name: str) -> list[tuple[list[int], list[str]]]:
    """The synthetic question (operands, operators) of every row, read from its prompt."""
    from oar.task.grammar import question_terms

    task = batch.extras.get("task") or {}
    if task.get("kind", "synthetic") != "synthetic":
        raise SyntheticTaskRequired(
            f"estimator {name!r} reads the synthetic task's ground truth; task.kind is {task.get('kind')!r}"
        )
    if batch.tokenizer is None or batch.prompt_ids is None:
        raise ValueError(f"estimator {name!r}: CreditBatch.tokenizer and prompt_ids are needed to read the question")
    out = []
    pmask = batch.prompt_mask if batch.prompt_mask is not None else torch.ones_like(batch.prompt_ids)
    for b in range(batch.prompt_ids.shape[0]):
        ids = batch.prompt_ids[b][pmask[b].bool()].tolist()
        text = batch.tokenizer.decode(ids, skip_special_tokens=True)
        found = _QUESTION_IN_PROMPT.findall(text)
        if not found:
            raise SyntheticTaskRequired(
                f"estimator {name!r} works on the synthetic task only (task.kind: synthetic): the prompt of row {b} "
                f"holds no 'Compute <expression>.' question: {text[:80]!r}"
            )
        out.append(question_terms(f"Compute {found[-1]}."))
    return out


def oracle_labels(batch: CreditBatch, *, fillers: Sequence[str], name: str = "oracle") -> OracleLabels:
    """Read the ground-truth token labels of a batch of synthetic-task responses.

    Each response is decoded token by token (:func:`oar.task.parsing.token_char_spans`),
    parsed by the task grammar (:func:`oar.task.parsing.parse_response`) and its steps are
    replayed against the question's reduction order (:func:`oar.task.grammar.check_steps`).
    Rows that do not parse get all-zero labels and ``parsed`` False.

    Args:
        batch: ``response_ids`` / ``response_mask`` ``(B, T)``, ``prompt_ids`` ``(B, P)`` and the
            tokenizer; ``extras["task"]`` (when present) must be a synthetic task.
        fillers: the task's filler words.

    Raises:
        SyntheticTaskRequired: a prompt holds no synthetic question, or ``extras["task"]`` is another task.
    """
    from oar.task.grammar import check_steps
    from oar.task.parsing import PIVOTAL, parse_response, token_char_spans, token_labels
    from oar.data.synthetic import solve_steps

    terms = _questions(batch, name)
    B, T = batch.response_ids.shape
    out = {k: torch.zeros(B, T) for k in ("first_mistake", "results", "progress", "reasoning", "result_step")}
    parsed_rows, located = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    mistake_step = torch.full((B,), -1, dtype=torch.long)
    ids_cpu, mask_cpu = batch.response_ids.detach().cpu(), batch.response_mask.detach().cpu().bool()
    for b in range(B):
        pos = mask_cpu[b].nonzero().flatten()
        text, starts, ends = token_char_spans(batch.tokenizer, ids_cpu[b, pos].tolist())
        parsed = parse_response(text, fillers=fillers)
        if parsed is None:
            continue
        parsed_rows[b] = True

        def mark(key: str, spans: Sequence[Sequence[int]], value: float = 1.0) -> None:
            on = token_labels(starts, ends, spans, [], len(text)) == PIVOTAL
            out[key][b, pos[torch.from_numpy(on)]] = value

        mark("reasoning", [[0, parsed.reasoning_end]])
        mark("results", parsed.result_spans)
        for k, span in enumerate(parsed.result_spans):
            mark("result_step", [span], float(k + 1))
        operands, ops = terms[b]
        check = check_steps(parsed.steps, operands, ops, parsed.answer)
        if check.locatable:
            located[b] = True
            mistake_step[b] = check.mistake_step
            mark("first_mistake", [parsed.result_spans[check.mistake_step]])
        reference = [c for (_, _, _, c) in solve_steps(operands, ops)]
        for k, step in enumerate(parsed.steps):
            if k >= len(reference) or step[3] != reference[k]:  # P_k drops from 1 to 0 here, once
                mark("progress", [parsed.step_spans[k]], -1.0)
                break
    result_step = out.pop("result_step").long()
    return OracleLabels(parsed=parsed_rows, located=located, result_step=result_step, mistake_step=mistake_step, **out)


def relocate_mistakes(labels: OracleLabels, rows: torch.Tensor, accuracy: float,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A degraded localisation of the first mistake: in each of ``rows`` (``(B,)`` bool, rows with a
    located mistake) the mistake's result tokens are kept with probability ``accuracy``; otherwise
    the result tokens of another step of the same response, drawn uniformly, take their place (a
    response whose only step is the mistake keeps it).

    Returns:
        ``(importance (B, T) float, moved (B,) bool)``: 1 on the chosen step's result tokens of the
        rows, ``labels.first_mistake`` elsewhere; which rows' importance moved.
    """
    target = labels.first_mistake.clone()
    B = target.shape[0]
    keep = torch.rand(B, generator=generator) < accuracy
    pick = torch.rand(B, generator=generator)
    moved = torch.zeros(B, dtype=torch.bool)
    for b in (rows & ~keep).nonzero().flatten().tolist():
        steps = [int(k) for k in labels.result_step[b].unique().tolist() if k > 0 and k - 1 != labels.mistake_step[b]]
        if not steps:
            continue
        k = steps[min(int(pick[b] * len(steps)), len(steps) - 1)]
        target[b] = (labels.result_step[b] == k).to(target.dtype)
        moved[b] = True
    return target, moved


def _fillers(batch: CreditBatch) -> list[str]:
    from oar.data.synthetic import task_fillers

    return task_fillers((batch.extras.get("task") or {}).get("synthetic"))


def _oracle_scores(name: str, batch: CreditBatch, which: str, *, wrong_only: bool, localisation: float = 1.0,
                   options: dict[str, Any] | None = None):
    """``wrong_only``: score only responses below their group's mean (``A_i < 0``), so a mistake that a
    later one cancels in a right answer is not boosted with a positive advantage. ``localisation`` < 1:
    the first mistake's importance moved to another step with probability ``1 - localisation``
    (:func:`relocate_mistakes`, drawn from the run seed and the step)."""
    def scores_of(A: torch.Tensor):
        t0 = time.perf_counter()
        labels = oracle_labels(batch, fillers=_fillers(batch), name=name)
        target = getattr(labels, which)
        a = A.detach().cpu()
        active = (target.sum(-1) > 0) & ((a < 0) if wrong_only else (a != 0))
        B = max(len(A), 1)
        stats = {"importance_s": time.perf_counter() - t0, "parsed_fraction": float(labels.parsed.sum()) / B,
                 "located_fraction": float(labels.located.sum()) / B, "scored_fraction": float(active.sum()) / B}
        if localisation < 1.0:
            target, moved = relocate_mistakes(labels, active, localisation,
                                              _generator(batch, options or {}, _RELOCATE_SALT))
            stats["relocated_fraction"] = float(moved.sum()) / B
        dev = batch.response_mask.device
        return target.to(dev), labels.reasoning.to(dev), active.to(dev), stats

    return scores_of


@register_estimator("oracle_first_mistake")
def oracle_first_mistake_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Oracle control: Bi-Level weights from importance 1 on the first mistake's result tokens.

    Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``quantile`` (0.25), ``beta`` (1.0), ``floor``
    (0.1), ``preserve_mass`` (True), as OAR; ``localisation`` (1.0): the probability that the
    importance is on the mistake, else on another step of the response (:func:`relocate_mistakes`).
    Rows scored: responses below their group's mean (``A_i < 0``) with a located first mistake; every
    other row keeps weight 1 (also a right answer reached through two mistakes that cancel). Stats:
    ``parsed_fraction``, ``located_fraction``, ``scored_fraction``, ``importance_s`` (and
    ``relocated_fraction`` with ``localisation`` < 1).
    """
    localisation = float(options.pop(_LOCALISATION, 1.0))
    return reshaped_credit("oracle_first_mistake", batch, options, _ORACLE_OPTIONS,
                           _oracle_scores("oracle_first_mistake", batch, "first_mistake", wrong_only=True,
                                          localisation=localisation, options=options))


@register_estimator("oracle_decisive")
def oracle_decisive_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Oracle control: Bi-Level weights from importance 1 on every step's result tokens.

    Options as ``oracle_first_mistake``. Rows scored: parsed responses with ``A_i != 0``.
    """
    return reshaped_credit("oracle_decisive", batch, options, _ORACLE_OPTIONS, _oracle_scores("oracle_decisive", batch, "results", wrong_only=False))


@register_estimator("oracle_progress")
def oracle_progress_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Oracle control in PAV's form: ``A_{i,t} = A_i m_{i,t} + alpha * progress_{i,t}``.

    ``progress`` is ``-1`` on the tokens of the first step whose result departs from the reference
    solution and 0 elsewhere (:class:`OracleLabels`); it is added to every response, also in groups
    whose rewards are all equal (``A_i = 0``), as PAV's process advantage is.

    Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``alpha`` (1.0).
    """
    check_options("oracle_progress", options, SEQ_OPTIONS + ("alpha",))
    t0 = time.perf_counter()
    A = sequence_advantages(batch, options)
    labels = oracle_labels(batch, fillers=_fillers(batch), name="oracle_progress")
    m = batch.response_mask.to(torch.float32)
    progress = labels.progress.to(m.device) * m
    token_adv = broadcast_seq(A.to(torch.float32), batch.response_mask) + float(options.get("alpha", 1.0)) * progress
    B = max(len(A), 1)
    return CreditResult(token_advantages=token_adv, seq_advantages=A, weights=None,
                        stats={"importance_s": time.perf_counter() - t0,
                               "parsed_fraction": float(labels.parsed.sum()) / B,
                               "progress_fraction": float((progress != 0).any(-1).sum()) / B})


@register_estimator("oracle_suffix")
def oracle_suffix_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """VPPO-style control (arXiv 2601.18984): the correct prefix of a wrong response spared, its penalty
    spread uniformly from the first mistake on.

    In a response below its group's mean (``A_i < 0``) with a located first mistake, the tokens before
    the mistake's result get weight 0 and the tokens from it to the end weight ``L / L_suffix`` with
    ``preserve_mass`` (the response's total penalty kept), else 1. Every other row keeps GRPO's
    uniform credit. Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``preserve_mass`` (True).
    Stats: ``parsed_fraction``, ``located_fraction``, ``scored_fraction``, ``spared_fraction`` (the
    share of a scored response's tokens spared, averaged), ``importance_s``.
    """
    check_options("oracle_suffix", options, SEQ_OPTIONS + ("preserve_mass",))
    t0 = time.perf_counter()
    A = sequence_advantages(batch, options)
    labels = oracle_labels(batch, fillers=_fillers(batch), name="oracle_suffix")
    m = batch.response_mask.to(torch.float32)
    dev = m.device
    start = torch.where(labels.first_mistake.to(dev) > 0, torch.arange(m.shape[1], device=dev), m.shape[1]).amin(-1)
    active = labels.located.to(dev) & (A.to(dev) < 0) & (start < m.shape[1])
    suffix = (torch.arange(m.shape[1], device=dev)[None, :] >= start[:, None]).to(m.dtype) * m
    lengths, kept = m.sum(-1), suffix.sum(-1)
    scale = lengths / kept.clamp(min=1.0) if bool(options.get("preserve_mass", True)) else torch.ones_like(lengths)
    weights = torch.where(active[:, None], suffix * scale[:, None], m)
    token_adv = broadcast_seq(A.to(torch.float32), batch.response_mask) * weights
    B = max(len(A), 1)
    spared = ((lengths - kept) / lengths.clamp(min=1.0))[active]
    return CreditResult(token_advantages=token_adv, seq_advantages=A, weights=weights,
                        stats={"importance_s": time.perf_counter() - t0,
                               "parsed_fraction": float(labels.parsed.sum()) / B,
                               "located_fraction": float(labels.located.sum()) / B,
                               "scored_fraction": float(active.sum()) / B,
                               "spared_fraction": float(spared.mean()) if len(spared) else 0.0})


def shuffle_scores(scores: torch.Tensor, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Permute each row's scores among its masked positions at random.

    Args:
        scores: ``(B, T)`` float; mask: ``(B, T)`` positions to permute among.
        generator: the random stream (CPU).

    Returns:
        ``(B, T)``: row ``b`` holds the same multiset of masked values in a random order; entries
        outside the mask are unchanged.
    """
    out = scores.clone()
    m = mask.bool()
    for b in range(scores.shape[0]):
        pos = m[b].nonzero().flatten()
        perm = torch.randperm(len(pos), generator=generator).to(pos.device)
        out[b, pos] = scores[b, pos[perm]]
    return out


def invert_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reflect each row's scores within its range over the masked positions: ``max + min - s``.

    Args:
        scores: ``(B, T)`` non-negative; mask: ``(B, T)``.

    Returns:
        ``(B, T)`` non-negative, the most important masked token now the least; unchanged outside the mask.
    """
    m = mask.bool()
    hi = torch.where(m, scores, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(m, scores, torch.inf).amin(-1, keepdim=True)
    return torch.where(m, hi + lo - scores, scores)


def _null_scores(batch: CreditBatch, options: dict[str, Any], transform: Callable[..., torch.Tensor]):
    from oar.credit.importance import importance_scores

    def scores_of(A: torch.Tensor):
        scores, reasoning, active, stats = importance_scores("oar_g", batch, options, A)
        return transform(scores, reasoning * active.to(reasoning.dtype).unsqueeze(-1)), reasoning, active, stats

    return scores_of


def _generator(batch: CreditBatch, options: dict[str, Any], salt: int) -> torch.Generator:
    """A control's random stream: the run's seed (or the ``seed`` option), the step and ``salt``."""
    from oar.credit.importance import mix_seed

    seed = int(options.get("seed", batch.extras.get("seed") or 0))
    return torch.Generator().manual_seed(mix_seed(mix_seed(seed, int(batch.extras.get("step") or 0)), salt))


@register_estimator("shuffled", needs_model=True)
def shuffled_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Null control: OAR-G's importance permuted within each response, then Bi-Level reshaped.

    Options: those of ``oar_g``. The permutation is seeded by (``seed`` or the run's seed, step).
    """
    from oar.credit.importance import OAR_G_OPTIONS

    gen = _generator(batch, options, _SHUFFLE_SALT)
    return reshaped_credit("shuffled", batch, options, OAR_G_OPTIONS,
                     _null_scores(batch, options, lambda s, m: shuffle_scores(s.cpu(), m.cpu(), gen).to(s.device)))


@register_estimator("inverted", needs_model=True)
def inverted_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Null control: OAR-G's importance reflected within each response (``max + min - s``), then
    Bi-Level reshaped. Options: those of ``oar_g``."""
    from oar.credit.importance import OAR_G_OPTIONS

    return reshaped_credit("inverted", batch, options, OAR_G_OPTIONS, _null_scores(batch, options, invert_scores))
