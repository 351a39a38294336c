"""Bad input fails early with one clear line naming the file, line, flag or key (issue 11, item 6):
hub ids offline, CLI numbers, --config overrides in Snakemake, unbounded dynamic sampling,
non-UTF-8 data files, and empty benchmark or training sets; and (issue 31) a model that cannot
load, a corrupt MLflow store, and an output that cannot be a folder written here."""

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

from helpers import ROOT, one_error_line, small_overrides

CONFIG = ROOT / "config" / "config.yaml"


def _write_config(tmp_path: Path, change: dict, name: str = "config.yaml") -> Path:
    """config/config.yaml with ``change`` merged in, written to ``tmp_path/name``."""
    from oar.config.source import deep_merge

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
    line = one_error_line(err, "evaluate")
    assert hub_id in line and "offline" in line and "not found in the local" in line


def test_hub_model_id_offline_from_load_policy_is_a_file_not_found(offline):
    from oar.models.loading import load_policy

    with pytest.raises(FileNotFoundError, match=r"'SomeOrg/some-model'.*cannot be loaded offline") as info:
        load_policy({"source": "SomeOrg/some-model"})
    assert "\n" not in str(info.value)


def test_hub_benchmark_id_offline_is_one_line_exit_2(offline, tmp_path, capsys):
    cfg = _write_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": "SomeOrg/some-data"}]}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2, err
    assert "'SomeOrg/some-data'" in one_error_line(err, "data")


