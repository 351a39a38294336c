"""The RL trainer: every method runs, resume equality, determinism, dynamic sampling, reference model."""

from __future__ import annotations

import json

import pytest
import torch

from oar.config.load import load_config
from oar.trainer.batch import dynamic_sampling_keep
from oar.trainer.loop import train
from oar.trainer.step import EndAfter
from oar.trainer.optim import make_scheduler
from oar.trainer.update import policy_forward

from helpers import ROOT, small_overrides


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _strip_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_") and not k.startswith("credit_importance")} for r in rows]


def test_dynamic_sampling_keep_filters_all_equal_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 1.0])
    groups = torch.tensor([5, 5, 7, 7, 9, 9, 2, 2])
    assert dynamic_sampling_keep(rewards, groups).tolist() == [False, False, True, True, False, False, True, True]


def test_scheduler_warmup_then_cosine():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sch = make_scheduler(opt, warmup_steps=2, floor_step=6, schedule="cosine")
    lrs = []
    for _ in range(6):
        lrs.append(sch.get_last_lr()[0])
        opt.step()
        sch.step()
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] < lrs[3] < lrs[2]


def test_policy_forward_matches_left_padding_invariance():
    from oar.models.tiny import build_tiny

    model, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model.eval()
    p1 = torch.tensor([[tok.pad_token_id, tok.pad_token_id, 10, 11]])
    m1 = torch.tensor([[0, 0, 1, 1]])
    p2 = torch.tensor([[10, 11]])
    m2 = torch.tensor([[1, 1]])
    r = torch.tensor([[12, 13, 14]])
    rm = torch.tensor([[1, 1, 0]])
    with torch.no_grad():
        a, ent = policy_forward(model, p1, m1, r, rm, with_entropy=True)
        b, _ = policy_forward(model, p2, m2, r, rm)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert a[0, 2] == 0 and ent[0, 2] == 0 and (ent[0, :2] > 0).all()


class _TextEngine:
    """A rollout engine that answers each prompt's ``n`` samples with fixed texts (``answers[prompt]``)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    def generate(self, prompts, *, n, seed, temperature, top_p, max_new_tokens):
        from oar.rollout import Rollout

        texts = [t for p in prompts for t in self.answers[p][:n]]
        N = len(texts)
        return Rollout(prompt_ids=torch.zeros(N, 1, dtype=torch.long), prompt_mask=torch.ones(N, 1, dtype=torch.long),
                       response_ids=torch.zeros(N, 3, dtype=torch.long), response_mask=torch.ones(N, 3, dtype=torch.long),
                       logprobs=torch.zeros(N, 3), texts=texts,
                       prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
                       truncated=torch.zeros(N, dtype=torch.bool))


def test_step_metrics_count_the_steps_reward_timeouts_and_crashes():
    """A step's metrics carry its reward checks that timed out, crashed and were marked (collect_batch's
    StepBatch.reward_stats, through score_batch's stats); a step without any shows zeros."""
    from oar.reward.pool import RewardPool
    from oar.trainer.batch import PromptStream, collect_batch
    from oar.credit import CreditResult
    from oar.config.settings import RolloutSettings
    from oar.trainer.step import step_metrics

    huge = "\\boxed{9^{9^{9^{9}}}}"  # math-verify's comparison never ends: timed out, retried, marked
    records = [{"answer": "5"}, {"answer": "7"}]
    engine = _TextEngine({"p0": ["\\boxed{5}", huge], "p1": ["\\boxed{7}", "\\boxed{8}"]})
    rollout = RolloutSettings.from_config(
        {"rollout": {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3, "batch_invariant": False}})
    recipe = {"correct": 1.0, "wrong": 0.0, "overlong_buffer": 0, "dynamic_sampling": False, "max_num_gen_batches": 1}
    upd = {k: [0.0] for k in ("entropy", "kl_ref", "approx_kl", "clipfrac", "loss", "pg_loss", "grad_norm")}
    upd.update(tokens_real=[1.0], tokens_computed=[1.0])

    def metrics(answers):
        engine.answers.update(answers)
        batch = collect_batch(engine, PromptStream(2, seed=0), ["p0", "p1"], records, prompts_per_step=2, rollout=rollout,
                              recipe=recipe,
                              seed=0, step=0, rank=0, world=1, local_prompts=2, pad_id=0,
                              timings={"rollout": 0.0, "reward": 0.0}, pool=pool)
        credit = CreditResult(token_advantages=torch.zeros(4, 3), seq_advantages=torch.zeros(4))
        return batch, step_metrics(batch, credit, upd, 0, lr=1.0, timings={}, step_seconds=0.0)

    pool = RewardPool(workers=1, timeout_s=1.0)  # the run's own, as setup_run makes it
    try:
        batch, m = metrics({})
        assert batch.rewards.sum() == 2.0
        assert (m["reward_timeouts"], m["reward_crashes"], m["reward_marked"]) == (2.0, 0.0, 1.0)
        assert batch.reward_stats.retried == 1
        _, m = metrics({"p0": ["\\boxed{5}", "\\boxed{6}"]})  # the next step: its own counts only
        assert (m["reward_timeouts"], m["reward_crashes"], m["reward_marked"]) == (0.0, 0.0, 0.0)
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "drgrpo", "dapo", "grpo_ktae", "dapo_ktae", "oar_p", "oar_p_tied", "oar_g",
                                    "oar_g_q50", "oar_g_nomass", "oar_g_ig", "dapo_oar_g"])
