"""`oar compare`: a finished run against a recorded reference, cell by cell within seed noise, with
the provenance that differs; the reference file written by `oar compare --save`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from oar.cli import main
from oar.report.compare import compare_runs, load_reference, save_reference


def _run(root: Path, per_seed: dict[str, list[float]], *, base: float = 40.0, cpu: str = "AMD EPYC",
         steps: dict[str, list[float]] | None = None) -> Path:
    """A finished run's tables: main.csv rows (avg@k, one benchmark) and learning_speed.csv."""
    recs = [{"row": "base", "metric": "avg@k", "benchmark": "synthetic-test", "per_seed": f"{base:.4f}"}]
    recs += [{"row": m, "metric": "avg@k", "benchmark": "synthetic-test", "per_seed": ";".join(f"{v:.4f}" for v in vals)}
             for m, vals in per_seed.items()]
    (root / "tables").mkdir(parents=True)
    pd.DataFrame.from_records(recs).to_csv(root / "tables" / "main.csv", index=False)
    if steps:
        pd.DataFrame.from_records([{"method": m, "auc_per_seed": "50;51;52", "steps_per_seed": ";".join(map(str, v))}
                                   for m, v in steps.items()]).to_csv(root / "tables" / "learning_speed.csv", index=False)
    ev = root / "grpo" / "seed0" / "eval"
    ev.mkdir(parents=True)
    (ev / "summary.json").write_text(json.dumps({"provenance": {"cpu_model": cpu, "git_commit": "abc"}}))
    return root


def test_the_same_run_is_identical_and_another_cpu_within_seed_noise(tmp_path):
    rec = _run(tmp_path / "rec", {"grpo": [55.0, 54.0, 56.3], "dapo": [57.0, 55.5, 60.1]},
               steps={"grpo": [10, 12, 11], "dapo": [8, 8, 7]})
    ref = save_reference(rec, tmp_path / "ref.json", note="here")
    assert load_reference(tmp_path / "ref.json")["values"] == ref["values"]
    same = compare_runs(ref, rec)
    assert set(same["counts"]) == {"identical"} and same["provenance"] == []
    # another CPU: every value moved by seed-noise amounts, the start model by 2 points
    other = _run(tmp_path / "other", {"grpo": [58.0, 57.1, 59.9], "dapo": [58.9, 56.0, 61.0]}, base=41.4,
                 cpu="Xeon AVX-512", steps={"grpo": [11, 11, 10], "dapo": [12, 9, 11]})
    res = compare_runs(ref, other)
    by = {(r["row"], r["metric"]): r for r in res["cells"]}
    assert by[("dapo", "avg@k")]["verdict"] == "within seed noise"
    assert by[("base", "avg@k")]["verdict"] == "within seed noise"  # 1.4 against the rows' seed spread
    assert by[("grpo", "avg@k")]["verdict"] == "differs"  # +3.2 with sd ~1: outside what seeds allow
    assert ("cpu_model", "AMD EPYC", "Xeon AVX-512") in res["provenance"]
    assert by[("dapo", "steps to threshold")]["verdict"] == "within seed noise"


def test_oar_compare_prints_the_verdict_and_exits_1_when_a_cell_differs(tmp_path, capsys):
    rec = _run(tmp_path / "rec", {"grpo": [55.0, 54.0, 56.3]})
    assert main(["compare", "--results", str(rec), "--reference", str(tmp_path / "r.json"), "--save"]) == 0
    assert main(["compare", "--results", str(rec), "--reference", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "REPRODUCED" in out and "identical" in out
    far = _run(tmp_path / "far", {"grpo": [75.0, 74.0, 76.3]})
    assert main(["compare", "--results", str(far), "--reference", str(tmp_path / "r.json"),
                 "--output", str(tmp_path / "c.md")]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "| grpo / avg@k / synthetic-test | 55.1 | 75.1 |" in out
    assert (tmp_path / "c.md").read_text() == out


def test_a_bad_reference_or_an_unfinished_run_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    rec = _run(tmp_path / "rec", {"grpo": [1.0, 2.0]})
    assert main(["compare", "--results", str(rec), "--reference", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a reference file" in capsys.readouterr().err
    assert main(["compare", "--results", str(tmp_path / "nothing"), "--reference", str(tmp_path / "x.json"),
                 "--save"]) == 2
    err = capsys.readouterr().err
    assert "main.csv: no such file" in err and len(err.strip().splitlines()) == 1


def test_a_one_seed_run_compares_with_its_own_reference(tmp_path, capsys):
    """A one-seed main.csv's per_seed column holds bare numbers, which pandas reads as floats: the
    reference still carries every value, and the run reproduces itself."""
    rec = _run(tmp_path / "rec", {"grpo": [55.0], "dapo": [57.25]})
    assert pd.read_csv(rec / "tables" / "main.csv")["per_seed"].dtype.kind == "f"  # what pandas makes of it
    assert main(["compare", "--results", str(rec), "--reference", str(tmp_path / "r.json"), "--save"]) == 0
    values = load_reference(tmp_path / "r.json")["values"]
    assert values["main|grpo|avg@k|synthetic-test"] == [55.0] and all(len(v) == 1 for v in values.values())
    capsys.readouterr()
    assert main(["compare", "--results", str(rec), "--reference", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "REPRODUCED" in out and "missing" not in out


def test_a_reference_of_another_config_is_refused_naming_what_differs(tmp_path, capsys):
    import yaml

    rec = _run(tmp_path / "rec", {"grpo": [55.0, 54.0, 56.3]})
    cfg = {"model": {"source": "tiny"}, "train": {"lr": 1e-4, "steps": 20}, "seeds": [0, 1, 2]}
    (rec / "config.yaml").write_text(yaml.safe_dump(cfg))
    save_reference(rec, tmp_path / "r.json")
    assert load_reference(tmp_path / "r.json")["config_identity"]["train"]
    longer = _run(tmp_path / "longer", {"grpo": [55.0, 54.0, 56.3]})  # only a resumable key differs: same config
    (longer / "config.yaml").write_text(yaml.safe_dump({**cfg, "train": {"lr": 1e-4, "steps": 40}}))
    assert main(["compare", "--results", str(longer), "--reference", str(tmp_path / "r.json")]) == 0
    other = _run(tmp_path / "other", {"grpo": [55.0, 54.0, 56.3]})
    (other / "config.yaml").write_text(yaml.safe_dump({**cfg, "train": {"lr": 1e-3, "steps": 20}}))
    capsys.readouterr()
    assert main(["compare", "--results", str(other), "--reference", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == (f"oar compare: error: {tmp_path / 'r.json'}: a run of another config "
                                       f"({other}/config.yaml differs in train); compare a run with a reference of its "
                                       "own config\n")
