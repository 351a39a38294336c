"""Reports: tables against hand computation on a hand-made results tree, the paired bootstrap
(coverage of a known difference, determinism), efficiency ratios, figures and missing-file errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from oar.config.validate import validate_config
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
# held-out accuracy after 0, 1, 2 updates per method and seed
HELDOUT = {"grpo": {0: [0.2, 0.4, 0.6], 1: [0.2, 0.3, 0.5]}, "oar_g": {0: [0.2, 0.6, 0.8], 1: [0.2, 0.3, 0.35]}}
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


def _write_metrics(d: Path, times: list[float], importance: float, method_rank: int,
                   heldout: list[float] | None = None) -> None:
    """Training rows, and (``heldout``) a held-out row before each step and after the last, as
    oar.evaluate.heldout writes them: step = updates done, train_seconds = summed time_step so far."""
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    spent = 0.0
    for step, t in enumerate(times):
        if heldout is not None:
            rows.append({"step": step, "heldout_acc": heldout[step], "heldout_pass_at_k": 1.0,
                         "heldout_seconds": 9.0, "train_seconds": spent})
        rows.append({"step": step, "reward": 0.1 * step + method_rank, "accuracy": 0.2 * step,
                     "ess_ratio": 1.0 - 0.1 * method_rank, "top10_mass": 0.1 + 0.05 * method_rank,
                     "time_rollout": 0.5, "time_reward": 0.25, "time_importance": importance,
                     "time_update": t - 0.75 - importance, "time_step": t})
        spent += t
    if heldout is not None:
        rows.append({"step": len(times), "heldout_acc": heldout[len(times)], "heldout_pass_at_k": 1.0,
                     "heldout_seconds": 9.0, "train_seconds": spent})
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
            _write_metrics(root / m / f"seed{seed}", times, IMPORTANCE[m], rank, HELDOUT[m][seed])
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
    assert set(out) == {"main_csv", "main_md", "main_tex", "efficiency_csv", "training_curves", "credit_concentration",
                        "learning_curves", "steps_to_threshold_csv", "learning_speed_csv"}
    for p in out.values():
        assert p.exists() and p.stat().st_size > 0
    for key in ("training_curves", "credit_concentration", "learning_curves"):
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
    assert not a["problem_ci_low"].equals(b["problem_ci_low"])  # ... the problem resamples do
    assert a["ci_low"].equals(b["ci_low"])  # the seed-level interval is a t interval: no resampling


def _add_provenance(path: Path, prov: dict) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "provenance": prov}))


def test_main_md_footer_names_the_provenance_and_nothing_else_changes(tree):
    """Results without a provenance (written before it was recorded): main.md as before, no footer.
    With one: the same bytes and one more line naming commit, CPU, capability and torch, with the
    values that differ between results counted."""
    cfg, root = tree
    before = build_report(cfg, root, seed=3)["main_md"].read_text()
    assert "Provenance" not in before
    prov = {"git_commit": "0123456789abcdef", "git_dirty": False, "cpu_model": "CPU A", "cpu_capability": "AVX2",
            "versions": {"torch": "2.13.0"}}
    runs = [root / m / f"seed{s}" for m in ("grpo", "oar_g") for s in (0, 1)]
    for i, run in enumerate(runs):
        _add_provenance(run / "train_summary.json", dict(prov, git_dirty=i == 3))
        _add_provenance(run / "eval" / "summary.json", prov)
    after = build_report(cfg, root, seed=3)["main_md"].read_text()
    assert after.startswith(before) and after[len(before):].count("\n") == 2  # a blank line, the footer
    footer = after.splitlines()[-1]
    assert footer == ("Provenance of the 9 results summarised (4 training runs, 5 evaluations): 2 commits: "
                      "0123456789ab (clean) x 7, 0123456789ab (dirty) x 1; CPU CPU A; CPU capability AVX2; "
                      "torch 2.13.0; 1 of them without a recorded provenance.")


# the transfer benchmark (eval.transfer): greedy correctness of the start model and of grpo's seeds only
TRANSFER = {"base": {None: [0, 1, 0, 0, 1]}, "grpo": {0: [1, 1, 0, 0, 1], 1: [1, 1, 1, 0, 1]}}


def test_transfer_rows_are_reported_apart_with_no_claim(tree):
    """eval.transfer: tables/transfer.csv and a "Transfer (no claim)" section after everything main.md had
    (which stays as it was): the start model and the listed method only, the mean over seeds with its t
    interval over seeds, the number of problems, no difference, nothing bold."""
    cfg, root = tree
    before = build_report(cfg, root, seed=3)["main_md"].read_text()
    cfg["eval"]["transfer"] = {"benchmarks": [{"name": "gsm8k", "source": "gsm8k.jsonl"}], "methods": ["grpo"]}
    cfg = validate_config(cfg)
    for row, seeds in TRANSFER.items():
        for seed, correct in seeds.items():
            _write_eval(root / "base" / "transfer" if seed is None else root / row / f"seed{seed}" / "transfer",
                        {"gsm8k": correct})
    out = build_report(cfg, root, seed=3)
    df = pd.read_csv(out["transfer_csv"])
    assert list(dict.fromkeys(df["metric"])) == ["avg@k", "pass@1"] and set(df["row"]) == {"base", "grpo"}
    grpo = df[(df["row"] == "grpo") & (df["metric"] == "pass@1")].iloc[0]
    half = 12.706204736 * 10.0  # t_(1, 0.975) x sd(60, 80) / sqrt(2)
    assert (grpo["benchmark"], grpo["n_problems"], grpo["n_seeds"]) == ("gsm8k", 5, 2)
    six_digits = dict(rel=1e-5)  # the csv's %.6g
    assert grpo["mean"] == pytest.approx(70.0) and grpo["std"] == pytest.approx(math.sqrt(200), **six_digits)
    assert grpo["ci_low"] == pytest.approx(70.0 - half, **six_digits)
    assert grpo["ci_high"] == pytest.approx(70.0 + half, **six_digits)
    base = df[(df["row"] == "base") & (df["metric"] == "pass@1")].iloc[0]
    assert base["mean"] == pytest.approx(40.0) and math.isnan(base["ci_low"]) and base["n_seeds"] == 1
    md = out["main_md"].read_text()
    assert md.startswith(before)
    section = md[len(before):]
    assert "## Transfer (no claim)" in section and "**" not in section and "oar_g" not in section
    assert "| Method | gsm8k (n = 5) |" in section and "| Base | 40.0 |" in section
    assert f"| GRPO | 70.0 [{70 - half:.1f}, {70 + half:.1f}] |" in section
    assert "Difference" not in section
    (root / "grpo" / "seed1" / "transfer" / "gsm8k.jsonl").unlink()
    with pytest.raises(ReportError, match="grpo/seed1/transfer/gsm8k.jsonl"):
        build_report(cfg, root)


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


# ----------------------------------------------------------------- paired design: 3 seeds x 10 problems
# greedy correctness per seed; the method gains problems 5, 6 (seed 0), loses 3 (seed 1), gains 6, 7 (seed 2)
GRPO_3x10 = [[1, 1, 1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
METHOD_3x10 = [[1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
START_3x10 = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
# d = method - GRPO, averaged over seeds per problem: (0, 0, 0, -1/3, 0, 1/3, 2/3, 1/3, 0, 0), mean 0.1;
# sum of squares 7/9, so sd (ddof 1) = sqrt((7/9 - 10 * 0.1^2) / 9) and SE = sd / sqrt(10)
SE_3x10 = math.sqrt((7 / 9 - 10 * 0.1**2) / 9) / math.sqrt(10) * 100.0


@pytest.fixture
def tree3x10(tmp_path):
    cfg = validate_config({
        "name": "fake", "results_dir": str(tmp_path), "seeds": [0, 1, 2], "model": {"source": "tiny"},
        "task": {"kind": "synthetic"}, "recipes": {"grpo": {"norm_by_std": True}},
        "methods": {"grpo": {"recipe": "grpo", "credit": "none", "label": "GRPO"},
                    "oar_g": {"recipe": "grpo", "credit": "oar_g"}},
        "eval": {"benchmarks": [{"name": "synthetic-test", "n": 10}], "samples": 2, "bootstrap": 400},
    })
    root = tmp_path / "fake"
    _write_eval(root / "base" / "eval", {"synthetic-test": START_3x10})
    for s in range(3):
        _write_eval(root / "grpo" / f"seed{s}" / "eval", {"synthetic-test": GRPO_3x10[s]})
        _write_eval(root / "oar_g" / f"seed{s}" / "eval", {"synthetic-test": METHOD_3x10[s]})
        for m in ("grpo", "oar_g"):
            _write_metrics(root / m / f"seed{s}", [1.0, 1.0], 0.0, 0)  # no held-out rows
    return cfg, root


def test_paired_se_and_mde_hand_values():
    from oar.core.stats import mde, paired_se, per_seed_differences, z_power

    d = np.array(METHOD_3x10, float) - np.array(GRPO_3x10, float)
    assert paired_se([d]) * 100 == pytest.approx(SE_3x10)
    assert SE_3x10 == pytest.approx(8.678, abs=1e-3)
    assert z_power(0.05, 0.8) == pytest.approx(1.959964 + 0.841621, abs=1e-5)
    assert mde(SE_3x10) == pytest.approx(2.801585 * 8.67802, abs=1e-3)
    assert per_seed_differences(d).tolist() == pytest.approx([0.2, -0.1, 0.2])
    # two benchmarks: SE of the mean of their means
    assert paired_se([d, 2 * d]) == pytest.approx(math.sqrt(1 + 4) * SE_3x10 / 100 / 2)
    # the bootstrap interval has the normal-theory width: its SE is the plug-in sd(ddof 0) / sqrt(n)
    est, lo, hi = paired_bootstrap([d], n_boot=20000, seed=1)
    plug_in = SE_3x10 / 100 * math.sqrt(9 / 10)
    assert est == pytest.approx(0.1)
    assert (hi - lo) == pytest.approx(2 * 1.96 * plug_in, rel=0.12)


def test_main_table_paired_columns_and_mde_hand_values(tree3x10):
    cfg, root = tree3x10
    df = main_table(cfg, root, n_boot=400)
    c = _cell(df, "oar_g", "synthetic-test")
    assert c["mean"] == pytest.approx(60.0) and c["diff"] == pytest.approx(10.0)
    assert c["problem_se"] == pytest.approx(SE_3x10)
    assert c["problem_ci_low"] < 10.0 < c["problem_ci_high"]
    assert c["diff_per_seed"] == "20.0000;-10.0000;20.0000"
    # seed level: per-seed differences 20, -10, 20: sd sqrt(300), SE 10, t_(2, 0.975) = 4.302653
    assert c["sd_seed"] == pytest.approx(math.sqrt(300.0)) and c["se"] == pytest.approx(10.0)
    assert (c["ci_low"], c["ci_high"]) == (pytest.approx(10.0 - 43.02653, abs=1e-4), pytest.approx(10.0 + 43.02653, abs=1e-4))
    # against the start model (30%): 60 - 30, seeds 40, 0, 50: every problem-level interval excludes 0,
    # the seed-level one (sd sqrt(700)) does not
    assert c["start_diff"] == pytest.approx(30.0) and c["start_problem_ci_low"] > 0
    assert c["start_ci_low"] == pytest.approx(30.0 - 4.302653 * math.sqrt(700.0 / 3), abs=1e-4) and c["start_ci_low"] < 0
    g = _cell(df, "grpo", "synthetic-test")
    assert g["start_diff"] == pytest.approx(20.0) and math.isnan(g["diff"]) and g["diff_per_seed"] == ""
    # one method besides the reference: MDE = (t_(2, 0.975) + t_(2, 0.8)) sd / sqrt(3), the same on every row
    mde = (4.302653 + 1.060660) * math.sqrt(300.0) / math.sqrt(3.0)
    assert df.loc[df["benchmark"] == "synthetic-test", "mde"].tolist() == [pytest.approx(mde, rel=1e-5)] * 3
    assert "median over 1 method" in c["mde_source"]
    # seeds for a 2-point MDE with that sd: the first S with (t + t) sd / sqrt(S) <= 2 (about (2.8 sd / 2)^2)
    from oar.core.stats import seed_mde

    need = int(c["seeds_for_target"])
    assert seed_mde(math.sqrt(300.0), need) <= 2.0 < seed_mde(math.sqrt(300.0), need - 1)
    assert 580 < need < 620
    # the base row vs GRPO: per-seed start - GRPO = 30 - (50, 40, 60)
    assert _cell(df, "base", "synthetic-test")["diff_per_seed"] == "-20.0000;-10.0000;-30.0000"
    assert math.isnan(_cell(df, "base", "synthetic-test")["start_diff"])


def test_build_report_main_md_has_the_new_columns(tree3x10):
    cfg, root = tree3x10
    out = build_report(cfg, root)
    md = out["main_md"].read_text()
    # both metrics, avg@k first; the start model's greedy pass@1, avg@k and pass@k (sampled = 1 - greedy)
    assert md.index("## avg@2 (sampled, T = 0.6)") < md.index("## pass@1 (greedy)")
    assert "| pass@1 greedy | 30.0 |" in md and "| pass@1 at T = 0.6 (avg@2) | 70.0 |" in md
    assert "| pass@2 at T = 0.6 | 70.0 |" in md
    assert "answers with a final answer" not in md  # evaluations without the format share: no row
    # the format share of the start model's answers, from its <bench>.json
    (root / "base" / "eval" / "synthetic-test.json").write_text(json.dumps({"answered": 0.825}))
    md = build_report(cfg, root)["main_md"].read_text()
    assert "| answers with a final answer the reward reads | 82.5 |" in md
    assert "| oar_g | +10.0 [" in md  # difference from GRPO with its interval
    assert "| oar_g | +20.0 / -10.0 / +20.0 |" in md  # per-seed differences, seeds 0 / 1 / 2
    assert "(points; seeds 0 / 1 / 2)" in md
    assert "| GRPO | +20.0 [" in md  # difference from the start model
    mde = (4.302653 + 1.060660) * math.sqrt(300.0) / math.sqrt(3.0)
    assert f"synthetic-test {mde:.1f}" in md and "MDE = (t_(S-1, 0.975) + t_(S-1, 0.8)) x sd / sqrt(S)" in md
    assert "t interval over the 3 training seed(s), each seed one replicate" in md
    assert "Seeds for a seed-level MDE of 2 points (same sd): synthetic-test" in md
    # no interval excludes 0 at the seed level, so nothing is bold
    assert "**+" not in md and "**-" not in md
    assert "no held-out evaluation during training (train.heldout.every is 0)" in md
    csv = pd.read_csv(out["main_csv"])
    assert set(csv["metric"]) == {"avg@k", "pass@1"}
    for col in ("se", "sd_seed", "problem_se", "problem_ci_low", "diff_per_seed", "start_diff", "start_ci_low",
                "start_ci_high", "mde", "seeds_for_target"):
        assert col in csv.columns, col
    assert out["learning_curves"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pass_at_k_scores(tree3x10):
    cfg, root = tree3x10
    df = main_table(cfg, root, metric="pass@k", n_boot=0)
    # both samples are the complement of the greedy answer: pass@2 = 1 - greedy
    assert _cell(df, "base", "synthetic-test")["mean"] == pytest.approx(70.0)
    assert _cell(df, "oar_g", "synthetic-test")["mean"] == pytest.approx(40.0)


# ---------------------------------------------------------------------------------- learning curves
def test_first_crossing_interpolates_and_says_not_reached():
    from oar.core.stats import first_crossing

    assert first_crossing([0, 5, 10], [0.2, 0.4, 0.6], 0.5) == pytest.approx(7.5)  # 5 + 0.1 / 0.2 * 5
    assert first_crossing([0, 5, 10], [0.2, 0.4, 0.6], 0.4) == pytest.approx(5.0)
    assert first_crossing([0, 5, 10], [0.6, 0.1, 0.9], 0.5) == 0.0  # the start already reaches it
    assert first_crossing([0, 5, 10], [0.2, 0.5, 0.3], 0.45) == pytest.approx(5 * 0.25 / 0.3)  # the first crossing
    assert math.isnan(first_crossing([0, 5, 10], [0.2, 0.4, 0.45], 0.5))
    assert first_crossing([0, 5, 10], [0.2, math.nan, 0.6], 0.4) == pytest.approx(5.0)  # a missing point is skipped
    with pytest.raises(ValueError, match="must not decrease"):
        first_crossing([0, 10, 5], [0.1, 0.2, 0.3], 0.5)


def test_steps_to_threshold_table_and_heldout_rows(tree):
    from oar.report.learning_curves import auto_threshold, load_heldout, steps_to_threshold

    cfg, root = tree
    heldout = {m: {s: load_heldout(root / m / f"seed{s}" / "metrics.jsonl") for s in (0, 1)} for m in HELDOUT}
    assert heldout["grpo"][1]["train_seconds"].tolist() == [0.0, 2.0, 4.0]
    # halfway between the start (0.2) and GRPO's last mean ((0.6 + 0.5) / 2)
    thr = auto_threshold(heldout, "grpo")
    assert thr == pytest.approx(0.375)
    t = steps_to_threshold(heldout, thr, {"grpo": "GRPO"}).set_index("method")
    # GRPO seed 0: 0 + 0.175 / 0.2 = 0.875 steps, train_seconds 0 -> 1: 0.875 s; seed 1: 1 + 0.075 / 0.2 = 1.375
    # steps, train_seconds 2 -> 4: 2.75 s
    assert t.loc["grpo", "steps"] == pytest.approx((0.875 + 1.375) / 2)
    assert t.loc["grpo", "seconds"] == pytest.approx((0.875 + 2.75) / 2)
    assert t.loc["grpo", "reached"] == 2 and t.loc["grpo", "label"] == "GRPO"
    # OAR-G seed 1 ends at 0.35: not reached, so no mean
    assert t.loc["oar_g", "reached"] == 1 and math.isnan(t.loc["oar_g", "steps"])
    assert t.loc["oar_g", "steps_per_seed"] == "0.4375;nan"
    md = build_report(cfg, root)["main_md"].read_text()
    assert "### Steps to 37.5% held-out accuracy" in md and "| oar_g | not reached | not reached | 1/2 |" in md
    assert "| GRPO | 1.1 | 2 | 2/2 |" in md and "interpolated linearly" in md
    # GRPO ending no higher than the start: no automatic threshold between them
    flat = {m: {s: df.assign(heldout_acc=0.2) for s, df in per_seed.items()} for m, per_seed in heldout.items()}
    assert math.isnan(auto_threshold(flat, "grpo"))
    # a fixed threshold from the config
    cfg["report"]["threshold"] = 0.3
    steps = pd.read_csv(build_report(cfg, root)["steps_to_threshold_csv"]).set_index("method")
    assert steps.loc["oar_g", "steps"] == pytest.approx((0.25 + 1.0) / 2)  # 0.1 / 0.4 of step 0 -> 1, and step 1


def test_learning_speed_endpoints_with_seed_level_intervals(tree):
    from oar.report.learning_curves import heldout_auc, learning_speed_table, load_heldout

    cfg, root = tree
    heldout = {m: {s: load_heldout(root / m / f"seed{s}" / "metrics.jsonl") for s in (0, 1)} for m in HELDOUT}
    # trapezoid over steps 0, 1, 2 divided by 2: GRPO seed 0 (0.3 + 0.5) / 2 = 0.4
    assert heldout_auc(heldout["grpo"][0]) == pytest.approx(0.4)
    t = learning_speed_table(heldout, 0.375, "grpo", labels={"grpo": "GRPO"}).set_index("method")
    # AUC: GRPO 0.4, 0.325; OAR-G 0.55, 0.2875 -> differences 15, -3.75 points, t_(1, 0.975) = 12.7062
    assert t.loc["grpo", "auc"] == pytest.approx(36.25) and math.isnan(t.loc["grpo", "auc_diff"])
    assert t.loc["oar_g", "auc_diff"] == pytest.approx(5.625)
    assert t.loc["oar_g", "auc_low"] == pytest.approx(5.625 - 12.7062 * 18.75 / 2, abs=1e-3)
    # OAR-G seed 1 never reaches 37.5%: no steps difference
    assert math.isnan(t.loc["oar_g", "steps_diff"]) and math.isnan(t.loc["oar_g", "steps"])
    # at 30%: GRPO 0.5, 1.0 steps; OAR-G 0.25, 1.0 -> differences -0.25, 0
    t = learning_speed_table(heldout, 0.3, "grpo").set_index("method")
    assert t.loc["oar_g", "steps_diff"] == pytest.approx(-0.125)
    assert t.loc["oar_g", "steps_low"] < -0.125 < t.loc["oar_g", "steps_high"]
    md = build_report(cfg, root)["main_md"].read_text()
    assert "### Learning speed: differences from GRPO, 95% interval over training seeds" in md
    assert "| oar_g | 41.9 | +5.6 [-113.5, +124.7] | not reached | — |" in md


def test_heldout_rows_stay_out_of_the_training_metrics(tree):
    from oar.report import load_metrics

    cfg, root = tree
    df = load_metrics(root / "grpo" / "seed0" / "metrics.jsonl")
    assert df.index.tolist() == [0, 1] and "heldout_acc" not in df.columns
    assert efficiency_table(cfg, root, skip_steps=0).set_index("method").loc["grpo", "steps"] == 2


def test_also_against_another_method(tree3x10):
    """report.also_against: the differences from a second reference, paired by seed, in main.md and a csv:
    GRPO - oar_g is the negative of oar_g - GRPO, seed by seed."""
    cfg, root = tree3x10
    cfg["report"]["also_against"] = ["oar_g"]
    out = build_report(cfg, root)
    md = out["main_md"].read_text()
    assert "### Difference from oar_g (avg@k, points), 95% interval over training seeds" in md
    vs = pd.read_csv(out["versus_oar_g_csv"])
    main = pd.read_csv(out["main_csv"])
    back = vs[(vs["row"] == "grpo") & (vs["benchmark"] == "synthetic-test")].iloc[0]
    fwd = main[(main["row"] == "oar_g") & (main["benchmark"] == "synthetic-test") & (main["metric"] == "avg@k")].iloc[0]
    assert back["diff"] == pytest.approx(-fwd["diff"]) and back["ci_low"] == pytest.approx(-fwd["ci_high"])
    assert f"| GRPO | {-fwd['diff']:+.1f} [" in md
    cfg["report"]["also_against"] = ["nope"]
    with pytest.raises(ReportError, match="also_against: 'nope'"):
        build_report(cfg, root)


def test_credit_efficiency_fieller_interval_endpoints_are_where_the_paired_t_test_turns():
    """The Fieller interval's ends r are the ratios where the paired t statistic of N - r D equals the
    critical value; the ratio is mean(N) / mean(D); an oracle whose own interval contains 0 leaves it
    unbounded."""
    from scipy.stats import t as student_t

    from oar.report.capture import EFFICIENCY_COLUMNS, credit_efficiency_markdown, credit_efficiency_table

    table = pd.DataFrame.from_records([
        {"row": "base", "label": "start", "metric": "avg@k", "benchmark": "Average", "n_seeds": 3, "diff": math.nan,
         "ci_low": math.nan, "ci_high": math.nan, "p": math.nan, "diff_per_seed": ""},
        {"row": "grpo", "label": "GRPO", "metric": "avg@k", "benchmark": "Average", "n_seeds": 3, "diff": math.nan,
         "ci_low": math.nan, "ci_high": math.nan, "p": math.nan, "diff_per_seed": ""},
        {"row": "m", "label": "M", "metric": "avg@k", "benchmark": "Average", "n_seeds": 3, "diff": 2.0,
         "ci_low": -0.5, "ci_high": 4.5, "p": 0.05, "diff_per_seed": "1;3;2"},
        {"row": "orc", "label": "Oracle", "metric": "avg@k", "benchmark": "Average", "n_seeds": 3, "diff": 5.0,
         "ci_low": 2.5, "ci_high": 7.5, "p": 0.01, "diff_per_seed": "4;5;6"},
    ])
    eff = credit_efficiency_table(table, oracle="orc").set_index("row")
    assert list(eff.index) == ["m"]
    assert eff.loc["m", "efficiency"] == pytest.approx(0.4)
    n, d = np.array([1.0, 3.0, 2.0]), np.array([4.0, 5.0, 6.0])
    crit = student_t.ppf(0.975, 2)
    for r in (eff.loc["m", "eff_low"], eff.loc["m", "eff_high"]):
        v = n - r * d
        assert abs(v.mean()) / (v.std(ddof=1) / math.sqrt(3)) == pytest.approx(crit)
    assert eff.loc["m", "eff_low"] < 0 < eff.loc["m", "eff_high"] < 1
    table.loc[3, "diff_per_seed"] = "4;-3;6"  # the oracle's lead no longer separates from 0
    eff = credit_efficiency_table(table, oracle="orc").set_index("row")
    assert math.isinf(eff.loc["m", "eff_low"]) and math.isinf(eff.loc["m", "eff_high"])
    # a config of the reference and the oracle alone: an empty table with the columns, no section
    only = credit_efficiency_table(table[table["row"] != "m"], oracle="orc")
    assert only.empty and list(only.columns) == EFFICIENCY_COLUMNS
    assert credit_efficiency_markdown(only, oracle_label="Oracle", reference_label="GRPO", confidence=0.95) == ""
    with pytest.raises(ReportError, match="efficiency_oracle: 'nope'"):
        credit_efficiency_table(table, oracle="nope")
    with pytest.raises(ReportError, match="'grpo' is the reference"):
        credit_efficiency_table(table, oracle="grpo")


def test_credit_efficiency_unpaired_uses_the_three_rows_seeds_as_independent_samples():
    """report.pairing none: the efficiency and its interval are oar.core.stats' unpaired Fieller over the
    method's, the oracle's and the reference's per-seed scores; the differences Welch's; the section
    says so and counts the oracle's own lead in its Holm family."""
    from oar.report.capture import credit_efficiency_markdown, credit_efficiency_table
    from oar.core.stats import fieller_ratio_interval_unpaired, welch_interval

    rows = {"grpo": "20;22;21;25", "m": "30;26;31", "orc": "40;44;41;43;39"}
    table = pd.DataFrame.from_records([
        {"row": r, "label": r.upper(), "metric": "avg@k", "benchmark": "Average", "n_seeds": len(v.split(";")),
         "diff": math.nan if r == "grpo" else 1.0, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan,
         "per_seed": v, "diff_per_seed": "" if r == "grpo" else "1;1;1"} for r, v in rows.items()])
    eff = credit_efficiency_table(table, oracle="orc", pairing="none", reference="grpo").set_index("row")
    vals = {k: [float(x) for x in v.split(";")] for k, v in rows.items()}
    ratio, low, high = fieller_ratio_interval_unpaired(vals["m"], vals["orc"], vals["grpo"])
    assert (eff.loc["m", "efficiency"], eff.loc["m", "eff_low"], eff.loc["m", "eff_high"]) == (ratio, low, high)
    diff, dlow, dhigh, _, p = welch_interval(vals["m"], vals["grpo"])
    assert (eff.loc["m", "diff"], eff.loc["m", "p"]) == (diff, p) and eff.loc["m", "oracle_diff"] == pytest.approx(
        sum(vals["orc"]) / 5 - sum(vals["grpo"]) / 4)
    md = credit_efficiency_markdown(eff.reset_index(), oracle_label="Oracle", reference_label="GRPO", confidence=0.95,
                                    pairing="none")
    assert "unpaired" in md and "2 comparisons" in md
    with pytest.raises(ReportError, match="reference"):
        credit_efficiency_table(table, oracle="orc", pairing="none", reference=None)