def test_hub_model_id_offline_cli_subprocess(tmp_path):
    """The installed entry point itself: no traceback, exit 2."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "oar.cli", "evaluate", "--config", str(CONFIG), "--model", "SomeOrg/some-model",
         "--output", str(tmp_path / "eval")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "SomeOrg/some-model" in one_error_line(proc.stderr, "evaluate")


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
    line = one_error_line(err, argv[0])
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
    import oar.trainer.loop

    got = {}

    def fake_train(config, method, seed, output, **kw):
        got.update(steps=config["train"]["steps"], seed=seed)
        return {}

    monkeypatch.setattr(oar.trainer.loop, "train", fake_train)
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
    from oar.config.overrides import typed_override as typed

    raw = {"a": "0.001", "b": "1e-3", "c": "30", "d": "true", "e": "null", "f": ["1", "x"], "g": "results/x",
           "h": "2024-01-01", "i": "", "j": {"k": "-2"}}
    assert typed(raw) == {"a": 0.001, "b": 0.001, "c": 30, "d": True, "e": None, "f": [1, "x"], "g": "results/x",
                          "h": "2024-01-01", "i": "", "j": {"k": -2}}


# --------------------------------------------------------------------- 4. bounded dynamic sampling
@pytest.mark.parametrize("value", [-1, 0])
def test_max_num_gen_batches_must_be_positive_in_a_recipe(tmp_path, value):
    from oar.config.load import load_config
    from oar.config.source import ConfigError

    path = _write_config(tmp_path, {"recipes": {"dapo": {"max_num_gen_batches": value}}})
    with pytest.raises(ConfigError, match=rf"{path}:\d+: key recipes\.dapo\.max_num_gen_batches: {value} is less than"):
        load_config(path)


def test_max_num_gen_batches_must_be_positive_in_a_method_override(tmp_path):
    from oar.config.load import load_config
    from oar.config.source import ConfigError

    path = _write_config(tmp_path, {"methods": {"dapo": {"max_num_gen_batches": -1}}})
    with pytest.raises(ConfigError, match=r"key methods\.dapo\.max_num_gen_batches: -1 is less than"):
        load_config(path)


@pytest.mark.parametrize("name", ["config.yaml", "smoke.yaml", "paper.yaml"])
def test_shipped_configs_still_validate(name):
    from oar.config.load import load_config

    config = load_config(ROOT / "config" / name)
    for recipe in config["recipes"].values():
        assert recipe["max_num_gen_batches"] >= 1


# ------------------------------------------------------------------------------- 5. non-UTF-8 data
def test_read_jsonl_non_utf8_names_file_and_line(tmp_path):
    from oar.core.io import read_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"b": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:3: not valid UTF-8 \(byte 0xe9 at column 11\)"):
        read_jsonl(path)


def test_read_jsonl_valid_utf8_still_reads(tmp_path):
    from oar.core.io import read_jsonl

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
    assert f"{bench}:1: not valid UTF-8" in one_error_line(err, "data")


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
    line = one_error_line(err, "data")
    assert "eval.benchmarks.1" in line and "'aime24'" in line and str(folder / "test.jsonl") in line
    assert "no records" in line
    assert not manifest.exists()


def test_oar_data_fails_on_an_empty_training_set(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_bytes(b"")
    cfg = _write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {"name": "math_train", "source": str(src)}}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2
    line = one_error_line(err, "data")
    assert "training set" in line and "'math_train'" in line and str(src) in line


def test_data_manifest_fails_when_filters_leave_no_training_records(tmp_path):
    from oar.config.load import load_config
    from oar.report import data_manifest

    src = tmp_path / "train.jsonl"
    src.write_bytes(_math_train_rows([1, 2]))
    cfg = load_config(_write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(src), "levels": [3, 4, 5]}}}))
    with pytest.raises(ValueError, match=r"'math_train' has no records after filters \{'levels': \[3, 4, 5\]\}"):
        data_manifest(cfg)


def test_data_manifest_accepts_non_empty_sets(tmp_path):
    from oar.config.load import load_config
    from oar.report import data_manifest

    src = tmp_path / "train.jsonl"
    src.write_bytes(_math_train_rows([3, 4]))
    cfg = load_config(_write_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(src), "levels": [3]}}}))
    assert data_manifest(cfg)["train"]["records"] == 1


@pytest.mark.parametrize("content, levels", [(b"", None), (b"\n\n", None), (_math_train_rows([1]), [3, 4, 5])])
def test_training_records_empty_is_a_clear_value_error(tmp_path, content, levels):
    from oar.config.load import load_config
    from oar.data.records import training_records

    src = tmp_path / "train.jsonl"
    src.write_bytes(content)
    bench = {"name": "math_train", "source": str(src), **({"levels": levels} if levels else {})}
    cfg = load_config(CONFIG, small_overrides(tmp_path, task={"kind": "benchmark", "benchmark": bench}))
    with pytest.raises(ValueError, match=r"task\.benchmark \(training set\): benchmark 'math_train' has no records") as info:
        training_records(cfg["task"])
    assert str(src) in str(info.value) and "\n" not in str(info.value)


def test_training_records_folder_source_names_its_file(tmp_path):
    from oar.config.load import load_config
    from oar.data.records import training_records

    (tmp_path / "train.jsonl").write_bytes(b"")
    cfg = load_config(CONFIG, small_overrides(tmp_path, task={"kind": "benchmark", "benchmark": {
        "name": "math_train", "source": str(tmp_path)}}))
    with pytest.raises(ValueError, match=rf"no records in {tmp_path / 'train.jsonl'}"):
        training_records(cfg["task"])


# ------------------------------------------------------------------ extends: a config as changes to another


def test_ablations_config_extends_the_default_adding_methods():
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods

    base = load_config(ROOT / "config" / "config.yaml")
    abl = load_config(ROOT / "config" / "ablations.yaml")
    assert abl["name"] == "ablations" and "extends" not in abl
    assert list(resolve_methods(abl))[: len(base["methods"])] == list(base["methods"])
    assert {"dapo_ktae", "oar_g_q50", "oar_g_nomass", "dapo_oar_g"} <= set(abl["methods"]) - set(base["methods"])
    assert abl["task"] == base["task"] and abl["train"] == base["train"]  # same testbed
    assert abl["attribution"]["enabled"] is False and base["attribution"]["enabled"] is True


def test_extends_chain_merges_and_names_the_file_for_a_missing_base_or_a_loop(tmp_path):
    from oar.config.load import resolve_extends
    from oar.config.source import ConfigError

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


def test_extends_replace_drops_the_base_mapping_instead_of_merging(tmp_path):
    from oar.config.load import load_config, resolve_extends
    from oar.config.source import ConfigError

    (tmp_path / "a.yaml").write_text("name: a\ntrain: {steps: 5, lr: 0.1}\nrecipes: {x: {a: 1}, y: {b: 2}}\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nreplace: [recipes, train]\nrecipes: {z: {c: 3}}\n"
                                     "train: {steps: 7}\n")
    assert resolve_extends({"extends": "b.yaml"}, tmp_path / "c.yaml") == {
        "name": "a", "train": {"steps": 7}, "recipes": {"z": {"c": 3}}}  # merged, the keys would be x, y, z
    # a nested key; without a value of its own the mapping is gone
    (tmp_path / "n.yaml").write_text("extends: a.yaml\nreplace: [recipes.x]\n")
    assert resolve_extends({"extends": "n.yaml"}, tmp_path / "c.yaml")["recipes"] == {"y": {"b": 2}}
    # a shipped config: only the replaced mapping differs from the merge
    (tmp_path / "abl.yaml").write_text(f"extends: {ROOT / 'config' / 'config.yaml'}\nname: abl\n"
                                       "replace: [methods]\nmethods: {grpo: {recipe: grpo, credit: none}}\n")
    assert list(load_config(tmp_path / "abl.yaml")["methods"]) == ["grpo"]
    for bad, match in [("replace: [train.lr]", r"b2\.yaml:2 .*key replace: train\.lr is not a mapping"),
                       ("replace: [nope]", r"key replace: nope is not a mapping of the config it extends"),
                       ("replace: recipes", r"key replace: a list of dotted keys")]:
        (tmp_path / "b2.yaml").write_text(f"extends: a.yaml\n{bad}\n")
        with pytest.raises(ConfigError, match=match):
            resolve_extends({"extends": "b2.yaml"}, tmp_path / "c.yaml")


# ------------------------------------------- 8. the user's files: a model, the MLflow store, an output
# (issue 31, failure 3) A model folder or GGUF that cannot load, a corrupt MLflow store and an output
# path that cannot be a folder are one line naming the file and what to do, exit 2, found before any
# work: an existing run folder is left as it was, even with --restart (which would discard its state).
SMOKE = ROOT / "config" / "smoke.yaml"
#: The tiny model of config/smoke.yaml.
SMOKE_TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 128}
#: A GGUF header: the magic bytes, version 3, no tensors, no metadata.
GGUF_HEADER = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)


def _smoke_config(tmp_path: Path, change: dict) -> Path:
    """config/smoke.yaml with ``change`` merged in, written to ``tmp_path/smoke.yaml``."""
    from oar.config.source import deep_merge

    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(deep_merge(yaml.safe_load(SMOKE.read_text()), change), sort_keys=False))
    return path


def _last_error_line(err: str, command: str) -> str:
    """:func:`_one_error_line`, asserting it is also the last line of ``err`` (what the user reads)."""
    line = one_error_line(err, command)
    assert err.strip().splitlines()[-1] == line, err
    return line


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``folder``, by relative path."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _existing_run(tmp_path: Path) -> Path:
    """A run folder as a run leaves it: checkpoint, final model, metrics, MLflow run id, summary."""
    run = tmp_path / "run"
    for rel, data in {"checkpoint/model.safetensors": b"weights", "checkpoint/trainer_state.pt": b"state",
                      "checkpoint/checkpoint.json": b'{"step": 2, "files": {}}\n',
                      "model/model.safetensors": b"final weights", "metrics.jsonl": b'{"step": 0}\n{"step": 1}\n',
                      "run.json": b'{"run_id": "abc"}\n', "train_summary.json": b'{"steps": 2}\n'}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    return run


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """The smoke config's tiny model and tokenizer, saved with save_pretrained (as SFT leaves them)."""
    from oar.models.tiny import build_tiny

    folder = tmp_path_factory.mktemp("saved") / "model"
    model, tok = build_tiny(**SMOKE_TINY)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _truncate_weights(size: int):
    def damage(folder: Path) -> Path:
        _truncate(folder / "model.safetensors", size)
        return folder
    return damage


