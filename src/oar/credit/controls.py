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
from typing import Any, Callable, Mapping, Sequence

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import SEQ_OPTIONS, broadcast_seq, check_options, sequence_advantages
from oar.credit.reshape import RESHAPE_OPTIONS, reshaped_credit

__all__ = ["SyntheticTaskRequired", "OracleLabels", "oracle_labels", "oracle_first_mistake_estimator", "oracle_decisive_estimator", "oracle_progress_estimator", "oracle_suffix_estimator", "relocate_mistakes", "oracle_importance", "StepLabels", "step_labels", "text_steps", "first_mistake_credit"]


_QUESTION_IN_PROMPT = re.compile(r"Compute ([0-9+\-*]+)\.")
#: Options of the reshaped oracles: the sequence advantage's and the Bi-Level reshaping's.
_ORACLE_OPTIONS = SEQ_OPTIONS + RESHAPE_OPTIONS
#: ``oracle_first_mistake``'s own: the accuracy of its localisation (1: the oracle itself).
_LOCALISATION = "localisation"
#: Salt of the degraded oracle's relocation draws (with the run seed and the step: :func:`seeded_generator`).
_RELOCATE_SALT = 0x10CA


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

    task = batch.task or {}
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


@dataclass
class StepLabels:
    """The steps of a batch of synthetic-task responses as the task grammar parses them, without the
    ground truth (what a step verifier sees), in response coordinates.

    Attributes:
        texts: each response decoded (:func:`oar.task.parsing.token_char_spans`).
        result_spans: per response, the character spans of its steps' results (``[]`` unparsed).
        step_spans: per response, the character spans of its whole steps ``a op b = c``.
        steps: per response, the parsed ``(a, op, b, c)`` steps (``[]`` unparsed).
        answers: per response, the boxed answer (``""`` unparsed).
        results: ``(B, T)`` float, 1 on the result tokens of every step.
        result_step: ``(B, T)`` long, ``k + 1`` on the result tokens of step ``k``, 0 elsewhere.
        reasoning: ``(B, T)`` float, 1 on the tokens before the answer marker of parsed rows.
        parsed: ``(B,)`` bool, the response follows the task grammar.
        mark: ``mark(b, spans) -> (T,) bool``, the tokens of row ``b`` that the character ``spans`` cover.
    """

    texts: list[str]
    result_spans: list[list[list[int]]]
    step_spans: list[list[list[int]]]
    steps: list[list[tuple[int, str, int, int]]]
    answers: list[str]
    results: torch.Tensor
    result_step: torch.Tensor
    reasoning: torch.Tensor
    parsed: torch.Tensor
    mark: Callable[[int, Sequence[Sequence[int]]], torch.Tensor]


def step_labels(batch: CreditBatch, *, name: str = "oracle", fillers: Sequence[str] | None = None) -> StepLabels:
    """Parse every response of a batch with the task grammar and the task's fillers (``fillers``,
    default the task's: :func:`oar.data.synthetic.task_fillers`; :func:`oar.task.parsing.parse_response`),
    through :func:`text_steps`. Rows that do not parse get all-zero labels and ``parsed`` False.

    Raises:
        SyntheticTaskRequired: ``batch.task`` is another task.
    """
    from oar.task.parsing import parse_response

    task = batch.task or {}
    if task.get("kind", "synthetic") != "synthetic":
        raise SyntheticTaskRequired(f"estimator {name!r} reads the synthetic task's steps; task.kind is {task.get('kind')!r}")
    fillers = _fillers(batch) if fillers is None else fillers
    return text_steps(batch, lambda text: parse_response(text, fillers=fillers), name=name)


