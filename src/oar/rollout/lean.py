"""The ``lean`` samplers of :class:`oar.rollout.hf.HFEngine`: :func:`lean_generate`, a plain loop over
the model's forward with a preallocated KV cache that reproduces transformers' ``generate`` for a seed,
and :func:`lean_unsupported`, the generation-config settings it does not reproduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from oar.models.loading import cache_argument

__all__ = ["lean_generate", "lean_unsupported", "COMPACT_BELOW", "HeadTailLayout", "head_tail_layout"]


#: generation-config settings under which ``generate`` adds no logits processor and no stopping
#: criterion beyond what :func:`lean_generate` reproduces (temperature, top-p, eos, max length);
#: each maps to the predicate a neutral value satisfies
_LEAN_NEUTRAL = {
    "repetition_penalty": lambda v: v is None or v == 1.0,
    "no_repeat_ngram_size": lambda v: not v,
    "encoder_no_repeat_ngram_size": lambda v: not v,
    "encoder_repetition_penalty": lambda v: v is None or v == 1.0,
    "bad_words_ids": lambda v: v is None,
    "sequence_bias": lambda v: v is None,
    "min_length": lambda v: not v,
    "min_new_tokens": lambda v: not v,
    "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None,
    "suppress_tokens": lambda v: v is None,
    "begin_suppress_tokens": lambda v: v is None,
    "guidance_scale": lambda v: v is None or v == 1.0,
    "remove_invalid_values": lambda v: not v,
    "exponential_decay_length_penalty": lambda v: v is None,
    "renormalize_logits": lambda v: not v,
    "watermarking_config": lambda v: v is None,
    "max_time": lambda v: v is None,
    "stop_strings": lambda v: v is None,
    "cache_implementation": lambda v: v in (None, "dynamic"),
    "prefill_chunk_size": lambda v: v is None,
    "use_cache": lambda v: v is None or bool(v),
    "min_p": lambda v: v is None,
    "typical_p": lambda v: v is None or v >= 1.0,
    "epsilon_cutoff": lambda v: not v or not 0.0 < v < 1.0,
    "eta_cutoff": lambda v: not v or not 0.0 < v < 1.0,
    "top_h": lambda v: v is None,
    "num_beams": lambda v: v in (None, 1),
    "num_return_sequences": lambda v: v in (None, 1),
}


def lean_unsupported(model: Any) -> list[str]:
    """The settings of ``model.generation_config`` that :func:`lean_generate` does not reproduce.

    An empty list means ``generate`` (with the engine's arguments) would apply temperature and top-p
    only, which :func:`lean_generate` replicates; otherwise :class:`oar.rollout.hf.HFEngine` falls back
    to ``generate``. The settings the engine passes (``temperature``, ``top_p``, ``top_k``:
    :func:`oar.rollout.hf.hf_generate_kwargs`) are not checked here.
    """
    gc = getattr(model, "generation_config", None)
    bad = [k for k, ok in _LEAN_NEUTRAL.items() if gc is not None and not ok(getattr(gc, k, None))]
    if getattr(model.config, "is_encoder_decoder", False):
        bad.append("is_encoder_decoder")
    return bad


def _preallocated_cache(model: Any, capacity: int) -> Any:
    """A ``DynamicCache`` whose full-attention layers write into buffers of ``capacity`` positions.

    transformers' ``DynamicLayer`` grows its keys and values with ``torch.cat`` at every step (a copy of
    the whole cache, O(T^2) bytes over a response); :class:`_PreallocatedLayer` writes each step's
    keys and values in place and hands attention views of the filled prefix, the same values
    (``capacity``: prompt length + ``max_new_tokens``).
    Sliding-window and other layer types are kept as they are.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layer_cls = _preallocated_layer_class()
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    cache.layers = [layer_cls(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _preallocated_layer_class() -> type:
    """The class of :func:`_preallocated_cache`'s layers (defined on first use: transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class _PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` backed by ``(B, H, capacity, D)`` buffers; ``keys`` / ``values`` are views of the prefix."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                b, h, _, d = key_states.shape
                self._k = key_states.new_empty(b, h, self.capacity, d)
                self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
                self.device = key_states.device
                self.is_initialized = True
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"preallocated KV cache full ({self.capacity} positions)")
            self._k[:, :, self.length : end] = key_states
            self._v[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows ``indices`` (new buffers holding their filled prefix)."""
            if not self.is_initialized:
                return
            n = self.length
            for name in ("_k", "_v"):
                buf = getattr(self, name)
                new = buf.new_empty(len(indices), buf.shape[1], self.capacity, buf.shape[3])
                new[:, :, :n] = buf[indices, :, :n]
                setattr(self, name, new)
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    return _PreallocatedLayer


#: ``lean_compact``: drop finished rows once at most this fraction of the batch is unfinished (each
#: compaction copies the unfinished rows' KV cache, so it pays only when it removes a good share)
COMPACT_BELOW = 0.75


def lean_generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    compact: bool = False,
    head_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample continuations with a plain loop over ``model``'s forward and a preallocated KV cache.

    A replica of transformers' ``generate`` (``_sample``) for a decoder-only model without its
    per-token machinery: the forwards get the same arguments (position ids from the attention mask,
    the 2-D mask dropped when there is no padding, ``logits_to_keep=1``), the scores the same
    warpers (``scores / temperature``, ``TopPLogitsWarper``), and every row draws
    ``torch.multinomial(softmax(scores), 1)`` at every step from the global RNG, finished rows
    included (their token is then replaced by ``pad_id``), so the RNG stream and the tokens equal
    ``generate``'s. Greedy: ``argmax`` of the raw logits. The loop stops when every row has emitted
    one of ``eos_ids`` or after ``max_new_tokens`` steps.

    ``compact=True`` (``rollout.sampler: lean_compact``) runs the prompt forward once per distinct
    prompt (:func:`_prefill_shared`: a group's ``n`` copies share it; with ``head_len``, once per
    distinct head, then each row's tail) and drops finished rows from the batch (and their KV cache)
    once at most :data:`COMPACT_BELOW` of the rows in it are unfinished. The random draws stay the
    full batch's (:func:`multinomial_rows`), so the samples are a deterministic function of the seed
    and equal ``generate``'s as long as a row's logits do not depend on which other rows share its
    forward, which the matmul kernels do not promise (then, rarely, a token differs).

    Args:
        model: a decoder-only ``PreTrainedModel`` (or an FSDP-wrapped one, gathered) in eval mode.
        input_ids: ``(B, P)`` long, left-padded prompts.
        attention_mask: ``(B, P)`` long, 1 on real prompt tokens.
        head_len: ``compact`` only: ``(B,)`` long, how many leading real tokens of each row are a head
            that other rows share (a Monte-Carlo state's rendered prompt, before its response prefix):
            rows with equal heads share one forward of it; None: the whole prompt is the head.
    Returns:
        tokens ``(B, T)`` long (``pad_id`` after a row's eos) and their log-probs ``(B, T)`` float32
        under ``log_softmax(logits / temperature)`` (temperature 1 when greedy), as
        :func:`oar.rollout.base.token_logprobs` of the step logits (0 after a row's eos when
        compacting); ``T <= max_new_tokens`` is the step at which the last row stopped.
    """
    B = input_ids.shape[0]
    device = input_ids.device
    if max_new_tokens < 1:
        return input_ids.new_zeros(B, 0), torch.zeros(B, 0, dtype=torch.float32, device=device)
    temp, top_p_warper = _warpers(greedy, temperature, top_p)
    cache_arg = cache_argument(model)  # its name differs between transformers versions
    cache, logits, mask, step_pos = _prefill(model, cache_arg, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                             compact=compact, head_len=head_len, pad_id=pad_id)
    eos_t = torch.tensor(list(eos_ids), dtype=torch.long, device=device) if eos_ids else None
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    rows = torch.arange(B, device=device)  # the full-batch index of each row in the forward's batch
    unfinished = torch.ones(B, dtype=torch.bool, device=device)  # of the rows in the batch
    step_ids = input_ids
    T = max_new_tokens
    for t in range(max_new_tokens):
        if t > 0:
            logits = _last_logits(model, cache, cache_arg, step_ids, mask, step_pos)
        nxt, lp = _next_tokens(logits, step_ids, rows, B, greedy=greedy, temp=temp, top_p_warper=top_p_warper,
                               unfinished=unfinished if eos_t is not None else None, pad_id=pad_id)
        if len(rows) == B:
            tokens[:, t], logprobs[:, t] = nxt, lp
        else:
            tokens[rows, t], logprobs[rows, t] = nxt, lp
        if eos_t is not None:
            unfinished &= ~torch.isin(nxt, eos_t)
            n_left = int(unfinished.sum())
            if n_left == 0:
                T = t + 1
                break
        step_ids, step_pos, mask = nxt.unsqueeze(1), step_pos[:, -1:] + 1, _grow_mask(mask)
        if compact and eos_t is not None and n_left <= COMPACT_BELOW * len(rows):
            rows, unfinished, step_ids, step_pos, mask = _drop_finished(cache, rows, unfinished, step_ids, step_pos, mask)
    return tokens[:, :T], logprobs[:, :T]


def _prefill(model: Any, cache_arg: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
             max_new_tokens: int, compact: bool, head_len: torch.Tensor | None, pad_id: int,
             ) -> tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`lean_generate`'s prompt forward into a new preallocated cache (``compact``:
    :func:`_prefill_shared`; else one forward of the ``(B, P)`` prompts, as ``generate``).

    Returns:
        the cache, the ``(B, V)`` logits of each prompt's last token, the attention mask of the
        cache's positions (None: no padding) and the ``(B, L)`` positions whose last column is each
        prompt's last token's.
    """
    if compact:
        layout = head_tail_layout(input_ids, attention_mask, head_len, pad_id=pad_id)
        cache = _preallocated_cache(model, layout.length + max_new_tokens)
        return (cache, *_prefill_shared(model, cache, cache_arg, layout))
    pos, mask = _prompt_positions(attention_mask)
    cache = _preallocated_cache(model, input_ids.shape[1] + max_new_tokens)
    return cache, _last_logits(model, cache, cache_arg, input_ids, mask, pos), mask, pos


def _last_logits(model: Any, cache: Any, cache_arg: str, ids: torch.Tensor, mask: torch.Tensor | None,
                 pos: torch.Tensor) -> torch.Tensor:
    """One forward of :func:`lean_generate` (``(b, L)`` ids and positions, ``(b, L')`` mask or None,
    writing into ``cache``): the ``(b, V)`` float32 logits of the last position."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_arg: cache},
                use_cache=True, logits_to_keep=1, return_dict=True)
    return out.logits[:, -1].to(copy=True, dtype=torch.float32)


@dataclass(frozen=True)
class HeadTailLayout:
    """The prompts of :func:`lean_generate`'s compacting prefill, each cut into a head (shared by rows
    with equal heads) and a tail, both left-padded: row ``i``'s prompt is its head's real tokens, then
    its tail's.

    Attributes:
        head_ids, head_mask: ``(B, H)`` long.
        tail_ids, tail_mask: ``(B, S)`` long (``S`` is 0 when every head is the whole prompt).
        lengths: ``(B,)`` long, each prompt's number of real tokens.
    """

    head_ids: torch.Tensor
    head_mask: torch.Tensor
    tail_ids: torch.Tensor
    tail_mask: torch.Tensor
    lengths: torch.Tensor

    @property
    def length(self) -> int:
        """Positions of the cache the prompts fill (``H + S``)."""
        return self.head_ids.shape[1] + self.tail_ids.shape[1]


def head_tail_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, head_len: torch.Tensor | None, *,
                     pad_id: int) -> HeadTailLayout:
    """Cut left-padded prompts (``(B, P)`` ids and mask) into heads of ``head_len`` (``(B,)`` long,
    clamped to ``[1, length]``; None: the whole prompt) real tokens and tails of the rest, each
    left-padded with ``pad_id``.

    >>> ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 9]]); mask = (ids > 0).long()
    >>> lay = head_tail_layout(ids, mask, torch.tensor([2, 2]), pad_id=0)
    >>> lay.head_ids.tolist(), lay.tail_ids.tolist(), lay.tail_mask.tolist()
    ([[5, 6], [5, 6]], [[0, 7], [8, 9]], [[0, 1], [1, 1]])
    """
    P = input_ids.shape[1]
    lengths = attention_mask.long().sum(1)
    h = lengths if head_len is None else head_len.to(lengths).clamp(min=1).minimum(lengths)
    H, S = int(h.max()), int((lengths - h).max())
    j = torch.arange(H, device=input_ids.device)
    head_valid = j[None] >= (H - h)[:, None]
    src = ((P - lengths + h - H)[:, None] + j[None]).clamp(0, P - 1)  # the head's columns in input_ids
    head_ids = torch.where(head_valid, input_ids.gather(1, src), pad_id)
    k = torch.arange(S, device=input_ids.device)
    tail_valid = k[None] >= (S - (lengths - h))[:, None]  # a tail is the last length - h columns
    tail_ids = torch.where(tail_valid, input_ids[:, P - S:], pad_id)
    return HeadTailLayout(head_ids, head_valid.long(), tail_ids, tail_valid.long(), lengths)


def _prefill_shared(model: Any, cache: Any, cache_arg: str, layout: HeadTailLayout,
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``lean_compact``'s prompt forwards, writing into ``cache``: each distinct head (ids and mask) once
    (a group's ``n`` copies of its prompt are one forward row), every layer of ``cache`` expanded to all
    ``B`` rows, then one forward of the tails (a row whose tail is empty keeps its head's logits).

    The same values as one forward of the whole prompts up to the kernels' dependence on the batch
    size: positions count real tokens, and the mask hides the padding between a head and its tail.

    Returns:
        the ``(B, V)`` float32 logits of each prompt's last token, the ``(B, H + S)`` attention mask of
        the cache (None when there is no padding) and the ``(B, 1)`` position of each last token.
    """
    head_ids, head_mask = layout.head_ids, layout.head_mask
    head_pos, hmask = _prompt_positions(head_mask)
    _, expand = torch.unique(torch.cat([head_ids, head_mask], dim=1), dim=0, return_inverse=True)
    n_distinct = int(expand.max()) + 1
    if n_distinct == head_ids.shape[0]:
        logits = _last_logits(model, cache, cache_arg, head_ids, hmask, head_pos)
    else:
        # one row of each distinct head (its copies are equal, so which one does not matter)
        distinct = expand.new_zeros(n_distinct).scatter_(0, expand, torch.arange(len(expand), device=expand.device))
        logits = _last_logits(model, cache, cache_arg, head_ids[distinct],
                              hmask[distinct] if hmask is not None else None, head_pos[distinct])
        for layer in cache.layers:
            layer.batch_select_indices(expand)
        logits = logits[expand]
    if layout.tail_ids.shape[1] == 0:
        return logits, hmask, head_pos[:, -1:]
    full_pos, mask = _prompt_positions(torch.cat([head_mask, layout.tail_mask], dim=1))
    tail_logits = _last_logits(model, cache, cache_arg, layout.tail_ids, mask, full_pos[:, head_ids.shape[1]:])
    has_tail = layout.tail_mask[:, -1].bool()
    return torch.where(has_tail[:, None], tail_logits, logits), mask, (layout.lengths - 1)[:, None]


def _warpers(greedy: bool, temperature: float, top_p: float) -> tuple[float, Any]:
    """The temperature :func:`lean_generate` divides the logits by (1 when greedy) and its top-p
    warper (transformers' ``TopPLogitsWarper``; None when greedy or ``top_p >= 1``)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    temp = 1.0 if greedy else float(temperature)
    # TemperatureLogitsWarper is ``scores / temperature``, applied (by generate) only when temperature != 1
    top_p_warper = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1) if not greedy and top_p < 1.0 else None
    return temp, top_p_warper


def _grow_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The ``(b, L)`` attention mask with a column of ones for the step's new token (None stays None)."""
    if mask is None:
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)


