# Helpers shared by every rule: config loading and validation, paths, resources, fingerprints.

import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# The library is this repository's src/ (no install needed): the workflow imports it from there,
# and every rule runs it from there too (OAR below), with or without --use-conda.
SRC_DIR = os.path.abspath(os.path.join(workflow.basedir, os.pardir, "src"))
if SRC_DIR not in sys.path:
    sys.path.insert(0, SRC_DIR)

from oar.config import ConfigError, deep_merge, resolve_extends, resolve_methods, validate_config
from oar.io import atomic_write_text
from oar.plan import PlanError, preemption_signal_seconds
from oar.plan import train_layout as _train_layout
from oar.preemption import STOP_SIGNALS


# ---------------------------------------------------------------------------------------- config
# config/config.yaml is the embedded default. A --configfile replaces it instead of being merged
# into it (so a config's `methods` are exactly the ones it lists); --config KEY=VALUE overrides
# apply on top of either.
DEFAULT_CONFIGFILE = "config/config.yaml"

if not workflow.overwrite_configfiles:
    if not os.path.exists(DEFAULT_CONFIGFILE):
        raise WorkflowError(
            f"no --configfile given and the default {DEFAULT_CONFIGFILE} does not exist "
            f"(working directory {os.getcwd()}); run snakemake from the repository root"
        )
    with open(DEFAULT_CONFIGFILE, encoding="utf-8") as _f:
        _merged = deep_merge(yaml.safe_load(_f) or {}, dict(config))
    config.clear()
    config.update(_merged)

# a --configfile that says `extends: config.yaml` is a set of changes to that config (oar.config.resolve_extends)
if workflow.overwrite_configfiles and "extends" in config:
    try:
        _merged = resolve_extends(dict(config), workflow.overwrite_configfiles[-1])
    except ConfigError as e:
        raise WorkflowError(str(e))
    config.clear()
    config.update(_merged)

