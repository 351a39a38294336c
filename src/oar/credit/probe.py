"""The OAR outcome probe (docs/methods.md, 4.1 The outcome probe).

Each response is split into ``reasoning`` (the response tokens strictly before the token that
starts its last ``\\boxed{`` marker) and ``answer`` (the tokens covering the content of that last
``\\boxed{...}``). The probe sequence is::

    prompt (real tokens only) + reasoning + conclude_ids + answer_ids

left-padded to a common length ``L``. OAR-P / OAR-G (:mod:`oar.credit.importance`) score the
reasoning positions of the probe by how much they move the model's distribution over its own
answer; :meth:`Probe.to_response` maps probe-aligned scores back to response positions.

Shapes: ``B`` responses, ``P`` prompt tokens (left-padded), ``T`` response tokens
(right-padded), ``L`` probe tokens (left-padded).

Rows without an extractable answer (no ``\\boxed{``, no closing brace, or empty content) are
kept, so that every tensor has ``B`` rows: ``has_answer`` is False, their probe row holds only the
prompt tokens, their reasoning/answer masks are all zero and ``last_index`` is -1. Importance
functions skip them and estimators give them weight 1 (plain GRPO).

Token/character alignment: the response's real tokens are decoded (special tokens kept, no
clean-up of spaces) and :func:`oar.reward.answer.last_boxed_span` locates the answer in the text. When
the single-token decodes concatenate to the full decode (character-level and most byte-level
BPE tokenizers on ASCII text) the character offsets come from their cumulative lengths;
otherwise (e.g. SentencePiece's leading-space handling, or multi-byte characters split over
tokens) from a binary search over lengths of decoded prefixes, ``len(decode(ids[:k]))``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from oar.reward.answer import BOXED_MARKERS, last_boxed_span

__all__ = ["DEFAULT_CONCLUDE", "Probe", "build_probe", "locate_answer_tokens"]

#: Default text appended after the reasoning that asks the model for its final answer.
DEFAULT_CONCLUDE = " Therefore, the final answer is \\boxed{"


@dataclass
class Probe:
    """Left-padded probe sequences ``prompt + reasoning + conclude + answer``.

    Attributes:
        input_ids: ``(B, L)`` long, probe tokens, left-padded with ``pad_token_id``.
        attention_mask: ``(B, L)`` long, 1 on real probe tokens.
        reasoning_mask: ``(B, L)`` bool, True on reasoning tokens (the ones that get scored).
        answer_mask: ``(B, L)`` bool, True on the answer tokens after ``conclude``.
        position_map: ``(B, L)`` long, index of the response token a probe position came from
            (reasoning and answer tokens), -1 elsewhere (padding, prompt, conclude).
        has_answer: ``(B,)`` bool, False for responses without an extractable answer.
        last_index: ``(B,)`` long, the last position of ``prompt + reasoning + conclude`` (the
            position whose next-token distribution predicts the first answer token); -1 for
            rows without an answer. Answer tokens always end at position ``L - 1``.
        pad_token_id: the tokenizer's pad id (the default neutral token of OAR-P).
        response_length: ``T`` of the responses the probe was built from.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    reasoning_mask: torch.Tensor
    answer_mask: torch.Tensor
    position_map: torch.Tensor
    has_answer: torch.Tensor
    last_index: torch.Tensor
    pad_token_id: int
    response_length: int

    @property
    def position_ids(self) -> torch.Tensor:
        """``(B, L)`` long position ids ``cumsum(attention_mask) - 1`` clamped at 0, so a row's
        result does not depend on how much left padding it got."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @property
    def answer_length(self) -> torch.Tensor:
        """``(B,)`` long number of answer tokens (0 for rows without an answer)."""
        return self.answer_mask.long().sum(-1)

    def to(self, device: torch.device | str) -> "Probe":
        """A copy with every tensor on ``device``."""
        return replace(
            self,
            **{
                k: getattr(self, k).to(device)
                for k in (
                    "input_ids",
                    "attention_mask",
                    "reasoning_mask",
                    "answer_mask",
                    "position_map",
                    "has_answer",
                    "last_index",
                )
            },
        )

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Probe":
        """The probe of a subset of rows (index or bool mask), with leading columns that are
        padding in every selected row dropped (``last_index`` shifted to match)."""
        idx = torch.as_tensor(rows, device=self.input_ids.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long()
        am = self.attention_mask[idx]
        if idx.numel() == 0 or not bool(am.any()):
            start = 0
        else:
            start = int(am.bool().any(0).long().argmax())
        last = self.last_index[idx]
        return replace(
            self,
            input_ids=self.input_ids[idx, start:],
            attention_mask=am[:, start:],
            reasoning_mask=self.reasoning_mask[idx, start:],
            answer_mask=self.answer_mask[idx, start:],
            position_map=self.position_map[idx, start:],
            has_answer=self.has_answer[idx],
            last_index=torch.where(last >= 0, last - start, last),
        )

    def to_response(self, scores: torch.Tensor, T: int | None = None, *, fill: float = 0.0) -> torch.Tensor:
        """Scatter probe-aligned values back to response positions.

        Args:
            scores: ``(B, L)`` values aligned with the probe (e.g. importance scores).
            T: response length (default: the ``T`` the probe was built from).
            fill: value at response positions no probe position maps to.

        Returns:
            ``(B, T)`` tensor in the dtype of ``scores``: ``out[b, position_map[b, j]] =
            scores[b, j]`` wherever ``position_map >= 0``.
        """
        if scores.shape != self.position_map.shape:
            raise ValueError(
                f"oar.credit.probe.Probe.to_response: scores shape {tuple(scores.shape)} != probe shape "
                f"{tuple(self.position_map.shape)}"
            )
        T = self.response_length if T is None else int(T)
        pm = self.position_map.to(scores.device)
        if pm.numel() and int(pm.max()) >= T:
            raise ValueError(f"oar.credit.probe.Probe.to_response: T={T} is shorter than the mapped positions")
        out = torch.full((scores.shape[0], T), fill, dtype=scores.dtype, device=scores.device)
        rows, cols = (pm >= 0).nonzero(as_tuple=True)
        out[rows, pm[rows, cols]] = scores[rows, cols]
        return out


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    def dec(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return dec


def _char_to_token_fn(
    ids: list[int], text: str, dec: Callable[[list[int]], str], piece_cache: dict[int, str]
) -> Callable[[int], int]:
    """Return ``f(c)`` = index of the token that contains character ``c`` of ``text``."""
    missing = [i for i in set(ids) if i not in piece_cache]
    for i in missing:
        piece_cache[i] = dec([i])
    pieces = [piece_cache[i] for i in ids]
    if "".join(pieces) == text:
        ends: list[int] = []
        total = 0
        for p in pieces:
            total += len(p)
            ends.append(total)
        return lambda c: min(bisect.bisect_right(ends, c), len(ids) - 1)

    # Fallback: binary search on the lengths of decoded prefixes (monotone for sane tokenizers).
    lengths: dict[int, int] = {0: 0, len(ids): len(text)}

    def prefix_len(k: int) -> int:
        if k not in lengths:
            lengths[k] = len(dec(ids[:k]))
        return lengths[k]

    def f(c: int) -> int:
        lo, hi = 1, len(ids)  # smallest k in [1, n] with prefix_len(k) > c
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix_len(mid) > c:
                hi = mid
            else:
                lo = mid + 1
        return lo - 1

    return f


def locate_answer_tokens(
    tokenizer: Any,
    ids: list[int],
    *,
    markers: tuple[str, ...] = BOXED_MARKERS,
    _piece_cache: dict[int, str] | None = None,
) -> tuple[int, int, int] | None:
    """Token positions of the last boxed answer of one response.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        ids: the response's real token ids (no padding).
        markers: answer markers, as :func:`oar.reward.answer.last_boxed_span`.

    Returns:
        ``(n_reasoning, answer_start, answer_end)``: reasoning is ``ids[:n_reasoning]`` (strictly
        before the token holding the first character of the marker), the answer is
        ``ids[answer_start:answer_end]`` (the tokens covering the boxed content); None when the
        response has no complete, non-empty boxed answer.
    """
    if not ids:
        return None
    dec = _decoder(tokenizer)
    text = dec(list(ids))
    span = last_boxed_span(text, markers)
    if span is None or span[1] <= span[0]:
        return None
    start, end = span
    mstart = None
    for m in markers:
        if start >= len(m) and text[start - len(m) : start] == m:
            mstart = start - len(m)
            break
    if mstart is None:  # cannot happen with last_boxed_span, kept as a guard
        return None
    tok = _char_to_token_fn(list(ids), text, dec, {} if _piece_cache is None else _piece_cache)
    n_reason = tok(mstart)
    a0 = tok(start)
    a1 = tok(end - 1) + 1
    if a1 <= a0:
        return None
    return n_reason, a0, a1


def _probe_rows(
    tokenizer: Any,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    pmask: torch.Tensor,
    rmask: torch.Tensor,
    conc: list[int],
    markers: tuple[str, ...],
) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int, int]], list[bool]]:
    """The unpadded probe row of each response (``(B, P)`` ``prompts`` and ``(B, T)`` ``responses``
    with their bool masks; ``conc``: the conclude ids).

    Returns:
        ``(ids, position_map, (n_prompt, n_reasoning, n_answer), has_answer)`` per row: the probe ids
        ``prompt + reasoning + conclude + answer`` (the real prompt tokens only for a row without an
        answer), the response position of each (-1 off the response), the lengths of its parts.
    """
    B = responses.shape[0]
    p_cpu, pm_cpu = prompts.detach().cpu(), pmask.cpu()
    r_cpu, rm_cpu = responses.detach().cpu(), rmask.cpu()
    cache: dict[int, str] = {}
    rows_ids: list[list[int]] = []
    rows_pmap: list[list[int]] = []
    rows_rlen: list[tuple[int, int, int]] = []  # (n_prompt, n_reasoning, n_answer)
    has = []
    for b in range(B):
        prompt = p_cpu[b][pm_cpu[b]].tolist()
        pos = rm_cpu[b].nonzero().flatten().tolist()
        ids = r_cpu[b, pos].tolist() if pos else []
        loc = locate_answer_tokens(tokenizer, ids, markers=markers, _piece_cache=cache)
        if loc is None:
            rows_ids.append(prompt)
            rows_pmap.append([-1] * len(prompt))
            rows_rlen.append((len(prompt), 0, 0))
            has.append(False)
            continue
        n_r, a0, a1 = loc
        seq = prompt + ids[:n_r] + conc + ids[a0:a1]
        pmap = [-1] * len(prompt) + pos[:n_r] + [-1] * len(conc) + pos[a0:a1]
        rows_ids.append(seq)
        rows_pmap.append(pmap)
        rows_rlen.append((len(prompt), n_r, a1 - a0))
        has.append(True)
    return rows_ids, rows_pmap, rows_rlen, has


def _left_pad_probe(
    rows_ids: list[list[int]],
    rows_pmap: list[list[int]],
    rows_rlen: list[tuple[int, int, int]],
    has: list[bool],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad the rows of :func:`_probe_rows` to ``L = max(length, 1)`` (on the CPU).

    Returns:
        ``(input_ids, attention_mask, reasoning_mask, answer_mask, position_map, last_index)``: the
        ``(B, L)`` tensors and the ``(B,)`` last index of :class:`Probe`.
    """
    B = len(rows_ids)
    L = max([len(s) for s in rows_ids] + [1])
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    reason = torch.zeros((B, L), dtype=torch.bool)
    answer = torch.zeros((B, L), dtype=torch.bool)
    pmap_t = torch.full((B, L), -1, dtype=torch.long)
    last = torch.full((B,), -1, dtype=torch.long)
    for b, (seq, pmap, (n_p, n_r, n_a)) in enumerate(zip(rows_ids, rows_pmap, rows_rlen)):
        off = L - len(seq)
        if seq:
            input_ids[b, off:] = torch.tensor(seq, dtype=torch.long)
            pmap_t[b, off:] = torch.tensor(pmap, dtype=torch.long)
            attn[b, off:] = 1
        reason[b, off + n_p : off + n_p + n_r] = True
        if has[b]:
            answer[b, L - n_a :] = True
            last[b] = L - n_a - 1
    return input_ids, attn, reason, answer, pmap_t, last


