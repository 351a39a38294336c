"""The device a job runs on, checked before it starts: a config that asks for a GPU where torch sees
none stops with one line naming the key, the NVIDIA driver and the torch build, instead of training on
the CPU (accelerate falls back to it silently)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from oar.core.problems import Problem, require

__all__ = ["CUDA_MIN_DRIVER", "nvidia_driver_version", "device_problem", "check_device", "job_device"]


#: The oldest Linux NVIDIA driver each CUDA major version's builds run on (minor-version
#: compatibility), from NVIDIA's CUDA Toolkit release notes, table "CUDA Toolkit and Minimum Required
#: Driver Version for CUDA Minor Version Compatibility". torch 2.13.0 from PyPI is a CUDA 13 build.
CUDA_MIN_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version on this node (``/proc/driver/nvidia/version``, else
    ``nvidia-smi``), or None when there is no NVIDIA driver."""
    import shutil
    import subprocess

    proc_file = Path("/proc/driver/nvidia/version")
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", proc_file.read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0].strip() if out.returncode == 0 and first else None


def _older(version: str, minimum: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v))

    return parts(version) < parts(minimum)


def _gpu_key(config: Mapping[str, Any]) -> str | None:
    """The key that makes this config's jobs need a GPU: ``device: cuda``, or ``device: auto`` with a
    rule's ``resources.<rule>.gpu`` > 0 (a GPU profile); None when they may run on CPU."""
    if config.get("device") == "cuda":
        return "device"
    if config.get("device") == "auto":
        for rule, res in sorted((config.get("resources") or {}).items()):
            if int((res or {}).get("gpu", 0) or 0) > 0:
                return f"resources.{rule}.gpu"
    return None


def device_problem(config: Mapping[str, Any], *, source: str) -> Problem | None:
    """Whether the GPU a config asks for (:func:`_gpu_key`) is usable on this node: a config that asks
    for one where torch sees none stops here, naming the key, the NVIDIA driver
    (:func:`nvidia_driver_version`) and the torch build (``torch.version.cuda``), instead of training
    on the CPU (accelerate falls back to it silently)."""
    key = _gpu_key(config)
    if key is None:
        return None
    import socket

    import torch

    if torch.cuda.is_available():
        return None
    build, drv = torch.version.cuda, nvidia_driver_version()
    host = socket.gethostname()
    torch_txt = f"torch {torch.__version__} ({f'a CUDA {build} build' if build else 'a CPU-only build'})"
    drv_txt = f"NVIDIA driver {drv}" if drv else "no NVIDIA driver"
    if not build:
        what = ("install torch's CUDA build in this environment (workflow/envs/gpu.yaml; docs/slurm.md), "
                "or set device: cpu")
    elif not drv:
        what = ("run the job on a GPU node (the SLURM profile's gpu resource, docs/slurm.md), or set device: cpu")
    else:
        need = CUDA_MIN_DRIVER.get(int(str(build).split(".")[0]))
        if need and _older(str(drv), need):
            what = (f"a CUDA {build} build needs NVIDIA driver >= {need}: update the driver, or install a torch "
                    f"built for an older CUDA (docs/slurm.md, 'Driver and system')")
        else:
            what = "check CUDA_VISIBLE_DEVICES and that the job was given a GPU (nvidia-smi on the node)"
    return Problem(source, f"key {key}",
                   f"asks for a GPU, but torch sees none on {host}: {torch_txt}, {drv_txt}; {what}")


def check_device(config: Mapping[str, Any], *, source: str) -> None:
    """:func:`device_problem`, raised (:class:`PreflightError`)."""
    problem = device_problem(config, source=source)
    require([problem] if problem is not None else [])


def job_device(config: Mapping[str, Any]) -> str:
    """The torch device a job of ``config`` runs on: ``cuda`` for ``device: cuda`` (refused by
    :func:`check_device` where there is none) and for ``device: auto`` where torch sees a GPU, else ``cpu``."""
    import torch

    device = str(config["device"])
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
