"""Ground truth read off a response of the synthetic task: the grammar parse, token character
spans and token labels (pivotal result digits vs filler words)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from oar.reward.answer import BOXED_MARKERS, last_boxed_span

__all__ = [
    "PIVOTAL",
    "FILLER",
    "UNLABELED",
    "ParsedResponse",
    "parse_response",
    "token_char_spans",
    "token_labels",
    "label_responses",
]

#: Label values of :func:`token_labels`.
PIVOTAL, FILLER, UNLABELED = 1, 0, -1

_STEP_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?)(\d+)")


@dataclass
class ParsedResponse:
    """Ground truth of one response that follows the task grammar.

    Attributes:
        pivotal_spans: ``[start, end)`` character spans of the digits of each step's result.
        filler_spans: ``[start, end)`` character spans of the filler words of each gap (one span per
            gap, inner spaces included).
        steps: ``(a, op, b, c)`` of each step as written (not checked for correct arithmetic).
        reasoning_end: character offset where the answer marker (``\\boxed{``) starts.
        answer: the boxed content.
        step_spans: ``[start, end)`` character span of each whole step ``a op b = c``.
        result_spans: ``[start, end)`` character span of each step's result, sign included.
        gap_fillers: the filler words of each gap (space-joined) (``len(steps)`` gaps: before every step after
            the first, and before the box), None where there is none; with ``steps`` it is what
            :func:`oar.data.synthetic.format_solution` renders back into the reasoning.
    """

    pivotal_spans: list[list[int]]
    filler_spans: list[list[int]]
    steps: list[tuple[int, str, int, int]]
    reasoning_end: int
    answer: str
    step_spans: list[list[int]] = field(default_factory=list)
    result_spans: list[list[int]] = field(default_factory=list)
    gap_fillers: list[str | None] = field(default_factory=list)


def _marker_start(text: str, content_start: int, markers: Sequence[str]) -> int | None:
    for m in markers:
        if content_start >= len(m) and text[content_start - len(m) : content_start] == m:
            return content_start - len(m)
    return None


def parse_response(
    text: str,
    *,
    fillers: Sequence[str],
    markers: tuple[str, ...] = BOXED_MARKERS,
) -> ParsedResponse | None:
    """Parse a response of the synthetic task and locate its pivotal and filler characters.

    Grammar of the reasoning (everything before the last answer marker), matched exactly::

        STEP ( ", " (FILLER " ")* STEP )* ". " (FILLER " ")*        STEP = a op b "=" ["-"] c

    with ``a`` an optionally negative integer, ``b`` and ``c`` non-negative digit strings, ``op`` in
    ``+ - *`` and ``FILLER`` one of ``fillers``. The boxed answer must be complete and non-empty;
    what follows its closing brace (e.g. an end-of-text token) is ignored. The arithmetic is not
    checked: a wrong intermediate result still decides the model's answer.

    Args:
        text: the decoded response.
        fillers: the task's filler words.
        markers: answer markers (as :func:`oar.reward.answer.last_boxed_span`).

    Returns:
        a :class:`ParsedResponse`, or None when the response has no answer or does not follow the
        grammar. For a reference solution of :func:`oar.data.synthetic.generate` the spans equal
        the record's ``result_spans`` and ``filler_spans``.
    """
    span = last_boxed_span(text, markers)
    if span is None or span[1] <= span[0] or not text[span[0] : span[1]].strip():
        return None
    end = _marker_start(text, span[0], markers)
    if end is None:
        return None
    return _parse_reasoning(text, end, text[span[0] : span[1]], _filler_regex(fillers))


def _filler_regex(fillers: Sequence[str]) -> re.Pattern[str] | None:
    """A gap's filler: one or more of the words ``fillers``, each followed by a space
    (task.synthetic.filler_words), longest words first; None without words."""
    words = sorted({str(f) for f in fillers}, key=len, reverse=True)
    return re.compile("(?:(?:" + "|".join(re.escape(w) for w in words) + ") )+") if words else None


def _parse_reasoning(text: str, end: int, answer: str, filler_re: re.Pattern[str] | None) -> ParsedResponse | None:
    """Match ``text[:end]`` (the reasoning before the answer marker) against the grammar of
    :func:`parse_response`, filler gaps matched by ``filler_re``; the :class:`ParsedResponse` with
    boxed content ``answer``, or None when it does not follow the grammar."""
    pivotal: list[list[int]] = []
    filler: list[list[int]] = []
    steps: list[tuple[int, str, int, int]] = []
    step_spans: list[list[int]] = []
    result_spans: list[list[int]] = []
    gap_fillers: list[str | None] = []
    pos = 0

    def take_step() -> bool:
        nonlocal pos
        m = _STEP_RE.match(text, pos, end)
        if m is None:
            return False
        pivotal.append([m.start(5), m.end(5)])
        step_spans.append([m.start(), m.end()])
        result_spans.append([m.start(4), m.end(5)])
        c = int(m.group(5))
        steps.append((int(m.group(1)), m.group(2), int(m.group(3)), -c if m.group(4) else c))
        pos = m.end()
        return True

    def take_filler() -> None:
        nonlocal pos
        m = None if filler_re is None else filler_re.match(text, pos, end)
        if m is not None:
            filler.append([m.start(), m.end() - 1])
            gap_fillers.append(text[m.start() : m.end() - 1])
            pos = m.end()
        else:
            gap_fillers.append(None)

    if not take_step():
        return None
    while True:
        if text.startswith(", ", pos) and pos + 2 <= end:
            pos += 2
            take_filler()
            if not take_step():
                return None
        elif text.startswith(". ", pos) and pos + 2 <= end:
            pos += 2
            take_filler()
            break
        else:
            return None
    if pos != end:
        return None
    return ParsedResponse(pivotal, filler, steps, end, answer, step_spans, result_spans, gap_fillers)


def token_char_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, np.ndarray, np.ndarray]:
    """Character span of every token of a decoded sequence.

    The text is ``tokenizer.decode(ids)`` with special tokens kept and no clean-up. When the
    single-token decodes concatenate to that text (character-level and byte-level BPE tokenizers
    on ASCII) the spans are their cumulative lengths; otherwise token ``k`` covers
    ``[len(decode(ids[:k])), len(decode(ids[:k+1])))`` (decoded prefixes; one decode per token).

    Args:
        tokenizer: a Hugging Face tokenizer.
        ids: ``(T,)`` token ids (no padding).

    Returns:
        ``(text, starts, ends)`` with ``(T,)`` int64 arrays; ``text[starts[k]:ends[k]]`` is token
        ``k``'s text (possibly empty).
    """
    ids = [int(i) for i in ids]

    def dec(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    text = dec(ids)
    pieces = [dec([i]) for i in ids]
    if "".join(pieces) == text:
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        ends = np.cumsum(lengths)
    else:
        ends = np.array([len(dec(ids[: k + 1])) for k in range(len(ids))], dtype=np.int64)
        ends = np.minimum(np.maximum.accumulate(ends), len(text)) if len(ends) else ends
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]]) if len(ends) else ends.copy()
    return text, starts, ends


def token_labels(
    starts: np.ndarray,
    ends: np.ndarray,
    pivotal_spans: Sequence[Sequence[int]],
    filler_spans: Sequence[Sequence[int]],
    n_chars: int,
) -> np.ndarray:
    """Label each token from character spans: 1 (pivotal), 0 (filler), -1 (neither).

    A token is pivotal when its characters overlap a pivotal span and no filler span, filler in
    the mirror case, unlabeled otherwise (including tokens that straddle both kinds).

    Args:
        starts, ends: ``(T,)`` character span of each token (:func:`token_char_spans`).
        pivotal_spans, filler_spans: ``[start, end)`` character spans.
        n_chars: length of the text.

    Returns:
        ``(T,)`` int64 labels.
    """

    def char_count(spans: Sequence[Sequence[int]]) -> np.ndarray:
        """``(n_chars + 1,)``: entry ``k`` = number of characters of ``text[:k]`` inside ``spans``."""
        diff = np.zeros(n_chars + 1, dtype=np.int64)
        for s, e in spans:
            diff[s] += 1
            diff[e] -= 1
        inside = np.cumsum(diff[:n_chars]) > 0
        return np.concatenate([[0], np.cumsum(inside)])

    cp = char_count(pivotal_spans)  # cp[k] = pivotal chars among text[:k]
    cf = char_count(filler_spans)
    st = np.asarray(starts, dtype=np.int64)
    en = np.asarray(ends, dtype=np.int64)
    piv = (cp[en] - cp[st]) > 0
    fil = (cf[en] - cf[st]) > 0
    out = np.full(st.shape, UNLABELED, dtype=np.int64)
    out[piv & ~fil] = PIVOTAL
    out[fil & ~piv] = FILLER
    return out


def label_responses(
    tokenizer: Any,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    fillers: Sequence[str],
    markers: tuple[str, ...] = BOXED_MARKERS,
) -> tuple[torch.Tensor, list[str]]:
    """Ground-truth token labels of a batch of right-padded responses.

    Args:
        tokenizer: the policy tokenizer.
        response_ids: ``(B, T)`` long.
        response_mask: ``(B, T)`` 1 on real response tokens.
        fillers: the task's filler words.
        markers: answer markers.

    Returns:
        ``labels`` ``(B, T)`` long (1 pivotal, 0 filler, -1 otherwise and in skipped rows) and a
        status per row: ``"ok"``, ``"no_answer"`` (no complete boxed answer) or ``"unparsed"``
        (an answer, but the reasoning does not follow the task grammar).
    """
    B, T = response_ids.shape
    labels = torch.full((B, T), UNLABELED, dtype=torch.long)
    status: list[str] = []
    ids_cpu, mask_cpu = response_ids.detach().cpu(), response_mask.detach().cpu().bool()
    for b in range(B):
        pos = mask_cpu[b].nonzero().flatten()
        ids = ids_cpu[b, pos].tolist()
        text, starts, ends = token_char_spans(tokenizer, ids)
        span = last_boxed_span(text, markers)
        if span is None or span[1] <= span[0] or not text[span[0] : span[1]].strip():
            status.append("no_answer")
            continue
        parsed = parse_response(text, fillers=fillers, markers=markers)
        if parsed is None:
            status.append("unparsed")
            continue
        lab = token_labels(starts, ends, parsed.pivotal_spans, parsed.filler_spans, len(text))
        labels[b, pos] = torch.from_numpy(lab)
        status.append("ok")
    return labels, status
