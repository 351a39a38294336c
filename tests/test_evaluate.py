"""oar evaluate: per-sample rows, summaries, resumability."""

from __future__ import annotations

import json

import pytest

from oar.config.load import load_config
from oar.config.settings import EvalSettings, TrainSettings
from oar.evaluate.evaluation import evaluate_from_config, load_eval_benchmarks

from helpers import ROOT, small_overrides


def test_synthetic_benchmarks_are_fixed_by_task_seed(tmp_path):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))
    ev = EvalSettings.from_config(cfg)
    a, b = load_eval_benchmarks(cfg["task"], ev), load_eval_benchmarks(cfg["task"], ev)
    assert list(a) == ["synthetic-test", "synthetic-ood"]
    assert [r["question"] for r in a["synthetic-test"]] == [r["question"] for r in b["synthetic-test"]]
    assert len(a["synthetic-ood"]) == cfg["eval"]["benchmarks"][1]["n"]


@pytest.mark.slow
def test_evaluate_writes_rows_and_summary_and_resumes(tmp_path):
    over = small_overrides(tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 6}, {"name": "synthetic-ood", "n": 4}],
                                           "samples": 2, "max_new_tokens": 16})
    cfg = load_config(ROOT / "config" / "config.yaml", over)
    out = tmp_path / "eval"
    summary = evaluate_from_config(cfg, None, out)
    rows = [json.loads(l) for l in (out / "synthetic-test.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * (1 + 2)
    assert {r["sample"] for r in rows} == {-1, 0, 1}
    assert set(rows[0]) == {"id", "question", "response", "extracted", "gold", "correct", "sample"}
    greedy = [r for r in rows if r["sample"] == -1]
    assert summary["benchmarks"]["synthetic-test"]["pass@1"] == pytest.approx(sum(r["correct"] for r in greedy) / 6)
    assert set(summary["average"]) == {"pass@1", "avg@k", "pass@k"}
    assert set(summary) == {"model", "model_identity", "benchmarks", "average", "reward", "provenance"}
    assert summary["reward"] == {"timeouts": 0, "crashes": 0, "retried": 0, "marked": 0}
    on_disk = json.loads((out / "summary.json").read_text())["provenance"]
    assert on_disk == summary["provenance"] and on_disk["device"] == "cpu" and on_disk["end_time"] >= on_disk["start_time"]
    sampled = {}
    for r in rows:
        if r["sample"] >= 0:
            sampled.setdefault(r["id"], []).append(r["correct"])
    assert summary["benchmarks"]["synthetic-test"]["pass@k"] == pytest.approx(sum(map(any, sampled.values())) / 6)
    # resumable: a second call reuses finished benchmarks
    stamp = (out / "synthetic-ood.json").stat().st_mtime_ns
    evaluate_from_config(cfg, None, out)
    assert (out / "synthetic-ood.json").stat().st_mtime_ns == stamp
    # eval.sampler lean_compact is another setting (evaluated again, not reused), with the same answers here
    compact = load_config(ROOT / "config" / "config.yaml", {**over, "eval": {**over["eval"], "sampler": "lean_compact"}})
    evaluate_from_config(compact, None, out)
    assert (out / "synthetic-ood.json").stat().st_mtime_ns != stamp
    assert json.loads((out / "synthetic-ood.json").read_text())["settings"]["sampler"] == "lean_compact"
    again = [json.loads(l) for l in (out / "synthetic-test.jsonl").read_text().splitlines()]
    assert [r["response"] for r in again] == [r["response"] for r in rows]


def test_cli_evaluate_transfer_scores_the_transfer_benchmarks_only(tmp_path, capsys):
    """`oar evaluate --transfer`: eval.transfer.benchmarks with eval's settings, in their own folder; a
    config without them: one line and exit 2, nothing written."""
    import yaml

    from oar.cli import main

    transfer = {"benchmarks": [{"name": "synthetic-ood", "n": 3}], "methods": ["grpo"]}
    over = small_overrides(tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 2}], "samples": 0,
                                           "max_new_tokens": 8, "transfer": transfer})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(load_config(ROOT / "config" / "config.yaml", over)))
    out = tmp_path / "transfer"
    assert main(["evaluate", "--config", str(path), "--output", str(out), "--transfer"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["benchmarks"]) == ["synthetic-ood"] and summary["benchmarks"]["synthetic-ood"]["n"] == 3
    # and the lock file the evaluation held (oar.core.io.exclusive_lock; released with the process)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "summary.json", "synthetic-ood.json", "synthetic-ood.jsonl"]
    rows = [json.loads(l) for l in (out / "synthetic-ood.jsonl").read_text().splitlines()]
    assert [r["sample"] for r in rows] == [-1] * 3  # greedy only: eval.samples is 0
    capsys.readouterr()
    del over["eval"]["transfer"]
    path.write_text(yaml.safe_dump(load_config(ROOT / "config" / "config.yaml", over)))
    assert main(["evaluate", "--config", str(path), "--output", str(tmp_path / "none"), "--transfer"]) == 2
    assert capsys.readouterr().err == ("oar evaluate: error: eval.transfer.benchmarks: empty; name the transfer "
                                       "benchmarks to evaluate\n")
    assert not (tmp_path / "none").exists()


class _FakeEngine:
    """Answers problem i's sample j correctly when (i + j) % 3 == 0 (greedy: when i is even); records
    every call, so the chunking can be checked."""

    needs_weights = False

    def __init__(self, golds_by_prompt):
        self.golds, self.calls = golds_by_prompt, []

    def generate(self, prompts, *, n, greedy=False, seed=None, **kw):
        import torch

        from oar.rollout import Rollout

        self.calls.append({"prompts": len(prompts), "n": 1 if greedy else n, "seed": seed, "greedy": greedy})
        texts, index = [], []
        for p, prompt in enumerate(prompts):
            i = self.golds[prompt][1]
            for j in range(1 if greedy else n):
                ok = (i % 2 == 0) if greedy else ((i + j) % 3 == 0)
                texts.append(f"so \\boxed{{{self.golds[prompt][0] if ok else 'x'}}}" if ok or i % 4 != 1 else "no box")
                index.append(p)
        N = len(texts)
        return Rollout(prompt_ids=torch.zeros(N, 1, dtype=torch.long), prompt_mask=torch.ones(N, 1, dtype=torch.long),
                       response_ids=torch.zeros(N, 3, dtype=torch.long), response_mask=torch.ones(N, 3, dtype=torch.long),
                       logprobs=torch.zeros(N, 3), texts=texts, prompt_index=torch.tensor(index),
                       truncated=torch.zeros(N, dtype=torch.bool))


def test_evaluate_records_in_chunks_with_per_problem_counts():
    from oar.data.prompts import render_prompt
    from oar.evaluate.evaluation import evaluate_records
    from oar.models.tiny import build_tiny

    _, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    records = [{"id": f"p{i}", "question": f"{i} + 1", "answer": str(i + 1)} for i in range(10)]
    engine = _FakeEngine({render_prompt("tiny", r["question"], tok): (r["answer"], i) for i, r in enumerate(records)})
    summary, rows = evaluate_records(engine, tok, records, template="tiny", samples=8, chunk_size=24, seed=5, workers=1)
    # greedy: chunks of 24 problems -> one call; sampled: 24 // 8 = 3 problems a call -> 4 calls (3, 3, 3, 1)
    assert [c["prompts"] for c in engine.calls] == [10, 3, 3, 3, 1]
    assert [c["seed"] for c in engine.calls] == [5 * 1_000_003, *(5 * 1_000_003 + c for c in range(4))]
    assert len(rows) == 10 * 9 and {r["sample"] for r in rows} == {-1, *range(8)}
    # per problem i: samples j in 0..7 with (i + j) % 3 == 0: j = 0, 3, 6 (i % 3 == 0), j = 2, 5 (i % 3 == 1),
    # j = 1, 4, 7 (i % 3 == 2)
    counts = [sum(r["correct"] for r in rows if r["id"] == f"p{i}" and r["sample"] >= 0) for i in range(10)]
    assert counts == [2 if i % 3 == 1 else 3 for i in range(10)]
    assert summary["avg@k"] == pytest.approx(sum(counts) / 80)
    assert summary["pass@k"] == 1.0 and summary["k"] == 8
    assert summary["pass@1"] == pytest.approx(0.5)  # the even problems
    assert {"question", "response", "extracted"} <= set(rows[0])
    # the format check: problems 1, 5, 9 answer "no box" when wrong (greedy: always; sampled: 5 of 8 / 6 of 8)
    unboxed = [r for r in rows if r["extracted"] is None]
    assert {r["id"] for r in unboxed} == {"p1", "p5", "p9"} and not any(r["correct"] for r in unboxed)
    assert summary["answered"] == pytest.approx(1 - len(unboxed) / 90) and summary["answered"] < 0.9
    _, lean = evaluate_records(engine, tok, records, template="tiny", greedy=False, samples=2, chunk_size=1, workers=1,
                               keep_text=False)
    assert set(lean[0]) == {"id", "gold", "correct", "sample"}
    assert [c["prompts"] for c in engine.calls[5:]] == [1] * 10  # chunk_size 1: one problem per call at least
    with pytest.raises(ValueError, match="chunk_size"):
        evaluate_records(engine, tok, records, template="tiny", chunk_size=0)


def test_evaluate_records_counts_the_reward_checks_that_timed_out():
    """An answer whose check never ends (math-verify's comparison of 9^{9^{9^9}}): timed out, retried
    under twice the limit, timed out again, marked; counted in the summary's reward entry."""
    from oar.data.prompts import render_prompt
    from oar.evaluate.evaluation import evaluate_records
    from oar.models.tiny import build_tiny

    _, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    records = [{"id": f"p{i}", "question": f"{i} + 1", "answer": str(i + 1)} for i in range(4)]
    engine = _FakeEngine({render_prompt("tiny", r["question"], tok): (r["answer"], i) for i, r in enumerate(records)})
    real, first = engine.generate, render_prompt("tiny", records[0]["question"], tok)

    def generate(prompts, **kw):  # problem 0's answer is the pathological one
        ro = real(prompts, **kw)
        if prompts[0] == first:
            ro.texts[0] = "\\boxed{9^{9^{9^{9}}}}"
        return ro

    engine.generate = generate
    summary, rows = evaluate_records(engine, tok, records, template="tiny", samples=0, seed=5, workers=1, timeout_s=1.0)
    assert summary["reward"] == {"timeouts": 2, "crashes": 0, "retried": 1, "marked": 1}
    assert [r["correct"] for r in rows] == [False, False, True, False]
    clean, _ = evaluate_records(engine, tok, records[1:], template="tiny", samples=0, seed=5, workers=1, timeout_s=1.0)
    assert clean["reward"] == {"timeouts": 0, "crashes": 0, "retried": 0, "marked": 0}


def test_evaluation_summary_sums_the_reward_counts_and_warns_when_answers_were_marked(tmp_path, monkeypatch, capsys):
    import oar.reward.score as R

    real = R.score_batch

    def score_batch(texts, golds, *, stats=None, **kw):  # each chunk: one item timed out twice, marked
        out = real(texts, golds, stats=stats, **kw)
        stats.add(R.PoolStats(timeouts=2, retried=1, marked=1))
        return out

    monkeypatch.setattr(R, "score_batch", score_batch)
    over = small_overrides(tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 2}, {"name": "synthetic-ood", "n": 2}],
                                           "samples": 0, "max_new_tokens": 4})
    cfg = load_config(ROOT / "config" / "config.yaml", over)
    out = tmp_path / "eval"
    summary = evaluate_from_config(cfg, None, out, progress=False)
    assert summary["benchmarks"]["synthetic-test"]["reward"] == {"timeouts": 2, "crashes": 0, "retried": 1, "marked": 1}
    assert summary["reward"] == {"timeouts": 4, "crashes": 0, "retried": 2, "marked": 2}
    assert json.loads((out / "summary.json").read_text())["reward"] == summary["reward"]
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "warning" in line] == [
        f"oar evaluate: warning: 2 answer(s) scored wrong because their check timed out or crashed twice "
        f"(reward.timeout_s = {cfg['reward']['timeout_s']:g} s; a busy machine or a pathological answer); "
        f"counts in {out / 'summary.json'} under reward"]


