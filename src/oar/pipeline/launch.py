"""How the workflow launches and sizes its jobs: per-rule resources, the training job's node and GPU
resources on SLURM, the command that starts one training job (one process, torchrun, srun +
torchrun), the early SIGTERM of training jobs, the disk the trainings will keep (checked before the
first job: :func:`disk_problems`) and the conda env of the rules (the fingerprints that
rerun a rule are :mod:`oar.config.identity`'s). ``workflow/rules/common.smk`` calls these with the
validated config; the layout itself is :func:`oar.plan.train_layout` (``oar plan`` sizes by it).

Why every rule's shell ignores SIGTERM (:data:`SHELL_PREFIX`): SLURM ends a job (time limit,
preemption, scancel) with SIGTERM to every process of its job steps, then SIGKILL after KillWait.
The trainer (:mod:`oar.trainer.preemption`) then finishes its step, writes a checkpoint and exits 75;
Snakemake's own process in the step waits for its job on SIGTERM; but bash dies of it, and once
bash is gone Snakemake reports the job failed and exits, and SLURM kills what is left of the step,
the trainer in the middle of its checkpoint. A rule's subshell inherits the ignored SIGTERM; the
trainer and torchrun install their own handlers, and every other ``oar`` command gives SIGTERM its
default action back when it starts (:func:`oar.trainer.preemption.restore_ignored_signals`), so an
evaluation ends on it instead of running on to SLURM's SIGKILL.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from oar.core.io import format_bytes, free_bytes
from oar.plan import ModelShape, PlanError, dtype_bytes, gib, model_shape, train_layout
from oar.core.problems import Problem
from oar.trainer.preemption import STOP_SIGNALS


#: The prefix of every rule's shell command (see the module docstring).
SHELL_PREFIX = "set -euo pipefail; trap '' TERM; "


class LaunchError(ValueError):
    """A config the workflow cannot launch as asked (the message names the key)."""


#: The signals torchrun forwards to its workers: its own defaults and those that stop the trainer.
TORCHRUN_SIGNALS = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in STOP_SIGNALS)]))


def model_bytes(config: Mapping[str, Any], shape: ModelShape | None = None) -> int:
    """Bytes of the model's weights in ``model.dtype`` (``auto``: the checkpoint's dtype): what a
    saved model (the SFT output, a training's final ``model/``) holds, give or take the small files.

    Raises:
        PlanError: when the model's shape is unknown (see :func:`oar.plan.model_shape`).
    """
    shape = shape or model_shape(dict(config))
    return shape.num_params * _model_dtype_bytes(config, shape)


def _model_dtype_bytes(config: Mapping[str, Any], shape: ModelShape) -> int:
    dtype = config["model"]["dtype"]
    return dtype_bytes(shape.dtype if dtype == "auto" else dtype, "model.dtype")


def checkpoint_bytes(config: Mapping[str, Any], shape: ModelShape | None = None) -> int:
    """Bytes of one training checkpoint, all processes together: the master weights and AdamW's two
    states (``3 x P x`` the master dtype's bytes: float32, or ``model.dtype`` with
    ``train.master_dtype: model``); the tokenizer and the trainer state's scalars are negligible.

    Raises:
        PlanError: when the model's shape is unknown (see :func:`oar.plan.model_shape`).
    """
    shape = shape or model_shape(dict(config))
    master_b = 4 if config["train"]["master_dtype"] == "float32" else _model_dtype_bytes(config, shape)
    return 3 * shape.num_params * master_b


def training_disk_bytes(config: Mapping[str, Any], shape: ModelShape | None = None) -> int:
    """Bytes a finished training keeps on disk: ``train.keep_checkpoints`` checkpoints
    (:func:`checkpoint_bytes`) and its final model (:func:`model_bytes`); its metrics and
    evaluations are small beside them.

    Raises:
        PlanError: when the model's shape is unknown (see :func:`oar.plan.model_shape`).
    """
    shape = shape or model_shape(dict(config))
    return int(config["train"]["keep_checkpoints"]) * checkpoint_bytes(config, shape) + model_bytes(config, shape)


def folder_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (following a link to it; 0 when it does not exist)."""
    root = Path(path).resolve()
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def disk_problems(config: Mapping[str, Any], *, source: str, runs: Sequence[str | os.PathLike],
                  sft: bool, free: int | None = None) -> list[Problem]:
    """Whether the disk under ``results_dir`` holds what the workflow still has to write, before any
    job runs: for each training of ``runs`` (the run folders not finished yet) what
    :func:`training_disk_bytes` says it keeps, less what its folder already holds (a resumed run); the
    start model when ``sft`` (the SFT is still to run); and one checkpoint more, the one being
    written beside the one it replaces. ``free`` defaults to the free bytes there.

    Returns:
        One :class:`oar.core.problems.Problem` (key ``results_dir``) when they do not fit, else none; none
        either with ``plan.disk_check: false`` or when the model's shape is unknown (a hub id ``oar
        plan`` does not know: give ``plan.model``).
    """
    if not config["plan"]["disk_check"] or not (runs or sft):
        return []
    try:
        shape = model_shape(dict(config))
    except PlanError:
        return []
    per_run, ckpt = training_disk_bytes(config, shape), checkpoint_bytes(config, shape)
    need = (sum(max(0, per_run - folder_bytes(r)) for r in runs) + (ckpt if runs else 0)
            + (model_bytes(config, shape) if sft else 0))
    results = Path(config["results_dir"])
    free = free_bytes(results) if free is None else free
    if need <= free:
        return []
    what = f"{len(runs)} training(s) still to run" + (" and the SFT" if sft else "")
    return [Problem(source, "key results_dir", (
        f"the {what} need about {format_bytes(need)} of disk ({format_bytes(per_run)} per training: "
        f"{config['train']['keep_checkpoints']} checkpoint(s) of {format_bytes(ckpt)} "
        f"and the model), but {format_bytes(free)} are free at {results}; free space, set results_dir to a "
        f"larger disk, or run fewer trainings at a time (name their targets); plan.disk_check: false skips this check"))]


def preemption_signal_seconds(config: Mapping[str, Any], shape: ModelShape | None = None) -> int:
    """Seconds before a SLURM job's time limit at which a training job should get SIGTERM (``sbatch
    --signal=TERM@N``), so that it finishes its step and writes a checkpoint before SIGKILL:
    ``train.preemption.signal_seconds`` when set, else ``step_seconds`` + :func:`checkpoint_bytes` /
    ``write_gb_per_s`` + ``margin_seconds``, rounded up.

    Raises:
        PlanError: sized, and the model's shape is unknown.
    """
    p = config["train"]["preemption"]
    if p.get("signal_seconds"):
        return int(p["signal_seconds"])
    write_s = checkpoint_bytes(config, shape) / (float(p["write_gb_per_s"]) * 1e9)
    return math.ceil(float(p["step_seconds"]) + write_s + float(p["margin_seconds"]))


def preemption_summary(config: Mapping[str, Any], shape: ModelShape | None = None, *, slurm: bool = True) -> str:
    """The line ``oar plan`` ends with: the checkpoint's size and, with ``slurm`` (a GPU config, the one a
    cluster runs), when SLURM sends training SIGTERM (:func:`preemption_signal_seconds`), with how
    that time is made up."""
    p = config["train"]["preemption"]
    ckpt = checkpoint_bytes(config, shape)
    size = gib(ckpt)
    if not slurm:
        return f"checkpoint {size} GiB (master weights + AdamW states, all processes)"
    how = ("train.preemption.signal_seconds" if p.get("signal_seconds") else
           f"step_seconds {p['step_seconds']:g} + {size} GiB at write_gb_per_s "
           f"{p['write_gb_per_s']:g} + margin_seconds {p['margin_seconds']:g}")
    return (f"checkpoint {size} GiB (master weights + AdamW states, all processes); SLURM sends training "
            f"SIGTERM {preemption_signal_seconds(config, shape)} s before the time limit ({how})")


def train_signal_seconds(config: Mapping[str, Any], *, runtime_minutes: int) -> int:
    """Seconds before the time limit at which SLURM sends a training job SIGTERM (sbatch
    --signal=TERM@N, through the plugin's slurm_extra), and the time torchrun gives its workers to
    stop: ``train.preemption.signal_seconds``, else sized by :func:`preemption_signal_seconds`
    (the longest step + the checkpoint's bytes at the stated write speed + a margin).

    Raises:
        LaunchError: the signal cannot be sized, or it would come before the job's ``runtime_minutes``.
    """
    try:
        seconds = preemption_signal_seconds(config)
    except PlanError as e:
        raise LaunchError(f"train.preemption.signal_seconds: cannot size the early SIGTERM of training jobs: {e}; "
                          f"or set train.preemption.signal_seconds (seconds)") from None
    if seconds >= 60 * runtime_minutes:
        raise LaunchError(
            f"train.preemption: training jobs would get SIGTERM {seconds} s before their time limit, but "
            f"resources.train.runtime is {runtime_minutes} min; raise the runtime or set a smaller "
            f"train.preemption.signal_seconds (or step_seconds, margin_seconds)")
    return seconds

__all__ = [
    "SHELL_PREFIX",
    "LaunchError",
    "TORCHRUN_SIGNALS",
    "model_bytes",
    "checkpoint_bytes",
    "training_disk_bytes",
    "folder_bytes",
    "disk_problems",
    "preemption_signal_seconds",
    "preemption_summary",
    "train_signal_seconds",
    "DEFAULT_RESOURCES",
    "RESOURCE_FALLBACK",
    "CONDA_ENVS",
    "resource",
    "uses_gpu",
    "conda_env_choice",
    "train_resources",
    "train_launcher",
    "oar_env",
]

#: Resources per rule; ``config["resources"][<rule>]`` overrides any key (gpu, mem_mb, runtime in
#: minutes, threads; for train also nodes and processes, see :func:`oar.plan.train_layout`). On
#: SLURM, ``gpu`` becomes --gpus=N (snakemake-executor-plugin-slurm); mem_mb, threads and a train
#: job's gpu are per node.
DEFAULT_RESOURCES: dict[str, dict[str, int]] = {
    "data": {"gpu": 0, "mem_mb": 2000, "runtime": 30, "threads": 1},
    "sft": {"gpu": 0, "mem_mb": 4000, "runtime": 120, "threads": 2},
    "train": {"gpu": 0, "nodes": 1, "processes": 0, "mem_mb": 8000, "runtime": 240, "threads": 1},
    "evaluate": {"gpu": 0, "mem_mb": 4000, "runtime": 60, "threads": 1},
    "attribution": {"gpu": 0, "mem_mb": 4000, "runtime": 60, "threads": 1},
    "report": {"gpu": 0, "mem_mb": 2000, "runtime": 15, "threads": 1},
}

#: A rule without its own entry in ``config["resources"]`` uses its parent rule's entry (and so on up:
#: the transfer evaluation of the start model takes evaluate_base's, else evaluate's).
RESOURCE_FALLBACK: dict[str, str] = {"evaluate_base": "evaluate", "evaluate_transfer": "evaluate",
                                     "evaluate_transfer_base": "evaluate_base"}

#: The rules' conda env files by ``software.conda_env`` name, relative to ``workflow/rules/`` (as
#: Snakemake reads a rule's ``conda:``).
CONDA_ENVS: dict[str, str] = {"cpu": "../envs/cpu.yaml", "gpu": "../envs/gpu.yaml"}


def resource(config: Mapping[str, Any], rule: str, key: str) -> Any:
    """Resource ``key`` of ``rule``: ``config["resources"][rule][key]`` (or the first of its fallback
    rules', :data:`RESOURCE_FALLBACK`, that sets it), else :data:`DEFAULT_RESOURCES` of the last of them."""
    table = config.get("resources") or {}
    chain = [rule]
    while chain[-1] in RESOURCE_FALLBACK:
        chain.append(RESOURCE_FALLBACK[chain[-1]])
    for name in chain:
        if key in table.get(name, {}):
            return table[name][key]
    return DEFAULT_RESOURCES[chain[-1]][key]


def uses_gpu(config: Mapping[str, Any]) -> bool:
    """Whether the config runs anything on a GPU or with vLLM (``software.conda_env: auto`` -> gpu)."""
    return (
        config["device"] == "cuda"
        or "vllm" in (config["rollout"]["engine"], config["eval"]["engine"])
        or any(int((r or {}).get("gpu", 0)) > 0 for r in (config.get("resources") or {}).values())
    )


def conda_env_choice(config: Mapping[str, Any]) -> tuple[str, bool]:
    """The env file of every rule: ``(path, builtin)``. ``builtin``: a :data:`CONDA_ENVS` path
    (``auto`` takes gpu for a config that uses a GPU or vLLM, else cpu); otherwise the file
    ``software.conda_env`` names, made absolute (relative to the working directory)."""
    choice = config["software"]["conda_env"]
    if choice == "auto":
        choice = "gpu" if uses_gpu(config) else "cpu"
    if choice in CONDA_ENVS:
        return CONDA_ENVS[choice], True
    return os.path.abspath(choice), False


def train_resources(config: Mapping[str, Any], *, signal_seconds: int) -> dict[str, Any]:
    """The train rule's node and GPU resources (snakemake-executor-plugin-slurm names), and the
    early SIGTERM (``slurm_extra``: --signal=TERM@<signal_seconds>; to the job steps, not ``B:``,
    whose batch shell, the plugin's /bin/sh script, would die of it and end the job).

    One node: ``gpu`` (sbatch --gpus=N) and nodes=1. Several nodes: one task per node, started by
    the rule's own ``srun`` (see :func:`train_launcher`): ``mpi`` tells the plugin's jobstep executor
    not to wrap the command in ``srun -n1``, ``tasks`` = nodes gives sbatch --ntasks (the plugin asks
    ``tasks`` > 1 of an ``mpi`` job), tasks_per_gpu=0 keeps it from also passing ``tasks`` as
    --ntasks-per-gpu, and the GPUs are requested per node as gres=gpu:G (--gpus is a total that SLURM
    may spread unevenly; the plugin would pass both, so gpu is 0 then).
    """
    nodes, _, gpu = train_layout(dict(config))
    signal = {"slurm_extra": f"--signal=TERM@{signal_seconds}"}
    if nodes == 1:
        return {"gpu": gpu, "nodes": 1, **signal}
    return {"gpu": 0, "nodes": nodes, "tasks": nodes, "tasks_per_gpu": 0, "mpi": "srun",
            **({"gres": f"gpu:{gpu}"} if gpu else {}), **signal}


def oar_env(src_dir: str) -> str:
    """The environment prefix that runs this repository's library: its ``src/`` first on PYTHONPATH
    (so the same code runs in a venv and in the conda env of --use-conda, whose files hold
    dependencies only). The user's PYTHONPATH follows it, and ``python -m`` puts the job's working
    directory (the workflow's) on ``sys.path``: a user estimator (``credit: mycredit:my_fn``,
    :mod:`oar.credit.user`) importable where Snakemake was started is importable in every job. The
    runs' MLflow tag ``oar.launched_by`` says ``workflow`` (:data:`oar.tracking.stage_runs.LAUNCHED_BY_ENV`)."""
    from oar.tracking.stage_runs import LAUNCHED_BY_ENV

    return f"{LAUNCHED_BY_ENV}=workflow PYTHONPATH={shlex.quote(src_dir)}${{PYTHONPATH:+:$PYTHONPATH}}"


# torchrun on every node of a multi-node job (run by srun, one task per node): the rendezvous host
# is the first node of the step; SLURM_JOB_ID names the rendezvous and picks the port
_NODE_TORCHRUN = (
    'MASTER_ADDR=$(scontrol show hostnames "${{SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}}" | head -n 1)'
    "; MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))"
    "; exec torchrun {signals} --nnodes {nodes} --nproc_per_node {procs} --rdzv_backend c10d"
    ' --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" -m oar.cli "$@"'
)


def train_launcher(config: Mapping[str, Any], src_dir: str, threads: int, *, signal_seconds: int) -> str:
    """The command that ``train --config ...`` follows (see :func:`oar.plan.train_layout`):

    - one process: ``python -m oar.cli`` behind :func:`oar_env` (which precedes every launcher;
      torchrun's and srun's processes inherit it);
    - several on one node (GPUs, or CPU processes): ``torchrun --standalone --nproc_per_node P -m
      oar.cli`` (a free port per job, so two jobs on one machine do not collide); accelerate's
      Accelerator in the trainer takes RANK/WORLD_SIZE/LOCAL_RANK from it, NCCL on GPUs and gloo on
      CPU. (``accelerate launch --cpu --num_processes 2`` starts ONE process, DistributedType.NO.)
    - several nodes (SLURM only): ``srun`` one task per node, each running torchrun with a c10d
      rendezvous on the first node of the job.

    OMP_NUM_THREADS splits the job's ``threads`` between its processes (snakemake sets it to all of
    them). torchrun forwards SIGUSR1 too (--signals-to-handle, :data:`TORCHRUN_SIGNALS`) and waits
    ``signal_seconds`` for its workers to stop after forwarding a signal (--shutdown-timeout)
    before it kills them.
    """
    env = oar_env(src_dir)
    nodes, procs, gpu = train_layout(dict(config))
    if nodes == 1 and procs == 1:
        return f"{env} python -m oar.cli"
    omp = f"{env} OMP_NUM_THREADS={max(1, int(threads) // procs)}"
    signals = f"--signals-to-handle {TORCHRUN_SIGNALS} --shutdown-timeout {signal_seconds}"
    if nodes == 1:
        return f"{omp} torchrun {signals} --standalone --nnodes 1 --nproc_per_node {procs} -m oar.cli"
    node = _NODE_TORCHRUN.format(signals=signals, nodes=nodes, procs=procs)
    gres = f" --gres=gpu:{gpu}" if gpu else ""
    return (f"{omp} srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task={int(threads)}{gres}"
            f" --kill-on-bad-exit=1 bash -c {shlex.quote(node)} oar")