def text_steps(batch: CreditBatch, segment: Callable[[str], Any], *, name: str = "steps") -> StepLabels:
    """The steps of every response of a batch (decoded token by token,
    :func:`oar.task.parsing.token_char_spans`) as ``segment(text)`` finds them, in response coordinates.

    Args:
        segment: text -> None (no steps: the row's labels are all zero, ``parsed`` False) or an object
            with ``result_spans``, ``step_spans`` (character spans per step), ``steps``, ``answer`` and
            ``reasoning_end`` (:class:`oar.task.parsing.ParsedResponse`).

    Raises:
        ValueError: the batch has no tokenizer.
    """
    from oar.task.parsing import PIVOTAL, token_char_spans, token_labels

    if batch.tokenizer is None:
        raise ValueError(f"estimator {name!r}: CreditBatch.tokenizer is needed to read the responses")
    B, T = batch.response_ids.shape
    results, reasoning, result_step = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T, dtype=torch.long)
    parsed_rows = torch.zeros(B, dtype=torch.bool)
    texts, parses, token_maps = [], [], []
    ids_cpu, mask_cpu = batch.response_ids.detach().cpu(), batch.response_mask.detach().cpu().bool()
    for b in range(B):
        pos = mask_cpu[b].nonzero().flatten()
        text, starts, ends = token_char_spans(batch.tokenizer, ids_cpu[b, pos].tolist())
        texts.append(text)
        token_maps.append((pos, starts, ends, len(text)))
        parses.append(segment(text))
        parsed_rows[b] = parses[-1] is not None

    def mark(b: int, spans: Sequence[Sequence[int]]) -> torch.Tensor:
        pos, starts, ends, n = token_maps[b]
        on = torch.zeros(T, dtype=torch.bool)
        hit = torch.from_numpy(token_labels(starts, ends, spans, [], n) == PIVOTAL)
        on[pos[hit]] = True
        return on

    for b, parsed in enumerate(parses):
        if parsed is None:
            continue
        reasoning[b] = mark(b, [[0, parsed.reasoning_end]]).float()
        results[b] = mark(b, parsed.result_spans).float()
        for k, span in enumerate(parsed.result_spans):
            result_step[b][mark(b, [span])] = k + 1
    return StepLabels(texts=texts, result_spans=[p.result_spans if p else [] for p in parses],
                      step_spans=[p.step_spans if p else [] for p in parses], steps=[p.steps if p else [] for p in parses],
                      answers=[p.answer if p else "" for p in parses], results=results, result_step=result_step,
                      reasoning=reasoning, parsed=parsed_rows, mark=mark)


def oracle_labels(batch: CreditBatch, *, fillers: Sequence[str] | None = None, name: str = "oracle") -> OracleLabels:
    """Read the ground-truth token labels of a batch of synthetic-task responses: the steps
    (:func:`step_labels`) replayed against the question's reduction order
    (:func:`oar.task.grammar.check_steps`). Rows that do not parse get all-zero labels and ``parsed``
    False. ``fillers``: the task's filler words (default: ``batch.task``'s).

    Raises:
        SyntheticTaskRequired: a prompt holds no synthetic question, or ``batch.task`` is another task.
    """
    from oar.task.grammar import check_steps
    from oar.data.synthetic import solve_steps

    terms = _questions(batch, name)
    lab = step_labels(batch, name=name, fillers=fillers)
    B, T = batch.response_ids.shape
    first_mistake, progress = torch.zeros(B, T), torch.zeros(B, T)
    located = torch.zeros(B, dtype=torch.bool)
    mistake_step = torch.full((B,), -1, dtype=torch.long)
    for b in range(B):
        if not lab.parsed[b]:
            continue
        operands, ops = terms[b]
        check = check_steps(lab.steps[b], operands, ops, lab.answers[b])
        if check.locatable:
            located[b] = True
            mistake_step[b] = check.mistake_step
            first_mistake[b] = lab.mark(b, [lab.result_spans[b][check.mistake_step]]).float()
        reference = [c for (_, _, _, c) in solve_steps(operands, ops)]
        for k, step in enumerate(lab.steps[b]):
            if k >= len(reference) or step[3] != reference[k]:  # P_k drops from 1 to 0 here, once
                progress[b][lab.mark(b, [lab.step_spans[b][k]])] = -1.0
                break
    return OracleLabels(first_mistake=first_mistake, results=lab.results, progress=progress, reasoning=lab.reasoning,
                        parsed=lab.parsed, located=located, result_step=lab.result_step, mistake_step=mistake_step)


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

    return task_fillers((batch.task or {}).get("synthetic"))