# --config KEY=VALUE: give the scalars inside mapping/list values their YAML types (see typed_override)
_YAML12_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def typed_override(value):
    """A --config value with the scalars inside its mappings and lists given their YAML types.

    Snakemake parses a --config value that is a mapping or a list with YAML's BaseLoader, which
    leaves every scalar in it a string ('train={"lr": 0.001}' gives {"lr": "0.001"}), while a
    top-level value such as steps=30 is typed. Nested scalars become int, float, bool or null as
    in a config file (plus 1e-3 without a dot, a float in YAML 1.2); anything else (text, paths,
    dates) stays the string it was.
    """
    if isinstance(value, dict):
        return {k: typed_override(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed_override(v) for v in value]
    if not isinstance(value, str) or not value.strip():
        return value
    if _YAML12_EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    try:
        typed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return typed if typed is None or isinstance(typed, (bool, int, float)) else value


# only mapping and list values went through the BaseLoader; top-level scalars keep Snakemake's type
_nested_overrides = {
    k: typed_override(v) for k, v in dict(workflow.config_settings.config).items() if isinstance(v, (dict, list))
}
if _nested_overrides:
    _merged = deep_merge(dict(config), _nested_overrides)
    config.clear()
    config.update(_merged)

CONFIG_SOURCE = ", ".join(map(str, workflow.overwrite_configfiles)) or DEFAULT_CONFIGFILE

# oar's validation first: it names the file and the key path of the first problem, fills nested
# defaults and resolves every method; snakemake's validate then checks the same schema again
try:
    validate_config(config, source=CONFIG_SOURCE)
except ConfigError as e:
    raise WorkflowError(str(e))
validate(config, "../schemas/config.schema.yaml")

METHODS = resolve_methods(config, source=CONFIG_SOURCE)
SEEDS = [int(s) for s in config["seeds"]]
BENCHMARKS = [b["name"] for b in config["eval"]["benchmarks"]]
SFT = bool(config["sft"]["enabled"])
ATTRIBUTION = bool(config["attribution"]["enabled"])

# R: every output of this config lives below it
R = f"{config['results_dir']}/{config['name']}"
# the resolved config (defaults filled, --config overrides applied) that every `oar` command reads;
# written by `onstart` (not in dry runs)
CONFIG_FILE = f"{R}/config.yaml"

# results/<name>/<x>/ is used by the workflow itself for these, so no method may take the name
RESERVED_NAMES = {"base", "sft", "data", "attribution", "tables", "figures", "logs", "benchmarks", "config"}
_clash = sorted(RESERVED_NAMES & set(METHODS))
if _clash:
    raise WorkflowError(f"{CONFIG_SOURCE}: key methods: reserved name(s) {_clash} (they are result folders)")
if not BENCHMARKS:
    raise WorkflowError(f"{CONFIG_SOURCE}: key eval.benchmarks: empty; the tables need at least one benchmark")


wildcard_constraints:
    method="|".join(re.escape(m) for m in METHODS),
    seed="|".join(str(s) for s in SEEDS),


# -------------------------------------------------------------------------------------- software
# The rules run the library as OAR, `python -m oar.cli` with this repository's src/ first on
# PYTHONPATH, so the same code runs in the active environment (a venv, where `pip install -e .` is
# then optional) and in the conda env of --use-conda / --sdm conda, whose files (workflow/envs/)
# hold dependencies only: Snakemake builds an env from a copy of its file in .snakemake/conda/,
# where a path relative to the repository (pip's `-e .`) means nothing.
OAR_ENV = f"PYTHONPATH={shlex.quote(SRC_DIR)}${{PYTHONPATH:+:$PYTHONPATH}}"
OAR = f"{OAR_ENV} python -m oar.cli"


def oar_command(wildcards, input):
    """OAR as a rule param (`{params.oar} data ...`). It takes `input`, so Snakemake counts it among
    the params derived from the inputs, which it leaves out of the params it compares between runs:
    the repository at another absolute path (moved, another clone) reruns nothing. (train_launcher,
    which takes threads, is such a param too.)"""
    return OAR


# the conda env of the rules, software.conda_env (one env per config, so training and evaluation
# run the same software); `auto` takes gpu.yaml (vLLM and the torch it pins) for a config that uses
# a GPU or vLLM, else cpu.yaml
CONDA_ENVS = {"cpu": "../envs/cpu.yaml", "gpu": "../envs/gpu.yaml"}


def uses_gpu():
    """Whether the config runs anything on a GPU or with vLLM (software.conda_env: auto -> gpu)."""
    return (
        config["device"] == "cuda"
        or "vllm" in (config["rollout"]["engine"], config["eval"]["engine"])
        or any(int((r or {}).get("gpu", 0)) > 0 for r in (config.get("resources") or {}).values())
    )


def conda_env():
    """The env file of every rule: workflow/envs/{cpu,gpu}.yaml (relative to workflow/rules/, as
    Snakemake reads a rule's `conda:`), or the file software.conda_env names (relative to the
    working directory, made absolute)."""
    choice = config["software"]["conda_env"]
    if choice == "auto":
        choice = "gpu" if uses_gpu() else "cpu"
    if choice in CONDA_ENVS:
        return CONDA_ENVS[choice]
    path = os.path.abspath(choice)
    if workflow.deployment_settings.deployment_method and not os.path.isfile(path):
        raise WorkflowError(f"{CONFIG_SOURCE}: key software.conda_env: no env file {path}")
    return path


CONDA_ENV = conda_env()


# ------------------------------------------------------------------------------------- resources
# Defaults per rule; config["resources"][<rule>] overrides any key (gpu, mem_mb, runtime in
# minutes, threads; for train also nodes and processes, see train_layout). On SLURM, `gpu` becomes
# --gpus=N (snakemake-executor-plugin-slurm); mem_mb, threads and a train job's gpu are per node.
DEFAULT_RESOURCES = {
    "data": {"gpu": 0, "mem_mb": 2000, "runtime": 30, "threads": 1},
    "sft": {"gpu": 0, "mem_mb": 4000, "runtime": 120, "threads": 2},
    "train": {"gpu": 0, "nodes": 1, "processes": 0, "mem_mb": 8000, "runtime": 240, "threads": 1},
    "evaluate": {"gpu": 0, "mem_mb": 4000, "runtime": 60, "threads": 1},
    "attribution": {"gpu": 0, "mem_mb": 4000, "runtime": 60, "threads": 1},
    "report": {"gpu": 0, "mem_mb": 2000, "runtime": 15, "threads": 1},
}


# a rule without its own entry in config["resources"] uses its parent rule's entry
RESOURCE_FALLBACK = {"evaluate_base": "evaluate"}


def res(rule, key):
    """Resource ``key`` of ``rule``: config["resources"][rule][key] (or its fallback rule's), else the default."""
    table = config.get("resources") or {}
    for name in (rule, RESOURCE_FALLBACK.get(rule)):
        if name is not None and key in table.get(name, {}):
            return table[name][key]
    return DEFAULT_RESOURCES[RESOURCE_FALLBACK.get(rule, rule)][key]


def train_layout():
    """(nodes, processes per node, GPUs per node) of a training job (oar.plan.train_layout, which
    `oar plan` sizes by): `processes: 2` trains with two CPU processes."""
    return _train_layout(config)


# ------------------------------------------------------------------------------------ preemption
# SLURM ends a job (time limit, preemption, scancel) with SIGTERM to every process of its job
# steps, then SIGKILL after KillWait. The trainer (oar.preemption) then finishes its step, writes a
# checkpoint and exits 75; Snakemake's own process in the step waits for its job on SIGTERM; but
# bash dies of it, and once bash is gone Snakemake reports the job failed and exits, and SLURM
# kills what is left of the step, the trainer in the middle of its checkpoint. So every rule's
# shell ignores SIGTERM (a rule's subshell inherits that; the trainer and torchrun install their
# own handlers). The prefix is not part of a rule's recorded code: setting it reruns nothing.
shell.prefix("set -euo pipefail; trap '' TERM; ")


def train_signal_seconds():
    """Seconds before the time limit at which SLURM sends a training job SIGTERM (sbatch
    --signal=TERM@N, through the plugin's slurm_extra), and the time torchrun gives its workers to
    stop: train.preemption.signal_seconds, else sized by oar.plan.preemption_signal_seconds (the
    longest step + the checkpoint's bytes at the stated write speed + a margin)."""
    try:
        seconds = preemption_signal_seconds(config)
    except PlanError as e:
        raise WorkflowError(f"train.preemption.signal_seconds: cannot size the early SIGTERM of training jobs: {e}; "
                            f"or set train.preemption.signal_seconds (seconds)")
    runtime_s = 60 * int(res("train", "runtime"))
    if seconds >= runtime_s:
        raise WorkflowError(
            f"train.preemption: training jobs would get SIGTERM {seconds} s before their time limit, but "
            f"resources.train.runtime is {runtime_s // 60} min; raise the runtime or set a smaller "
            f"train.preemption.signal_seconds (or step_seconds, margin_seconds)")
    return seconds


TRAIN_SIGNAL_S = train_signal_seconds()
# the signals torchrun forwards to its workers: its own defaults and those that stop the trainer
TORCHRUN_SIGNALS = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in STOP_SIGNALS)]))