def _bad_config_json(folder: Path) -> Path:
    (folder / "config.json").write_text('{"model_type": "llama",\n')
    return folder


def _remove(name: str):
    def damage(folder: Path) -> Path:
        (folder / name).unlink()
        return folder
    return damage


def _write(name: str, text: str):
    def damage(folder: Path) -> Path:
        (folder / name).write_text(text)
        return folder
    return damage


def _gguf_file(content: bytes):
    def damage(folder: Path) -> Path:
        (folder / "model.gguf").write_bytes(content)
        return folder / "model.gguf"
    return damage


#: How a model is damaged: (the damage, given the model folder and returning the path to load; the
#: file the message names, relative to the folder; what the message says).
MODEL_DAMAGES = {
    "truncated safetensors": (_truncate_weights(4), "model.safetensors",
                              "4 bytes, shorter than a safetensors header: truncated"),
    "half a safetensors": (_truncate_weights(50_000), "model.safetensors", "50000 bytes where its header describes"),
    "config.json not JSON": (_bad_config_json, "config.json", "not valid JSON"),
    "no weights": (_remove("model.safetensors"), ".", "no weights: none of model.safetensors"),
    "no tokenizer": (_remove("tokenizer.json"), ".", "no tokenizer: none of tokenizer.json"),
    "tokenizer.json not a tokenizer": (_write("tokenizer.json", '{"foo": 1}'), "tokenizer.json",
                                       "not a tokenizer file: it has no 'model' object"),
    "tokenizer.json that does not load": (_write("tokenizer.json", '{"model": {"type": "NoSuchModel"}}'),
                                          "tokenizer.json", "the tokenizer does not load ("),
    "not a GGUF": (_gguf_file(b"not a gguf file at all"), "model.gguf", "not a GGUF file"),
    "truncated GGUF": (_gguf_file(GGUF_HEADER[:8]), "model.gguf", "8 bytes, shorter than a GGUF header"),
}


