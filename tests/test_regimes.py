"""The regime map (oar.report.regimes, config/regimes.yaml) and the configs that run a subset of methods."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from oar.config.load import load_config
from oar.config.methods import resolve_methods
from oar.config.source import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_controls_and_regimes_configs_resolve():
    controls = load_config(ROOT / "config" / "controls.yaml")
    assert list(resolve_methods(controls)) == controls["only_methods"]
    assert resolve_methods(controls)["oar_g_shuffled"].credit == "shuffled"
    regimes = load_config(ROOT / "config" / "regimes.yaml")
    assert list(resolve_methods(regimes)) == ["grpo", "oracle_first_mistake", "oar_g"]
    assert not regimes["attribution"]["enabled"]  # a cell is a training run only
    cfg = dict(controls, only_methods=["grpo", "nope"])
    with pytest.raises(ConfigError, match=r"only_methods.*nope"):
        resolve_methods(cfg)
    # a trained policy to measure must be a run of the config
    cfg = dict(controls, attribution=dict(controls["attribution"], trained=[{"method": "dapo", "seed": 0}]))
    with pytest.raises(ConfigError, match=r"attribution.trained\[0\]: dapo seed 0"):
        resolve_methods(cfg)


def test_cell_configs_extend_the_regime_config(tmp_path):
    from oar.report.regimes import cell_names, write_cell_configs

    path = ROOT / "config" / "regimes.yaml"
    config = load_config(path)
    # by default every cell but the optional ones (the long n=4 cells); an optional cell is written when named
    default = write_cell_configs(config, path, tmp_path / "default")
    optional = {"regimes_len60_n4", "regimes_len140_n4"}
    assert [p.stem for p in default] == [n for n in cell_names(config) if n not in optional]
    paths = write_cell_configs(config, path, tmp_path, [c["name"] for c in config["regimes"]["cells"]])
    assert [p.stem for p in paths] == cell_names(config)
    cells = {p.stem: load_config(p) for p in paths}
    c = cells["regimes_len140_n4"]
    assert c["name"] == "regimes_len140_n4" and c["rollout"]["n"] == 4 and c["train"]["prompts_per_step"] == 64
    assert c["task"]["synthetic"]["filler_words"] == 16 and c["rollout"]["max_new_tokens"] == 224
    assert c["seeds"] == config["seeds"] and c["only_methods"] == config["only_methods"]
    # the highlighted cells (the two ~28-token cells and the harder task) carry the seeds for a seed-level
    # MDE of ~2; the harder task's cell, more operands
    assert [c["name"] for c in config["regimes"]["cells"] if c["highlight"]] == ["len28_n8", "len28_n4", "hard_n8"]
    for cell in config["regimes"]["cells"]:
        n_seeds = len(cells[f"regimes_{cell['name']}"]["seeds"])
        assert n_seeds == (6 if cell["highlight"] else 3), cell["name"]
    h = cells["regimes_hard_n8"]
    assert h["task"]["synthetic"]["operands"] == [4, 5] and h["rollout"]["max_new_tokens"] == 96
    assert h["task"]["synthetic"]["filler_prob"] == config["task"]["synthetic"]["filler_prob"]
    # every cell trains 256 responses per step: only the group size changes between n=4 and n=8
    for cell in cells.values():
        assert cell["rollout"]["n"] * cell["train"]["prompts_per_step"] == 256
    # the default cell is the regime config itself
    d = cells["regimes_len28_n8"]
    assert d["task"] == config["task"] and d["rollout"] == config["rollout"] and d["train"] == config["train"]


def test_selected_cells_by_name_and_optional():
    from oar.report.regimes import selected_cells

    config = {"name": "m", "regimes": {"cells": [{"name": "a", "optional": False, "set": {}},
                                                 {"name": "b", "optional": True, "set": {}},
                                                 {"name": "c", "optional": False, "set": {}}]}}
    assert selected_cells(config) == ["a", "c"]
    # named (by cell or run name), in the config's order, optional ones included
    assert selected_cells(config, ["c", "m_b"]) == ["b", "c"]
    with pytest.raises(ValueError, match=r"no cell 'x' in regimes.cells \(cells: a, b, c\)"):
        selected_cells(config, ["a", "x"])


def _main_csv(path: Path, rows: dict[str, tuple[float, float, float, str]], mde: float = 2.0) -> None:
    recs = [{"metric": "avg@k", "benchmark": "synthetic-test", "row": "base", "n_seeds": 1, "diff": -10.0,
             "ci_low": math.nan, "ci_high": math.nan, "mde": mde, "diff_per_seed": ""}]
    recs += [{"metric": "avg@k", "benchmark": "synthetic-test", "row": r, "n_seeds": 4, "diff": d, "ci_low": lo,
              "ci_high": hi, "mde": mde, "diff_per_seed": per_seed} for r, (d, lo, hi, per_seed) in rows.items()]
    recs += [{"metric": "pass@1", "benchmark": "synthetic-test", "row": "oar_g", "n_seeds": 4, "diff": 99.0,
              "ci_low": 98.0, "ci_high": 100.0, "mde": mde}]  # another metric: not read
    path.parent.mkdir(parents=True)
    pd.DataFrame.from_records(recs).to_csv(path, index=False)


def test_regime_table_efficiency_and_report(tmp_path):
    from oar.report.regimes import cell_names, write_regime_report

    config = load_config(ROOT / "config" / "regimes.yaml")
    names = cell_names(config)
    # cell 0: the oracle separates (+4 [+1, +7]); OAR-G gains 1 of it. cell 2: it does not. the rest: not run
    # per-seed differences: the oracle's in cell 0 survive Holm's correction over the 4 comparisons shown
    _main_csv(tmp_path / names[0] / "tables" / "main.csv",
              {"oracle_first_mistake": (4.0, 1.0, 7.0, "3.9;4.0;4.1;4.0"), "oar_g": (1.0, -1.0, 3.0, "-1;3;0;2")})
    _main_csv(tmp_path / names[2] / "tables" / "main.csv",
              {"oracle_first_mistake": (1.0, -2.0, 4.0, "-2;4;1;1"), "oar_g": (0.5, -1.0, 2.0, "-1;2;0;1")})
    out = write_regime_report(config, tmp_path)
    df = pd.read_csv(out["csv"])
    first = df[(df["cell"] == "len28_n8")].set_index("method")
    assert bool(first.loc["oracle_first_mistake", "separates"]) and first.loc["oar_g", "efficiency"] == pytest.approx(0.25)
    assert math.isnan(first.loc["oracle_first_mistake", "efficiency"])
    third = df[(df["cell"] == "len60_n8")].set_index("method")
    assert not bool(third.loc["oar_g", "separates"]) and math.isnan(third.loc["oar_g", "efficiency"])
    assert int((~df["done"]).sum()) == len(names) - 2  # cells not run yet are listed as such
    assert bool(first["highlight"].all()) and not bool(third["highlight"].any())
    assert set(df["series"]) == {"length", "harder task"}
    md = out["md"].read_text()
    # the base row (-10 from GRPO) is GRPO's room: +10.0 over the start model
    assert "| ~28 tokens, n=8 (default) ★ | 28 | 8 | +10.0 | oracle_first_mistake | 4 | **+4.0 [+1.0, +7.0]** | 2.0 | — |" in md
    assert "| ~28 tokens, n=8 (default) ★ | 28 | 8 | +10.0 | oar_g | 4 | +1.0 [-1.0, +3.0] | 2.0 | 0.25 |" in md
    assert "| ~60 tokens, n=8 | 60 | 8 | +10.0 | oar_g |" in md and "★ highlighted" in md
    assert "survives Holm's correction for the 4 comparisons of its table" in md
    assert first.loc["oar_g", "headroom"] == pytest.approx(10.0)
    assert "(not run)" in md
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
