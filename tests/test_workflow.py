"""The Snakemake workflow: lint, dry runs of every shipped config and of the SLURM profile, GPU
resources of the paper config, one ablation target alone, config replacement and errors, the
fingerprinted resume script (and the train rule's reset when the SFT model changed), shell quoting of
paths (a results_dir with a space and `$(...)`), and (slow) the whole smoke DAG end to end, where
every method must have had mixed rewards, scored credit and moved weights."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
SNAKEFILE = ROOT / "workflow" / "Snakefile"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None, reason="snakemake not installed")


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `oar` of this venv
    return env


def snakemake(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*SNAKEMAKE, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def dry_run(*args: str, results: Path, cwd: Path = ROOT) -> tuple[Counter, list[dict]]:
    """``snakemake -n`` with results under ``results``: (jobs per rule, [{rule, resources, output}])."""
    proc = snakemake("-n", *args, "--config", f"results_dir={results}", cwd=cwd)  # --config takes all that follows
    text = proc.stdout + proc.stderr
    jobs = []
    for block in re.split(r"\n\s*\n", text):
        m = re.search(r"^(?:localrule|rule) (\w+):", block, re.M)
        if not m:
            continue
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        out = re.search(r"^\s+output: (.*)$", block, re.M)
        jobs.append({
            "rule": m.group(1),
            "resources": dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {},
            "output": out.group(1).split(", ") if out else [],
        })
    return Counter(j["rule"] for j in jobs), jobs


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "config" / name).read_text())


@pytest.mark.slow  # one snakemake process: a few seconds
def test_lint_is_clean():
    proc = snakemake("--lint")
    assert "Congratulations, your workflow is in a good condition" in proc.stdout + proc.stderr


@pytest.mark.slow  # one snakemake process: a few seconds
def test_dry_run_default_config(tmp_path):
    cfg = _config("config.yaml")
    n_runs = len(cfg["methods"]) * len(cfg["seeds"])
    counts, jobs = dry_run(results=tmp_path)
    assert counts == Counter({"data": 1, "sft": 1, "train": n_runs, "evaluate": n_runs, "evaluate_base": 1,
                              "attribution": 1, "report": 1, "all": 1})
    outputs = {o for j in jobs for o in j["output"]}
    R = f"{tmp_path}/{cfg['name']}"
    for m in cfg["methods"]:
        for s in cfg["seeds"]:
            assert f"{R}/{m}/seed{s}/eval/summary.json" in outputs
    assert f"{R}/tables/main.csv" in outputs and f"{R}/figures/credit_concentration.png" in outputs


@pytest.mark.slow  # one snakemake process: a few seconds
def test_dry_run_smoke_config_runs_every_method_once(tmp_path):
    cfg = _config("smoke.yaml")
    assert cfg["seeds"] == [0] and cfg["sft"]["enabled"] and cfg["attribution"]["enabled"]
    assert set(cfg["methods"]) == set(_config("config.yaml")["methods"])  # every method and ablation
    counts, _ = dry_run("--configfile", "config/smoke.yaml", results=tmp_path)
    n = len(cfg["methods"])
    assert counts == Counter({"data": 1, "sft": 1, "train": n, "evaluate": n, "evaluate_base": 1,
                              "attribution": 1, "report": 1, "all": 1})


@pytest.mark.slow  # one snakemake process: a few seconds
def test_dry_run_paper_config(tmp_path):
    from oar.config import load_config

    cfg = load_config(ROOT / "config" / "paper.yaml")  # passes validation
    assert cfg["model"]["source"] == "Qwen/Qwen2.5-Math-7B" and cfg["rollout"]["engine"] == "vllm"
    assert [b["name"] for b in cfg["eval"]["benchmarks"]] == ["aime24", "amc23", "math500", "minerva_math",
                                                              "olympiadbench", "gsm8k"]
    counts, jobs = dry_run("--configfile", "config/paper.yaml", results=tmp_path)
    n_runs = len(cfg["methods"]) * len(cfg["seeds"])
    # sft and attribution are disabled: RL starts from the hub model
    assert counts == Counter({"data": 1, "train": n_runs, "evaluate": n_runs, "evaluate_base": 1, "report": 1,
                              "all": 1})
    for j in jobs:
        if j["rule"] in ("train", "evaluate", "evaluate_base"):
            assert int(j["resources"]["gpu"]) == cfg["resources"][j["rule"]]["gpu"] >= 1


@pytest.mark.slow  # one snakemake process: a few seconds
def test_configfile_replaces_the_default_instead_of_merging(tmp_path):
    cfg = _config("smoke.yaml")
    cfg["methods"] = {"grpo": {"recipe": "grpo", "credit": "none"}, "oar_g": {"recipe": "grpo", "credit": "oar_g"}}
    cfg["seeds"] = [3, 4]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(cfg))
    counts, jobs = dry_run("--configfile", str(path), results=tmp_path)
    assert counts["train"] == 4  # not the union with config/config.yaml's ten methods
    trained = {o for j in jobs if j["rule"] == "train" for o in j["output"]}
    assert trained == {f"{tmp_path}/smoke/{m}/seed{s}/train_summary.json" for m in ("grpo", "oar_g") for s in (3, 4)}


@pytest.mark.slow  # one snakemake process: a few seconds
def test_one_ablation_target_builds_only_its_chain(tmp_path):
    target = f"{tmp_path}/tiny/oar_g_q50/seed0/eval/summary.json"
    counts, jobs = dry_run(target, results=tmp_path)
    assert counts == Counter({"data": 1, "sft": 1, "train": 1, "evaluate": 1})
    assert [j["output"] for j in jobs if j["rule"] == "train"] == [[f"{tmp_path}/tiny/oar_g_q50/seed0/train_summary.json"]]


@pytest.mark.slow  # one snakemake process: a few seconds
def test_unknown_method_or_seed_target_is_rejected(tmp_path):
    for target in (f"{tmp_path}/tiny/nosuch/seed0/eval/summary.json", f"{tmp_path}/tiny/grpo/seed9/eval/summary.json"):
        proc = snakemake("-n", target, "--config", f"results_dir={tmp_path}", check=False)
        assert proc.returncode != 0
        assert "MissingRuleException" in proc.stderr + proc.stdout or "No rule to produce" in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, message",
    [
        ({"train": {"stepz": 3}}, "key train: Additional properties are not allowed ('stepz' was unexpected)"),
        ({"methods": {"base": {"recipe": "grpo", "credit": "none"}}}, "reserved name(s) ['base']"),
    ],
)
def test_bad_config_fails_with_key_path(tmp_path, change, message):
    from oar.config import deep_merge

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(deep_merge(_config("smoke.yaml"), change)))
    proc = snakemake("-n", "--configfile", str(path), check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm not installed")
def test_slurm_profile_dry_run_gives_training_the_promised_gpus(tmp_path):
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.utils import set_gres_string

    profile = yaml.safe_load((ROOT / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["jobs"] > 0
    paper = _config("paper.yaml")
    counts, jobs = dry_run("--workflow-profile", "workflow/profiles/slurm", "--configfile", "config/paper.yaml",
                           results=tmp_path)
    train = [j for j in jobs if j["rule"] == "train"]
    assert len(train) == counts["train"] == len(paper["methods"]) * len(paper["seeds"])
    for j in train:
        r = j["resources"]
        assert int(r["gpu"]) == paper["resources"]["train"]["gpu"]
        assert int(r["mem_mb"]) == paper["resources"]["train"]["mem_mb"]
        assert int(r["runtime"]) == paper["resources"]["train"]["runtime"]
        assert r["slurm_partition"] == profile["set-resources"]["train"]["slurm_partition"]
        assert r["slurm_account"] == profile["default-resources"]["slurm_account"]
        # what the plugin puts on the sbatch line for this job
        job = SimpleNamespace(resources=SimpleNamespace(get=lambda k, d=None, r=r: int(r[k]) if k == "gpu" else r.get(k, d)),
                              rule=SimpleNamespace(name="train"))
        assert set_gres_string(job).strip() == f"--gpus={paper['resources']['train']['gpu']}"
    for j in jobs:
        if j["rule"] in ("data", "report"):
            assert int(j["resources"]["gpu"]) == 0 and j["resources"]["slurm_partition"] == "<cpu-partition>"


def test_reset_script_keeps_a_resumable_run_and_clears_a_changed_one(tmp_path):
    script = ROOT / "workflow" / "scripts" / "reset_if_changed.sh"
    d = tmp_path / "run"

    def run(fp):
        subprocess.run(["bash", str(script), str(d), fp, "checkpoint", "*.jsonl"], check=True, capture_output=True)

    run("A")
    (d / "checkpoint").mkdir()
    (d / "checkpoint" / "state.pt").write_text("x")
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "keep.json").write_text("{}")
    run("A")  # same fingerprint: an interrupted run resumes
    assert (d / "checkpoint" / "state.pt").exists() and (d / "metrics.jsonl").exists()
    run("B")  # config changed: partial state goes, other files stay
    assert not (d / "checkpoint").exists() and not (d / "metrics.jsonl").exists()
    assert (d / "keep.json").exists() and (d / ".fingerprint").read_text().strip() == "B"


# a results_dir (or model path) that breaks an unquoted shell command twice: a space and a command
WEIRD = "my results/$(touch PWNED)"


def shell_commands(text: str) -> dict[str, list[str]]:
    """Rule -> the shell commands ``snakemake -n -p`` printed for its jobs."""
    cmds: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*\n", text):
        rule = re.search(r"^(?:localrule|rule) (\w+):", block, re.M)
        cmd = re.search(r"^Shell command: (.*)$", block, re.M)
        if rule and cmd and cmd.group(1) != "None":  # `all` has no command
            cmds.setdefault(rule.group(1), []).append(cmd.group(1))
    return cmds


def _write_config(tmp_path: Path, cfg: dict) -> Path:
    cfg["tracking"]["uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _args_after(tokens: list[str], flag: str) -> list[str]:
    return [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == flag]


def _check_quoted(cmds: dict[str, list[str]], weird: str) -> None:
    """Every word of every command that holds part of ``weird`` holds all of it (one argument)."""
    for rule, lines in cmds.items():
        for line in lines:
            tokens = shlex.split(line)
            for tok in tokens:
                if "touch" in tok or "PWNED" in tok:
                    assert weird in tok, (rule, tok, line)


@pytest.mark.slow  # two snakemake dry runs: a few seconds each
def test_dry_run_quotes_every_value_that_reaches_a_shell(tmp_path):
    cfg = _config("smoke.yaml")
    cfg["results_dir"] = WEIRD
    path = _write_config(tmp_path, cfg)
    base = ["-n", "-p", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path), "--configfile", str(path)]
    proc = snakemake(*base)
    cmds = shell_commands(proc.stdout + proc.stderr)
    assert set(cmds) == {"data", "sft", "train", "evaluate", "evaluate_base", "attribution", "report"}
    _check_quoted(cmds, WEIRD)
    R = f"{WEIRD}/smoke"
    for rule, lines in cmds.items():
        for line in lines:
            tokens = shlex.split(line)
            assert _args_after(tokens, "--config") == [f"{R}/config.yaml"], line
            (log,) = _args_after(tokens, ">")
            assert log.startswith(f"{R}/logs/") and log.endswith(".log"), line
    (train,) = [c for c in cmds["train"] if "--method grpo " in c]
    tokens = shlex.split(train)
    assert _args_after(tokens, "--init") == [f"{R}/sft/model"]
    assert _args_after(tokens, "--output") == [f"{R}/grpo/seed0"]

    # without SFT the start model is train.init (else model.source) from the config, as given
    cfg = _config("smoke.yaml")
    cfg["sft"]["enabled"] = False
    cfg["train"]["init"] = start = "my models/init $(touch PWNED)"
    _write_config(tmp_path, cfg)
    cmds = shell_commands((p := snakemake(*base)).stdout + p.stderr)
    _check_quoted(cmds, "my models/init $(touch PWNED)")
    for rule in ("evaluate_base", "attribution"):
        (line,) = cmds[rule]
        assert _args_after(shlex.split(line), "--model") == [start], line


@pytest.mark.slow  # the data rule and onstart for real: ~15 s
def test_results_dir_with_a_space_and_command_substitution_is_one_literal_folder(tmp_path):
    """`onstart` (oar init-tracking) and a rule's shell command see the results_dir as one literal
    path: nothing in it runs, and the outputs land under the folder of that exact name."""
    cfg = _config("smoke.yaml")
    cfg["results_dir"] = WEIRD
    path = _write_config(tmp_path, cfg)
    snakemake("--snakefile", str(SNAKEFILE), "--directory", str(tmp_path), "--configfile", str(path),
              "--cores", "1", f"{WEIRD}/smoke/data/manifest.json")
    assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()
    R = tmp_path / "my results" / "$(touch PWNED)" / "smoke"
    assert json.loads((R / "data" / "manifest.json").read_text())
    assert (R / "config.yaml").stat().st_size > 0  # onstart
    assert (tmp_path / "mlflow.db").exists()  # onstart's `oar init-tracking --config <that path>`


@pytest.mark.slow  # one snakemake dry run: a few seconds
def test_train_job_starts_over_when_the_sft_model_changed(tmp_path):
    """The train rule's reset step (its shell command up to `&&`, as the workflow prints it) keeps
    an interrupted run's checkpoint while the inputs are unchanged, and removes checkpoint, model
    and metrics once the start model's sft_summary.json changed (`--forcerun sft`), so training
    starts over from the new SFT model instead of resuming a run trained from the old one."""
    cfg = _config("smoke.yaml")
    cfg["results_dir"] = "results"
    path = _write_config(tmp_path, cfg)
    run = "results/smoke/grpo/seed0"
    proc = snakemake("-n", "-p", f"{run}/train_summary.json", "--snakefile", str(SNAKEFILE),
                     "--directory", str(tmp_path), "--configfile", str(path))
    (train,) = shell_commands(proc.stdout + proc.stderr)["train"]
    reset = train.split(" && ")[0].removeprefix("(")
    assert "reset_if_changed.sh" in reset and "train --config" not in reset

    R = tmp_path / "results" / "smoke"
    (R / "data").mkdir(parents=True)
    (R / "data" / "manifest.json").write_text("{}")
    summary = R / "sft" / "model" / "sft_summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text('{"seconds": 1.0}')
    d = tmp_path / run
    partial = [d / "checkpoint" / "state.pt", d / "model" / "model.safetensors", d / "metrics.jsonl"]

    def reset_now():
        subprocess.run(["bash", "-c", reset], cwd=tmp_path, check=True, capture_output=True)

    reset_now()  # first start
    for f in partial:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
    reset_now()  # interrupted, same config and start model: resumes
    assert all(f.exists() for f in partial)
    summary.write_text('{"seconds": 2.0}')  # SFT ran again
    reset_now()
    assert not (d / "checkpoint").exists() and not (d / "model").exists() and not (d / "metrics.jsonl").exists()


def _missing_subcommands() -> list[str]:
    from oar.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return [c for c in ("data", "sft", "train", "evaluate", "attribution", "report", "init-tracking")
            if c not in sub.choices]


@pytest.mark.slow
def test_smoke_dag_end_to_end(tmp_path):
    """The whole smoke DAG on 2 cores in a temporary folder; the HTML report; a rerun has nothing
    to do; changing an evaluation setting reruns only the evaluations and the report."""
    missing = _missing_subcommands()
    if missing:
        pytest.skip(f"`oar` lacks the subcommand(s) {missing} the workflow calls")
    check_smoke_dag(tmp_path)


def check_every_method_did_something(R: Path, cfg: dict) -> None:
    """Each method's real path ran: its groups had mixed rewards (some step's accuracy strictly
    between 0 and 1), OAR scored responses, KTAE found key tokens, and the final weights moved away
    from the SFT model's (with every reward 0 the smoke run used to pass without any of that)."""
    import torch
    from safetensors.torch import load_file

    from oar.config import resolve_methods

    methods = resolve_methods(cfg)
    sft = load_file(R / "sft" / "model" / "model.safetensors")
    for name, m in methods.items():
        rows = [json.loads(line) for line in (R / name / "seed0" / "metrics.jsonl").read_text().splitlines() if line]
        assert len(rows) == cfg["train"]["steps"], name
        assert any(0 < r["accuracy"] < 1 for r in rows), (name, [r["accuracy"] for r in rows])
        if m.credit in ("oar_p", "oar_g"):
            assert any(r["credit_scored_fraction"] > 0 for r in rows), (name, rows)
        if m.credit == "ktae":
            assert any(r["credit_ktae/k_abs_mean"] > 0 for r in rows), (name, rows)
        final = load_file(R / name / "seed0" / "model" / "model.safetensors")
        assert final.keys() == sft.keys(), name
        assert any(not torch.equal(final[k], sft[k]) for k in sft), f"{name}: final weights equal the SFT model's"


