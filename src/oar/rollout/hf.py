"""``rollout.engine: hf``: :class:`HFEngine`, batched sampling from the policy module itself (transformers'
``generate`` or the lean samplers of :mod:`oar.rollout.lean`).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from oar.rollout.base import (
    Rollout,
    WeightStream,
    prompt_add_special_tokens,
    response_mask_from_ids,
    token_logprobs,
)
from oar.rollout.lean import lean_generate, lean_unsupported

__all__ = ["HFEngine", "SAMPLERS", "hf_generate_kwargs", "prompt_heads"]

#: the samplers of :class:`HFEngine` (config ``rollout.sampler``)
SAMPLERS = ("hf", "lean", "lean_compact")


def hf_generate_kwargs(*, greedy: bool, temperature: float, top_p: float) -> dict[str, Any]:
    """The decoding arguments :class:`HFEngine` passes to ``generate`` (and that :func:`lean_generate` replicates)."""
    if greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)


def prompt_heads(tokenizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefixes: Sequence[str], *,
                 add_special_tokens: bool) -> torch.Tensor:
    """How many leading real tokens of each left-padded prompt (``(B, P)`` ids and mask) are its
    ``prefixes[i]``'s tokens: ``(B,)`` long, the whole prompt where the prompt's tokens do not start
    with the prefix's own (a tokenizer that merges across the cut), so a head is always exact."""
    lengths = attention_mask.long().sum(1).tolist()
    distinct = sorted(set(prefixes))
    enc = tokenizer(distinct, add_special_tokens=add_special_tokens)["input_ids"]
    own = dict(zip(distinct, enc))
    P = input_ids.shape[1]
    heads = []
    for i, (prefix, n) in enumerate(zip(prefixes, lengths, strict=True)):
        ids = own[prefix]
        real = input_ids[i, P - n : P - n + len(ids)].tolist()
        heads.append(len(ids) if 0 < len(ids) <= n and real == ids else n)
    return torch.tensor(heads, dtype=torch.long)


class HFEngine:
    """Rollouts sampled from the policy itself (no copy of the weights), with ``transformers``.

    Args:
        model: the policy (``PreTrainedModel``); generation runs in eval mode and restores the mode.
        tokenizer: its tokenizer (left padding is enforced).
        batch_size: sequences per ``generate`` call.
        sampler: ``lean`` (default): :func:`lean_generate`, the same tokens and log-probs as
            ``generate`` for a seed with less per-token overhead; ``lean_compact``: the same loop
            with one prompt forward per distinct prompt (or per distinct ``shared_prefix``) and
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
            raise ValueError("tokenizer has no pad token; oar.models.loading.load_policy sets one")
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

    def close(self) -> None:
        """Nothing to release: the engine samples from the policy module itself."""

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
        shared_prefix: Sequence[str] | None = None,
    ) -> Rollout:
        """Sample ``n`` responses for each prompt (``greedy``: one deterministic response each, n ignored).

        ``shared_prefix``: per prompt, a leading part of it that other prompts of the call share (a
        Monte-Carlo state's rendered prompt before its response prefix). The ``lean_compact`` sampler
        then runs each distinct prefix's forward once (:func:`prompt_heads`); the other samplers
        ignore it. The prompts are tokenized whole either way."""
        if seed is not None:
            torch.manual_seed(seed)
        n_eff = 1 if greedy else n
        tok = self.tokenizer
        tok.padding_side = "left"
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        parts = []
        compact = self.sampler == "lean_compact"
        try:
            order = [i for i in range(len(prompts)) for _ in range(n_eff)]
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                batch_prompts = [prompts[i] for i in idx]
                special = prompt_add_special_tokens(tok, batch_prompts)
                enc = tok(batch_prompts, return_tensors="pt", padding=True,
                          add_special_tokens=special)
                input_ids = enc["input_ids"].to(device)
                attn = enc["attention_mask"].to(device)
                heads = None
                if compact and shared_prefix is not None:
                    heads = prompt_heads(tok, input_ids.cpu(), attn.cpu(), [shared_prefix[i] for i in idx],
                                         add_special_tokens=special).to(device)
                if self.sampler != "hf":
                    resp, lp = lean_generate(self.model, input_ids, attn, max_new_tokens=max_new_tokens,
                                             eos_ids=self.eos_ids, pad_id=self.pad_id, greedy=greedy,
                                             temperature=temperature, top_p=top_p, compact=compact, head_len=heads)
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
            # the trainer gathers a sharded policy for the rollout (oar.trainer.strategy.local_phase),
            # so processes need not step together (transformers would for an FSDP module)
            synced_gpus=False,
            **hf_generate_kwargs(greedy=greedy, temperature=temperature, top_p=top_p),
        )
        resp = out.sequences[:, input_ids.shape[1] :]
        if resp.shape[1] == 0:
            return resp, torch.zeros(resp.shape, device=resp.device)
        logits = torch.stack(out.logits, dim=1)  # (b, T, V) raw logits
        return resp, token_logprobs(logits, resp, 1.0 if greedy else temperature)
