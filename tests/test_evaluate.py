"""oar evaluate: per-sample rows, summaries, resumability."""

from __future__ import annotations

import json

import pytest

from oar.config import load_config
from oar.evaluate import evaluate_from_config, load_eval_benchmarks

from conftest import ROOT, small_overrides


def test_synthetic_benchmarks_are_fixed_by_task_seed(tmp_path):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))
    a, b = load_eval_benchmarks(cfg), load_eval_benchmarks(cfg)
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
    assert set(summary["average"]) == {"pass@1", "avg@k"}
    # resumable: a second call reuses finished benchmarks
    stamp = (out / "synthetic-ood.json").stat().st_mtime_ns
    evaluate_from_config(cfg, None, out)
    assert (out / "synthetic-ood.json").stat().st_mtime_ns == stamp