def _decisive_scores(batch: CreditBatch):
    """``oracle_decisive``'s scores: importance 1 on every step's result tokens of the parsed responses
    with a nonzero advantage."""
    def scores_of(A: torch.Tensor):
        t0 = time.perf_counter()
        labels = oracle_labels(batch, name="oracle_decisive")
        target = labels.results
        active = (target.sum(-1) > 0) & (A.detach().cpu() != 0)
        B = max(len(A), 1)
        stats = {"importance_s": time.perf_counter() - t0, "parsed_fraction": float(labels.parsed.sum()) / B,
                 "located_fraction": float(labels.located.sum()) / B, "scored_fraction": float(active.sum()) / B}
        dev = batch.response_mask.device
        return target.to(dev), labels.reasoning.to(dev), active.to(dev), stats

    return scores_of


def first_mistake_credit(name: str, batch: CreditBatch, options: dict[str, Any], *, labels: Any,
                         first_mistake: torch.Tensor, located: torch.Tensor, shape: str,
                         stats: dict[str, float] | None = None) -> CreditResult:
    """First-mistake credit from a location of each response's first mistake, however found (the task's
    ground truth for the oracles, a step verifier: :mod:`oar.credit.verifier`).

    Args:
        labels: the batch's parsed steps (:class:`StepLabels` or :class:`OracleLabels`: ``reasoning``
            and ``parsed``).
        first_mistake: ``(B, T)`` float, 1 on the located mistake's result tokens.
        located: ``(B,)`` bool, rows with a located mistake.
        shape: ``pinpoint``: Bi-Level weights from importance 1 on the mistake's result tokens
            (:func:`oar.credit.reshape.reshaped_credit`; options the sequence advantage's and the
            reshaping's); ``suffix``: the tokens before the mistake's result get weight 0, those from
            it to the end ``L / L_suffix`` with ``preserve_mass`` (else 1). Both score only rows below
            their group's mean (``A_i < 0``) with a located mistake; the others keep GRPO's credit.
        stats: more statistics for the result (``parsed_fraction``, ``located_fraction``,
            ``scored_fraction`` are added; ``spared_fraction`` for ``suffix``).
    """
    t0 = time.perf_counter()
    B = max(batch.response_ids.shape[0], 1)
    base = {**(stats or {}), "parsed_fraction": float(labels.parsed.sum()) / B,
            "located_fraction": float(located.sum()) / B}
    if shape == "pinpoint":
        def scores_of(A: torch.Tensor):
            a = A.detach().cpu()
            active = (first_mistake.sum(-1) > 0) & located & (a < 0)
            dev = batch.response_mask.device
            out = {"importance_s": time.perf_counter() - t0 + base.pop("importance_s", 0.0), **base,
                   "scored_fraction": float(active.sum()) / B}
            return first_mistake.to(dev), labels.reasoning.to(dev), active.to(dev), out

        return reshaped_credit(name, batch, options, _ORACLE_OPTIONS, scores_of)
    check_options(name, options, SEQ_OPTIONS + ("preserve_mass",))
    A = sequence_advantages(batch, options)
    m = batch.response_mask.to(torch.float32)
    dev, T = m.device, m.shape[1]
    start = torch.where(first_mistake.to(dev) > 0, torch.arange(T, device=dev), T).amin(-1)
    active = located.to(dev) & (A.to(dev) < 0) & (start < T)
    suffix = (torch.arange(T, device=dev)[None, :] >= start[:, None]).to(m.dtype) * m
    lengths, kept = m.sum(-1), suffix.sum(-1)
    scale = lengths / kept.clamp(min=1.0) if bool(options.get("preserve_mass", True)) else torch.ones_like(lengths)
    weights = torch.where(active[:, None], suffix * scale[:, None], m)
    token_adv = broadcast_seq(A.to(torch.float32), batch.response_mask) * weights
    spared = ((lengths - kept) / lengths.clamp(min=1.0))[active]
    return CreditResult(token_advantages=token_adv, seq_advantages=A, weights=weights,
                        stats={"importance_s": time.perf_counter() - t0 + base.pop("importance_s", 0.0), **base,
                               "scored_fraction": float(active.sum()) / B,
                               "spared_fraction": float(spared.mean()) if len(spared) else 0.0})