def _efficiency_tree(tmp_path, **sections):
    """A validated 3-seed config (GRPO, oar_g, the oracle ``orc``) with ``sections`` (e.g. ``report``) and its
    results tree (greedy: GRPO 5, 4, 6 of 10; oar_g 7, 3, 8; oracle 8, 6, 8): ``(config, root)``."""
    cfg = validate_config({
        "name": "fake", "results_dir": str(tmp_path), "seeds": [0, 1, 2], "model": {"source": "tiny"},
        "task": {"kind": "synthetic"}, "recipes": {"grpo": {"norm_by_std": True}},
        "methods": {"grpo": {"recipe": "grpo", "credit": "none", "label": "GRPO"},
                    "oar_g": {"recipe": "grpo", "credit": "oar_g"},
                    "orc": {"recipe": "grpo", "credit": "oracle_first_mistake", "label": "Oracle"}},
        "eval": {"benchmarks": [{"name": "synthetic-test", "n": 10}], "samples": 2, "bootstrap": 200},
        **sections,
    })
    root = tmp_path / "fake"
    oracle = [[1] * 8 + [0] * 2, [1] * 6 + [0] * 4, [1] * 8 + [0] * 2]
    _write_eval(root / "base" / "eval", {"synthetic-test": START_3x10})
    for s in range(3):
        for m, rows in (("grpo", GRPO_3x10), ("oar_g", METHOD_3x10), ("orc", oracle)):
            _write_eval(root / m / f"seed{s}" / "eval", {"synthetic-test": rows[s]})
            _write_metrics(root / m / f"seed{s}", [1.0, 1.0], 0.0, 0)
    return cfg, root