def train_resources():
    """The train rule's node and GPU resources (snakemake-executor-plugin-slurm names), and the
    early SIGTERM (slurm_extra: --signal=TERM@<train_signal_seconds()>; to the job steps, not B:,
    whose batch shell, the plugin's /bin/sh script, would die of it and end the job).

    One node: `gpu` (sbatch --gpus=N) and nodes=1. Several nodes: one task per node, started by
    the rule's own `srun` (see train_launcher): `mpi` tells the plugin's jobstep executor not to wrap
    the command in `srun -n1`, `tasks` = nodes gives sbatch --ntasks (the plugin asks `tasks` > 1 of an
    `mpi` job), tasks_per_gpu=0 keeps it from also passing `tasks` as --ntasks-per-gpu, and the GPUs
    are requested per node as gres=gpu:G (--gpus is a total that SLURM may spread unevenly; the
    plugin would pass both, so gpu is 0 then).
    """
    nodes, _, gpu = train_layout()
    signal = {"slurm_extra": f"--signal=TERM@{TRAIN_SIGNAL_S}"}
    if nodes == 1:
        return {"gpu": gpu, "nodes": 1, **signal}
    return {"gpu": 0, "nodes": nodes, "tasks": nodes, "tasks_per_gpu": 0, "mpi": "srun",
            **({"gres": f"gpu:{gpu}"} if gpu else {}), **signal}


