"""Bad input fails early with one clear line naming the file, line, flag or key (issue 11, item 6):
hub ids offline, CLI numbers, --config overrides in Snakemake, unbounded dynamic sampling,
non-UTF-8 data files, and empty benchmark or training sets."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, small_overrides

CONFIG = ROOT / "config" / "config.yaml"


def _write_config(tmp_path: Path, change: dict, name: str = "config.yaml") -> Path:
    """config/config.yaml with ``change`` merged in, written to ``tmp_path/name``."""
    from oar.config import deep_merge

    path = tmp_path / name
    path.write_text(yaml.safe_dump(deep_merge(yaml.safe_load(CONFIG.read_text()), change), sort_keys=False))
    return path


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """``oar <argv>`` in this process: (exit code, stderr); argparse's SystemExit becomes its code."""
    from oar.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _one_error_line(err: str, command: str) -> str:
    """The single ``oar <command>: error: ...`` line of ``err`` (asserting there is exactly one, no traceback)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"oar {command}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------ 1. hub id offline
@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touches the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.chdir(tmp_path)  # "SomeOrg/some-model" is not an existing relative path


@pytest.mark.parametrize("where", ["--model", "model.source"])
def test_hub_model_id_offline_is_one_line_exit_2(offline, tmp_path, capsys, where):
    hub_id = "SomeOrg/some-model"
    if where == "--model":
        argv = ["evaluate", "--config", str(CONFIG), "--model", hub_id, "--output", str(tmp_path / "eval")]
    else:
        cfg = _write_config(tmp_path, {"model": {"source": hub_id}})
        argv = ["evaluate", "--config", str(cfg), "--output", str(tmp_path / "eval")]
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = _one_error_line(err, "evaluate")
    assert hub_id in line and "offline" in line and "not found in the local" in line


def test_hub_model_id_offline_from_load_policy_is_a_file_not_found(offline):
    from oar.models import load_policy

    with pytest.raises(FileNotFoundError, match=r"'SomeOrg/some-model'.*cannot be loaded offline") as info:
        load_policy({"source": "SomeOrg/some-model"})
    assert "\n" not in str(info.value)


def test_hub_benchmark_id_offline_is_one_line_exit_2(offline, tmp_path, capsys):
    cfg = _write_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": "SomeOrg/some-data"}]}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2, err
    assert "'SomeOrg/some-data'" in _one_error_line(err, "data")


def test_hub_model_id_offline_cli_subprocess(tmp_path):
    """The installed entry point itself: no traceback, exit 2."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "oar.cli", "evaluate", "--config", str(CONFIG), "--model", "SomeOrg/some-model",
         "--output", str(tmp_path / "eval")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "SomeOrg/some-model" in _one_error_line(proc.stderr, "evaluate")


# ---------------------------------------------------------------------------- 2. CLI numeric flags
@pytest.mark.parametrize("argv, flag", [
    (["train", "--config", "C", "--method", "grpo", "--output", "O", "--steps", "-1"], "--steps"),
    (["train", "--config", "C", "--method", "grpo", "--output", "O", "--steps", "0"], "--steps"),
    (["train", "--config", "C", "--method", "grpo", "--output", "O", "--steps", "2.5"], "--steps"),
    (["train", "--config", "C", "--method", "grpo", "--output", "O", "--seed", "-1"], "--seed"),
    (["evaluate", "--config", "C", "--output", "O", "--seed", "-3"], "--seed"),
    (["report", "--config", "C", "--seed", "x"], "--seed"),
])
def test_cli_numbers_are_checked_at_the_cli_naming_the_flag(capsys, argv, flag):
    rc, err = _cli([*argv[:2], str(CONFIG), *argv[3:]], capsys)
    assert rc == 2
    line = _one_error_line(err, argv[0])
    assert f"argument {flag}:" in line and argv[-1] in line
    assert "config.yaml" not in line


