"""Issue 30: a sourceable scripts/setup.sh, and dotted overrides (``oar ... --set train.lr=1e-3``,
``snakemake --config set="train.lr=1e-3 rollout.n=4"``) whose errors name where the value came from
(the command line, or the file, line and ``extends:`` chain), suggest the nearest key for a misspelt
one, and name ``methods.<x>.base`` for a typo in a method's base."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, one_error_line, run_cli

CONFIG = ROOT / "config" / "config.yaml"
SETUP = ROOT / "scripts" / "setup.sh"


# ------------------------------------------------------------------------------ 1. source setup.sh
@pytest.fixture
def fake_venv(tmp_path) -> Path:
    """A venv whose ``bin/python`` only logs its arguments to ``calls`` and exits ``$FAKE_RC`` (0): setup.sh
    installs nothing, in well under a second, and never touches a real environment."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/../calls"\nexit "${FAKE_RC:-0}"\n')
    python.chmod(0o755)
    return venv


def _bash(script: str, venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OAR_VENV": str(venv), **env})


_OPTIONS = 'echo "opts=$-"; set -o | grep -w pipefail'


def test_sourcing_setup_leaves_the_callers_shell_options_unchanged(fake_venv):
    proc = _bash(f"set +e; {_OPTIONS}; source scripts/setup.sh; echo rc=$?; {_OPTIONS}; "
                 'case ":$PATH:" in *":$OAR_VENV/bin:"*) echo on-path;; esac', fake_venv)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    before, after = lines[:2], lines[3:5]
    assert lines[2] == "rc=0"
    assert after == before, proc.stdout
    opts = after[0].removeprefix("opts=")
    assert "e" not in opts and "u" not in opts and after[1].split() == ["pipefail", "off"]
    assert lines[5] == "on-path"  # what sourcing is for
    assert len((fake_venv / "calls").read_text().splitlines()) == 2  # torch, then the package
    # the stamp: a second source installs nothing
    assert _bash("source scripts/setup.sh", fake_venv).returncode == 0
    assert len((fake_venv / "calls").read_text().splitlines()) == 2


def test_a_failed_install_returns_to_the_sourcing_shell_instead_of_closing_it(fake_venv):
    proc = _bash(f"set +e; source scripts/setup.sh; echo rc=$?; {_OPTIONS}", fake_venv, FAKE_RC="3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "rc=3" and "e" not in lines[1].removeprefix("opts=") and lines[2].split() == ["pipefail", "off"]
    assert "setup.sh: installing into" in proc.stderr and not (fake_venv / ".oar-setup-stamp").exists()


def test_setup_run_with_bash_stays_strict(fake_venv):
    proc = subprocess.run(["bash", str(SETUP)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OAR_VENV": str(fake_venv), "FAKE_RC": "3"})
    assert proc.returncode == 3
    assert len((fake_venv / "calls").read_text().splitlines()) == 1  # stopped at the first failure
    assert not (fake_venv / ".oar-setup-stamp").exists()


# ------------------------------------------------------------------- 2. oar <command> --set KEY.SUB=VALUE




@pytest.fixture
def loaded(monkeypatch) -> list[dict]:
    """Every config the CLI loads (oar.config.load.load_config, spied on)."""
    import oar.config.load

    seen: list[dict] = []
    real = oar.config.load.load_config

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(oar.config.load, "load_config", spy)
    return seen


def test_set_on_oar_methods_reaches_the_resolved_config(capsys, loaded):
    rc, out, err = run_cli(["methods", "--config", str(CONFIG), "--set", "train.lr=1e-3", "rollout.n=4",
                         "--set", "seeds=[0,1]", "methods.oar_g.quantile=0.3", "--set", "train.lr=2e-3"], capsys)
    assert rc == 0, err
    (config,) = loaded
    assert config["train"]["lr"] == 0.002 and isinstance(config["train"]["lr"], float)  # in order: the last wins
    assert config["rollout"]["n"] == 4 and config["seeds"] == [0, 1]
    assert config["train"]["prompts_per_step"] == yaml.safe_load(CONFIG.read_text())["train"]["prompts_per_step"]
    assert "'quantile': 0.3" in next(ln for ln in out.splitlines() if ln.startswith("oar_g "))


def test_set_on_oar_plan_changes_the_plan(capsys):
    rc, out, err = run_cli(["plan", "--config", str(CONFIG)], capsys)
    assert rc == 0, err
    layers = yaml.safe_load(CONFIG.read_text())["model"]["tiny"]["num_layers"]
    assert f"{layers} layers" in out
    rc, out, err = run_cli(["plan", "--config", str(CONFIG), "--set", f"model.tiny.num_layers={layers + 1}"], capsys)
    assert rc == 0, err
    assert f"{layers + 1} layers" in out


def test_every_command_with_config_takes_set():
    from oar.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    with_config = [name for name, p in sub.choices.items() if any("--config" in a.option_strings for a in p._actions)]
    # the two that read no config: compare (the run's own resolved config) and fetch-model (--source)
    assert set(sub.choices) - set(with_config) == {"compare", "fetch-model"}
    for name in with_config:
        args = parser.parse_args([*([name] if name != "regimes" else ["regimes", "cells"]), "--config", "c.yaml",
                                  *(["--method", "m", "--output", "o"] if name == "train" else []),
                                  *(["--output", "o"] if name in ("sft", "evaluate", "data") else []),
                                  *(["--model", "m", "--output", "o"] if name in ("attribution", "verifier") else []),
                                  "--set", "a.b=1", "c=2", "--set", "d.e=x"])
        assert args.set == ["a.b=1", "c=2", "d.e=x"], name


def test_a_bad_set_value_names_the_command_line_one_line_exit_2(capsys):
    rc, _, err = run_cli(["methods", "--config", str(CONFIG), "--set", "train.lr=abc"], capsys)
    assert rc == 2
    line = one_error_line(err, "methods")
    assert line == "oar methods: error: command line: --set train.lr=abc: key train.lr: 'abc' is not of type 'number'"


@pytest.mark.parametrize("assignment, message", [
    ("train.lrr=1", "command line: --set train.lrr=1: unknown key train.lrr; did you mean train.lr?"),
    ("train.lr.x=1", "command line: --set train.lr.x=1: key train.lr is a float, not a mapping; cannot set train.lr.x"),
    ("train..lr=1", "command line: --set train..lr=1: empty key component in 'train..lr'"),
    ("methods.oar_g.quantil=0.3", "command line: --set methods.oar_g.quantil=0.3: key methods.oar_g.quantil: not an "
                                  "option of recipe 'grpo' or credit 'oar_g'; did you mean quantile?"),
])
def test_set_mistakes_are_one_line_naming_the_assignment(capsys, assignment, message):
    rc, _, err = run_cli(["methods", "--config", str(CONFIG), "--set", assignment], capsys)
    assert rc == 2
    assert one_error_line(err, "methods").startswith(f"oar methods: error: {message}")


def test_set_without_a_value_is_refused_by_argparse(capsys):
    rc, _, err = run_cli(["methods", "--config", str(CONFIG), "--set", "train.lr"], capsys)
    assert rc == 2
    assert "argument --set: expected KEY.SUB=VALUE" in one_error_line(err, "methods")


def test_override_value_types_as_yaml():
    from oar.config.overrides import override_value as typed

    assert typed("1e-3") == 0.001 and typed("4") == 4 and typed("true") is True and typed("null") is None
    assert typed("[0,1]") == [0, 1] and typed("{lr: 0.1, schedule: cosine}") == {"lr": 0.1, "schedule": "cosine"}
    assert typed("'1'") == "1" and typed("results/x") == "results/x" and typed("2024-01-01") == "2024-01-01"
    assert typed("") == "" and typed("a b") == "a b"


def test_apply_assignments_creates_mappings_indexes_lists_and_leaves_the_input():
    from oar.config.overrides import apply_assignments, assigned_values, parse_assignments
    from oar.config.source import ConfigError

    config = {"train": {"init": None}, "eval": {"benchmarks": [{"name": "a", "n": 1}, {"name": "b"}]}}
    sets = parse_assignments(["train.init.x=1", "eval.benchmarks.1.n=5", "new.key=v"])
    out = apply_assignments(config, sets)
    assert out == {"train": {"init": {"x": 1}}, "eval": {"benchmarks": [{"name": "a", "n": 1}, {"name": "b", "n": 5}]},
                   "new": {"key": "v"}}
    assert config["train"]["init"] is None and "n" not in config["eval"]["benchmarks"][1]
    # what a file that extends the original needs to hold for the same effect: a list goes whole
    assert assigned_values(out, sets) == {"train": {"init": {"x": 1}}, "new": {"key": "v"},
                                          "eval": {"benchmarks": out["eval"]["benchmarks"]}}
    with pytest.raises(ConfigError, match=r"^command line: --set eval\.benchmarks\.2\.n=1: key eval\.benchmarks is a "
                                          r"list of 2; '2' is no index of it$"):
        apply_assignments(config, parse_assignments(["eval.benchmarks.2.n=1"]))


def test_regime_cells_carry_the_set_values(tmp_path, capsys):
    out = tmp_path / "cells"
    config = ROOT / "config" / "regimes.yaml"
    rc, stdout, err = run_cli(["regimes", "cells", "--config", str(config), "--out", str(out),
                            "--set", "train.lr=3e-4", "rollout.n=2"], capsys)
    assert rc == 0, err
    from oar.config.load import load_config

    for path in stdout.split():
        cell = yaml.safe_load(Path(path).read_text())
        resolved = load_config(path)
        assert resolved["train"]["lr"] == 3e-4  # from the command line
        # a cell's own axis wins over the command line
        assert resolved["rollout"]["n"] == cell.get("rollout", {}).get("n", 2)
        assert resolved["name"] == Path(path).stem


# --------------------------------------------------------- 3. errors name the file, line and extends chain
def _fails(capsys, path: Path | str, command: str = "methods") -> str:
    rc, _, err = run_cli([command, "--config", str(path)], capsys)
    assert rc == 2, err
    return one_error_line(err, command).removeprefix(f"oar {command}: error: ")


def _line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def test_a_bad_value_in_a_file_names_the_file_line_and_its_extends(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    top = tmp_path / "top.yaml"
    top.write_text(f"extends: {CONFIG}\nname: top\ntrain:\n  lr: abc\n")
    assert _fails(capsys, top) == f"{top}:4 (extends config/config.yaml): key train.lr: 'abc' is not of type 'number'"


def test_a_bad_value_in_a_base_names_the_base_and_who_extends_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = CONFIG.read_text().replace("  lr: 1.0e-4", "  lr: abc", 1)
    (tmp_path / "base.yaml").write_text(text)
    (tmp_path / "mid.yaml").write_text("extends: base.yaml\nname: mid\n")
    (tmp_path / "top.yaml").write_text("extends: mid.yaml\nname: top\n")
    line = _line_of(text, "  lr: abc")
    assert _fails(capsys, "top.yaml") == (f"base.yaml:{line} (extended by mid.yaml, which is extended by top.yaml): "
                                          "key train.lr: 'abc' is not of type 'number'")
    (tmp_path / "base.yaml").write_text(CONFIG.read_text())
    (tmp_path / "top.yaml").write_text("extends: mid.yaml\nname: top\nseeds: [0, -1]\n")
    assert _fails(capsys, "top.yaml") == ("top.yaml:3 (extends mid.yaml, which extends base.yaml): key seeds.1: -1 is "
                                          "less than the minimum of 0")


def test_the_shipped_chain_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    top = tmp_path / "top.yaml"
    top.write_text(f"extends: {ROOT / 'config' / 'ablations.yaml'}\ntrain: {{lr: abc}}\n")
    assert _fails(capsys, top).startswith(f"{top}:2 (extends config/ablations.yaml, which extends config/config.yaml): "
                                          "key train.lr:")


@pytest.mark.parametrize("body, message", [
    ("train:\n  lrr: 0.1\n", "top.yaml:3 (extends config/config.yaml): unknown key train.lrr; did you mean train.lr?"),
    ("seedz: [0]\n", "top.yaml:2 (extends config/config.yaml): unknown key seedz; did you mean seeds?"),
    ("rollout: {n: 4, max_new_tokenz: 8}\n",
     "top.yaml:2 (extends config/config.yaml): unknown key rollout.max_new_tokenz; "
     "did you mean rollout.max_new_tokens?"),
])
def test_a_misspelt_key_names_the_nearest_valid_key(tmp_path, monkeypatch, capsys, body, message):
    monkeypatch.chdir(ROOT)
    top = tmp_path / "top.yaml"
    top.write_text(f"extends: {CONFIG}\n{body}")
    assert _fails(capsys, top) == f"{tmp_path}/{message}"


def test_a_method_base_typo_names_methods_x_base_and_the_nearest_method(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    top = tmp_path / "top.yaml"
    top.write_text(f"extends: {CONFIG}\nmethods:\n  x: {{base: oar_gg}}\n")
    where = f"{top}:3 (extends config/config.yaml)"
    assert _fails(capsys, top) == f"{where}: key methods.x.base: unknown method 'oar_gg'; did you mean oar_g?"
    top.write_text(f"extends: {CONFIG}\nmethods:\n  x: {{recipe: grpoo}}\n")
    assert _fails(capsys, top) == f"{where}: key methods.x.recipe: unknown recipe 'grpoo'; did you mean grpo?"
    top.write_text(f"extends: {CONFIG}\nonly_methods: [grpo, oar_gg]\n")
    assert _fails(capsys, top).startswith(f"{top}:2 (extends config/config.yaml): key only_methods.1: "
                                          "unknown method(s) ['oar_gg']; did you mean oar_g?")


def test_transfer_methods_are_methods_of_the_config(tmp_path, monkeypatch, capsys):
    """eval.transfer defaults to no benchmark and no method; a name it lists that the config does not run
    (not in methods, or not in only_methods) is one line naming the file, line and key."""
    from oar.config.load import load_config

    monkeypatch.chdir(ROOT)
    assert load_config(CONFIG)["eval"]["transfer"] == {"benchmarks": [], "methods": []}
    top = tmp_path / "top.yaml"
    top.write_text(f"extends: {CONFIG}\neval:\n  transfer: {{methods: [grpo, oar_gg]}}\n")
    where = f"{top}:3 (extends config/config.yaml)"
    assert _fails(capsys, top) == f"{where}: key eval.transfer.methods.1: unknown method 'oar_gg'; did you mean oar_g?"
    top.write_text(f"extends: {CONFIG}\nonly_methods: [grpo]\neval:\n  transfer: {{methods: [oar_g]}}\n")
    assert _fails(capsys, top) == (f"{top}:4 (extends config/config.yaml): key eval.transfer.methods.0: method "
                                   "'oar_g' is not in only_methods ['grpo'] (a transfer row is a method the config runs)")


def test_a_file_without_extends_names_file_and_line(tmp_path, capsys):
    text = CONFIG.read_text().replace("  lr: 1.0e-4", "  lr: abc", 1)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert _fails(capsys, path) == f"{path}:{_line_of(text, '  lr: abc')}: key train.lr: 'abc' is not of type 'number'"


# ------------------------------------------------------------- 4. snakemake --config set="KEY.SUB=VALUE ..."
needs_snakemake = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None, reason="snakemake not installed")


def _snakemake(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _grpo_fingerprint(results: Path, sets: list[str]) -> str:
    """The grpo run's fingerprint of config/smoke.yaml with ``sets`` (what train's shell command carries)."""
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import run_key

    config = load_config(ROOT / "config" / "smoke.yaml", {"results_dir": str(results)}, sets=sets)
    return run_key(config, resolve_methods(config)["grpo"], sft=bool(config["sft"]["enabled"]))


@needs_snakemake
@pytest.mark.slow  # one snakemake dry run of one training job's chain: a few seconds
def test_snakemake_config_set_takes_effect_and_only_its_effect_is_fingerprinted(tmp_path):
    sets = ["train.lr=1e-3", "rollout.n=4"]
    target = f"{tmp_path}/smoke/grpo/seed0/train_summary.json"
    proc = _snakemake("-n", "-p", target, "--configfile", "config/smoke.yaml",
                      "--config", f"set={' '.join(sets)}", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shell = next(ln for ln in proc.stdout.splitlines() if "reset_if_changed.sh" in ln)
    # the same fingerprint as the file with the change written into it: `set` itself is in no fingerprint
    assert f" {_grpo_fingerprint(tmp_path, sets)}-$(cat " in shell
    assert f" {_grpo_fingerprint(tmp_path, [])}-$(cat " not in shell


@needs_snakemake
@pytest.mark.slow  # one snakemake process that stops while reading its config: a few seconds
def test_snakemake_config_set_bad_value_names_the_command_line(tmp_path):
    proc = _snakemake("-n", "--configfile", "config/smoke.yaml", "--config", "set=rollout.n=4 train.lr=abc",
                      f"results_dir={tmp_path}")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "command line: --config set=train.lr=abc: key train.lr: 'abc' is not of type 'number'" in text
    assert "smoke.yaml" not in text.split("command line:")[0].splitlines()[-1]


@needs_snakemake
@pytest.mark.slow  # two snakemake dry runs of one training job's chain: a few seconds each
def test_snakemake_several_set_entries_apply_in_order_like_the_cli(tmp_path):
    """``--config set="train.lr=1e-3" set="train.steps=3"`` keeps both (Snakemake's config holds only the
    last; the raw --config arguments hold all): the fingerprint is the one of both assignments, as the
    oar CLI's repeated --set gives, and a later entry wins over an earlier one for the same key."""
    target = f"{tmp_path}/smoke/grpo/seed0/train_summary.json"

    def shell_of(*entries: str) -> str:
        proc = _snakemake("-n", "-p", target, "--configfile", "config/smoke.yaml", "--config", *entries,
                          f"results_dir={tmp_path}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return next(ln for ln in proc.stdout.splitlines() if "reset_if_changed.sh" in ln)

    both = _grpo_fingerprint(tmp_path, ["train.lr=1e-3", "train.steps=3"])
    assert both != _grpo_fingerprint(tmp_path, ["train.steps=3"])
    assert f" {both}-$(cat " in shell_of("set=train.lr=1e-3", "set=train.steps=3")
    later = _grpo_fingerprint(tmp_path, ["train.lr=1e-2"])
    assert f" {later}-$(cat " in shell_of("set=train.lr=1e-3", "set=train.lr=1e-2")


def test_workflow_config_merges_every_set_argument_in_order(tmp_path):
    from oar.config.load import workflow_config

    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text())
    raw = ["set=train.lr=1e-3 rollout.n=4", "set=train.steps=3 rollout.n=2"]
    given = yaml.safe_load(path.read_text())  # what Snakemake read from --configfile
    cfg, _ = workflow_config(given, configfiles=[path], default_configfile=path,
                             cli_config={"set": "train.steps=3 rollout.n=2"}, config_args=raw)
    assert (cfg["train"]["lr"], cfg["train"]["steps"], cfg["rollout"]["n"]) == (1e-3, 3, 2)
    one, _ = workflow_config(given, configfiles=[path], default_configfile=path, cli_config={"set": "train.steps=3"},
                             config_args=["set=train.steps=3"])
    assert one["train"]["steps"] == 3 and one["train"]["lr"] != 1e-3
