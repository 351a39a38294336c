"""Provenance of a result: which code, software and machine made it, when, and by which command.

:func:`provenance` returns a plain, JSON-ready dict; every SFT (``sft_summary.json``), training
(``train_summary.json``), evaluation (``summary.json``) and attribution (``summary.json``) output
records one under its ``provenance`` key, and their MLflow runs carry it as ``oar.core.provenance.<key>``
tags (:func:`provenance_tags`). :func:`describe` is the one-line account ``oar report`` puts at the
foot of ``main.md``. Nothing here fails for want of git, torch or a GPU: what cannot be found is None.

Keys of :func:`provenance`:

- ``git_commit``, ``git_dirty``: the commit of the git checkout the ``oar`` package runs from, and
  whether its tracked files differ from it (None for both when the package is not tracked by git, or
  git is not installed);
- ``python``; ``versions``: ``{package: version or None}`` for :data:`PACKAGES`;
- ``device`` (``cpu`` or ``cuda``), ``cpu_model`` (``/proc/cpuinfo``, else :mod:`platform`),
  ``cpu_capability`` (``torch.backends.cpu.get_cpu_capability()``: the SIMD kernels torch runs,
  e.g. ``AVX2``, ``AVX512``; CPU results differ in the last bits between them), ``gpu`` (the CUDA
  device's name; None on CPU), ``hostname``;
- ``argv``: the command line (``sys.argv``); ``start_time`` and, after :func:`with_end_time`,
  ``end_time`` (ISO 8601, UTC, seconds);
- ``credit_source`` (a training run of a user estimator only): the estimator's source files, their
  hash and their git state (``oar.credit.user.EstimatorSource.as_dict``); :func:`describe` names it.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "PACKAGES",
    "DESCRIBED_KEYS",
    "GIT_TIMEOUT_S",
    "git_state",
    "path_git_state",
    "cpu_model",
    "provenance",
    "with_end_time",
    "provenance_tags",
    "describe",
]

#: The packages whose versions :func:`provenance` records.
PACKAGES: tuple[str, ...] = ("torch", "transformers", "numpy", "mlflow", "oar")
#: Seconds a git call may take before the commit is given up (None): a hung network file system
#: must not hold up a run.
GIT_TIMEOUT_S: float = 10.0
#: The keys :func:`describe` reports, as ``(label, plural, key)``; ``git_commit`` carries ``git_dirty``.
DESCRIBED_KEYS: tuple[tuple[str, str, str], ...] = (
    ("commit", "commits", "git_commit"),
    ("CPU", "CPUs", "cpu_model"),
    ("CPU capability", "CPU capabilities", "cpu_capability"),
    ("torch", "torch versions", "torch"),
)
#: Characters of a commit :func:`describe` shows.
_SHORT_COMMIT = 12


def _now_iso(when: datetime | None = None) -> str:
    return (when or datetime.now(timezone.utc)).astimezone(timezone.utc).isoformat(timespec="seconds")


def _git(folder: Path, *args: str) -> str | None:
    """``git -C folder <args>``'s stdout, or None when git is missing, fails or hangs."""
    try:
        proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(path: str | os.PathLike | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout that tracks ``path`` (a file or folder; default: the
    ``oar`` package's ``__init__.py``); ``(None, None)`` when no checkout tracks it or git is absent.

    ``path`` must itself be tracked: an installed copy inside some other repository's ignored folder
    (a virtual environment in a clone) is not that repository's code. ``dirty``: a tracked file
    differs from the commit (untracked files do not count).
    """
    target = Path(path) if path is not None else Path(__file__).resolve().parents[1] / "__init__.py"
    target = target.resolve()
    folder = target if target.is_dir() else target.parent
    if _git(folder, "ls-files", "--error-unmatch", "--", str(target)) is None:
        return None, None
    commit = _git(folder, "rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return commit.strip(), (None if status is None else bool(status.strip()))


def path_git_state(path: str | os.PathLike) -> str | None:
    """The git state of one file: ``clean`` (tracked, as committed), ``modified`` (tracked, changed),
    ``untracked`` (inside a checkout, not tracked; an ignored file too), or None (no checkout holds
    it, or git is absent)."""
    target = Path(path).resolve()
    folder = target.parent
    if _git(folder, "rev-parse", "--is-inside-work-tree") is None:
        return None
    if _git(folder, "ls-files", "--error-unmatch", "--", str(target)) is None:
        return "untracked"
    status = _git(folder, "status", "--porcelain", "--", str(target))
    if status is None:
        return None
    return "modified" if status.strip() else "clean"


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        module = sys.modules.get(package)
        return getattr(module, "__version__", None)


def _torch_facts(device: str | None) -> tuple[str, str | None, str | None]:
    """``(device, cpu capability, gpu name)``; torch is imported only when it is installed."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch, or a broken one: no facts
        return (device or "cpu"), None, None
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch
        capability = None
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device.split(":")[0]
    gpu = _gpu_name(torch) if device == "cuda" else None
    return device, capability, gpu


def _gpu_name(torch: Any) -> str | None:
    """The CUDA device's name: from torch when CUDA is initialised in this process (asking torch
    otherwise would initialise it), else from ``nvidia-smi`` for the first visible device."""
    try:
        if torch.cuda.is_initialized():
            return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001
        return None
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        proc = subprocess.run(["nvidia-smi", "-i", first, "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    name = proc.stdout.strip().splitlines()[0].strip() if proc.returncode == 0 and proc.stdout.strip() else ""
    return name or None


def provenance(*, device: str | None = None, started: datetime | None = None,
               root: str | os.PathLike | None = None, argv: Sequence[str] | None = None,
               credit_source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance of the calling process (keys: see the module docstring).

    Args:
        device: the device the result was computed on (``cpu``, ``cuda``, ``cuda:1``, ``auto``;
            None or ``auto``: ``cuda`` when torch sees a GPU, else ``cpu``).
        started: the start time (default: now).
        root: the path whose git checkout is recorded (default: the ``oar`` package).
        argv: the command line (default: ``sys.argv``).
        credit_source: a user estimator's source (recorded only when given).
    """
    commit, dirty = git_state(root)
    device, capability, gpu = _torch_facts(device)
    extra = {"credit_source": dict(credit_source)} if credit_source else {}
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in PACKAGES},
        "device": device,
        "cpu_model": cpu_model(),
        "cpu_capability": capability,
        "gpu": gpu,
        "hostname": socket.gethostname(),
        "argv": list(sys.argv if argv is None else argv),
        "start_time": _now_iso(started),
        **extra,
    }


def with_end_time(prov: Mapping[str, Any], ended: datetime | None = None) -> dict[str, Any]:
    """A copy of ``prov`` with ``end_time`` (default: now)."""
    return {**prov, "end_time": _now_iso(ended)}


def provenance_tags(prov: Mapping[str, Any] | None, prefix: str = "oar.provenance.") -> dict[str, str]:
    """``prov`` as MLflow tags: ``{prefix + key: text}``, nested keys joined by ``.``
    (``oar.core.provenance.versions.torch``), ``argv`` as one shell-quoted line; None values left out."""
    import shlex

    out: dict[str, str] = {}
    for key, value in (prov or {}).items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            out.update(provenance_tags(value, f"{prefix}{key}."))
        elif key == "argv" and isinstance(value, (list, tuple)):
            out[prefix + key] = shlex.join(str(a) for a in value)
        else:
            out[prefix + key] = str(value)
    return out


def _described(prov: Mapping[str, Any], key: str) -> str:
    if key == "torch":
        return str((prov.get("versions") or {}).get("torch") or "unknown")
    if key == "git_commit":
        commit = prov.get("git_commit")
        if not commit:
            return "not a git checkout"
        dirty = prov.get("git_dirty")
        return f"{commit[:_SHORT_COMMIT]} ({'dirty' if dirty else 'clean' if dirty is False else 'state unknown'})"
    value = prov.get(key)
    return "unknown" if value in (None, "") else str(value)


def describe(provs: Iterable[Mapping[str, Any] | None], *, what: str | None = None) -> str | None:
    """One line naming the commit (and whether it was dirty), CPU model, CPU capability and torch
    version of the results ``provs`` (one provenance per result; None: a result without one).

    A value all results share is named once (``commit 0e15aa3c9d1b (clean)``); values that differ
    are counted, most common first (``2 commits: 0e15aa3c9d1b (clean) x 12, 7b1fdac2e4f0 (dirty) x 2``).

    Args:
        what: what the results are (default ``"the <n> results"``), e.g.
            ``"the 29 results summarised (14 training runs, 15 evaluations)"``.
    Returns:
        ``"Provenance of <what>: ...; <m> of them without a recorded provenance."``, or None when no
        result has a provenance (results written before it was recorded).
    """
    provs = list(provs)
    known = [p for p in provs if p]
    if not known:
        return None
    parts = []
    for label, plural, key in DESCRIBED_KEYS:
        counts = Counter(_described(p, key) for p in known)
        if len(counts) == 1:
            parts.append(f"{label} {next(iter(counts))}")
        else:
            listed = ", ".join(f"{v} x {n}" for v, n in counts.most_common())
            parts.append(f"{len(counts)} {plural}: {listed}")
    sources = Counter(_source_text(p["credit_source"]) for p in known if p.get("credit_source"))
    if sources:
        parts.append("user estimator source" + ("s" if len(sources) > 1 else "") + ": "
                     + ", ".join(f"{v} x {n}" for v, n in sources.most_common()))
    missing = len(provs) - len(known)
    tail = f"; {missing} of them without a recorded provenance" if missing else ""
    return f"Provenance of {what or f'the {len(provs)} results'}: " + "; ".join(parts) + tail + "."


def _source_text(src: Mapping[str, Any]) -> str:
    """``my_credit:fn sha256 3f2a...(16) (my_credit.py untracked, helpers.py clean)``."""
    files = ", ".join(f"{f} {st or 'not in git'}" for f, st in (src.get("git") or {}).items())
    return f"{src.get('name')} sha256 {src.get('sha256')} ({files})"
