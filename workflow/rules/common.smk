# Helpers shared by every rule: config loading and validation, paths, resources, fingerprints.

import os
import re
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# The library is this repository's src/ (no install needed): the workflow imports it from there,
# and every rule runs it from there too (OAR below), with or without --use-conda.
SRC_DIR = os.path.abspath(os.path.join(workflow.basedir, os.pardir, "src"))
if SRC_DIR not in sys.path:
    sys.path.insert(0, SRC_DIR)

from oar.config.load import workflow_config, write_resolved
from oar.config.methods import resolve_methods
from oar.config.source import ConfigError
from oar.config.validate import validate_config
from oar.models.fetch import hub_model
from oar.pipeline.preflight import path_problems, profile_files, profile_problems
from oar.core.problems import PreflightError
from oar.pipeline.launch import SHELL_PREFIX, LaunchError, conda_env_choice, disk_problems, oar_env, resource, train_signal_seconds
from oar.pipeline.launch import train_launcher as _train_launcher, train_resources as _train_resources
from oar.config.identity import (attribution_fingerprint, data_key, eval_fingerprint, fingerprint, plan_fingerprint,
                          report_fingerprint, resumable_train_values, run_key, sft_key, transfer_fingerprint,
                          uses_trained_verifier, verifier_key, attribution_uses_trained_verifier)
from oar.config.tree import BASE_ROW, TRANSFER_FOLDER, ResultsTree
from oar.pipeline.store import STORE_DIR, LayoutError, link_views, store_entries, target_problems


# ---------------------------------------------------------------------------------------- config
# the config (oar.config.load.workflow_config: the default, a --configfile, `extends:`, typed --config, and the
# dotted assignments of --config set="train.lr=1e-3 rollout.n=4"), then oar's validation (names the file
# and line or the command-line override, and the key; fills defaults, resolves methods), then snakemake's
try:
    _resolved, CONFIG_SOURCE = workflow_config(
        dict(config), configfiles=list(workflow.overwrite_configfiles), default_configfile="config/config.yaml",
        cli_config=dict(workflow.config_settings.config),
        config_args=list(workflow.config_settings.config_args or ()))
    validate_config(_resolved, source=CONFIG_SOURCE)
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_resolved)
validate(config, "../schemas/config.schema.yaml")

METHODS = resolve_methods(config, source=CONFIG_SOURCE)
SEEDS = [int(s) for s in config["seeds"]]
BENCHMARKS = [b["name"] for b in config["eval"]["benchmarks"]]
SFT = bool(config["sft"]["enabled"])
ATTRIBUTION = bool(config["attribution"]["enabled"])
# the transfer evaluation (eval.transfer): its benchmarks on the start model and on every seed of the
# methods it lists, only when it names benchmarks
TRANSFER = bool(config["eval"]["transfer"]["benchmarks"])
TRANSFER_METHODS = list(config["eval"]["transfer"]["methods"]) if TRANSFER else []

# TREE: every output of this config lives below its root R (oar.config.tree.ResultsTree names each path)
TREE = ResultsTree.of(config)
R = TREE.root
# the resolved config (defaults filled, --config overrides applied) that every `oar` command reads;
# written by `onstart` (not in dry runs)
CONFIG_FILE = TREE.config_file

# results/<name>/<x>/ is used by the workflow itself for these, so no method may take the name
RESERVED_NAMES = {"base", "sft", "data", "attribution", "tables", "figures", "logs", "benchmarks", "config", "verifier"}
_clash = sorted(RESERVED_NAMES & set(METHODS))
if _clash:
    raise WorkflowError(f"{CONFIG_SOURCE}: key methods: reserved name(s) {_clash} (they are result folders)")
if config["name"] == STORE_DIR:
    raise WorkflowError(f"{CONFIG_SOURCE}: key name: {STORE_DIR!r} is the results store's folder; choose another name")
if not BENCHMARKS:
    raise WorkflowError(f"{CONFIG_SOURCE}: key eval.benchmarks: empty; the tables need at least one benchmark")