def _prompt_positions(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As ``generate``: the ``(B, P)`` position ids of left-padded prompts from their attention mask
    (0 on padding), and the mask itself, or None when it is all ones (no padding)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    mask = None if bool((attention_mask == 1).all()) else attention_mask
    return position_ids, mask


def _next_tokens(
    logits: torch.Tensor,
    step_ids: torch.Tensor,
    rows: torch.Tensor,
    batch: int,
    *,
    greedy: bool,
    temp: float,
    top_p_warper: Any,
    unfinished: torch.Tensor | None,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's tokens of :func:`lean_generate` and their log-probs.

    Args:
        logits: ``(b, V)`` float32 last-position logits of the ``b`` rows in the forward's batch.
        step_ids: the forward's input ids (what the top-p warper is given, as in ``generate``).
        rows: ``(b,)`` long, each row's index in the full batch of ``batch`` rows (the random draws
            are the full batch's, :func:`multinomial_rows`, when ``b < batch``).
        greedy: ``argmax`` of the raw logits; else a draw from ``softmax`` of the warped scores
            (``logits / temp`` when ``temp != 1``, then ``top_p_warper`` when given).
        unfinished: ``(b,)`` bool; the tokens of finished rows are replaced by ``pad_id`` (None: no eos).

    Returns:
        ``(b,)`` long tokens and ``(b,)`` float32 log-probs under ``log_softmax(logits / temp)``.
    """
    scaled = logits / temp if temp != 1.0 else logits  # the warped scores, and what token_logprobs uses
    if greedy:
        nxt = torch.argmax(logits, dim=-1)
    else:
        scores = top_p_warper(step_ids, scaled) if top_p_warper is not None else scaled
        probs = torch.softmax(scores, dim=-1)
        if len(rows) == batch:
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            nxt = multinomial_rows(probs, rows, batch)
    if unfinished is not None:
        nxt = torch.where(unfinished, nxt, pad_id)
    lp = torch.gather(torch.log_softmax(scaled, dim=-1), -1, nxt.unsqueeze(-1)).squeeze(-1)
    return nxt, lp


def _drop_finished(
    cache: Any,
    rows: torch.Tensor,
    unfinished: torch.Tensor,
    step_ids: torch.Tensor,
    step_pos: torch.Tensor,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``lean_compact``: keep only the unfinished rows of the forward's batch (``(b,)`` ``rows`` and
    ``unfinished``, ``(b, 1)`` next input ids and positions, ``(b, L)`` mask or None) and of every
    layer of ``cache`` (in place); returns the first five, selected."""
    keep = unfinished.nonzero().squeeze(1)
    rows, unfinished, step_ids, step_pos = rows[keep], unfinished[keep], step_ids[keep], step_pos[keep]
    mask = mask[keep] if mask is not None else None
    for layer in cache.layers:
        layer.batch_select_indices(keep)
    return rows, unfinished, step_ids, step_pos, mask


def multinomial_rows(probs: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``torch.multinomial(full_probs, 1)[rows]`` for a batch of ``batch`` rows of which only ``rows`` are given.

    torch draws one sample as ``argmax(probs / q)`` with ``q = empty_like(probs).exponential_()``
    (``aten/src/ATen/native/Distributions.cpp``); drawing ``q`` for the full batch consumes the RNG
    as the full-batch call does, and the given rows get the samples they would get in it.

    Args:
        probs: ``(b, V)`` float, the probabilities of the rows ``rows`` (``(b,)`` long) of the batch.
    Returns:
        ``(b,)`` long.
    """
    q = torch.empty(batch, probs.shape[-1], dtype=probs.dtype, device=probs.device).exponential_(1)
    return torch.argmax(probs / q[rows], dim=-1)