def test_every_method_runs_a_few_steps(tmp_path, method):
    # config/ablations.yaml: the default's six systems plus the ablations and combinations
    cfg = load_config(ROOT / "config" / "ablations.yaml", small_overrides(tmp_path, train={"steps": 2}))
    out = tmp_path / method
    summary = train(cfg, method, 0, out, progress=False)
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward", "accuracy", "response_length", "entropy", "clipfrac", "grad_norm", "ess_ratio",
                "top10_mass", "time_rollout", "time_reward", "time_importance", "time_update"):
        assert key in rows[-1], key
    assert (out / "model" / "model.safetensors").exists()
    assert summary["method"] == method and summary["steps"] == 2


@pytest.mark.slow
def test_resume_gives_identical_weights(tmp_path):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"steps": 4, "save_every": 2}))
    full = tmp_path / "full"
    train(cfg, "grpo", 3, full, progress=False)
    part = tmp_path / "part"
    # interrupted after step 3 (the checkpoint is at step 2): step 3 runs again on resume
    assert train(cfg, "grpo", 3, part, progress=False, observer=EndAfter(3)) == {"interrupted_at": 3}
    train(cfg, "grpo", 3, part, progress=False)
    wa, wb = _weights(full / "model"), _weights(part / "model")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _strip_times(_rows(full / "metrics.jsonl")) == _strip_times(_rows(part / "metrics.jsonl"))


@pytest.mark.slow
def test_same_seed_same_run_other_seed_differs(tmp_path):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"steps": 2}))
    train(cfg, "grpo", 1, tmp_path / "a", progress=False)
    train(cfg, "grpo", 1, tmp_path / "b", progress=False)
    train(cfg, "grpo", 2, tmp_path / "c", progress=False)
    ra, rb, rc = (_strip_times(_rows(tmp_path / x / "metrics.jsonl")) for x in "abc")
    assert ra == rb
    assert ra != rc
    wa, wb = _weights(tmp_path / "a" / "model"), _weights(tmp_path / "b" / "model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_reference_model_only_with_kl(tmp_path, monkeypatch):
    import oar.models.loading

    calls = []
    real = oar.models.loading.load_policy

    def counting(spec):
        calls.append(spec)
        return real(spec)

    monkeypatch.setattr(oar.models.loading, "load_policy", counting)
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"steps": 1}))
    train(cfg, "grpo", 0, tmp_path / "nokl", progress=False)
    assert len(calls) == 1
    calls.clear()
    cfg["methods"]["grpo_kl"] = {"base": "grpo", "kl_coef": 0.05}
    train(cfg, "grpo_kl", 0, tmp_path / "kl", progress=False)
    assert len(calls) == 2
    rows = _rows(tmp_path / "kl" / "metrics.jsonl")
    assert rows[0]["kl_ref"] >= 0.0


