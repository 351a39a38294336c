"""Rollout engines: sample ``n`` responses per prompt and return token ids with their log-probs.

Two engines behind one interface (:class:`RolloutEngine`):

- ``hf``: batched sampling from the policy module itself (KV cache, left-padded prompts, stop at eos
  or ``max_new_tokens``); the log-prob of each sampled token is taken from the step logits. Two
  samplers (``rollout.sampler``): ``hf``, transformers' ``model.generate``; ``lean`` (default),
  :func:`lean_generate`, a plain loop over the model's forward with a preallocated KV cache that
  makes the same forward calls and the same random draws, so its tokens and log-probs equal
  ``generate``'s for a seed, without ``generate``'s per-token bookkeeping and cache copies;
  ``lean_compact``, the same loop with one prompt forward per distinct prompt and dropping finished
  rows (deterministic, not bit-identical).
- ``vllm``: a colocated ``vllm.LLM``; the trainer streams the policy's full weights into it after
  every update (:meth:`VLLMEngine.sync_weights`), and may free its memory during the update
  (:meth:`VLLMEngine.sleep` / :meth:`VLLMEngine.wake_up`, ``rollout.sleep_mode``).

Per training step the trainer calls: ``generate`` (in :func:`engine_phase`) -> ``sleep`` -> update ->
:func:`refresh_engine` (``wake_up``, then ``sync_weights`` when ``engine.needs_weights``).

Log-probs are those of the sampling distribution before top-p truncation, i.e.
``log_softmax(logits / temperature)``, the same quantity the trainer recomputes for the ratio.

The package owns sampling and the rollout batch; every name is importable from ``oar.rollout``:

- :mod:`oar.rollout.base` -- :class:`Rollout`, the :class:`RolloutEngine` protocol, padding
  (:func:`pad_batch`: token lists to left-padded prompts and right-padded responses, shared with
  :mod:`oar.attribution`; :func:`pad_stack`), masks and log-probs, :func:`generate_per_prompt`.
- :mod:`oar.rollout.lean` -- :func:`lean_generate` and :func:`lean_unsupported` (the lean samplers).
- :mod:`oar.rollout.hf` -- :class:`HFEngine` (``rollout.engine: hf``).
- :mod:`oar.rollout.vllm` -- :class:`VLLMEngine` (``rollout.engine: vllm``; vLLM imported lazily).
- here -- :func:`make_engine`, the engine named in config.
"""

from __future__ import annotations

from typing import Any

from oar.rollout.base import (
    Rollout,
    RolloutEngine,
    WeightStream,
    engine_phase,
    generate_per_prompt,
    pad_batch,
    pad_stack,
    prompt_add_special_tokens,
    refresh_engine,
    response_mask_from_ids,
    token_logprobs,
)
from oar.rollout.hf import SAMPLERS, HFEngine, hf_generate_kwargs
# the private names too: tests import them from here
from oar.rollout.lean import COMPACT_BELOW, multinomial_rows, lean_generate, lean_unsupported  # noqa: F401
from oar.rollout.vllm import VLLMEngine, vllm_sleep_mode_available  # noqa: F401

__all__ = ["Rollout", "generate_per_prompt", "RolloutEngine", "HFEngine", "VLLMEngine", "make_engine", "pad_stack",
           "pad_batch", "token_logprobs", "lean_generate", "lean_unsupported", "SAMPLERS", "WeightStream",
           "response_mask_from_ids", "prompt_add_special_tokens", "hf_generate_kwargs", "COMPACT_BELOW",
           "engine_phase", "refresh_engine"]


def make_engine(name: str, model: Any, tokenizer: Any, *, batch_size: int = 256, model_path: str | None = None, seed: int = 0,
                vllm_kwargs: dict | None = None, sleep_mode: bool = False, sampler: str = "lean",
                colocated: bool = False) -> RolloutEngine:
    """Build the rollout engine named in config (``hf`` or ``vllm``).

    ``sleep_mode``: ``rollout.sleep_mode`` (vllm only); ``sampler``: ``rollout.sampler`` (hf only);
    ``colocated``: a training engine, one per training process and fed the policy's weights (vllm
    only: :class:`VLLMEngine`).
    """
    if name == "hf":
        return HFEngine(model, tokenizer, batch_size=batch_size, sampler=sampler)
    if name == "vllm":
        if model_path is None:
            raise ValueError("rollout.engine 'vllm' needs a checkpoint folder (model_path)")
        return VLLMEngine(model_path, tokenizer, seed=seed, sleep_mode=sleep_mode, colocated=colocated,
                          **(vllm_kwargs or {}))
    raise ValueError(f"rollout.engine: unknown engine {name!r}; valid: ['hf', 'vllm']")