# a target under results/<name>/ that names a method or seed this config lacks: one line with the
# nearest name, before Snakemake's MissingRuleException (the targets are not known to the workflow
# while it is read, so they are taken from the command line as Snakemake's own parser reads it)
def _command_line_targets():
    from snakemake.cli import get_argument_parser

    try:
        args, _ = get_argument_parser().parse_known_args(sys.argv[1:])
    except SystemExit:  # not a snakemake command line (the API, a test harness)
        return []
    return list(getattr(args, "targets", None) or [])


if not (getattr(workflow, "remote_exec", False) or getattr(workflow, "subprocess_exec", False)):
    _target_problems = target_problems(_command_line_targets(), results_dir=config["results_dir"],
                                       name=config["name"], methods=METHODS, seeds=SEEDS, reserved=RESERVED_NAMES)
    if _target_problems:
        raise WorkflowError("; ".join(_target_problems))

# pre-flight (oar.pipeline.preflight), at load so that a dry run stops too: every path the config names
# exists, and the profile's resources hold no placeholder such as <your-account>; not in a job's
# own Snakemake (remote, subprocess): the submitting one has checked
if not (getattr(workflow, "remote_exec", False) or getattr(workflow, "subprocess_exec", False)):
    _problems = path_problems(config, source=CONFIG_SOURCE) + profile_problems(
        workflow.resource_settings.default_resources, workflow.resource_settings.overwrite_resources,
        profiles=profile_files(sys.argv, workflow_dir=workflow.basedir))
    if _problems:
        raise WorkflowError(str(PreflightError(_problems)))


#: a regular expression that matches nothing: the constraint of a wildcard that no name may take
NO_NAME = "(?!)"


def names_pattern(names):
    """A wildcard constraint that matches exactly ``names`` (:data:`NO_NAME` for none)."""
    return "|".join(re.escape(str(n)) for n in names) or NO_NAME


wildcard_constraints:
    method=names_pattern(METHODS),
    seed=names_pattern(SEEDS),


# -------------------------------------------------------------------------------------- software
# the rules run this repository's library, in the active environment or in --use-conda's env, whose
# files hold dependencies only (a copy in .snakemake/conda/ cannot name the repository): oar.pipeline.launch.oar_env
OAR_ENV = oar_env(SRC_DIR)
OAR = f"{OAR_ENV} python -m oar.cli"


def oar_command(wildcards, input):
    """OAR as a rule param (`{params.oar} data ...`). It takes `input`, so Snakemake counts it among
    the params derived from the inputs, which it leaves out of the params it compares between runs:
    the repository at another absolute path (moved, another clone) reruns nothing. (train_launcher,
    which takes threads, is such a param too.)"""
    return OAR


# the conda env of every rule, software.conda_env (oar.pipeline.launch.conda_env_choice: one env per config)
CONDA_ENV, _builtin_env = conda_env_choice(config)
if not _builtin_env and workflow.deployment_settings.deployment_method and not os.path.isfile(CONDA_ENV):
    raise WorkflowError(f"{CONFIG_SOURCE}: key software.conda_env: no env file {CONDA_ENV}")


# ------------------------------------------------------------------------------------- resources
def res(rule, key):
    """Resource ``key`` of ``rule`` (oar.pipeline.launch.resource: config["resources"], else the defaults)."""
    return resource(config, rule, key)


# ------------------------------------------------------------------------------------ preemption
# every rule's shell ignores SIGTERM, so Snakemake's job outlives SLURM's early SIGTERM while the trainer
# checkpoints (why: oar.pipeline.launch's module docstring); the prefix is not recorded code: it reruns nothing
shell.prefix(SHELL_PREFIX)

# seconds before the time limit at which SLURM sends a training job SIGTERM, and the time torchrun
# gives its workers to stop (oar.pipeline.launch.train_signal_seconds)
try:
    TRAIN_SIGNAL_S = train_signal_seconds(config, runtime_minutes=int(res("train", "runtime")))
except LaunchError as e:
    raise WorkflowError(str(e))


def train_resources():
    """The train rule's node and GPU resources and its early SIGTERM (oar.pipeline.launch.train_resources)."""
    return _train_resources(config, signal_seconds=TRAIN_SIGNAL_S)