def check_smoke_dag(tmp_path: Path, *, attribution: bool = True) -> None:
    cfg = _config("smoke.yaml")
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["tracking"]["uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    cfg["attribution"]["enabled"] = attribution
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["--snakefile", str(SNAKEFILE), "--directory", str(tmp_path), "--configfile", str(path)]
    snakemake(*args, "--cores", "2")
    R = tmp_path / "results" / "smoke"
    expected = ["tables/main.csv", "tables/main.md", "tables/main.tex", "tables/efficiency.csv",
                "figures/training_curves.png", "figures/credit_concentration.png", "data/manifest.json", "config.yaml"]
    if attribution:
        expected += ["attribution/fidelity.csv", "attribution/fidelity.png"]
    for rel in expected:
        assert (R / rel).stat().st_size > 0, rel
    import pandas as pd

    main = pd.read_csv(R / "tables" / "main.csv")
    assert set(main["row"]) == {"base", *cfg["methods"]}
    assert set(main["benchmark"]) == {b["name"] for b in cfg["eval"]["benchmarks"]} | {"Average"}
    assert main["mean"].between(0, 100).all()
    eff = pd.read_csv(R / "tables" / "efficiency.csv")
    assert set(eff["method"]) == set(cfg["methods"]) and (eff["time_step"] > 0).all()
    assert eff.loc[eff["method"] == "grpo", "overhead"].item() == pytest.approx(1.0)
    check_every_method_did_something(R, cfg)

    snakemake(*args, "--report", str(tmp_path / "report.html"))
    assert (tmp_path / "report.html").stat().st_size > 0
    again = snakemake(*args, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
    cfg["eval"]["temperature"] = cfg["eval"]["temperature"] + 0.1
    path.write_text(yaml.safe_dump(cfg))
    counts, _ = dry_run(*args, results=tmp_path / "results")
    assert counts == Counter({"evaluate": len(cfg["methods"]), "evaluate_base": 1, "report": 1, "all": 1})