def test_every_numeric_cli_flag_is_range_checked():
    """No subcommand takes a plain ``type=int``/``float`` flag (which would let -1 reach the config)."""
    from oar.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    seen = []
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.type not in (int, float), f"oar {name} {action.option_strings}: unchecked {action.type}"
            if action.type is not None:
                seen.append((name, action.dest))
    assert ("train", "steps") in seen and ("train", "seed") in seen and ("report", "seed") in seen


def test_cli_steps_override_still_reaches_the_config(monkeypatch, tmp_path):
    import oar.train

    got = {}

    def fake_train(config, method, seed, output, **kw):
        got.update(steps=config["train"]["steps"], seed=seed)
        return {}

    monkeypatch.setattr(oar.train, "train", fake_train)
    from oar.cli import main

    assert main(["train", "--config", str(CONFIG), "--method", "grpo", "--output", str(tmp_path), "--steps", "1",
                 "--seed", "0"]) == 0
    assert got == {"steps": 1, "seed": 0}


# ------------------------------------------------------------------- 3. snakemake --config overrides
needs_snakemake = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None, reason="snakemake not installed")


def _snakemake(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@needs_snakemake
@pytest.mark.slow  # one snakemake process: a few seconds
def test_snakemake_nested_config_override_is_accepted(tmp_path):
    proc = _snakemake("-n", "--config", 'train={"lr": 0.001}', f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "is not of type" not in proc.stdout + proc.stderr


@needs_snakemake
@pytest.mark.slow  # one snakemake process: a few seconds
def test_snakemake_nested_config_override_resolves_to_typed_values(tmp_path):
    """The config common.smk resolves (what every rule and the written config.yaml see)."""
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(
        f'include: "{ROOT / "workflow" / "rules" / "common.smk"}"\n'
        "import json\n"
        'print("RESOLVED " + json.dumps({"train": config["train"], "seeds": config["seeds"], '
        '"template": config["task"]["template"], "results_dir": config["results_dir"]}))\n'
        "rule all:\n    input: []\n"
    )
    proc = _snakemake("-n", "--snakefile", str(snakefile), "--config",
                      'train={"lr": 0.001, "steps": 5, "warmup_steps": 0, "grad_clip": 2.5e-1, "schedule": "cosine"}',
                      "seeds=[0, 2]", 'task={"template": "plain"}', f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("RESOLVED "))
    got = json.loads(line.removeprefix("RESOLVED "))
    tr = got["train"]
    assert tr["lr"] == 0.001 and isinstance(tr["lr"], float)
    assert tr["steps"] == 5 and isinstance(tr["steps"], int) and tr["warmup_steps"] == 0
    assert tr["grad_clip"] == 0.25 and tr["schedule"] == "cosine"
    assert tr["prompts_per_step"] == yaml.safe_load(CONFIG.read_text())["train"]["prompts_per_step"]  # merged
    assert got["seeds"] == [0, 2]
    assert got["template"] == "plain" and got["results_dir"] == str(tmp_path)


def test_typed_override_helper():
    """oar.config.typed_override (the workflow's --config values), on the values Snakemake's BaseLoader leaves as strings."""
    from oar.config import typed_override as typed

    raw = {"a": "0.001", "b": "1e-3", "c": "30", "d": "true", "e": "null", "f": ["1", "x"], "g": "results/x",
           "h": "2024-01-01", "i": "", "j": {"k": "-2"}}
    assert typed(raw) == {"a": 0.001, "b": 0.001, "c": 30, "d": True, "e": None, "f": [1, "x"], "g": "results/x",
                          "h": "2024-01-01", "i": "", "j": {"k": -2}}


# --------------------------------------------------------------------- 4. bounded dynamic sampling
@pytest.mark.parametrize("value", [-1, 0])
def test_max_num_gen_batches_must_be_positive_in_a_recipe(tmp_path, value):
    from oar.config import ConfigError, load_config

    path = _write_config(tmp_path, {"recipes": {"dapo": {"max_num_gen_batches": value}}})
    with pytest.raises(ConfigError, match=rf"{path}:\d+: key recipes\.dapo\.max_num_gen_batches: {value} is less than"):
        load_config(path)


def test_max_num_gen_batches_must_be_positive_in_a_method_override(tmp_path):
    from oar.config import ConfigError, load_config

    path = _write_config(tmp_path, {"methods": {"dapo": {"max_num_gen_batches": -1}}})
    with pytest.raises(ConfigError, match=r"key methods\.dapo\.max_num_gen_batches: -1 is less than"):
        load_config(path)


@pytest.mark.parametrize("name", ["config.yaml", "smoke.yaml", "paper.yaml"])
def test_shipped_configs_still_validate(name):
    from oar.config import load_config

    config = load_config(ROOT / "config" / name)
    for recipe in config["recipes"].values():
        assert recipe["max_num_gen_batches"] >= 1


# ------------------------------------------------------------------------------- 5. non-UTF-8 data
def test_read_jsonl_non_utf8_names_file_and_line(tmp_path):
    from oar.io import read_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"b": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:3: not valid UTF-8 \(byte 0xe9 at column 11\)"):
        read_jsonl(path)


def test_read_jsonl_valid_utf8_still_reads(tmp_path):
    from oar.io import read_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_text('{"q": "café ∑"}\r\n{"q": "x"}\n', encoding="utf-8")
    assert read_jsonl(path) == [{"q": "café ∑"}, {"q": "x"}]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_benchmark_file_non_utf8_names_file_and_line(tmp_path, suffix):
    from oar.data.benchmarks import load_benchmark

    path = tmp_path / f"test{suffix}"
    if suffix == ".jsonl":
        path.write_bytes(b'{"id": 1, "problem": "1+1?", "answer": "2"}\n{"id": 2, "problem": "\xff", "answer": "3"}\n')
    else:
        path.write_bytes(b'[{"id": 1, "problem": "1+1?", "answer": "2"},\n {"id": 2, "problem": "\xff", "answer": "3"}]\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid UTF-8 \(byte 0xff"):
        load_benchmark("aime24", path)


def test_oar_data_non_utf8_is_one_line_exit_2(tmp_path, capsys):
    bench = tmp_path / "aime24.jsonl"
    bench.write_bytes(b'{"id": 1, "problem": "caf\xe9", "answer": "2"}\n')
    cfg = _write_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": str(bench)}]}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2
    assert f"{bench}:1: not valid UTF-8" in _one_error_line(err, "data")


# ------------------------------------------------------------- 6-7. empty benchmark / training set
def _math_train_rows(levels: list[int]) -> bytes:
    return "".join(
        json.dumps({"problem": f"{i}+1?", "answer": str(i + 1), "difficulty": float(lv)}) + "\n"
        for i, lv in enumerate(levels)
    ).encode()


def test_oar_data_fails_on_an_empty_eval_benchmark(tmp_path, capsys):
    folder = tmp_path / "aime24"
    folder.mkdir()
    (folder / "test.jsonl").write_text("\n")  # a blank line only: zero records
    cfg = _write_config(tmp_path, {"eval": {"benchmarks": [{"name": "synthetic-test", "n": 4},
                                                           {"name": "aime24", "source": str(folder)}]}})
    manifest = tmp_path / "manifest.json"
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(manifest)], capsys)
    assert rc == 2
    line = _one_error_line(err, "data")
    assert "eval.benchmarks.1" in line and "'aime24'" in line and str(folder / "test.jsonl") in line
    assert "no records" in line
    assert not manifest.exists()


def test_oar_data_fails_on_an_empty_training_set(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_bytes(b"")
    cfg = _write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {"name": "math_train", "source": str(src)}}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2
    line = _one_error_line(err, "data")
    assert "training set" in line and "'math_train'" in line and str(src) in line


def test_data_manifest_fails_when_filters_leave_no_training_records(tmp_path):
    from oar.config import load_config
    from oar.report import data_manifest

    src = tmp_path / "train.jsonl"
    src.write_bytes(_math_train_rows([1, 2]))
    cfg = load_config(_write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(src), "levels": [3, 4, 5]}}}))
    with pytest.raises(ValueError, match=r"'math_train' has no records after filters \{'levels': \[3, 4, 5\]\}"):
        data_manifest(cfg)