# torchrun on every node of a multi-node job (run by srun, one task per node): the rendezvous host
# is the first node of the step; SLURM_JOB_ID names the rendezvous and picks the port
_NODE_TORCHRUN = (
    'MASTER_ADDR=$(scontrol show hostnames "${{SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}}" | head -n 1)'
    "; MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))"
    "; exec torchrun {signals} --nnodes {nodes} --nproc_per_node {procs} --rdzv_backend c10d"
    ' --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" -m oar.cli "$@"'
)


def train_launcher(wildcards, resources, threads):
    """The command that `train --config ...` follows (see train_layout):

    - one process: OAR, `python -m oar.cli` with the repository's src/ on PYTHONPATH (OAR_ENV
      precedes every launcher; torchrun's and srun's processes inherit it);
    - several on one node (GPUs, or CPU processes): `torchrun --standalone --nproc_per_node P -m
      oar.cli` (a free port per job, so two jobs on one machine do not collide); accelerate's
      Accelerator in the trainer takes RANK/WORLD_SIZE/LOCAL_RANK from it, NCCL on GPUs and gloo on
      CPU. (`accelerate launch --cpu --num_processes 2` starts ONE process, DistributedType.NO.)
    - several nodes (SLURM only): `srun` one task per node, each running torchrun with a c10d
      rendezvous on the first node of the job.
    OMP_NUM_THREADS splits the job's threads between its processes (snakemake sets it to all of them).
    torchrun forwards SIGUSR1 too (--signals-to-handle) and waits train_signal_seconds() for its
    workers to stop after forwarding a signal (--shutdown-timeout) before it kills them.
    """
    nodes, procs, gpu = train_layout()
    if nodes == 1 and procs == 1:
        return OAR
    omp = f"{OAR_ENV} OMP_NUM_THREADS={max(1, int(threads) // procs)}"
    signals = f"--signals-to-handle {TORCHRUN_SIGNALS} --shutdown-timeout {TRAIN_SIGNAL_S}"
    if nodes == 1:
        return f"{omp} torchrun {signals} --standalone --nnodes 1 --nproc_per_node {procs} -m oar.cli"
    node = _NODE_TORCHRUN.format(signals=signals, nodes=nodes, procs=procs)
    gres = f" --gres=gpu:{gpu}" if gpu else ""
    return (f"{omp} srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task={int(threads)}{gres}"
            f" --kill-on-bad-exit=1 bash -c {shlex.quote(node)} oar")