def train_launcher(wildcards, resources, threads):
    """The command that `train --config ...` follows (oar.pipeline.launch.train_launcher)."""
    return _train_launcher(config, SRC_DIR, threads, signal_seconds=TRAIN_SIGNAL_S)


# ---------------------------------------------------------------------------------- fingerprints
# oar.config.identity defines every fingerprint and store key (what identifies each result, which keys a run
# may change and continue)
# drops a run folder's partial state when its fingerprint changed (see the script)
# (a path relative to the working directory: params are compared between runs, so they must be stable)
RESET_SCRIPT = os.path.relpath(os.path.join(workflow.basedir, "scripts", "reset_if_changed.sh"))


# ------------------------------------------------------------------------------------------ paths
# R/data, R/sft, R/base and R/<method> are links into the store shared by every config
# (oar.pipeline.store): a run whose settings, start model and seed equal another config's is that run.
# Made when the workflow is read; a dry run makes no folder and links only to results that exist
# (so it plans what a real run would do, and a fresh dry run writes nothing).
try:
    _links = link_views(config["results_dir"], R, store_entries(config, METHODS, sft=SFT), create=not workflow.output_settings.dryrun)
    for _view, _action in _links.items():
        print(f"results store: {R}/{_view} {_action} -> {os.readlink(os.path.join(R, _view))}", file=sys.stderr)
except (LayoutError, OSError) as e:
    raise WorkflowError(f"{CONFIG_SOURCE}: cannot link {R} into the results store: {e}")

MANIFEST = TREE.manifest
SFT_DIR = TREE.sft_model
SFT_SUMMARY = f"{SFT_DIR}/sft_summary.json"


# a hub model.source is fetched once, on this host, into <models_dir>/<org>--<name>/ (rules/model.smk,
# oar.models.fetch.hub_model; None for tiny, smollm2 or a local folder or file): the jobs load that folder
HUB_MODEL = hub_model(config)


def model_source():
    """model.source as the jobs load it: the fetched folder (or its GGUF file) of a hub id, else model.source."""
    return HUB_MODEL.source if HUB_MODEL else config["model"]["source"]


def model_inputs():
    """Inputs of rules that load model.source: the fetched folder's marker (none for a local model)."""
    return {"model": HUB_MODEL.marker} if HUB_MODEL else {}


def start_model():
    """The model RL starts from (and the base row evaluates): the SFT output, else train.init, else model.source
    (its fetched folder for a hub id)."""
    if SFT:
        return SFT_DIR
    return config["train"].get("init") or model_source()


def start_model_param(wildcards, input):
    """:func:`start_model` as a rule param (derived from the input when it is the SFT output)."""
    return os.path.dirname(input.start) if SFT else start_model()


def start_inputs():
    """Inputs of rules that read the starting model: the SFT output, or the fetched model.source."""
    start = {"start": SFT_SUMMARY} if SFT else {} if config["train"].get("init") else model_inputs()
    return {"manifest": MANIFEST, **start}


def start_init_param(wildcards, input):
    """The train rule's `--init`: the SFT output, or the fetched model.source (empty: train.init or
    model.source, as the config says). Inserted unquoted (it may be empty), so the path is quoted here."""
    if SFT:
        return f"--init {shlex.quote(os.path.dirname(input.start))}"
    return f"--init {shlex.quote(start_model())}" if "model" in start_inputs() else ""


# the step verifier (rules/verifier.smk): trained when a method's credit is step_verifier with the option
# verifier: trained (oar.config.identity.uses_trained_verifier); its view entry links into the store by its key
VERIFIER_SUMMARY = TREE.verifier_summary


def attribution_verifier_inputs():
    """The attribution rules' verifier input: its summary when a step_verifier signal reads the verifier
    this config trains."""
    return {"verifier": VERIFIER_SUMMARY} if attribution_uses_trained_verifier(config) else {}


def verifier_input(wildcards):
    """The train rule's verifier input: the verifier's summary for a method that reads the verifier
    this config trains (none for another method)."""
    return VERIFIER_SUMMARY if uses_trained_verifier(METHODS[wildcards.method]) else []


def run_dir(method, seed):
    return TREE.run_dir(method, seed)