def test_heldout_records_are_the_test_split_not_training(tmp_path):
    from oar.evaluate.heldout import heldout_records
    from oar.data.records import training_records

    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"heldout": {"every": 1, "size": 7}}))
    recs = heldout_records(TrainSettings.from_config(cfg).heldout, cfg["task"], cfg["eval"]["benchmarks"])
    assert len(recs) == 7 and all(r["id"].startswith("synthetic-test-") for r in recs)
    # problems of the final evaluation's synthetic-test, spread evenly over it (its head is easier)
    full = load_eval_benchmarks(cfg["task"], EvalSettings.from_config(cfg))["synthetic-test"]
    assert [r["question"] for r in recs] == [full[(i * len(full)) // 7]["question"] for i in range(7)]
    assert len(full) > 7 and recs[-1]["question"] != full[6]["question"]
    assert not {r["question"] for r in recs} & {r["question"] for r in training_records(cfg["task"])}
    cfg["train"]["heldout"]["benchmark"] = "math500"
    with pytest.raises(ValueError, match="not in eval.benchmarks"):
        heldout_records(TrainSettings.from_config(cfg).heldout, cfg["task"], cfg["eval"]["benchmarks"])


@pytest.mark.slow
def test_heldout_hook_logs_step0_every_k_and_last_and_resumes_without_duplicates(tmp_path):
    import torch
    from safetensors.torch import load_file

    from oar.trainer.loop import train
    from oar.trainer.step import EndAfter

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    over = dict(train={"steps": 5, "save_every": 2, "heldout": {"every": 2, "size": 6, "samples": 2}},
                eval={"max_new_tokens": 24})
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, **over))
    full = tmp_path / "full"
    train(cfg, "grpo", 0, full, progress=False)
    got = rows(full)
    held = [r for r in got if "heldout_acc" in r]
    assert [r["step"] for r in held] == [0, 2, 4, 5]  # the start model, every 2 updates, the last one
    assert all(0.0 <= r["heldout_acc"] <= 1.0 and r["heldout_seconds"] > 0 for r in held)
    step_time = {r["step"]: r["time_step"] for r in got if "time_step" in r}
    assert sorted(step_time) == [0, 1, 2, 3, 4]
    for r in held:  # training seconds: the summed step times of the updates done, evaluations excluded
        assert r["train_seconds"] == pytest.approx(sum(step_time[s] for s in range(r["step"])))
    summary = json.loads((full / "train_summary.json").read_text())
    assert summary["mean_time"]["step"] == pytest.approx(sum(step_time.values()) / 5)  # held-out rows not counted

    # interrupted after 3 steps (checkpoint at 2), resumed: one row per (kind, step), same accuracies
    part = tmp_path / "part"
    assert train(cfg, "grpo", 0, part, progress=False, observer=EndAfter(3)) == {"interrupted_at": 3}
    train(cfg, "grpo", 0, part, progress=False)
    held_part = [r for r in rows(part) if "heldout_acc" in r]
    assert [r["step"] for r in held_part] == [0, 2, 4, 5]
    assert [r["heldout_acc"] for r in held_part] == [r["heldout_acc"] for r in held]

    # the evaluation does not change training: the same weights as without it
    cfg_off = load_config(ROOT / "config" / "config.yaml",
                          small_overrides(tmp_path, **dict(over, train=dict(over["train"], heldout={"every": 0}))))
    off = tmp_path / "off"
    train(cfg_off, "grpo", 0, off, progress=False)
    assert not [r for r in rows(off) if "heldout_acc" in r]
    wa, wb = load_file(str(full / "model" / "model.safetensors")), load_file(str(off / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_evaluations_into_one_folder_the_second_stops_naming_the_first(tmp_path, capsys):
    """evaluate takes the trainer's lock (oar.core.io.exclusive_lock): a second one into the same folder
    exits 2 at once with one line naming the holder, and writes nothing."""
    import yaml

    from oar.cli import main
    from oar.core.io import exclusive_lock

    over = small_overrides(tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 2}], "samples": 0,
                                           "max_new_tokens": 8})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(load_config(ROOT / "config" / "config.yaml", over)))
    out = tmp_path / "eval"
    with exclusive_lock(out, purpose="oar evaluate the first one"):
        assert main(["evaluate", "--config", str(path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oar evaluate: error: {out} is in use by pid ") and "(oar evaluate the first one)" in err
    assert err.count("\n") == 1 and sorted(p.name for p in out.iterdir()) == [".lock"]
    assert main(["evaluate", "--config", str(path), "--output", str(out)]) == 0  # free again: it runs


def test_a_full_disk_while_evaluating_is_one_line_and_keeps_the_finished_benchmarks(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing the second benchmark's rows: one line naming the file (exit 2), the first
    benchmark's finished files kept; run again with space, it carries on (the first is not redone)."""
    import errno

    import yaml

    import oar.evaluate.evaluation as ev
    from oar.cli import main

    over = small_overrides(tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 2},
                                                          {"name": "synthetic-ood", "n": 2}],
                                           "samples": 0, "max_new_tokens": 8})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(load_config(ROOT / "config" / "config.yaml", over)))
    out = tmp_path / "eval"
    real = ev.atomic_write_jsonl

    def full(target, rows):
        if "synthetic-ood" in str(target):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return real(target, rows)

    monkeypatch.setattr(ev, "atomic_write_jsonl", full)
    assert main(["evaluate", "--config", str(path), "--output", str(out)]) == 2
    from helpers import one_error_line

    line = one_error_line(capsys.readouterr().err, "evaluate")  # besides the progress bars
    assert line == (f"oar evaluate: error: the disk is full (No space left on device) writing {out}/synthetic-ood.jsonl:"
                    " free space there and run the same command again (what it finished is kept; it carries on from "
                    "there)")
    stamp = (out / "synthetic-test.json").stat().st_mtime_ns
    monkeypatch.setattr(ev, "atomic_write_jsonl", real)
    assert main(["evaluate", "--config", str(path), "--output", str(out)]) == 0
    assert (out / "synthetic-test.json").stat().st_mtime_ns == stamp and (out / "summary.json").exists()