def _damaged_model(saved_model: Path, tmp_path: Path, damage: str) -> tuple[Path, Path, str]:
    """A copy of ``saved_model`` damaged as :data:`MODEL_DAMAGES` says: (path to load, file named, what is said)."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder)
    fn, named, says = MODEL_DAMAGES[damage]
    return fn(folder), (folder / named if named != "." else folder), says


def test_check_model_files_accepts_what_save_pretrained_writes_whole_or_sharded(saved_model, tmp_path):
    from oar.models.checks import ModelLoadError, check_model_files
    from oar.models.tiny import build_tiny

    check_model_files(saved_model)
    check_model_files({"source": "tiny"})
    sharded = tmp_path / "sharded"
    model, tok = build_tiny(**SMOKE_TINY)
    model.save_pretrained(sharded, max_shard_size="40KB")
    tok.save_pretrained(sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    check_model_files(sharded)
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=rf"^{shards[-1]}: cannot load the model: missing \(listed in "
                                             r"model\.safetensors\.index\.json\)"):
        check_model_files(sharded)


@pytest.mark.parametrize("damage", list(MODEL_DAMAGES))
def test_load_policy_names_the_file_of_a_model_that_cannot_load(saved_model, tmp_path, damage):
    from oar.models.checks import ModelLoadError
    from oar.models.loading import load_policy

    source, named, says = _damaged_model(saved_model, tmp_path, damage)
    with pytest.raises(ModelLoadError) as info:
        load_policy(source)
    message = str(info.value)
    assert message.startswith(f"{named}: cannot load the model: ") and says in message, message
    assert "give another model" in message and "\n" not in message


def test_load_policy_names_the_model_whose_loader_fails_without_a_traceback(saved_model, tmp_path):
    """What the checks cannot see (pickled weights that do not unpickle) is the loader's first line."""
    from oar.models.checks import ModelLoadError
    from oar.models.loading import load_policy

    source, _, _ = _damaged_model(saved_model, tmp_path, "no weights")
    (source / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ModelLoadError, match=rf"^{source}: cannot load the model: UnpicklingError: ") as info:
        load_policy(source)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", list(MODEL_DAMAGES))
def test_train_init_model_that_cannot_load_is_one_line_and_leaves_the_run(saved_model, tmp_path, capsys,
                                                                         monkeypatch, damage):
    monkeypatch.chdir(tmp_path)  # smoke.yaml's MLflow store (results/mlflow.db) goes here
    source, named, says = _damaged_model(saved_model, tmp_path, damage)
    run = _existing_run(tmp_path)
    before = _snapshot(run)
    rc, err = _cli(["train", "--config", str(SMOKE), "--method", "grpo", "--init", str(source), "--output", str(run),
                    "--restart", "--no-progress"], capsys)
    assert rc == 2, err
    line = _last_error_line(err, "train")
    assert line.startswith(f"oar train: error: {named}: cannot load the model: ") and says in line, line
    assert "give another model" in line
    assert _snapshot(run) == before  # not locked, repaired or reset


def test_train_init_that_does_not_exist_is_one_line_and_leaves_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _existing_run(tmp_path)
    before = _snapshot(run)
    missing = tmp_path / "no_such_model"
    rc, err = _cli(["train", "--config", str(SMOKE), "--method", "grpo", "--init", str(missing), "--output", str(run),
                    "--restart", "--no-progress"], capsys)
    assert rc == 2, err
    assert f"--init: {str(missing)!r} does not exist" in _last_error_line(err, "train")
    assert _snapshot(run) == before


@pytest.mark.parametrize("damage", list(MODEL_DAMAGES))
def test_evaluate_model_that_cannot_load_is_one_line_and_leaves_the_output(saved_model, tmp_path, capsys,
                                                                          monkeypatch, damage):
    monkeypatch.chdir(tmp_path)
    source, named, says = _damaged_model(saved_model, tmp_path, damage)
    out = tmp_path / "eval"
    out.mkdir()
    (out / "summary.json").write_text('{"average": {}}\n')
    before = _snapshot(out)
    rc, err = _cli(["evaluate", "--config", str(SMOKE), "--model", str(source), "--output", str(out)], capsys)
    assert rc == 2, err
    line = _last_error_line(err, "evaluate")
    assert line.startswith(f"oar evaluate: error: {named}: cannot load the model: ") and says in line, line
    assert _snapshot(out) == before