# ---------------------------------------------------------------------------------- fingerprints
def fingerprint(*parts):
    """Short hash of config sections; a rule's params carry it, so changing them reruns the rule."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def section(*keys):
    return {k: config.get(k) for k in keys}


# train keys a run may change without starting over (oar.runs.RESUMABLE_TRAIN_KEYS): leaving them
# out keeps the fingerprints of runs started before they existed
_RESUMABLE_NEW_TRAIN_KEYS = ("save_every_minutes", "preemption")


def method_fingerprint(method):
    m = METHODS[method]
    sections = section("model", "task", "sft", "rollout", "train", "reward")
    sections["train"] = {k: v for k, v in sections["train"].items() if k not in _RESUMABLE_NEW_TRAIN_KEYS}
    return fingerprint(
        sections,
        {"recipe": m.recipe, "credit": m.credit, "options": m.credit_options, "sft": SFT},
    )


def eval_fingerprint():
    ev = {k: v for k, v in config["eval"].items() if k != "bootstrap"}
    return fingerprint(ev, section("reward"), config["task"].get("template"), config["task"].get("seed"),
                       config["task"].get("synthetic"))


# drops a run folder's partial state when its fingerprint changed (see the script)
# (a path relative to the working directory: params are compared between runs, so they must be stable)
RESET_SCRIPT = os.path.relpath(os.path.join(workflow.basedir, "scripts", "reset_if_changed.sh"))


# ------------------------------------------------------------------------------------------ paths
MANIFEST = f"{R}/data/manifest.json"
SFT_DIR = f"{R}/sft/model"
SFT_SUMMARY = f"{SFT_DIR}/sft_summary.json"


def start_model():
    """The model RL starts from (and the base row evaluates): the SFT output, else train.init, else model.source."""
    if SFT:
        return SFT_DIR
    return config["train"].get("init") or config["model"]["source"]


def start_model_param(wildcards, input):
    """:func:`start_model` as a rule param (derived from the input when it is the SFT output)."""
    return os.path.dirname(input.start) if SFT else start_model()


def start_inputs():
    """Inputs of rules that read the starting model."""
    return {"manifest": MANIFEST, **({"start": SFT_SUMMARY} if SFT else {})}


def run_dir(method, seed):
    return f"{R}/{method}/seed{seed}"


def train_summaries():
    return [f"{run_dir(m, s)}/train_summary.json" for m in METHODS for s in SEEDS]


def eval_summaries():
    return [f"{R}/base/eval/summary.json"] + [f"{run_dir(m, s)}/eval/summary.json" for m in METHODS for s in SEEDS]


# the memory plan (rules/plan.smk): GPU training jobs wait for it, so a config that cannot fit
# stops before any of them runs, naming the term that breaks it (plan.check: false skips it)
PLAN_FILE = f"{R}/plan.txt"
PLAN = int(res("train", "gpu")) > 0 and bool(config["plan"]["check"])


def plan_inputs():
    """The train rule's input on the plan (none when training has no GPU). ancient(): rerunning the
    plan (its config sections changed) does not by itself rerun finished training."""
    return {"plan": ancient(PLAN_FILE)} if PLAN else {}


def plan_fingerprint():
    """What `oar plan` reads; the plan rule reruns when it changes."""
    return fingerprint(section("device", "model", "train", "rollout", "plan", "methods", "recipes"),
                       (config.get("resources") or {}).get("train"))


REPORT_OUTPUTS = {
    "main": f"{R}/tables/main.csv",
    "md": f"{R}/tables/main.md",
    "tex": f"{R}/tables/main.tex",
    "efficiency": f"{R}/tables/efficiency.csv",
    "curves": f"{R}/figures/training_curves.png",
    "concentration": f"{R}/figures/credit_concentration.png",
}


def final_targets():
    targets = list(REPORT_OUTPUTS.values())
    if ATTRIBUTION:
        targets += [f"{R}/attribution/fidelity.csv", f"{R}/attribution/fidelity.png"]
        targets += [f"{R}/attribution/{t['method']}_seed{t['seed']}/attribution.md"
                    for t in config["attribution"]["trained"]]
    return targets


# ---------------------------------------------------------------------------------------- onstart
def write_resolved_config():
    """Write CONFIG_FILE (only when its content changed, so its mtime means something)."""
    text = (
        f"# resolved by the workflow from {CONFIG_SOURCE} (defaults filled, --config overrides applied)\n"
        + yaml.safe_dump(json.loads(json.dumps(dict(config))), sort_keys=False)
    )
    path = Path(CONFIG_FILE)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)


onstart:
    write_resolved_config()
    if workflow.deployment_settings.deployment_method:
        # --use-conda / --sdm: the rules' software is not in this (Snakemake's) environment; each
        # training job creates the MLflow store and experiment on first use, under a file lock
        print("onstart: oar init-tracking skipped (--sdm); the jobs create the MLflow store", file=sys.stderr)
    else:
        # {CONFIG_FILE:q}: shell() formats it once, quoted (a results_dir with spaces or $(...) stays
        # one literal argument); every rule's shell command quotes its values the same way
        shell("{OAR} init-tracking --config {CONFIG_FILE:q}")
