"""One rank of the colocated-vLLM check (tests/test_vllm.py), run under ``torchrun --nproc_per_node N``::

    LD_PRELOAD=<venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1 \
        torchrun --nproc_per_node 2 tests/scripts/colocated_vllm.py <model dir> <output dir>

Each rank: joins the trainer's process group (gloo on CPU, nccl on CUDA), builds its own training
engine (:class:`oar.rollout.VLLMEngine` with ``colocated=True``: vLLM's ``external_launcher`` executor
with more than one rank), moves its own copy of the policy with a few AdamW steps on rank-specific
data (so the ranks' policies differ), syncs its engine with it and samples from it. It writes
``rank<r>.json``: vLLM's view of the worker (rank, local rank, device, executor), the log-prob gap
between its engine and its policy before and after the sync, and the log-probs its engine gives a
fixed sequence after the sync (so the test can show the two engines hold different weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PROMPTS = ["Compute 1+2.\n", "Compute 30-4+5.\n"]
FIXED = "Compute 7+8.\n"


def main(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar.rollout import VLLMEngine
    from oar.update import policy_forward

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = VLLMEngine(model_dir, tok, seed=0, colocated=True, enforce_eager=True, dtype="float32",
                        max_model_len=128)
    worker = engine.llm.llm_engine.model_executor.driver_worker.worker
    pc = engine.llm.llm_engine.vllm_config.parallel_config
    view = {"rank": int(worker.rank), "local_rank": int(worker.local_rank), "device": str(worker.device),
            "executor": pc.distributed_executor_backend, "vllm_world_size": int(pc.world_size),
            "engine_seed": engine.placement["seed"], "pid": os.getpid()}

    def gap() -> tuple[float, object]:
        ro = engine.generate(PROMPTS, n=4, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=rank)
        with torch.no_grad():
            lp, _ = policy_forward(model.eval(), ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        return float((lp - ro.logprobs)[ro.response_mask.bool()].abs().max()), ro

    start, ro = gap()
    # rank-specific updates: rank r fits its own sampled responses 3 + 2r times
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3 + 2 * rank):
        lp, _ = policy_forward(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        loss = -lp.sum() / ro.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    stale, _ = gap()
    engine.sync_weights(model)
    after, _ = gap()
    fixed = engine.generate([FIXED], n=1, greedy=True, max_new_tokens=8, seed=0)
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        **view, "world": world, "gap_start": start, "gap_stale": stale, "gap_after": after,
        "fixed_text": fixed.texts[0], "fixed_logprobs": fixed.logprobs[0][fixed.response_mask[0].bool()].tolist(),
        "policy_checksum": float(sum(p.double().sum() for p in model.parameters())),
    }))
    engine.close()  # ends vLLM's process groups and the default one, as at the end of oar train
    assert not dist.is_initialized()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