@pytest.mark.parametrize("command", ["sft", "train"])
def test_output_naming_an_existing_file_is_one_line_exit_2(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    cfg = _smoke_config(tmp_path, {"sft": {"steps": 1, "eval_size": 1}})  # small, should it ever run
    target = tmp_path / "a_file"
    target.write_bytes(b"the user's file\n")
    argv = [command, "--config", str(cfg), "--output", str(target)]
    if command == "train":
        argv += ["--method", "grpo", "--no-progress"]
    before = _snapshot(tmp_path)
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = _last_error_line(err, command)
    assert line.startswith(f"oar {command}: error: {target}: exists and is not a folder"), line
    assert "move the file away" in line
    assert _snapshot(tmp_path) == before  # the file as it was; no half-made folder beside it


needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


@needs_proc
@pytest.mark.parametrize("command", ["sft", "train", "evaluate"])
@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_output_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys, monkeypatch, command, where):
    """Nothing can be created in /proc, even by root (whom a chmod 0o555 folder does not stop)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x\n")
    out = Path("/proc/oar_results") / command if where == "read-only" else tmp_path / "a_file" / command
    argv = [command, "--config", str(SMOKE), "--output", str(out)]
    if command == "train":
        argv += ["--method", "grpo"]
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = _last_error_line(err, command)
    assert line.startswith(f"oar {command}: error: {out}: "), line
    if where == "read-only":
        assert "cannot write there (/proc: " in line and "writable file system" in line
    else:
        assert f"{tmp_path / 'a_file'} is a file, not a folder" in line
    assert not out.exists()


def test_check_output_folder_on_a_read_only_file_system_says_it_cannot_write(tmp_path, monkeypatch):
    """EROFS as a read-only mount gives it (mounting needs privileges a test does not have)."""
    import errno
    import tempfile

    from oar.core.io import OutputPathError, check_output_folder

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OutputPathError, match=rf"^{tmp_path / 'out'}: cannot write there \({tmp_path}: Read-only "
                                              r"file system\), so it cannot be --output; give a folder on a writable"):
        check_output_folder(tmp_path / "out", what="--output")
    assert not (tmp_path / "out").exists()


def test_check_output_folder_leaves_nothing_behind(tmp_path):
    from oar.core.io import check_output_folder

    (tmp_path / "run").mkdir()
    check_output_folder(tmp_path / "run")
    check_output_folder(tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["run"]


@pytest.mark.parametrize("command", ["train", "init-tracking"])
def test_a_corrupt_mlflow_store_stops_before_any_work(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)  # smoke.yaml's tracking.uri is sqlite:///results/mlflow.db
    store = tmp_path / "results" / "mlflow.db"
    store.parent.mkdir()
    store.write_bytes(b"this is not an SQLite database, it was overwritten\n" * 4)
    run = _existing_run(tmp_path)
    before = _snapshot(tmp_path)
    argv = [command, "--config", str(SMOKE)]
    if command == "train":
        argv += ["--method", "grpo", "--output", str(run), "--restart", "--no-progress"]
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = _last_error_line(err, command)
    assert line.startswith(f"oar {command}: error: results/mlflow.db: the MLflow store "
                           f"(tracking.uri sqlite:///results/mlflow.db) cannot be read: file is not a database; "), line
    assert "move the file away" in line and "set tracking.uri to another store" in line
    assert _snapshot(tmp_path) == before  # the store and the run as they were


def test_check_store_accepts_a_missing_an_empty_and_a_real_store(tmp_path):
    from oar.tracking.client import check_store, ensure_experiment

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    check_store(uri)  # missing: MLflow makes it
    (tmp_path / "mlflow.db").write_bytes(b"")
    check_store(uri)  # empty: SQLite makes it a database
    (tmp_path / "mlflow.db").unlink()
    ensure_experiment(uri, "x")
    check_store(uri)
    check_store("http://localhost:5000")  # not a file: not checked


# -------------------------------------------------- 9. hostile inputs (issue 54, item 7)
# A prompt longer than the model's context, a gold answer the reward cannot read, a tokenizer that
# runs past the model's embeddings, a tokenizer.json that is not one, and a model folder without a
# tokenizer: each is found by `oar data` / the pre-flight / the model's check, in one line naming the
# file (and record), exit 2 (a warning for the golds), before any output is made.

#: The room smoke.yaml's tiny model leaves for a prompt: 128 positions minus 48 new tokens.
SMOKE_ROOM = SMOKE_TINY["max_position_embeddings"] - 48
#: A 1 MB question (what issue 54 fed `oar data`).
HUGE_QUESTION = "x" * 1_000_000


def _bench_file(path: Path, questions_and_golds: list[tuple[str, str]]) -> Path:
    """An aime24-style .jsonl file, one record per line (ids 1, 2, ...)."""
    path.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n"
                            for i, (q, a) in enumerate(questions_and_golds, 1)))
    return path


def test_oar_data_refuses_a_prompt_longer_than_the_context_naming_file_and_line(tmp_path, capsys):
    bench = _bench_file(tmp_path / "aime24.jsonl", [("1+1?", "2"), (HUGE_QUESTION, "3"), ("2+2?", "4")])
    cfg = _smoke_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": str(bench)}]}})
    manifest = tmp_path / "data" / "manifest.json"
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(manifest)], capsys)
    assert rc == 2, err
    line = _last_error_line(err, "data")
    assert line == (f"oar data: error: {bench}:2: eval.benchmarks.0 (aime24): the prompt is 1000001 tokens (tiny "
                    "template), as long as the model's whole context or longer (model.tiny: max_position_embeddings "
                    "128), so nothing can be generated after it; shorten or drop the record, or use a model with a "
                    "longer context"), line
    assert not manifest.parent.exists()  # no manifest, no folder for it


def test_oar_data_warns_of_training_prompts_that_leave_less_than_the_rollout_and_refuses_full_ones(tmp_path, capsys):
    """A prompt that leaves fewer than rollout.max_new_tokens is a warning (its answers may be cut short:
    config/paper.yaml's longest MATH prompts are such); one that fills the context is an error."""
    src = tmp_path / "train.jsonl"

    def write(questions):
        src.write_text("".join(json.dumps({"problem": q, "answer": "1", "difficulty": 3.0}) + "\n" for q in questions))

    write(("1+1?", "2+2?", "y" * SMOKE_ROOM, "3+3?", "z" * 100))
    cfg = _smoke_config(tmp_path, {"task": {"kind": "benchmark", "benchmark": {"name": "math_train", "source": str(src)}},
                                   "only_methods": ["grpo"]})  # not the step verifier: it reads the synthetic task's steps
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 0, err
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("oar data: warning: task.benchmark")]
    # "y" * room plus the template's newline is one token too many; "z" * 100 too
    assert warning == (f"oar data: warning: task.benchmark (training set): 2 of 5 prompts leave fewer than "
                       f"rollout.max_new_tokens 48 new tokens in the model's context (model.tiny: max_position_embeddings "
                       f"128), so their answers may be cut short: {src}:3 ({SMOKE_ROOM + 1} tokens), {src}:5 (101 tokens); "
                       "shorten them or lower rollout.max_new_tokens")
    assert warning[len("oar data: warning: "):] in json.loads((tmp_path / "manifest.json").read_text())["warnings"]
    write(("1+1?", "w" * 200, "v" * 300))
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest2.json")], capsys)
    assert rc == 2 and f"{src}:2: task.benchmark (training set): the prompt is 201 tokens" in err
    assert f"; 1 more records do not fit either: {src}:3; shorten or drop the records" in err
    assert not (tmp_path / "manifest2.json").exists()