def train_summaries():
    return [f"{run_dir(m, s)}/train_summary.json" for m in METHODS for s in SEEDS]


def eval_summaries():
    return [TREE.eval_summary(BASE_ROW)] + [f"{run_dir(m, s)}/eval/summary.json" for m in METHODS for s in SEEDS]


def transfer_summaries():
    """The transfer evaluations (rules evaluate_transfer_base, evaluate_transfer): the start model's and
    those of every seed of eval.transfer.methods; none without eval.transfer.benchmarks."""
    if not TRANSFER:
        return []
    return [TREE.eval_summary(BASE_ROW, folder=TRANSFER_FOLDER)] + [
        f"{run_dir(m, s)}/transfer/summary.json" for m in TRANSFER_METHODS for s in SEEDS]


def report_attribution_inputs():
    """The attribution results that report.credit_signals reads (with report.efficiency_oracle and the
    benchmark enabled): the start model's and each attribution.trained policy's (per_response.csv beside)."""
    rep = config["report"]
    if not (ATTRIBUTION and rep["credit_signals"] and rep["efficiency_oracle"]):
        return []
    return [f"{TREE.attribution_dir()}/localisation.csv"] + [
        f"{TREE.attribution_dir(t['method'], t['seed'])}/localisation.csv" for t in config["attribution"]["trained"]]


# the memory plan (rules/plan.smk): GPU training jobs wait for it, so a config that cannot fit
# stops before any of them runs, naming the term that breaks it (plan.check: false skips it)
PLAN_FILE = TREE.plan_file
PLAN = int(res("train", "gpu")) > 0 and bool(config["plan"]["check"])


def plan_inputs():
    """The train rule's input on the plan (none when training has no GPU). ancient(): rerunning the
    plan (its config sections changed) does not by itself rerun finished training."""
    return {"plan": ancient(PLAN_FILE)} if PLAN else {}


REPORT_OUTPUTS = {
    "main": TREE.table("main.csv"),
    "md": TREE.table("main.md"),
    "tex": TREE.table("main.tex"),
    "efficiency": TREE.table("efficiency.csv"),
    "curves": TREE.figure("training_curves.png"),
    "concentration": TREE.figure("credit_concentration.png"),
}


def final_targets():
    targets = list(REPORT_OUTPUTS.values())
    if ATTRIBUTION:
        targets += [f"{TREE.attribution_dir()}/fidelity.csv", f"{TREE.attribution_dir()}/fidelity.png"]
        targets += [f"{TREE.attribution_dir(t['method'], t['seed'])}/attribution.md"
                    for t in config["attribution"]["trained"]]
    return targets


# ---------------------------------------------------------------------------------------- onstart
def write_resolved_config():
    """Write CONFIG_FILE (only when its content changed, so its mtime means something)."""
    write_resolved(config, CONFIG_FILE, source=CONFIG_SOURCE)


def check_disk():
    """Stop before any job runs when the trainings this invocation runs (the DAG's train jobs: all of a
    full run, those a target names) would not fit under results_dir with their checkpoints and models,
    and the SFT's model when it runs (oar.pipeline.launch.disk_problems; plan.disk_check: false skips it)."""
    jobs = list(workflow.dag.needrun_jobs())
    runs = sorted({os.path.dirname(str(j.output[0])) for j in jobs if j.rule.name == "train"})
    problems = disk_problems(config, source=CONFIG_SOURCE, runs=runs, sft=any(j.rule.name == "sft" for j in jobs))
    if problems:
        raise WorkflowError(str(PreflightError(problems)))


onstart:
    check_disk()
    write_resolved_config()
    if workflow.deployment_settings.deployment_method:
        # --use-conda / --sdm: the rules' software is not in this (Snakemake's) environment; each
        # training job creates the MLflow store and experiment on first use, under a file lock
        print("onstart: oar init-tracking skipped (--sdm); the jobs create the MLflow store", file=sys.stderr)
    else:
        # {CONFIG_FILE:q}: shell() formats it once, quoted (a results_dir with spaces or $(...) stays
        # one literal argument); every rule's shell command quotes its values the same way
        shell("{OAR} init-tracking --config {CONFIG_FILE:q}")