def _mask_or_pad(ids: torch.Tensor, mask: torch.Tensor | None, pad_id: int, name: str) -> torch.Tensor:
    if mask is None:
        return ids != pad_id
    if mask.shape != ids.shape:
        raise ValueError(f"oar.credit.probe.build_probe: {name} shape {tuple(mask.shape)} != ids shape {tuple(ids.shape)}")
    return mask.bool()


def build_probe(
    tokenizer: Any,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    *,
    conclude: str = DEFAULT_CONCLUDE,
    prompt_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    markers: tuple[str, ...] = BOXED_MARKERS,
) -> Probe:
    """Build the OAR outcome probe of a batch of responses.

    Args:
        tokenizer: the policy's Hugging Face tokenizer; needs a pad token.
        prompts: ``(B, P)`` long prompt ids, left-padded.
        responses: ``(B, T)`` long response ids, right-padded.
        conclude: text inserted between reasoning and answer (tokenized without special tokens).
        prompt_mask: ``(B, P)`` 1 on real prompt tokens; default ``prompts != pad_id``.
        response_mask: ``(B, T)`` 1 on real response tokens; default ``responses != pad_id``
            (pass the mask whenever pad equals eos, or eos would be dropped).
        markers: answer markers (default ``\\boxed{`` and ``\\fbox{``).

    Returns:
        a :class:`Probe` with ``B`` rows (rows without an answer included, see the module doc),
        on the device of ``responses``.
    """
    if prompts.dim() != 2 or responses.dim() != 2 or prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"oar.credit.probe.build_probe: need prompts (B, P) and responses (B, T), got "
            f"{tuple(prompts.shape)} and {tuple(responses.shape)}"
        )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("oar.credit.probe.build_probe: the tokenizer has no pad token (pad_token_id is None)")
    pad_id = int(pad_id)
    pmask = _mask_or_pad(prompts, prompt_mask, pad_id, "prompt_mask")
    rmask = _mask_or_pad(responses, response_mask, pad_id, "response_mask")
    conc = list(tokenizer(conclude, add_special_tokens=False)["input_ids"]) if conclude else []

    T = responses.shape[1]
    rows_ids, rows_pmap, rows_rlen, has = _probe_rows(tokenizer, prompts, responses, pmask, rmask, conc, markers)
    input_ids, attn, reason, answer, pmap_t, last = _left_pad_probe(rows_ids, rows_pmap, rows_rlen, has, pad_id)
    dev = responses.device
    return Probe(
        input_ids=input_ids.to(dev),
        attention_mask=attn.to(dev),
        reasoning_mask=reason.to(dev),
        answer_mask=answer.to(dev),
        position_map=pmap_t.to(dev),
        has_answer=torch.tensor(has, dtype=torch.bool, device=dev),
        last_index=last.to(dev),
        pad_token_id=pad_id,
        response_length=T,
    )