def test_oar_data_checks_prompts_against_a_local_model_folder(saved_model, tmp_path):
    from oar.config.load import load_config
    from oar.evaluate.prompt_checks import prompt_model

    config = load_config(_smoke_config(tmp_path, {"model": {"source": str(saved_model)}}))
    model = prompt_model(config)
    assert model.max_positions == 128 and model.origin == str(saved_model / "config.json")
    assert len(model.tokenizer) == 100


def test_oar_data_skips_the_prompt_check_for_a_hub_model_not_fetched(offline, tmp_path, capsys):
    cfg = _smoke_config(tmp_path, {"model": {"source": "Qwen/Qwen2.5-Math-1.5B"}})
    manifest = tmp_path / "manifest.json"
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(manifest)], capsys)
    assert rc == 0, err
    (note,) = [ln for ln in err.splitlines() if ln.startswith("oar data: note: ")]
    assert "'Qwen/Qwen2.5-Math-1.5B' is a hub id that is not fetched yet" in note
    assert json.loads(manifest.read_text())["checks"]["prompts"]["skipped"] in note


def test_evaluate_checks_the_prompts_again_before_it_makes_its_folder(tmp_path, capsys, monkeypatch):
    """A benchmark changed after `oar data` passed it: `oar evaluate` stops before it generates."""
    monkeypatch.chdir(tmp_path)
    bench = _bench_file(tmp_path / "aime24.jsonl", [("1+1?", "2")])
    cfg = _smoke_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": str(bench)}]}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 0, err
    _bench_file(bench, [("1+1?", "2"), (HUGE_QUESTION, "3")])
    out = tmp_path / "eval"
    rc, err = _cli(["evaluate", "--config", str(cfg), "--output", str(out)], capsys)
    assert rc == 2, err
    line = _last_error_line(err, "evaluate")
    assert line.startswith(f"oar evaluate: error: {bench}:2: eval.benchmarks.0 (aime24): the prompt is 1000001 "
                           f"tokens"), line
    assert "as long as the model's whole context" in line
    assert not out.exists()