@pytest.mark.slow
def test_mlflow_run_logged(tmp_path):
    import mlflow

    over = small_overrides(tmp_path, train={"steps": 1}, tracking={"enabled": True})
    cfg = load_config(ROOT / "config" / "config.yaml", over)
    summary = train(cfg, "oar_g", 0, tmp_path / "run", progress=False)
    client = mlflow.tracking.MlflowClient(tracking_uri=cfg["tracking"]["uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["method"] == "oar_g" and run.data.params["credit"] == "oar_g"
    assert "ess_ratio" in run.data.metrics and "time_importance" in run.data.metrics
    tags = run.data.tags  # as every stage's run (oar.tracking.stage_runs), with the provenance of train_summary.json
    assert (tags["oar.stage"], tags["oar.method"], tags["oar.seed"], tags["oar.config"]) == ("train", "oar_g", "0", cfg["name"])
    prov = summary["provenance"]
    assert prov["end_time"] >= prov["start_time"] and prov["device"] == "cpu"
    assert tags["oar.provenance.start_time"] == prov["start_time"] and tags["oar.provenance.end_time"] == prov["end_time"]
    assert tags.get("oar.git_commit") == prov["git_commit"]
    # the resolved config beside the summary (the run's params are only what differs from the defaults)
    assert [f.path for f in client.list_artifacts(run.info.run_id)] == ["config.yaml", "train_summary.json"]
    assert len(run.data.params) < 80 and run.data.params["config.name"] == cfg["name"]
    # started again with nothing left to train (the workflow reruns the job when train.save_every
    # changes): the same train_summary.json byte for byte, so the evaluation's checksum holds
    before = (tmp_path / "run" / "train_summary.json").read_bytes()
    again = train(cfg, "oar_g", 0, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "train_summary.json").read_bytes() == before and again["provenance"] == prov
    rerun = client.get_run(summary["mlflow_run_id"])
    assert rerun.info.status == "FINISHED" and rerun.data.tags["oar.provenance.start_time"] == prov["start_time"]


@pytest.mark.slow
def test_nonfinite_losses_stop_with_checkpoint_intact(tmp_path, monkeypatch):
    import oar.trainer.loop as tr
    import oar.trainer.update

    cfg = load_config(ROOT / "config" / "config.yaml",
                      small_overrides(tmp_path, train={"steps": 6, "save_every": 1, "max_nonfinite": 2}))
    out = tmp_path / "run"
    train(cfg, "grpo", 0, out, progress=False, observer=EndAfter(1))
    before = _weights(out / "checkpoint")
    real = oar.trainer.update.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(oar.trainer.update, "policy_loss", nan_loss)
    with pytest.raises(tr.TrainingError, match="non-finite"):
        train(cfg, "grpo", 0, out, progress=False)
    after = _weights(out / "checkpoint")
    # checkpoints after the failure streak started contain the unchanged (skipped-update) weights
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows = _rows(out / "metrics.jsonl")
    assert rows[-1]["nonfinite_updates"] > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_on_two_cpu_processes(tmp_path):
    """The same command under torchrun with two CPU processes (DDP over gloo): each process samples
    its share. (`accelerate launch --cpu --num_processes 2` starts ONE process: it is not used.)"""
    import os
    import subprocess
    import sys

    import yaml

    from oar.config.source import deep_merge

    cfg = deep_merge(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()),
                     small_overrides(tmp_path, train={"steps": 2}))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "oar.cli",
           "train", "--config", str(path), "--method", "grpo", "--seed", "0", "--output", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]  # written once, by the main process
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert (out / "model" / "model.safetensors").exists()
    # without a progress bar (every workflow job) the log has a line per step, from the main process only
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("oar train: grpo seed 0: step ")]
    assert [ln.split(":")[2].split()[1] for ln in lines] == ["1/2", "2/2"], proc.stderr[-2000:]
    assert all(" reward " in ln and " accuracy " in ln and ln.endswith(" s/step") for ln in lines)
