"""The rollout batch and what every engine shares: the :class:`Rollout` dataclass, the
:class:`RolloutEngine` protocol, padding (:func:`pad_batch`, :func:`pad_stack`), response masks,
token log-probs, prompt encoding, and :func:`generate_per_prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch

__all__ = ["Rollout", "RolloutEngine", "WeightStream", "pad_stack", "pad_batch", "token_logprobs",
           "response_mask_from_ids", "prompt_add_special_tokens", "generate_per_prompt", "engine_phase",
           "refresh_engine"]


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


def pad_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, *, min_response_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists to a padded batch: prompts padded on the left, responses on the right (:class:`Rollout`'s layout).

    Args:
        prompts: ``B`` prompts' token ids (row ``b`` of the batch is ``prompts[b]``, ``responses[b]``).
        responses: ``B`` responses' token ids.
        pad_id: the id of padding positions.
        min_response_len: the least response width ``T`` (e.g. 1 for a batch whose responses may all be empty).
    Returns:
        ``prompt_ids``, ``prompt_mask``: ``(B, P)`` long, ``P`` the longest prompt, 1 in the mask on real tokens;
        ``response_ids``, ``response_mask``: ``(B, T)`` long, ``T`` the longest response (at least
        ``min_response_len``). ``P`` and ``T`` are 1 for an empty batch.
    """
    B = len(prompts)
    P = max((len(p) for p in prompts), default=1)
    T = max(max((len(r) for r in responses), default=1), min_response_len)
    p_ids = torch.full((B, P), pad_id, dtype=torch.long)
    p_mask = torch.zeros((B, P), dtype=torch.long)
    r_ids = torch.full((B, T), pad_id, dtype=torch.long)
    r_mask = torch.zeros((B, T), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p):
            p_ids[b, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            p_mask[b, P - len(p) :] = 1
        if len(r):
            r_ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            r_mask[b, : len(r)] = 1
    return p_ids, p_mask, r_ids, r_mask


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

    Yes, as in training (``oar.trainer.sft.build_sft_batch``), unless every prompt already starts with the
    BOS text because a chat template put it there.
    """
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and all(p.startswith(bos) for p in prompts))


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
        shared_prefix: Sequence[str] | None = None,
    ) -> Rollout:
        """``n`` responses per prompt; ``shared_prefix``: per prompt, a leading part other prompts of the
        call share, which an engine may compute once (a hint: the responses do not depend on it)."""
        ...

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

    def close(self) -> None:
        """Release the engine at the end of a run, while the trainer's process group still exists."""
        ...


WeightStream = Iterable[tuple[str, torch.Tensor]]


def weight_stream(weights: WeightStream | torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A lazy iterator of detached ``(name, tensor)`` pairs.

    A module is accepted too (its ``state_dict()``, by reference, no copy), for callers that hold the
    whole unsharded policy.
    """
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict().items()
    return ((name, t.detach()) for name, t in weights)


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


def engine_phase(engine: Any, strategy: Any, model: Any) -> Any:
    """Where ``engine.generate`` runs: nothing to gather for an engine with its own copy of the weights
    (vLLM), the policy's rank-local phase (:meth:`oar.trainer.strategy.Strategy.local_phase`: a sharded policy
    gathered) for one that samples from the policy module itself (HF)."""
    import contextlib

    return contextlib.nullcontext() if engine.needs_weights else strategy.local_phase(model)


def refresh_engine(engine: Any, strategy: Any, model: Any) -> None:
    """After a policy update (or a resume): wake the engine and load the policy's current weights
    into it (vLLM: streamed layer by layer); a no-op for the HF engine, which samples the policy itself."""
    engine.wake_up()
    if engine.needs_weights:
        engine.sync_weights(strategy.full_state(model))