def test_gold_readable_is_the_rewards_reading():
    from oar.reward.verify import gold_readable, score_one

    for gold in ("42", "\\frac{1}{2}", "(3, 4)", "\\sqrt{51}", "27"):
        assert gold_readable(gold, timeout_s=5.0), gold
    for gold in ("???", "-1./3", ""):
        assert not gold_readable(gold, timeout_s=5.0), gold
    assert not score_one("The answer is \\boxed{3}", "???")  # what a correct-looking answer scores against it


def test_oar_data_warns_about_gold_answers_the_reward_cannot_read(tmp_path, capsys):
    bench = _bench_file(tmp_path / "aime24.jsonl", [("1+1?", "2"), ("2+2?", "???"), ("3+3?", "6")])
    cfg = _smoke_config(tmp_path, {"eval": {"benchmarks": [{"name": "aime24", "source": str(bench)}]}})
    manifest = tmp_path / "manifest.json"
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(manifest)], capsys)
    assert rc == 0, err
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("oar data: warning: ")]
    assert warning.startswith("oar data: warning: eval.benchmarks.0 (aime24): 1 of 3 gold answers do not read as "
                              "math"), warning
    assert f"{bench}:2 '???'" in warning and "fix or drop those records" in warning
    entry = json.loads(manifest.read_text())["eval"][0]
    assert entry["unreadable_golds"] == 1 and entry["unreadable_gold_records"] == [f"{bench}:2 '???'"]


@pytest.mark.slow  # parses every gold of ../shared/data: 15-30 s
@pytest.mark.skipif(not (ROOT.parent / "shared" / "data").is_dir(), reason="../shared/data not here")
def test_the_shipped_benchmarks_hold_a_few_golds_the_reward_cannot_read():
    """Why unreadable golds are a warning (oar.evaluate.prompt_checks): refusing them would stop the shipped files."""
    from oar.data.benchmarks import load_benchmark_located
    from oar.evaluate.prompt_checks import unreadable_golds

    data = ROOT.parent / "shared" / "data"
    counts = {name: len(unreadable_golds(load_benchmark_located(name, data / name), timeout_s=5.0))
              for name in ("aime24", "amc23", "math500", "minerva_math", "olympiadbench", "gsm8k", "math_train")}
    assert counts == {"aime24": 0, "amc23": 0, "math500": 0, "minerva_math": 5, "olympiadbench": 2, "gsm8k": 0,
                      "math_train": 8}