def test_data_manifest_accepts_non_empty_sets(tmp_path):
    from oar.config import load_config
    from oar.report import data_manifest

    src = tmp_path / "train.jsonl"
    src.write_bytes(_math_train_rows([3, 4]))
    cfg = load_config(_write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(src), "levels": [3]}}}))
    assert data_manifest(cfg)["train"]["records"] == 1


@pytest.mark.parametrize("content, levels", [(b"", None), (b"\n\n", None), (_math_train_rows([1]), [3, 4, 5])])
def test_load_training_records_empty_is_a_clear_value_error(tmp_path, content, levels):
    from oar.config import load_config
    from oar.train import load_training_records

    src = tmp_path / "train.jsonl"
    src.write_bytes(content)
    bench = {"name": "math_train", "source": str(src), **({"levels": levels} if levels else {})}
    cfg = load_config(CONFIG, small_overrides(tmp_path, task={"kind": "benchmark", "benchmark": bench}))
    with pytest.raises(ValueError, match=r"task\.benchmark \(training set\): benchmark 'math_train' has no records") as info:
        load_training_records(cfg)
    assert str(src) in str(info.value) and "\n" not in str(info.value)


def test_load_training_records_folder_source_names_its_file(tmp_path):
    from oar.config import load_config
    from oar.train import load_training_records

    (tmp_path / "train.jsonl").write_bytes(b"")
    cfg = load_config(CONFIG, small_overrides(tmp_path, task={"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(tmp_path)}}))
    with pytest.raises(ValueError, match=rf"no records in {tmp_path / 'train.jsonl'}"):
        load_training_records(cfg)


# ------------------------------------------------------------------ extends: a config as changes to another


def test_ablations_config_extends_the_default_adding_methods():
    from oar.config import load_config, resolve_methods

    base = load_config(ROOT / "config" / "config.yaml")
    abl = load_config(ROOT / "config" / "ablations.yaml")
    assert abl["name"] == "ablations" and "extends" not in abl
    assert list(resolve_methods(abl))[: len(base["methods"])] == list(base["methods"])
    assert {"dapo_ktae", "oar_g_q50", "oar_g_nomass", "dapo_oar_g"} <= set(abl["methods"]) - set(base["methods"])
    assert abl["task"] == base["task"] and abl["train"] == base["train"]  # same testbed
    assert abl["attribution"]["enabled"] is False and base["attribution"]["enabled"] is True


def test_extends_chain_merges_and_names_the_file_for_a_missing_base_or_a_loop(tmp_path):
    from oar.config import ConfigError, resolve_extends

    (tmp_path / "a.yaml").write_text("name: a\ntrain: {steps: 5, lr: 0.1}\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\ntrain: {steps: 7}\n")
    top = {"extends": "b.yaml", "name": "c"}
    assert resolve_extends(top, tmp_path / "c.yaml") == {"name": "c", "train": {"steps": 7, "lr": 0.1}}
    with pytest.raises(ConfigError, match=r"c\.yaml: key extends: no such config file .*nope\.yaml"):
        resolve_extends({"extends": "nope.yaml"}, tmp_path / "c.yaml")
    (tmp_path / "x.yaml").write_text("extends: y.yaml\n")
    (tmp_path / "y.yaml").write_text("extends: x.yaml\n")
    with pytest.raises(ConfigError, match="loop"):
        resolve_extends({"extends": "x.yaml"}, tmp_path / "z.yaml")
