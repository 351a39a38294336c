"""Reports: tables against hand computation on a hand-made results tree, the paired bootstrap
(coverage of a known difference, determinism), efficiency ratios, figures and missing-file errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from oar.config import validate_config
from oar.report import ReportError, build_report, efficiency_table, main_table, paired_bootstrap

# per-problem greedy correctness: row -> seed -> benchmark -> list over problems p0, p1, ...
GREEDY = {
    "base": {None: {"synthetic-test": [0, 0, 1, 0], "synthetic-ood": [0, 1, 0]}},
    "grpo": {0: {"synthetic-test": [1, 0, 1, 0], "synthetic-ood": [0, 1, 0]},
             1: {"synthetic-test": [1, 1, 0, 0], "synthetic-ood": [1, 1, 0]}},
    "oar_g": {0: {"synthetic-test": [1, 1, 1, 0], "synthetic-ood": [1, 1, 0]},
              1: {"synthetic-test": [1, 1, 1, 1], "synthetic-ood": [1, 1, 1]}},
}
# step times (time_step per step) per method and seed; importance time is constant per step
STEP_TIMES = {"grpo": {0: [1.0, 3.0], 1: [2.0, 2.0]}, "oar_g": {0: [3.0, 5.0], 1: [4.0, 4.0]}}
IMPORTANCE = {"grpo": 0.0, "oar_g": 1.0}


def _config(tmp_path: Path) -> dict:
    cfg = {
        "name": "fake",
        "results_dir": str(tmp_path),
        "seeds": [0, 1],
        "model": {"source": "tiny"},
        "task": {"kind": "synthetic"},
        "recipes": {"grpo": {"norm_by_std": True}},
        "methods": {"grpo": {"recipe": "grpo", "credit": "none", "label": "GRPO"},
                    "oar_g": {"recipe": "grpo", "credit": "oar_g"}},
        "eval": {"benchmarks": [{"name": "synthetic-test", "n": 4}, {"name": "synthetic-ood", "n": 3}],
                 "samples": 2, "bootstrap": 500},
    }
    return validate_config(cfg)


def _write_eval(d: Path, per_bench: dict[str, list[int]]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    summary = {"benchmarks": {}, "average": {}}
    for bench, correct in per_bench.items():
        rows = []
        for i, c in enumerate(correct):
            pid = f"{bench}-{i}"
            rows.append({"id": pid, "question": "q", "response": "r", "extracted": "1", "gold": "1",
                         "correct": bool(c), "sample": -1})
            # sampled answers disagree with the greedy ones: they must not enter pass@1
            rows += [{"id": pid, "question": "q", "response": "r", "extracted": "2", "gold": "1",
                      "correct": not bool(c), "sample": k} for k in range(2)]
        (d / f"{bench}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary["benchmarks"][bench] = {"n": len(correct), "pass@1": float(np.mean(correct)),
                                        "avg@k": 1.0 - float(np.mean(correct)), "k": 2}
    (d / "summary.json").write_text(json.dumps(summary))


def _write_metrics(d: Path, times: list[float], importance: float, method_rank: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for step, t in enumerate(times):
        rows.append({"step": step, "reward": 0.1 * step + method_rank, "accuracy": 0.2 * step,
                     "ess_ratio": 1.0 - 0.1 * method_rank, "top10_mass": 0.1 + 0.05 * method_rank,
                     "time_rollout": 0.5, "time_reward": 0.25, "time_importance": importance,
                     "time_update": t - 0.75 - importance, "time_step": t})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "train_summary.json").write_text("{}")


@pytest.fixture
def tree(tmp_path):
    cfg = _config(tmp_path)
    root = tmp_path / "fake"
    for row, seeds in GREEDY.items():
        for seed, per_bench in seeds.items():
            _write_eval(root / "base" / "eval" if seed is None else root / row / f"seed{seed}" / "eval", per_bench)
    for rank, (m, per_seed) in enumerate(STEP_TIMES.items()):
        for seed, times in per_seed.items():
            _write_metrics(root / m / f"seed{seed}", times, IMPORTANCE[m], rank)
    return cfg, root


def _cell(df: pd.DataFrame, row: str, bench: str) -> pd.Series:
    sel = df[(df["row"] == row) & (df["benchmark"] == bench)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_main_table_matches_hand_computation(tree):
    cfg, root = tree
    df = main_table(cfg, root)
    assert list(dict.fromkeys(df["row"])) == ["base", "grpo", "oar_g"]
    assert list(dict.fromkeys(df["benchmark"])) == ["synthetic-test", "synthetic-ood", "Average"]
    # GRPO: test 50, 50 -> 50 ± 0; ood 33.3, 66.7 -> 50 ± 23.57; average per seed (41.67, 58.33)
    c = _cell(df, "grpo", "synthetic-test")
    assert c["mean"] == pytest.approx(50.0) and c["std"] == pytest.approx(0.0)
    c = _cell(df, "grpo", "synthetic-ood")
    assert c["mean"] == pytest.approx(50.0) and c["std"] == pytest.approx(math.sqrt(2) * 50 / 3)
    c = _cell(df, "grpo", "Average")
    assert c["mean"] == pytest.approx(50.0)
    assert c["std"] == pytest.approx(np.std([(50 + 100 / 3) / 2, (50 + 200 / 3) / 2], ddof=1))
    assert math.isnan(c["diff"]) and math.isnan(c["ci_low"])  # the reference has no difference
    assert c["label"] == "GRPO"
    # OAR-G: test 75, 100 -> 87.5 ± 17.68; difference from GRPO 37.5 points
    c = _cell(df, "oar_g", "synthetic-test")
    assert c["mean"] == pytest.approx(87.5) and c["std"] == pytest.approx(25 / math.sqrt(2))
    assert c["diff"] == pytest.approx(37.5)
    assert c["ci_low"] <= 37.5 <= c["ci_high"]
    assert c["per_seed"] == "75.0000;100.0000"
    c = _cell(df, "oar_g", "Average")
    # per-seed averages (75+66.7)/2, (100+100)/2 ; difference = mean of per-benchmark differences
    assert c["mean"] == pytest.approx(((75 + 200 / 3) / 2 + 100) / 2)
    assert c["diff"] == pytest.approx((37.5 + (200 / 3 + 100) / 2 - 50) / 2)
    # base: one evaluation (no std), paired with each GRPO seed: 25 - 50
    c = _cell(df, "base", "synthetic-test")
    assert c["mean"] == pytest.approx(25.0) and math.isnan(c["std"]) and c["n_seeds"] == 1
    assert c["diff"] == pytest.approx(-25.0)
    assert c["n_problems"] == 4 and _cell(df, "base", "Average")["n_problems"] == 7


def test_avg_at_k_metric_uses_sampled_answers(tree):
    cfg, root = tree
    df = main_table(cfg, root, metric="avg@k", n_boot=0)
    # the sampled answers are the complements of the greedy ones
    assert _cell(df, "grpo", "synthetic-test")["mean"] == pytest.approx(50.0)
    assert _cell(df, "oar_g", "synthetic-test")["mean"] == pytest.approx(12.5)
    assert _cell(df, "oar_g", "synthetic-test")["diff"] == pytest.approx(-37.5)


def test_build_report_writes_everything_deterministically(tree):
    cfg, root = tree
    out = build_report(cfg, root, seed=3)
    assert set(out) == {"main_csv", "main_md", "main_tex", "efficiency_csv", "training_curves", "credit_concentration"}
    for p in out.values():
        assert p.exists() and p.stat().st_size > 0
    for key in ("training_curves", "credit_concentration"):
        assert out[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = out["main_md"].read_text()
    assert "| OAR" not in md and "| oar_g | 87.5 ± 17.7 |" in md
    assert "| GRPO | 50.0 ± 0.0 | 50.0 ± 23.6 | 50.0 ± 11.8 |" in md
    assert "| Base | 25.0 | 33.3 | 29.2 |" in md
    assert "Difference from GRPO" in md
    tex = out["main_tex"].read_text()
    assert r"\begin{tabular}{lrrr}" in tex and r"oar\_g & 87.5 $\pm$ 17.7" in tex
    first = out["main_csv"].read_text()
    build_report(cfg, root, seed=3)
    assert out["main_csv"].read_text() == first
    a, b = main_table(cfg, root, seed=3), main_table(cfg, root, seed=4)
    assert a["diff"].equals(b["diff"])  # the point estimates do not depend on the seed ...
    assert not a["ci_low"].equals(b["ci_low"])  # ... the resamples do


def test_efficiency_table(tree):
    cfg, root = tree
    eff = efficiency_table(cfg, root, skip_steps=0).set_index("method")
    assert eff.loc["grpo", "time_step"] == pytest.approx(2.0)
    assert eff.loc["oar_g", "time_step"] == pytest.approx(4.0)
    assert eff.loc["grpo", "overhead"] == pytest.approx(1.0)
    assert eff.loc["oar_g", "overhead"] == pytest.approx(2.0)
    assert eff.loc["oar_g", "time_importance"] == pytest.approx(1.0)
    assert eff.loc["oar_g", "importance_share"] == pytest.approx(0.25)
    assert eff.loc["oar_g", "time_rollout"] == pytest.approx(0.5)
    assert eff.loc["grpo", "step_std"] == pytest.approx(0.0)
    assert eff.loc["grpo", "steps"] == 2 and eff.loc["grpo", "timed_steps"] == 2


def test_efficiency_table_skips_warmup_steps(tree):
    cfg, root = tree
    eff = efficiency_table(cfg, root).set_index("method")  # default: the first step is left out
    # grpo: last steps 3.0 (seed 0) and 2.0 (seed 1) -> 2.5; oar_g: 5.0 and 4.0 -> 4.5
    assert eff.loc["grpo", "time_step"] == pytest.approx(2.5)
    assert eff.loc["oar_g", "time_step"] == pytest.approx(4.5)
    assert eff.loc["oar_g", "overhead"] == pytest.approx(4.5 / 2.5)
    assert eff.loc["grpo", "step_std"] == pytest.approx(math.sqrt(0.5))
    assert eff.loc["grpo", "timed_steps"] == 1 and eff.loc["grpo", "steps"] == 2
    # a run with no more steps than skip_steps keeps them all
    assert efficiency_table(cfg, root, skip_steps=5).set_index("method").loc["grpo", "time_step"] == pytest.approx(2.0)


def test_missing_files_are_named(tree):
    cfg, root = tree
    gone = root / "oar_g" / "seed1" / "eval" / "synthetic-ood.jsonl"
    gone.unlink()
    (root / "grpo" / "seed0" / "metrics.jsonl").unlink()
    with pytest.raises(ReportError, match="oar_g/seed1/eval/synthetic-ood.jsonl"):
        build_report(cfg, root)
    with pytest.raises(ReportError, match="grpo/seed0/metrics.jsonl"):
        efficiency_table(cfg, root)


def test_summary_out_of_sync_is_an_error(tree):
    cfg, root = tree
    path = root / "grpo" / "seed1" / "eval" / "summary.json"
    s = json.loads(path.read_text())
    s["benchmarks"]["synthetic-test"]["pass@1"] = 0.75
    path.write_text(json.dumps(s))
    with pytest.raises(ValueError, match="out of sync"):
        main_table(cfg, root)


def test_different_problems_cannot_be_paired(tree):
    cfg, root = tree
    path = root / "oar_g" / "seed0" / "eval" / "synthetic-test.jsonl"
    path.write_text(path.read_text().replace("synthetic-test-3", "synthetic-test-9"))
    with pytest.raises(ValueError, match="problem ids differ"):
        main_table(cfg, root)


def test_bad_evaluation_rows_name_file_and_line(tree):
    cfg, root = tree
    path = root / "grpo" / "seed0" / "eval" / "synthetic-test.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + ["{not json"] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match=r"grpo/seed0/eval/synthetic-test.jsonl:2: malformed JSON"):
        main_table(cfg, root)
    path.write_text("\n".join(lines[:2] + ['{"correct": true, "sample": -1}'] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=r"synthetic-test.jsonl: row 3: bad evaluation row \(KeyError"):
        main_table(cfg, root)
    path.write_text("\n".join(lines + lines[:1]) + "\n")
    with pytest.raises(ValueError, match=rf"synthetic-test.jsonl: row {len(lines) + 1}: second greedy answer"):
        main_table(cfg, root)


def test_paired_bootstrap_hand_values_and_determinism():
    d = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    est, lo, hi = paired_bootstrap([d], n_boot=2000, seed=0)
    assert est == pytest.approx(0.5)
    # per-problem means (0.5, 0, 0.5, 1): the resampled mean lies in [0, 1]
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    assert paired_bootstrap([d], n_boot=2000, seed=0) == (est, lo, hi)
    assert paired_bootstrap([d], n_boot=0) == (est, pytest.approx(math.nan, nan_ok=True), pytest.approx(math.nan, nan_ok=True))
    with pytest.raises(ValueError, match="streams"):
        paired_bootstrap([d], streams=[0, 1])


def test_paired_bootstrap_width_matches_normal_theory_and_covers_truth():
    rng = np.random.default_rng(123)
    n, true = 2000, 0.10
    # paired outcomes: the method solves what GRPO solves, plus 10% of the rest... on average
    p_ref = rng.uniform(0.2, 0.8, size=n)
    ref = (rng.random((3, n)) < p_ref).astype(float)
    better = (rng.random((3, n)) < true / (1 - p_ref.mean())).astype(float)
    method = np.maximum(ref, better)
    d = method - ref
    est, lo, hi = paired_bootstrap([d], n_boot=4000, seed=7)
    se = d.mean(axis=0).std(ddof=1) / math.sqrt(n)
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert lo <= est <= hi
    assert lo < true < hi
    # two benchmarks: the statistic is the mean of per-benchmark means
    est2, lo2, hi2 = paired_bootstrap([d, np.zeros((3, 50))], n_boot=500, seed=7)
    assert est2 == pytest.approx(est / 2)
    assert lo2 < est2 < hi2


def test_paired_bootstrap_coverage_of_a_known_difference():
    """Over many simulated data sets the 95% interval covers the true mean difference ~95% of the time."""
    rng = np.random.default_rng(0)
    n, trials, covered = 200, 300, 0
    for t in range(trials):
        d = rng.choice([-1.0, 0.0, 1.0], p=[0.1, 0.7, 0.2], size=(2, n))  # true mean 0.1
        _, lo, hi = paired_bootstrap([d], n_boot=400, seed=t)
        covered += lo <= 0.1 <= hi
    assert 0.90 <= covered / trials <= 0.985