def oracle_importance(batch: CreditBatch, *, localisation: float = 1.0, rows: torch.Tensor | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, OracleLabels, torch.Tensor]:
    """``oracle_first_mistake``'s importance: 1 on the result tokens of each response's located first
    mistake; with ``localisation`` below 1, moved to another step of the response in a share
    ``1 - localisation`` of the located rows among ``rows`` (``(B,)`` bool, default every row;
    :func:`relocate_mistakes`, drawn from the run's seed and step: ``options`` may set ``seed``).

    Returns:
        ``(importance (B, T) float, labels, moved (B,) bool)``.
    """
    labels = oracle_labels(batch, name="oracle_first_mistake")
    if localisation >= 1.0:
        return labels.first_mistake, labels, torch.zeros(labels.located.shape, dtype=torch.bool)
    rows = labels.located if rows is None else labels.located & rows
    target, moved = relocate_mistakes(labels, rows, localisation, seeded_generator(batch, dict(options or {}), _RELOCATE_SALT))
    return target, labels, moved


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
    t0 = time.perf_counter()
    A = sequence_advantages(batch, {k: v for k, v in options.items() if k in SEQ_OPTIONS}).detach().cpu()
    target, labels, moved = oracle_importance(batch, localisation=localisation, rows=A < 0, options=options)
    stats = {"importance_s": time.perf_counter() - t0}
    if localisation < 1.0:
        stats["relocated_fraction"] = float(moved.sum()) / max(len(A), 1)
    return first_mistake_credit("oracle_first_mistake", batch, options, labels=labels, first_mistake=target,
                                located=labels.located, shape="pinpoint", stats=stats)


@register_estimator("oracle_decisive")
def oracle_decisive_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Oracle control: Bi-Level weights from importance 1 on every step's result tokens.

    Options as ``oracle_first_mistake``. Rows scored: parsed responses with ``A_i != 0``.
    """
    return reshaped_credit("oracle_decisive", batch, options, _ORACLE_OPTIONS, _decisive_scores(batch))


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
    spread uniformly from the first mistake on (:func:`first_mistake_credit`, shape ``suffix``).

    In a response below its group's mean (``A_i < 0``) with a located first mistake, the tokens before
    the mistake's result get weight 0 and the tokens from it to the end weight ``L / L_suffix`` with
    ``preserve_mass`` (the response's total penalty kept), else 1. Every other row keeps GRPO's
    uniform credit. Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``preserve_mass`` (True).
    Stats: ``parsed_fraction``, ``located_fraction``, ``scored_fraction``, ``spared_fraction`` (the
    share of a scored response's tokens spared, averaged), ``importance_s``.
    """
    t0 = time.perf_counter()
    labels = oracle_labels(batch, name="oracle_suffix")
    return first_mistake_credit("oracle_suffix", batch, options, labels=labels, first_mistake=labels.first_mistake,
                                located=labels.located, shape="suffix",
                                stats={"importance_s": time.perf_counter() - t0})


def seeded_generator(batch: CreditBatch, options: dict[str, Any], salt: int) -> torch.Generator:
    """A control's random stream: the run's seed (or the ``seed`` option), the step and ``salt``."""
    from oar.credit.importance import mix_seed

    seed = int(options.get("seed", batch.seed or 0))
    return torch.Generator().manual_seed(mix_seed(mix_seed(seed, int(batch.step or 0)), salt))