def test_report_efficiency_oracle_writes_the_credit_efficiency(tmp_path):
    """report.efficiency_oracle: main.md's section and tables/credit_efficiency.csv from the same seeds'
    differences (greedy: GRPO 5, 4, 6 of 10; oar_g 7, 3, 8; oracle 8, 6, 8 -> 10 / 23.3 = 0.43)."""
    cfg, root = _efficiency_tree(tmp_path, report={"efficiency_oracle": "orc"})
    out = build_report(cfg, root)
    eff = pd.read_csv(out["credit_efficiency_csv"])
    avg = eff[(eff["row"] == "oar_g") & (eff["benchmark"] == "Average")].iloc[0]
    assert avg["efficiency"] == pytest.approx(10.0 / (70.0 / 3.0), abs=1e-4)
    assert set(eff["row"]) == {"oar_g"}
    md = out["main_md"].read_text()
    assert "### Credit efficiency against Oracle (avg@k, Average)" in md
    assert "| oar_g | " in md.split("### Credit efficiency")[1]


def test_report_credit_signals_join_the_efficiency_with_the_signals_localisation(tmp_path, monkeypatch):
    """report.credit_signals: each mapped method's credit efficiency beside its signal's top-3 hit rate
    by mistake position (sampled mistakes only), on the start model and on each attribution.trained
    policy, in tables/efficiency_vs_localisation.csv and a figure; a signal the attribution table lacks,
    a method the config lacks, or a missing attribution result is named."""
    cfg, root = _efficiency_tree(
        tmp_path, attribution={"trained": [{"method": "grpo", "seed": 0}]},
        report={"efficiency_oracle": "orc", "credit_signals": {"oar_g": "oar_g_joint", "grpo": "uniform"}})
    with pytest.raises(ReportError, match=r"attribution/per_response.csv"):
        build_report(cfg, root)
    # 4 sampled responses: mistakes in step 0 of 3 (earlier), 1 of 3 (earlier), 2 of 3 (last), none;
    # OAR-G hits the two earlier ones and misses the last; one counterfactual row that must not count
    per = pd.DataFrame({"kind": ["sampled"] * 4 + ["counterfactual"], "mistake_step": [0, 1, 2, -1, 0],
                        "n_steps": [3, 3, 3, 3, 3], "top3_oar_g_joint": [1.0, 1.0, 0.0, math.nan, 0.0],
                        "top3_uniform": [0.0, 1.0, 0.0, math.nan, 1.0]})
    for d in (root / "attribution", root / "attribution" / "grpo_seed0"):
        d.mkdir(parents=True, exist_ok=True)
        per.to_csv(d / "per_response.csv", index=False)
    out = build_report(cfg, root)
    tab = pd.read_csv(out["efficiency_vs_localisation_csv"])
    assert list(tab["policy"]) == ["start model", "grpo_seed0"]   # grpo is the reference: no efficiency
    row = tab.iloc[0]
    assert (row["method"], row["signal"], row["n_earlier"], row["n_last"]) == ("oar_g", "oar_g_joint", 2, 1)
    assert (row["earlier_top3"], row["last_top3"]) == (1.0, 0.0)
    assert row["efficiency"] == pytest.approx(10.0 / (70.0 / 3.0), abs=1e-4)
    assert out["efficiency_vs_localisation"].stat().st_size > 0
    # the oracle mapped: a row of efficiency 1 at its lead, the calibration curve's top; a signal no method
    # uses is drawn where it would sit (its earlier-step top-3 on the start model)
    seen: dict = {}
    monkeypatch.setattr("oar.report.localisation.plot_efficiency_vs_localisation",
                        lambda path, table, **kw: seen.update(kw, table=table))
    cfg["report"]["credit_signals"] = {"orc": "uniform"}
    build_report(cfg, root)
    orc = seen["table"][(seen["table"]["method"] == "orc") & (seen["table"]["policy"] == "start model")].iloc[0]
    assert orc["efficiency"] == 1.0 and orc["diff"] == pytest.approx(-70.0 / 3.0, abs=1e-4)  # the lead of the fixture
    assert seen["calibration"] == ["orc"] and seen["unmatched"] == {"oar_g_joint": 1.0}
    monkeypatch.undo()
    for bad, match in (({"oar_g": "nope"}, r"credit_signals.oar_g: 'nope' is not a signal"),
                       ({"oar_x": "uniform"}, r"credit_signals.oar_x: not a method")):
        cfg["report"]["credit_signals"] = bad
        with pytest.raises(ReportError, match=match):
            build_report(cfg, root)


def test_one_seed_report_says_nothing_is_bold(tree):
    """With one seed there is no interval, so no comparison to correct: the notes say nothing is bold
    instead of naming a correction over 0 comparisons, and that the MDE is not defined instead of
    printing a NaN sd; with seeds, the note names the family size."""
    from oar.report.render import holm_note

    assert holm_note(0, 0.05) == "Bold: none (no interval to test: one seed, or no comparison)."
    assert "Holm's correction for the 4 comparisons of its table (familywise alpha 0.05" in holm_note(4, 0.05)
    cfg, root = tree
    out = build_report(validate_config({**cfg, "seeds": [0]}), root, seed=3)
    md, tex = out["main_md"].read_text(), out["main_tex"].read_text()
    assert "Bold: none (no interval to test" in md and "0 comparisons" not in md and "| **" not in md
    assert "one training seed: no interval, nothing bold" in tex and "0 comparisons" not in tex
    assert "**Minimum detectable difference**: not defined; a seed-level sd needs" in md and "sd nan" not in md