def _new_pad_token(saved_model: Path, tmp_path: Path) -> Path:
    """``saved_model`` with a tokenizer that gained a pad token the model has no embedding row for."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    tok.save_pretrained(folder)
    return folder


def test_load_policy_refuses_a_tokenizer_past_the_models_embeddings(saved_model, tmp_path):
    from oar.models.checks import ModelLoadError
    from oar.models.loading import load_policy

    folder = _new_pad_token(saved_model, tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_policy(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'tokenizer.json'}: the tokenizer has 101 tokens (ids up to 100) but the "
                              f"model ({folder / 'config.json'}, vocab_size 100) has 100 embedding rows"), message
    assert "resize_token_embeddings" in message and "\n" not in message


@pytest.mark.parametrize("command", ["evaluate", "sft"])
def test_a_tokenizer_past_the_embeddings_is_one_line_not_an_index_error(saved_model, tmp_path, capsys, monkeypatch,
                                                                       command):
    monkeypatch.chdir(tmp_path)
    folder = _new_pad_token(saved_model, tmp_path)
    out = tmp_path / "out"
    if command == "evaluate":
        argv = ["evaluate", "--config", str(SMOKE), "--model", str(folder), "--output", str(out)]
    else:
        cfg = _smoke_config(tmp_path, {"model": {"source": str(folder)}, "sft": {"steps": 1, "eval_size": 1}})
        argv = ["sft", "--config", str(cfg), "--output", str(out)]
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = _last_error_line(err, command)
    assert line.startswith(f"oar {command}: error: {folder / 'tokenizer.json'}: the tokenizer has 101 tokens"), line
    assert not out.exists()


@pytest.mark.parametrize("command", ["evaluate", "train", "sft"])
def test_a_tokenizer_json_that_is_not_one_is_named_and_makes_no_folder(saved_model, tmp_path, capsys, monkeypatch,
                                                                      command):
    monkeypatch.chdir(tmp_path)
    source, named, says = _damaged_model(saved_model, tmp_path, "tokenizer.json not a tokenizer")
    out = tmp_path / "out"
    argv = {"evaluate": ["evaluate", "--config", str(SMOKE), "--model", str(source)],
            "train": ["train", "--config", str(SMOKE), "--method", "grpo", "--init", str(source), "--no-progress"],
            "sft": ["sft", "--config", str(_smoke_config(tmp_path, {"model": {"source": str(source)}}))]}[command]
    rc, err = _cli([*argv, "--output", str(out)], capsys)
    assert rc == 2, err
    line = _last_error_line(err, command)
    assert line.startswith(f"oar {command}: error: {named}: cannot load the model: {says}"), line
    assert not out.exists()


def test_preflight_requires_a_tokenizer_beside_a_local_models_config(saved_model, tmp_path):
    import shutil

    from oar.config.load import load_config
    from oar.pipeline.preflight import path_problems

    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    config = load_config(_smoke_config(tmp_path, {"model": {"source": str(folder)}, "train": {"init": str(folder)}}))
    problems = path_problems(config, source="c.yaml")
    assert [p.key for p in problems] == ["key model.source", "key train.init"]
    assert str(problems[0]) == (f"c.yaml: key model.source: model folder {folder} has no tokenizer: none of "
                                f"tokenizer.json, *.model, vocab.json, vocab.txt, *.tiktoken (save the tokenizer "
                                f"beside the model: tokenizer.save_pretrained)")
    trusted = load_config(_smoke_config(tmp_path, {"model": {"source": str(folder), "trust_remote_code": True}}))
    assert path_problems(trusted, source="c.yaml") == []  # its code may load the tokenizer from elsewhere
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m.gguf").write_bytes(GGUF_HEADER)  # a GGUF carries its tokenizer
    gguf = load_config(_smoke_config(tmp_path, {"model": {"source": str(tmp_path / "gguf"), "gguf_file": "m.gguf"}}))
    assert path_problems(gguf, source="c.yaml") == []
    shutil.copy(saved_model / "tokenizer.json", folder)
    assert path_problems(config, source="c.yaml") == []


def test_a_model_folder_without_a_tokenizer_stops_oar_data_in_one_line(saved_model, tmp_path, capsys):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder, ignore=shutil.ignore_patterns("tokenizer*"))
    cfg = _smoke_config(tmp_path, {"model": {"source": str(folder)}})
    rc, err = _cli(["data", "--config", str(cfg), "--output", str(tmp_path / "manifest.json")], capsys)
    assert rc == 2, err
    assert _last_error_line(err, "data") == (f"oar data: error: {cfg}: key model.source: model folder {folder} has no "
                                             f"tokenizer: none of tokenizer.json, *.model, vocab.json, vocab.txt, "
                                             f"*.tiktoken (save the tokenizer beside the model: "
                                             f"tokenizer.save_pretrained)")


@pytest.mark.parametrize("how, key", [("option", "--init"), ("config", "train.init")])
def test_a_missing_init_folder_is_named_as_what_gave_it(tmp_path, capsys, how, key):
    """The start model from --init (or train.init) that does not exist: the message names that, not
    model.source; nothing is made."""
    missing = tmp_path / "no_such_model"
    over = {"train": {"init": str(missing)}} if how == "config" else {}
    cfg = _smoke_config(tmp_path, over)
    out = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--method", "grpo", "--output", str(out)]
    rc, err = _cli(args + (["--init", str(missing)] if how == "option" else []), capsys)
    assert rc == 2, err
    line = _last_error_line(err, "train")
    # --init: the trainer's own check; train.init: the pre-flight's (it names the config file too)
    said = f"{key}: '{missing}' does not exist" if how == "option" else f"key {key}: no model folder {missing}"
    assert said in line and "model.source" not in line, line
    assert not out.exists()
